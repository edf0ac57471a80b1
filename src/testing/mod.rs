//! Test utilities (feature `test-util`): the conformance suite for custom
//! [`Store`](crate::store::Store)s (in any build); with a store's feature,
//! the texts of statements the layer sends, for benchmarks that compare it
//! with hand-written code; and with `postgres`, a throwaway PostgreSQL for
//! tests and demos (on Unix: the cluster runs as a child process on a
//! private socket directory).

#[cfg(all(unix, feature = "postgres"))]
mod citus;
#[cfg(all(unix, feature = "postgres"))]
mod cluster;
pub mod conformance;
#[cfg(all(unix, feature = "postgres"))]
mod database;
#[cfg(any(feature = "postgres", feature = "sqlx"))]
#[cfg_attr(docsrs, doc(cfg(any(feature = "postgres", feature = "sqlx"))))]
pub mod statements;

#[cfg(all(unix, feature = "postgres"))]
#[cfg_attr(docsrs, doc(cfg(all(unix, feature = "postgres"))))]
pub use citus::{TempCitus, TEST_SHARD_COUNT};
#[cfg(all(unix, feature = "postgres"))]
#[cfg_attr(docsrs, doc(cfg(all(unix, feature = "postgres"))))]
pub use cluster::{HarnessError, Shutdown, TempPostgres, TempPostgresBuilder};
#[cfg(all(unix, feature = "postgres"))]
#[cfg_attr(docsrs, doc(cfg(all(unix, feature = "postgres"))))]
pub use database::TestDatabase;
