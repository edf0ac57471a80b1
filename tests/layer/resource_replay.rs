//! The resource id on the record, and replays rebuilt from it: against a
//! real PostgreSQL, asserting on rows, counters and bytes.

use crate::common;

use std::sync::{
    atomic::{AtomicU64, Ordering},
    Arc,
};

use bytes::Bytes;
use common::*;
use http::StatusCode;
use serde_json::json;
use tower::Layer;
use tower_idempotency::{
    key::IdempotencyKey,
    postgres::{PgStore, PgTx},
    record::ResourceId,
    replay::{RebuildRequest, Rebuilt},
    scope::{Scope, TenantId},
};

/// Writes an order and names it as the operation's resource; counts calls.
fn order_naming_itself(calls: Arc<AtomicU64>) -> Handler {
    handler(move |tx: PgTx| {
        let calls = calls.clone();
        async move {
            calls.fetch_add(1, Ordering::SeqCst);
            let id = new_order_id();
            tx.execute(
                "INSERT INTO orders (id, tenant_id) VALUES ($1, $2)",
                &[&id, &tx.tenant()],
            )
            .await?;
            let mut response = created(
                json!({ "id": id, "download_url": format!("/files/{id}?sig=first") }).to_string(),
            );
            response.extensions_mut().insert(ResourceId::new(id));
            Ok(response)
        }
    })
}

/// A rebuild function that reads the order again and signs a fresh URL
/// (its call number), or answers `Gone` when the order was deleted.
#[derive(Clone)]
struct FreshLinks {
    store: PgStore,
    calls: Arc<AtomicU64>,
    seen: Arc<std::sync::Mutex<Vec<RebuildRequest>>>,
}

impl FreshLinks {
    fn new(store: PgStore) -> Self {
        FreshLinks {
            store,
            calls: Arc::default(),
            seen: Arc::default(),
        }
    }

    fn service(
        &self,
    ) -> impl tower::Service<
        RebuildRequest,
        Response = Rebuilt,
        Error = tower_idempotency::store::StoreError,
        Future = impl Send,
    > + Clone
           + Send
           + Sync
           + 'static {
        let this = self.clone();
        tower::service_fn(move |request: RebuildRequest| {
            let this = this.clone();
            async move {
                let n = this.calls.fetch_add(1, Ordering::SeqCst) + 1;
                this.seen.lock().unwrap().push(request.clone());
                let client = this.store.client().await?;
                let found = client
                    .query_opt(
                        "SELECT id FROM orders WHERE id = $1 AND tenant_id = $2",
                        &[&request.resource_id.as_str(), &request.tenant.as_str()],
                    )
                    .await
                    .expect("query");
                Ok(match found {
                    None => Rebuilt::Gone,
                    Some(row) => {
                        let id: String = row.get(0);
                        let body = json!({ "id": id, "download_url": format!("/files/{id}?sig=fresh-{n}") });
                        // The status here is ignored: the replay keeps the first one.
                        Rebuilt::Current(
                            http::Response::builder()
                                .status(StatusCode::OK)
                                .header("content-type", "application/json")
                                .body(Bytes::from(body.to_string()))
                                .unwrap(),
                        )
                    }
                })
            }
        })
    }
}

