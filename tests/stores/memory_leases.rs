//! `MemoryStore` against the long-running mode's conformance checks.

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
