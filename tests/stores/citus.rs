//! The stores through a Citus coordinator, their tables distributed by
//! tenant: every conformance suite passes, as on one PostgreSQL.

use crate::common::citus;
use crate::postgres::PgWrites;
use crate::scenarios::assert_every_suite_passes;
use crate::sqlx_store::SqlxWrites;

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn pg_store_passes_every_suite_through_a_citus_coordinator() {
    let pg = citus::postgres().await;
    assert_every_suite_passes(pg.store.clone(), || PgWrites::new(&pg)).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn sqlx_store_passes_every_suite_through_a_citus_coordinator() {
    let backend = citus::sqlx().await;
    assert_every_suite_passes(backend.store.clone(), || SqlxWrites::new(&backend)).await;
}
