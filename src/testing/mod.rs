//! Test utilities (feature `test-util`): a throwaway PostgreSQL for tests and
//! demos, and the conformance suite for custom [`Store`](crate::store::Store)s.

mod citus;
mod cluster;
pub mod conformance;
mod database;

pub use citus::{TempCitus, TEST_SHARD_COUNT};
pub use cluster::{HarnessError, Shutdown, TempPostgres, TempPostgresBuilder};
pub use database::TestDatabase;