async fn resource_column(pg: &Postgres, key: &str) -> Option<String> {
    pg.client
        .query_one(
            "SELECT resource_id FROM idempotency_requests WHERE idempotency_key = $1",
            &[&key],
        )
        .await
        .unwrap()
        .get(0)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn resource_id_is_stored_with_the_response_and_shown_to_operators() {
    let pg = Postgres::new().await;
    let calls = Arc::new(AtomicU64::new(0));
    let service = layer(pg.store.clone()).layer(order_naming_itself(calls));
    let first = send(service, tenant_a_post("k-res")).await;
    assert_eq!(first.status, StatusCode::CREATED);
    let order: String = pg.value("SELECT id FROM orders").await;
    assert_eq!(first.json()["id"], order);
    assert_eq!(
        resource_column(&pg, "k-res").await.as_deref(),
        Some(&*order)
    );
    let record = pg
        .store
        .inspect_key(
            &Scope::new(TenantId::new("tenant-a"), "POST /orders v1"),
            &IdempotencyKey::parse(b"k-res").unwrap(),
        )
        .await
        .unwrap()
        .expect("the key's record");
    assert_eq!(record.resource_id, Some(ResourceId::new(order)));
}

/// A deferred constraint fails at `COMMIT`: the order, the response and the
/// resource id go together, so none of them exists.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn resource_id_rolls_back_with_the_handlers_writes() {
    let pg = Postgres::new().await;
    pg.exec(
        "CREATE TABLE audit (n int, CONSTRAINT one_audit UNIQUE (n) DEFERRABLE INITIALLY DEFERRED); \
         INSERT INTO audit VALUES (1);",
    )
    .await;
    let service = layer(pg.store.clone()).layer(handler(|tx: PgTx| async move {
        let id = new_order_id();
        tx.execute(
            "INSERT INTO orders (id, tenant_id) VALUES ($1, 'tenant-a')",
            &[&id],
        )
        .await?;
        // Violates the deferred constraint: only COMMIT finds out.
        tx.execute("INSERT INTO audit VALUES (1)", &[]).await?;
        let mut response = created(json!({ "id": id }).to_string());
        response.extensions_mut().insert(ResourceId::new(id));
        Ok(response)
    }));
    let answer = send(service, tenant_a_post("k-deferred")).await;
    assert_eq!(answer.status, StatusCode::INTERNAL_SERVER_ERROR);
    assert_eq!(answer.json()["code"], "commit_rejected");
    assert_eq!(pg.count("SELECT count(*) FROM orders").await, 0);
    assert_eq!(
        pg.count("SELECT count(*) FROM idempotency_requests WHERE resource_id IS NOT NULL")
            .await,
        0
    );
    assert_eq!(
        pg.count("SELECT count(*) FROM idempotency_requests").await,
        0
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn rebuilt_replays_are_fresh_and_never_run_the_handler() {
    let pg = Postgres::new().await;
    let calls = Arc::new(AtomicU64::new(0));
    let links = FreshLinks::new(pg.store.clone());
    // The cache stays on: its replays are rebuilt too.
    let service = layer(pg.store.clone())
        .rebuild_replays(links.service())
        .layer(order_naming_itself(calls.clone()));
    let first = send(service.clone(), tenant_a_post("k-link")).await;
    assert_eq!(first.status, StatusCode::CREATED);
    assert!(!first.replayed());
    let order = first.json()["id"].as_str().unwrap().to_owned();
    assert_eq!(
        links.calls.load(Ordering::SeqCst),
        0,
        "a first answer is never rebuilt"
    );

    let mut urls = vec![first.json()["download_url"].as_str().unwrap().to_owned()];
    for n in 1..=3u64 {
        let replay = send(service.clone(), tenant_a_post("k-link")).await;
        assert_eq!(
            replay.status,
            StatusCode::CREATED,
            "the first status, not the rebuild's 200"
        );
        assert!(replay.replayed());
        assert_eq!(replay.json()["id"], order, "the same resource");
        let url = replay.json()["download_url"].as_str().unwrap().to_owned();
        assert_eq!(url, format!("/files/{order}?sig=fresh-{n}"));
        assert!(!urls.contains(&url), "a fresh field on every replay");
        urls.push(url);
    }
    assert_eq!(calls.load(Ordering::SeqCst), 1, "the handler ran once");
    assert_eq!(links.calls.load(Ordering::SeqCst), 3);
    assert_eq!(pg.count("SELECT count(*) FROM orders").await, 1);
    let seen = links.seen.lock().unwrap().clone();
    assert!(seen.iter().all(|r| r.tenant.as_str() == "tenant-a"
        && r.resource_id.as_str() == order
        && r.status == StatusCode::CREATED
        && &*r.endpoint == "POST /orders v1"));
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn rebuilt_replays_refuse_another_request_and_stay_in_the_tenant() {
    let pg = Postgres::new().await;
    let calls = Arc::new(AtomicU64::new(0));
    let links = FreshLinks::new(pg.store.clone());
    let service = layer(pg.store.clone())
        .without_replay_cache()
        .rebuild_replays(links.service())
        .layer(order_naming_itself(calls.clone()));
    assert_eq!(
        send(service.clone(), tenant_a_post("k-shared"))
            .await
            .status,
        StatusCode::CREATED
    );
    let other = send(
        service.clone(),
        post(
            Some("tenant-a"),
            Some("k-shared"),
            r#"{"checkout_id":"other","amount":1}"#,
        ),
    )
    .await;
    assert_eq!(other.status, StatusCode::CONFLICT);
    assert_eq!(other.json()["code"], "idempotency_key_reused");
    assert_eq!(
        links.calls.load(Ordering::SeqCst),
        0,
        "a refusal is never rebuilt"
    );

    // Tenant b's same raw key is its own operation: its own order, its own
    // answer, nothing of tenant a's.
    let b = send(
        service.clone(),
        post(Some("tenant-b"), Some("k-shared"), BODY),
    )
    .await;
    assert_eq!(b.status, StatusCode::CREATED);
    assert!(!b.replayed());
    let b_replay = send(service, post(Some("tenant-b"), Some("k-shared"), BODY)).await;
    assert!(b_replay.replayed());
    assert_eq!(b_replay.json()["id"], b.json()["id"]);
    let seen = links.seen.lock().unwrap().clone();
    assert_eq!(seen.len(), 1);
    assert_eq!(seen[0].tenant.as_str(), "tenant-b");
    assert_eq!(calls.load(Ordering::SeqCst), 2);
    assert_eq!(
        pg.count("SELECT count(*) FROM orders WHERE tenant_id = 'tenant-b'")
            .await,
        1
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn rebuilt_replay_of_a_deleted_resource_is_gone() {
    let pg = Postgres::new().await;
    let calls = Arc::new(AtomicU64::new(0));
    let links = FreshLinks::new(pg.store.clone());
    let service = layer(pg.store.clone())
        .without_replay_cache()
        .rebuild_replays(links.service())
        .layer(order_naming_itself(calls.clone()));
    send(service.clone(), tenant_a_post("k-gone")).await;
    pg.exec("DELETE FROM orders").await;
    let replay = send(service, tenant_a_post("k-gone")).await;
    assert_eq!(replay.status, StatusCode::GONE);
    assert_eq!(replay.json()["code"], "resource_gone");
    assert_eq!(
        calls.load(Ordering::SeqCst),
        1,
        "never re-run to recreate it"
    );
    assert_eq!(pg.count("SELECT count(*) FROM orders").await, 0);
    assert_eq!(
        pg.count("SELECT count(*) FROM idempotency_requests WHERE state = 'completed'")
            .await,
        1,
        "the record stays"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn failed_rebuild_is_unavailable_and_changes_nothing() {
    let pg = Postgres::new().await;
    let calls = Arc::new(AtomicU64::new(0));
    let failing = tower::service_fn(|_: RebuildRequest| async {
        Err::<Rebuilt, _>(std::io::Error::other("signing service down"))
    });
    let service = layer(pg.store.clone())
        .rebuild_replays(failing)
        .layer(order_naming_itself(calls.clone()));
    send(service.clone(), tenant_a_post("k-fail")).await;
    let replay = send(service, tenant_a_post("k-fail")).await;
    assert_eq!(replay.status, StatusCode::SERVICE_UNAVAILABLE);
    assert_eq!(replay.json()["code"], "replay_unavailable");
    assert!(replay.headers.contains_key("retry-after"));
    assert_eq!(calls.load(Ordering::SeqCst), 1);
    assert_eq!(pg.count("SELECT count(*) FROM orders").await, 1);
}

/// Without `rebuild_replays`, replays are the stored bytes, resource id or not.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn stored_replays_are_unchanged_byte_for_byte() {
    let pg = Postgres::new().await;
    let calls = Arc::new(AtomicU64::new(0));
    let service = layer(pg.store.clone())
        .without_replay_cache()
        .layer(order_naming_itself(calls.clone()));
    let first = send(service.clone(), tenant_a_post("k-bytes")).await;
    let replay = send(service, tenant_a_post("k-bytes")).await;
    assert!(replay.replayed());
    assert_eq!(replay.status, first.status);
    assert_eq!(replay.body, first.body);
    assert!(resource_column(&pg, "k-bytes").await.is_some());
    assert_eq!(calls.load(Ordering::SeqCst), 1);
}

/// A record written before the column existed (or by a handler that named
/// no resource) replays its stored bytes under `rebuild_replays` too.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn records_without_a_resource_id_replay_their_bytes() {
    let pg = Postgres::new().await;
    let calls = Arc::new(AtomicU64::new(0));
    let links = FreshLinks::new(pg.store.clone());
    let service = layer(pg.store.clone())
        .without_replay_cache()
        .rebuild_replays(links.service())
        .layer(order_handler::<Postgres>(calls.clone()));
    let first = send(service.clone(), tenant_a_post("k-old")).await;
    assert_eq!(resource_column(&pg, "k-old").await, None);
    let replay = send(service, tenant_a_post("k-old")).await;
    assert!(replay.replayed());
    assert_eq!(replay.body, first.body);
    assert_eq!(links.calls.load(Ordering::SeqCst), 0);
    assert_eq!(calls.load(Ordering::SeqCst), 1);
}

/// A resource id no store could keep is refused before anything commits.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn unstorable_resource_id_rolls_back() {
    let pg = Postgres::new().await;
    let service = layer(pg.store.clone()).layer(handler(|tx: PgTx| async move {
        tx.execute(
            "INSERT INTO orders (id, tenant_id) VALUES ($1, 'tenant-a')",
            &[&new_order_id()],
        )
        .await?;
        let mut response = created("{}");
        response
            .extensions_mut()
            .insert(ResourceId::new("line\nbreak"));
        Ok(response)
    }));
    let answer = send(service, tenant_a_post("k-bad-id")).await;
    assert_eq!(answer.status, StatusCode::INTERNAL_SERVER_ERROR);
    assert_eq!(answer.json()["code"], "response_not_storable");
    assert_eq!(pg.count("SELECT count(*) FROM orders").await, 0);
    assert_eq!(
        pg.count("SELECT count(*) FROM idempotency_requests").await,
        0
    );
}
