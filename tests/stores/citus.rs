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

/// The store-side scenarios that read nothing node-local (`pg_stat_activity`
/// of the coordinator does not show a worker's lock waits): each handle
/// ends only its own way, and extreme durations are held to their limits.
mod scenarios {
    use crate::common::citus;
    use crate::scenarios::{
        each_transaction_handle_ends_only_its_own_way, extreme_durations_are_held_to_their_limits,
    };

    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn pg_store_handles_end_their_own_way_on_citus() {
        each_transaction_handle_ends_only_its_own_way(&citus::postgres().await).await;
    }

    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn sqlx_store_handles_end_their_own_way_on_citus() {
        each_transaction_handle_ends_only_its_own_way(&citus::sqlx().await).await;
    }

    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn pg_store_holds_extreme_durations_on_citus() {
        extreme_durations_are_held_to_their_limits(&citus::postgres().await).await;
    }

    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn sqlx_store_holds_extreme_durations_on_citus() {
        extreme_durations_are_held_to_their_limits(&citus::sqlx().await).await;
    }
}
