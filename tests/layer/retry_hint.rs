//! A retry that says so (`Idempotency-Attempt: 2`) is answered from one read
//! of the key's record, on both stores and in both one-transaction modes:
//! no claim, nothing written (the row's `xmin` is unchanged), the first
//! answer byte for byte; another body under the key is still refused; a
//! "retry" whose key has no record is claimed and runs as any request.

use crate::common;

use std::sync::{
    atomic::{AtomicU64, Ordering},
    Arc,
};

use common::*;
use http::StatusCode;
use tower::Layer;
use tower_idempotency::{
    record::{Record, StoredResponse, IDEMPOTENCY_ATTEMPT},
    store::{Claim, ClaimRequest, CommitStore, Committed, Store, StoreError},
};

/// How often the layer called each of the wrapped store's entry points.
#[derive(Default, Debug)]
struct Calls {
    claims: AtomicU64,
    begins: AtomicU64,
    lookups: AtomicU64,
}

impl Calls {
    /// (claims and begins, lookups) so far.
    fn seen(&self) -> (u64, u64) {
        (
            self.claims.load(Ordering::SeqCst) + self.begins.load(Ordering::SeqCst),
            self.lookups.load(Ordering::SeqCst),
        )
    }
}

/// A store that counts the layer's calls and passes them on.
#[derive(Clone)]
struct Counted<St> {
    inner: St,
    calls: Arc<Calls>,
}

impl<St: Store> Store for Counted<St> {
    type Tx = St::Tx;

    async fn claim(&self, request: &ClaimRequest) -> Result<Claim<St::Tx>, StoreError> {
        self.calls.claims.fetch_add(1, Ordering::SeqCst);
        self.inner.claim(request).await
    }

    async fn complete(&self, tx: St::Tx, response: &StoredResponse) -> Result<(), StoreError> {
        self.inner.complete(tx, response).await
    }

    async fn abort(&self, tx: St::Tx) -> Result<(), StoreError> {
        self.inner.abort(tx).await
    }

    async fn lookup(&self, request: &ClaimRequest) -> Result<Option<Record>, StoreError> {
        self.calls.lookups.fetch_add(1, Ordering::SeqCst);
        self.inner.lookup(request).await
    }
}

impl<St: CommitStore> CommitStore for Counted<St> {
    async fn begin(&self, request: &ClaimRequest) -> Result<St::Tx, StoreError> {
        self.calls.begins.fetch_add(1, Ordering::SeqCst);
        self.inner.begin(request).await
    }

    async fn commit(
        &self,
        tx: St::Tx,
        request: &ClaimRequest,
        response: &StoredResponse,
    ) -> Result<Committed, StoreError> {
        self.inner.commit(tx, request, response).await
    }
}

/// tenant-a's post of `body` under `key`, as attempt `attempt` says.
fn attempt(
    key: &str,
    body: &str,
    attempt: &str,
) -> http::Request<http_body_util::Full<bytes::Bytes>> {
    let mut request = post(Some("tenant-a"), Some(key), body);
    request
        .headers_mut()
        .insert(IDEMPOTENCY_ATTEMPT, attempt.parse().unwrap());
    request
}

/// The key's row: (state, response body, xmin), xmin changing with any
/// write to the row.
async fn row(client: &tokio_postgres::Client, key: &str) -> Vec<(String, Vec<u8>, String)> {
    client
        .query(
            "SELECT state, response_body, xmin::text FROM idempotency_requests \
             WHERE tenant_id = 'tenant-a' AND idempotency_key = $1",
            &[&key],
        )
        .await
        .unwrap()
        .iter()
        .map(|r| (r.get(0), r.get(1), r.get(2)))
        .collect()
}

