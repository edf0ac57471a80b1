//! The PostgreSQL protocol both drivers speak: the schema and its
//! migrations, every statement both send, the reading of the columns they
//! return, the SQL guard a handler's statements pass, the identity of a
//! key's owner that both drivers' handles hold, and how long the protocol
//! waits. `postgres/`
//! (tokio-postgres and deadpool) and `sqlx/` each use this module and never
//! each other; nothing here depends on a driver.

pub(crate) mod identity;
pub(crate) mod lease;
pub(crate) mod lexer;
pub(crate) mod migrations;
pub(crate) mod statements;
pub(crate) mod waits;
