//! Handlers written the axum way against a real PostgreSQL: a handler that
//! returns `Err(TxError)` answers the problem and commits nothing, and
//! `Option<PgTx>` on a route whose key is optional.

use axum::{body::Body, routing::post, Router};
use bytes::Bytes;
use http::{header, Request, StatusCode};
use http_body_util::{BodyExt, Full};
use serde_json::Value;
use tower::ServiceExt;
use tower_idempotency::{
    postgres::{PgTx, TxError},
    problem::PROBLEM_JSON,
};

use crate::common::{self, layer, tenant_a_post, Postgres, BODY};

/// Status, headers and body of an axum answer.
struct Answer {
    status: StatusCode,
    headers: http::HeaderMap,
    body: Bytes,
}

impl Answer {
    fn json(&self) -> Value {
        serde_json::from_slice(&self.body).expect("JSON body")
    }
}

async fn send(app: Router, request: Request<Full<Bytes>>) -> Answer {
    let response = app
        .oneshot(request.map(Body::new))
        .await
        .expect("axum answers");
    let (parts, body) = response.into_parts();
    Answer {
        status: parts.status,
        headers: parts.headers,
        body: body.collect().await.expect("body reads").to_bytes(),
    }
}

async fn orders(pg: &Postgres) -> i64 {
    pg.count("SELECT count(*) FROM orders").await
}

async fn records(pg: &Postgres) -> i64 {
    pg.count("SELECT count(*) FROM idempotency_requests").await
}

/// The second insert of the same id breaks the primary key: the handler's
/// `?` answers `500 statement_failed` as a problem, the body names neither
/// the statement nor the value, and neither the first order nor the key's
/// record is committed, so the key is free for a retry.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_refused_statement_answers_its_problem_and_commits_nothing() {
    async fn create(tx: PgTx) -> Result<StatusCode, TxError> {
        for _ in 0..2 {
            tx.execute(
                "INSERT INTO orders (id, tenant_id) VALUES ('secret-order-id', $1)",
                &[&tx.tenant()],
            )
            .await?;
        }
        Ok(StatusCode::CREATED)
    }
    let pg = Postgres::new().await;
    let app = Router::new().route("/orders", post(create).layer(layer(pg.store.clone())));
    let answer = send(app, tenant_a_post("k1")).await;
    assert_eq!(answer.status, StatusCode::INTERNAL_SERVER_ERROR);
    assert_eq!(answer.headers[header::CONTENT_TYPE], PROBLEM_JSON);
    assert_eq!(answer.json()["code"], "statement_failed");
    assert!(answer.headers.get(header::RETRY_AFTER).is_none());
    let text = String::from_utf8_lossy(&answer.body);
    assert!(
        !text.contains("secret-order-id") && !text.contains("INSERT") && !text.contains("23505"),
        "{text}"
    );
    assert_eq!(orders(&pg).await, 0, "the first insert rolled back");
    assert_eq!(records(&pg).await, 0, "the key is free");
    assert_eq!(pg.idle_in_transaction().await, 0);
}

/// A session the server ended under the handler (`57P01`): `503
/// store_unavailable` with `Retry-After`, and nothing committed.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_lost_connection_answers_store_unavailable_and_commits_nothing() {
    async fn create(tx: PgTx) -> Result<StatusCode, TxError> {
        tx.execute(
            "INSERT INTO orders (id, tenant_id) VALUES ('o1', $1)",
            &[&tx.tenant()],
        )
        .await?;
        tx.execute("SELECT pg_terminate_backend(pg_backend_pid())", &[])
            .await?;
        Ok(StatusCode::CREATED)
    }
    let pg = Postgres::new().await;
    let app = Router::new().route("/orders", post(create).layer(layer(pg.store.clone())));
    let answer = send(app, tenant_a_post("k1")).await;
    assert_eq!(
        answer.status,
        StatusCode::SERVICE_UNAVAILABLE,
        "{:?}",
        answer.body
    );
    assert_eq!(answer.headers[header::CONTENT_TYPE], PROBLEM_JSON);
    assert_eq!(answer.json()["code"], "store_unavailable");
    assert!(answer.headers.contains_key(header::RETRY_AFTER));
    assert_eq!(orders(&pg).await, 0);
    assert_eq!(records(&pg).await, 0);
}

/// With `require_key(false)` a request without a key passes through with
/// no handle (`None`, nothing written by the handler, no record); with a
/// key the handler gets `Some` and its row commits with the record.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn optional_tx_is_none_without_a_key_and_some_with_one() {
    async fn create(tx: Option<PgTx>) -> Result<(StatusCode, &'static str), TxError> {
        let Some(tx) = tx else {
            return Ok((StatusCode::CREATED, "without"));
        };
        tx.execute(
            "INSERT INTO orders (id, tenant_id) VALUES ('o1', $1)",
            &[&tx.tenant()],
        )
        .await?;
        Ok((StatusCode::CREATED, "with"))
    }
    let pg = Postgres::new().await;
    let app = Router::new().route(
        "/orders",
        post(create).layer(layer(pg.store.clone()).require_key(false)),
    );

    let without = send(app.clone(), common::post(Some("tenant-a"), None, BODY)).await;
    assert_eq!(without.status, StatusCode::CREATED);
    assert_eq!(&without.body[..], b"without");
    assert_eq!(orders(&pg).await, 0);
    assert_eq!(records(&pg).await, 0);

    let with = send(app, tenant_a_post("k1")).await;
    assert_eq!(with.status, StatusCode::CREATED);
    assert_eq!(&with.body[..], b"with");
    assert_eq!(orders(&pg).await, 1);
    assert_eq!(
        pg.count("SELECT count(*) FROM idempotency_requests WHERE state = 'completed'")
            .await,
        1
    );
}
