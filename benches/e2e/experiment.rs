//! Claim at commit, written by hand (not a mode of the layer): the anchors
//! the one-commit mode is measured against. Two of them: the minimal one
//! (a short key row, the first experiment) and the full record (the
//! layer's own one-commit insert, its text and its parameters: fingerprint,
//! status, header block, body, retention), the one a target is set against.

use std::{net::SocketAddr, sync::LazyLock};

use axum::{
    body::Bytes, extract::State, response::IntoResponse, response::Response, routing::post, Router,
};
use http::{header, HeaderMap, HeaderValue, StatusCode};
use tower_idempotency::{record::StoredResponse, testing::statements};

use crate::servers::{serve, BarePool, NewOrder, ENQUEUE};

const INSERT_ORDER: &str =
    "INSERT INTO orders (tenant_id, checkout_id, total) VALUES ($1, $2, $3) RETURNING id::text";

/// The minimal experiment's key row: completed, the body only.
const REMEMBER: &str = "INSERT INTO idempotency_requests (tenant_id, endpoint, idempotency_key, \
     request_fingerprint, state, response_status, response_headers, response_body, completed_at, \
     expires_at) VALUES ('bench', 'at-commit', $1, $2, 'completed', 201, '', $3, now(), \
     now() + interval '1 day')";

/// The full record's endpoint (its keys apart from the layer's).
const FULL_ENDPOINT: &str = "at-commit-full";

/// The layer's default retention, in seconds, as the full record sends it.
const RETENTION_SECS: f64 = 24.0 * 3600.0;

/// The header block the layer stores for the layered handlers' answer
/// (`content-type: application/json`, the only allow-listed header it has).
static HEADER_BLOCK: LazyLock<Vec<u8>> = LazyLock::new(|| {
    let mut headers = HeaderMap::new();
    headers.insert(
        header::CONTENT_TYPE,
        HeaderValue::from_static("application/json"),
    );
    StoredResponse::new(
        StatusCode::CREATED,
        &headers,
        &[header::CONTENT_TYPE],
        Bytes::new(),
    )
    .encode_headers()
});

/// Which key row an experiment writes.
#[derive(Clone, Copy)]
enum Record {
    Minimal,
    Full,
}

/// Claim at commit as an end-to-end experiment, written by hand: the
/// handler's writes come first; the key row goes in last, already
/// completed with its response, pipelined with `COMMIT`, and the unique
/// index arbitrates. The key row is a plain `INSERT`: a duplicate's unique
/// violation aborts its transaction, so the pipelined `COMMIT` rolls its
/// order back, and it replays the winner's record. (No expired-record
/// takeover, no session reset and no in-process waiting: an upper bound of
/// what the strategy could reach.)
async fn at_commit(
    record: Record,
    pool: &BarePool,
    headers: &http::HeaderMap,
    body: &Bytes,
) -> Response {
    use sha2::Digest as _;
    let Some(key) = headers
        .get("idempotency-key")
        .and_then(|k| k.to_str().ok())
        .map(str::to_owned)
    else {
        return StatusCode::BAD_REQUEST.into_response();
    };
    let Ok(order) = serde_json::from_slice::<NewOrder>(body) else {
        return StatusCode::UNPROCESSABLE_ENTITY.into_response();
    };
    let fingerprint = sha2::Sha256::digest(body).to_vec();
    let Ok(client) = pool.get().await else {
        return StatusCode::SERVICE_UNAVAILABLE.into_response();
    };
    let (endpoint, remember_sql) = match record {
        Record::Minimal => ("at-commit", REMEMBER),
        Record::Full => (FULL_ENDPOINT, statements::CLAIM_AT_COMMIT),
    };
    let result = async {
        let insert = client.prepare_cached(INSERT_ORDER).await?;
        let enqueue = client.prepare_cached(ENQUEUE).await?;
        let remember = client.prepare_cached(remember_sql).await?;
        let params: [&(dyn tokio_postgres::types::ToSql + Sync); 3] =
            [&"bench", &order.checkout_id, &order.total];
        let (_, row) = tokio::try_join!(biased; client.batch_execute("BEGIN"), client.query_one(&insert, &params))?;
        let id: String = row.get(0);
        let payload = serde_json::json!({"id": id, "total": order.total});
        let _event: String = client
            .query_one(&enqueue, &[&"bench", &id, &"OrderCreated", &payload])
            .await?
            .get(0);
        let response = serde_json::to_vec(
            &serde_json::json!({"id": id, "checkout_id": order.checkout_id, "total": order.total}),
        )
        .expect("json");
        let remembered = async {
            match record {
                Record::Minimal => {
                    client
                        .execute(&remember, &[&key, &fingerprint, &response])
                        .await
                }
                Record::Full => {
                    let resource: Option<&str> = None;
                    // No trace: the bench's requests carry none.
                    let trace: Option<&str> = None;
                    client
                        .execute(
                            &remember,
                            &[
                                &"bench",
                                &endpoint,
                                &key,
                                &fingerprint,
                                &201_i16,
                                &*HEADER_BLOCK,
                                &response,
                                &resource,
                                &RETENTION_SECS,
                                &trace,
                            ],
                        )
                        .await
                }
            }
        };
        let (remembered, committed) =
            tokio::join!(biased; remembered, client.batch_execute("COMMIT"));
        match (remembered, committed) {
            (Ok(_), Ok(())) => Ok(Ok(response)),
            (Err(e), _) if e.code() == Some(&tokio_postgres::error::SqlState::UNIQUE_VIOLATION) => {
                // The pipelined COMMIT ended the aborted transaction as a
                // rollback: replay the winner's record.
                let row = client
                    .query_one(
                        "SELECT response_body FROM idempotency_requests \
                         WHERE tenant_id = 'bench' AND endpoint = $1 AND idempotency_key = $2",
                        &[&endpoint, &key],
                    )
                    .await?;
                Ok(Err(row.get::<_, Vec<u8>>(0)))
            }
            (Err(e), _) | (_, Err(e)) => Err(e),
        }
    }
    .await;
    match result {
        Ok(Ok(response)) => (
            StatusCode::CREATED,
            [("content-type", "application/json")],
            response,
        )
            .into_response(),
        Ok(Err(replay)) => (
            StatusCode::CREATED,
            [
                ("content-type", "application/json"),
                ("idempotent-replayed", "true"),
            ],
            replay,
        )
            .into_response(),
        Err(_) => {
            let _ = client.batch_execute("ROLLBACK").await;
            StatusCode::SERVICE_UNAVAILABLE.into_response()
        }
    }
}

/// A server whose `POST /orders` is the minimal experiment.
pub(crate) async fn at_commit_server(pool: BarePool) -> SocketAddr {
    server(Record::Minimal, pool).await
}

/// A server whose `POST /orders` is the full-record experiment.
pub(crate) async fn full_record_server(pool: BarePool) -> SocketAddr {
    server(Record::Full, pool).await
}

/// A server whose `POST /orders` is the experiment writing `record`.
async fn server(record: Record, pool: BarePool) -> SocketAddr {
    let handler = move |State(pool): State<BarePool>, headers: HeaderMap, body: Bytes| async move {
        at_commit(record, &pool, &headers, &body).await
    };
    serve(
        Router::new()
            .route("/orders", post(handler))
            .with_state(pool),
    )
    .await
}
