//! Claim at commit, written by hand (not a mode of the layer): the upper
//! bound the one-commit mode is measured against.

use axum::{body::Bytes, extract::State, response::IntoResponse, response::Response};
use http::StatusCode;

use std::net::SocketAddr;

use axum::{routing::post, Router};

use crate::servers::{created, serve, BarePool, NewOrder};

const INSERT_ORDER: &str =
    "INSERT INTO orders (tenant_id, checkout_id, total) VALUES ($1, $2, $3) RETURNING id::text";

/// Claim at commit as an end-to-end experiment, written by hand (it is not
/// a strategy of the layer): "claim at commit". The handler's writes come
/// first; the key row goes in last, already completed with its response,
/// pipelined with `COMMIT`, and the unique index arbitrates. The key row is a
/// plain `INSERT`: a duplicate's unique violation aborts its transaction, so
/// the pipelined `COMMIT` rolls its order back, and it replays the winner's
/// record. (No expired-record takeover and no in-process waiting: an upper
/// bound of what the strategy could reach.)
pub(crate) async fn at_commit(
    State(pool): State<BarePool>,
    headers: http::HeaderMap,
    body: Bytes,
) -> Response {
    use sha2::Digest as _;
    let Some(key) = headers
        .get("idempotency-key")
        .and_then(|k| k.to_str().ok())
        .map(str::to_owned)
    else {
        return StatusCode::BAD_REQUEST.into_response();
    };
    let Ok(order) = serde_json::from_slice::<NewOrder>(&body) else {
        return StatusCode::UNPROCESSABLE_ENTITY.into_response();
    };
    let fingerprint = sha2::Sha256::digest(&body).to_vec();
    let Ok(client) = pool.get().await else {
        return StatusCode::SERVICE_UNAVAILABLE.into_response();
    };
    let result = async {
        let insert = client.prepare_cached(INSERT_ORDER).await?;
        let enqueue = client
            .prepare_cached(
                "INSERT INTO outbox_events (tenant_id, aggregate_id, event_type, payload) VALUES ($1, $2, 'OrderCreated', $3)",
            )
            .await?;
        let remember = client
            .prepare_cached(
                "INSERT INTO idempotency_requests (tenant_id, endpoint, idempotency_key, request_fingerprint, state, \
                 response_status, response_headers, response_body, completed_at, expires_at) \
                 VALUES ('bench', 'at-commit', $1, $2, 'completed', 201, '', $3, now(), now() + interval '1 day')",
            )
            .await?;
        let params: [&(dyn tokio_postgres::types::ToSql + Sync); 3] = [&"bench", &order.checkout_id, &order.total];
        let (_, row) = tokio::try_join!(biased; client.batch_execute("BEGIN"), client.query_one(&insert, &params))?;
        let id: String = row.get(0);
        let payload = serde_json::json!({"id": id, "total": order.total});
        client.execute(&enqueue, &[&"bench", &id, &payload]).await?;
        let response = serde_json::to_vec(
            &serde_json::json!({"id": id, "checkout_id": order.checkout_id, "total": order.total}),
        )
        .expect("json");
        let row: [&(dyn tokio_postgres::types::ToSql + Sync); 3] = [&key, &fingerprint, &response];
        let (remembered, committed) = tokio::join!(
            biased;
            client.execute(&remember, &row),
            client.batch_execute("COMMIT")
        );
        match (remembered, committed) {
            (Ok(_), Ok(())) => Ok(Ok(id)),
            (Err(e), _) if e.code() == Some(&tokio_postgres::error::SqlState::UNIQUE_VIOLATION) => {
                // The pipelined COMMIT ended the aborted transaction as a
                // rollback: replay the winner's record.
                let row = client
                    .query_one(
                        "SELECT response_body FROM idempotency_requests \
                         WHERE tenant_id = 'bench' AND endpoint = 'at-commit' AND idempotency_key = $1",
                        &[&key],
                    )
                    .await?;
                Ok(Err(row.get::<_, Vec<u8>>(0)))
            }
            (Err(e), _) | (_, Err(e)) => Err(e),
        }
    }
    .await;
    match result {
        Ok(Ok(id)) => created(id, &order.checkout_id, order.total),
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

/// A server whose `POST /orders` is [`at_commit`].
pub(crate) async fn at_commit_server(pool: BarePool) -> SocketAddr {
    let app = Router::new().route("/orders", post(at_commit));
    serve(app.with_state(pool)).await
}
