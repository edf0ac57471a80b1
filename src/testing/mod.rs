//! Test utilities (feature `test-util`): a throwaway PostgreSQL for tests and
//! demos (on Unix: the cluster runs as a child process on a private socket
//! directory), and the conformance suite for custom
//! [`Store`](crate::store::Store)s, and the texts of statements the layer
//! sends, for benchmarks that compare it with hand-written code.

#[cfg(unix)]
mod citus;
#[cfg(unix)]
mod cluster;
pub mod conformance;
#[cfg(unix)]
mod database;
pub mod statements;

#[cfg(unix)]
#[cfg_attr(docsrs, doc(cfg(unix)))]
pub use citus::{TempCitus, TEST_SHARD_COUNT};
#[cfg(unix)]
#[cfg_attr(docsrs, doc(cfg(unix)))]
pub use cluster::{HarnessError, Shutdown, TempPostgres, TempPostgresBuilder};
#[cfg(unix)]
#[cfg_attr(docsrs, doc(cfg(unix)))]
pub use database::TestDatabase;