async fn a_retry_that_says_so_is_answered_from_one_read<B: Backend>(
    backend: &B,
    client: &tokio_postgres::Client,
    one_commit: bool,
) where
    B::Store: CommitStore,
{
    let calls = Arc::new(Calls::default());
    let runs = Arc::new(AtomicU64::new(0));
    let store = Counted {
        inner: backend.store(),
        calls: calls.clone(),
    };
    let handler = order_handler::<B>(runs.clone());
    let send_one = |request| {
        let service = if one_commit {
            tower::util::BoxCloneService::new(
                layer(store.clone())
                    .claim_at_commit()
                    .layer(handler.clone()),
            )
        } else {
            tower::util::BoxCloneService::new(layer(store.clone()).layer(handler.clone()))
        };
        send(service, request)
    };

    // The first attempt: claimed (or begun), run, committed.
    let created = send_one(tenant_a_post("hinted")).await;
    assert_eq!(created.status, StatusCode::CREATED, "{created:?}");
    assert_eq!(calls.seen(), (1, 0), "a first attempt is not looked up");
    let first_row = row(client, "hinted").await;
    assert_eq!(first_row.len(), 1);
    assert_eq!(first_row[0].0, "completed");

    // Its retry, saying so: one lookup, no claim, the first answer.
    let retried = send_one(attempt("hinted", BODY, "2")).await;
    assert_eq!(retried.status, StatusCode::CREATED);
    assert!(retried.replayed(), "{retried:?}");
    assert_eq!(retried.body, created.body, "byte for byte");
    assert_eq!(
        retried.headers.get_all("link").iter().collect::<Vec<_>>(),
        created.headers.get_all("link").iter().collect::<Vec<_>>()
    );
    assert_eq!(calls.seen(), (1, 1), "answered by the lookup, not a claim");
    assert_eq!(
        row(client, "hinted").await,
        first_row,
        "nothing was written to the key's row"
    );

    // Another body under the key, saying it is a retry: still refused.
    let reused = send_one(attempt(
        "hinted",
        r#"{"checkout_id":"other","amount":1}"#,
        "3",
    ))
    .await;
    assert_eq!(reused.status, StatusCode::CONFLICT);
    assert_eq!(reused.json()["code"], "idempotency_key_reused");
    assert_eq!(calls.seen(), (1, 2));

    // A "retry" whose key has no record: looked up, then claimed and run.
    let fresh = send_one(attempt("hinted-but-new", BODY, "2")).await;
    assert_eq!(fresh.status, StatusCode::CREATED);
    assert!(!fresh.replayed());
    assert_eq!(calls.seen(), (2, 3), "nothing found: the claim arbitrated");
    assert_eq!(row(client, "hinted-but-new").await[0].0, "completed");

    // A retry that does not say so, and values that are not a retry's.
    for (request, what) in [
        (tenant_a_post("hinted"), "no header"),
        (attempt("hinted", BODY, "1"), "attempt 1"),
        (attempt("hinted", BODY, "two"), "not a number"),
    ] {
        let before = calls.seen();
        let answer = send_one(request).await;
        assert_eq!(answer.status, StatusCode::CREATED, "{what}");
        assert!(answer.replayed(), "{what}");
        assert_eq!(answer.body, created.body, "{what}");
        assert_eq!(
            calls.seen(),
            (before.0 + 1, before.1),
            "{what}: claimed, not looked up"
        );
    }

    // Once a key; in the one-commit mode the three retries that did not
    // say so ran it too, before their commits lost (and rolled back).
    let expected_runs = if one_commit { 5 } else { 2 };
    assert_eq!(runs.load(Ordering::SeqCst), expected_runs);
    let orders = backend.orders().await;
    assert_eq!(orders.len(), 2, "one order a key: {orders:?}");
    assert!(
        orders.iter().any(|o| created.json()["id"] == o.0.as_str()),
        "the first answer names a committed order: {orders:?}"
    );
    assert_eq!(
        row(client, "hinted").await,
        first_row,
        "the row is as first committed"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn pg_store_a_retry_that_says_so_is_answered_from_one_read() {
    let pg = Postgres::new().await;
    a_retry_that_says_so_is_answered_from_one_read(&pg, &pg.client, false).await;
    assert_eq!(pg.idle_in_transaction().await, 0);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn pg_store_one_commit_a_retry_that_says_so_is_answered_from_one_read() {
    let pg = Postgres::new().await;
    a_retry_that_says_so_is_answered_from_one_read(&pg, &pg.client, true).await;
    assert_eq!(pg.idle_in_transaction().await, 0);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn sqlx_store_a_retry_that_says_so_is_answered_from_one_read() {
    let sqlx = Sqlx::new().await;
    a_retry_that_says_so_is_answered_from_one_read(&sqlx, &sqlx.client, false).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn sqlx_store_one_commit_a_retry_that_says_so_is_answered_from_one_read() {
    let sqlx = Sqlx::new().await;
    a_retry_that_says_so_is_answered_from_one_read(&sqlx, &sqlx.client, true).await;
}
