//! The hyper example (`examples/hyper_server.rs`) and the `ServiceBuilder`
//! example (`examples/service_builder.rs`) as processes on their own
//! databases: a create and its replay (one row, one record, the same body),
//! a request without a tenant refused, and a clean stop on SIGINT.

use std::{process::Stdio, time::Duration};

use bytes::Bytes;
use http::{Request, StatusCode};
use http_body_util::{BodyExt, Full};
use hyper_util::{client::legacy::Client, rt::TokioExecutor};
use tokio::process::Command;
use tower_idempotency::testing::TestDatabase;

/// Starts example `name` (its address in `addr_var`), runs a create, its
/// replay and an unauthenticated request, and stops it with SIGINT.
async fn create_replay_and_stop(name: &str, source: &str, addr_var: &str, table: &str) {
    let binary = crate::common::example_binary::example(name, &[source, "Cargo.toml"]);
    let db = TestDatabase::create().await;
    let mut child = Command::new(binary)
        .env("DATABASE_URL", db.connection_string())
        .env(addr_var, "127.0.0.1:0")
        .env("RUST_LOG", "warn")
        .stdin(Stdio::null())
        .stdout(Stdio::piped())
        .stderr(Stdio::inherit())
        .kill_on_drop(true)
        .spawn()
        .expect("the example starts");
    let base = crate::common::example_binary::listening_base(&mut child).await;

    let client = Client::builder(TokioExecutor::new()).build_http();
    let send = |token: &'static str| {
        let request = Request::post(format!("{base}/orders"))
            .header("authorization", token)
            .header("idempotency-key", "k1")
            .header("content-type", "application/json")
            .body(Full::new(Bytes::from_static(
                br#"{"checkout_id":"c1","total":1200}"#,
            )))
            .unwrap();
        let client = client.clone();
        async move {
            let response = client.request(request).await.expect("the example answers");
            let (parts, body) = response.into_parts();
            let body = body.collect().await.expect("body reads").to_bytes();
            (parts, body)
        }
    };
    let (first, first_body) = send("Bearer demo-token-a").await;
    assert_eq!(first.status, StatusCode::CREATED, "{first_body:?}");
    let (replay, replay_body) = send("Bearer demo-token-a").await;
    assert_eq!(replay.status, StatusCode::CREATED);
    assert_eq!(replay.headers["idempotent-replayed"], "true");
    assert_eq!(replay_body, first_body);
    let (stranger, _) = send("Bearer nobody").await;
    assert_eq!(stranger.status, StatusCode::UNAUTHORIZED);

    let sql = db.client().await;
    let count = |query: String| {
        let sql = &sql;
        async move { sql.query_one(&query, &[]).await.unwrap().get::<_, i64>(0) }
    };
    assert_eq!(count(format!("SELECT count(*) FROM {table}")).await, 1);
    assert_eq!(
        count("SELECT count(*) FROM idempotency_requests WHERE state = 'completed'".into()).await,
        1
    );

    let pid = child.id().expect("running").to_string();
    let sent = Command::new("kill")
        .args(["-INT", &pid])
        .status()
        .await
        .unwrap();
    assert!(sent.success());
    let status = tokio::time::timeout(Duration::from_secs(20), child.wait())
        .await
        .expect("the example stops on SIGINT")
        .unwrap();
    assert!(status.success(), "{status:?}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn hyper_example_creates_replays_and_stops() {
    create_replay_and_stop(
        "hyper_server",
        "examples/hyper_server.rs",
        "HYPER_SERVER_ADDR",
        "hyper_orders",
    )
    .await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn service_builder_example_creates_replays_and_stops() {
    create_replay_and_stop(
        "service_builder",
        "examples/service_builder.rs",
        "SERVICE_BUILDER_ADDR",
        "builder_orders",
    )
    .await;
}
