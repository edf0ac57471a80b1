//! Test utilities (feature `test-util`): a throwaway PostgreSQL for tests and
//! demos, and the conformance suite for custom [`Store`](crate::store::Store)s.

pub mod conformance;
mod postgres;

pub use postgres::{HarnessError, TempPostgres, TempPostgresBuilder, TestDatabase};
