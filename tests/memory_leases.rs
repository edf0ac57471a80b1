//! `MemoryStore` against the long-running mode's conformance checks.

mod common;

use tower_idempotency::{memory::MemoryStore, testing::conformance};

#[tokio::test]
async fn memory_store_keeps_the_lease_contract() {
    conformance::run_leases(MemoryStore::new())
        .await
        .assert_passed();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn memory_store_keeps_the_lease_contract_across_threads() {
    conformance::run_leases(MemoryStore::new())
        .await
        .assert_passed();
}

#[tokio::test]
async fn memory_store_holds_extreme_durations_to_their_limits() {
    common::extreme_durations_are_held_to_their_limits(&common::Memory::new().await).await;
}
