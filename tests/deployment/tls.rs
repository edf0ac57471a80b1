//! TLS as managed PostgreSQL requires it: a server with `ssl = on` that
//! accepts TLS connections only (`hostssl` lines, `hostnossl … reject`), its
//! certificate signed by a CA made for this run (subject alternative names
//! `localhost` and `127.0.0.1`). Both stores and the example server reach it
//! with libpq's `sslmode`, `sslrootcert`, `sslcert` and `sslkey`; what must
//! not connect is refused, with the reason.

use crate::common;
use crate::common::example_binary;
use crate::common::tls_server;

use std::{process::Stdio, time::Duration};

use bytes::Bytes;
use common::{created, handler, layer, send, tenant_a_post};
use http::StatusCode;
use http_body_util::{BodyExt, Full};
use tls_server::{server, PASSWORD};
use tokio::io::{AsyncBufReadExt, BufReader};
use tower::Layer;
use tower_idempotency::{
    postgres::{PgStore, PgStoreBuilder, PgTx},
    sqlx::SqlxStore,
};

/// Whether the session of `client` is encrypted, as the server sees it.
async fn encrypted(client: &tokio_postgres::Client) -> bool {
    client
        .query_one(
            "SELECT ssl FROM pg_stat_ssl WHERE pid = pg_backend_pid()",
            &[],
        )
        .await
        .unwrap()
        .get(0)
}

/// A create through the layer on `store`, its replay, and the rows: one
/// order, one completed record.
async fn create_and_replay(store: PgStore) {
    let client = store.client().await.unwrap();
    client
        .batch_execute("CREATE TABLE orders (id text PRIMARY KEY, tenant_id text NOT NULL)")
        .await
        .unwrap();
    let service = layer(store.clone()).layer(handler(|tx: PgTx| async move {
        tx.execute(
            "INSERT INTO orders (id, tenant_id) VALUES ('o-1', 'tenant-a')",
            &[],
        )
        .await?;
        Ok(created(r#"{"id":"o-1"}"#))
    }));
    let first = send(service.clone(), tenant_a_post("tls-key")).await;
    assert_eq!(first.status, StatusCode::CREATED, "{:?}", first.body);
    let replay = send(service, tenant_a_post("tls-key")).await;
    assert!(replay.replayed());
    assert_eq!(replay.body, first.body);
    let orders: i64 = client
        .query_one("SELECT count(*) FROM orders", &[])
        .await
        .unwrap()
        .get(0);
    let remembered: i64 = client
        .query_one(
            "SELECT count(*) FROM idempotency_requests WHERE state = 'completed' AND response_status = 201",
            &[],
        )
        .await
        .unwrap()
        .get(0);
    assert_eq!((orders, remembered), (1, 1));
    assert!(encrypted(&client).await);
}

/// The whole error chain of a failed start, as one line.
fn chain(e: &dyn std::error::Error) -> String {
    let mut text = e.to_string();
    let mut source = e.source();
    while let Some(s) = source {
        text.push_str(" / ");
        text.push_str(&s.to_string());
        source = s.source();
    }
    text
}

async fn pg_store_error(url: &str) -> String {
    let store = PgStore::connect(url).expect("the store builds");
    let e = store
        .migrate()
        .await
        .expect_err("the connection is refused");
    chain(&e)
}

#[tokio::test]
async fn pg_store_with_require_creates_and_replays_encrypted() {
    let server = server();
    let db = server.database().await;
    let store = PgStore::connect(&server.url("127.0.0.1", &db, "sslmode=require")).unwrap();
    store.migrate().await.unwrap();
    create_and_replay(store).await;
}

/// The store's TLS takes rustls's process-default crypto provider where
/// the application installed one: here ring restricted to
/// ChaCha20-Poly1305, which the server then reports as the session's
/// cipher (it picks AES-GCM otherwise). Run in a process of its own (this
/// test binary again, on the test below alone), so that no other test's
/// TLS has installed a default before it.
#[test]
fn pg_store_takes_the_process_default_crypto_provider() {
    let output = std::process::Command::new(std::env::current_exe().unwrap())
        .args([
            "--exact",
            "tls::with_a_chacha_only_default_provider",
            "--ignored",
            "--nocapture",
        ])
        .env(PROVIDER_CHILD, "1")
        .output()
        .expect("the test binary runs");
    let out = String::from_utf8_lossy(&output.stdout);
    assert!(
        output.status.success() && out.contains("1 passed"),
        "{out}\n{}",
        String::from_utf8_lossy(&output.stderr)
    );
}

const PROVIDER_CHILD: &str = "TOWER_IDEMPOTENCY_PROVIDER_CHILD";

#[tokio::test]
#[ignore = "run by pg_store_takes_the_process_default_crypto_provider in a process of its own"]
async fn with_a_chacha_only_default_provider() {
    assert!(
        std::env::var_os(PROVIDER_CHILD).is_some(),
        "run through pg_store_takes_the_process_default_crypto_provider"
    );
    let mut provider = rustls::crypto::ring::default_provider();
    provider
        .cipher_suites
        .retain(|s| s.suite() == rustls::CipherSuite::TLS13_CHACHA20_POLY1305_SHA256);
    provider
        .install_default()
        .expect("nothing installed a default before this test");
    let server = server();
    let db = server.database().await;
    let store = PgStore::connect(&server.url("127.0.0.1", &db, "sslmode=require")).unwrap();
    let client = store.client().await.unwrap();
    let cipher: String = client
        .query_one(
            "SELECT cipher FROM pg_stat_ssl WHERE pid = pg_backend_pid()",
            &[],
        )
        .await
        .unwrap()
        .get(0);
    assert_eq!(cipher, "TLS_CHACHA20_POLY1305_SHA256");
}

#[tokio::test]
async fn pg_store_with_verify_full_and_the_ca_works_for_each_name_in_the_certificate() {
    let server = server();
    let db = server.database().await;
    for host in ["127.0.0.1", "localhost"] {
        let url = server.url(
            host,
            &db,
            &format!("sslmode=verify-full&sslrootcert={}", server.ca()),
        );
        let store = PgStore::connect(&url).unwrap();
        store.migrate().await.unwrap();
        assert!(encrypted(&store.client().await.unwrap()).await, "{host}");
    }
    let url = server.url(
        "localhost",
        &db,
        &format!("sslmode=verify-full&sslrootcert={}", server.ca()),
    );
    create_and_replay(PgStore::connect(&url).unwrap()).await;
}

#[tokio::test]
async fn pg_store_refuses_a_certificate_another_ca_signed() {
    let server = server();
    let db = server.database().await;
    for mode in ["verify-full", "verify-ca", "require"] {
        let url = server.url(
            "127.0.0.1",
            &db,
            &format!("sslmode={mode}&sslrootcert={}", server.other_ca()),
        );
        let error = pg_store_error(&url).await;
        assert!(error.contains("store_unavailable"), "{mode}: {error}");
        assert!(
            error.contains("invalid peer certificate") && error.contains("UnknownIssuer"),
            "{mode}: {error}"
        );
    }
}

/// A name the certificate does not carry: verify-full refuses it,
/// verify-ca (the chain only) accepts it.
#[tokio::test]
async fn verify_full_checks_the_host_name_and_verify_ca_does_not() {
    let server = server();
    let db = server.database().await;
    let conninfo = |mode: &str| {
        format!(
            "host=db.invalid hostaddr=127.0.0.1 port={} user=app password={PASSWORD} dbname={db} sslmode={mode} sslrootcert='{}'",
            server.port,
            server.ca()
        )
    };
    let error = pg_store_error(&conninfo("verify-full")).await;
    assert!(
        error.contains("not valid for name \"db.invalid\""),
        "{error}"
    );
    let store = PgStore::connect(&conninfo("verify-ca")).unwrap();
    store.migrate().await.unwrap();
    assert!(encrypted(&store.client().await.unwrap()).await);
}

#[tokio::test]
async fn sslmode_disable_is_refused_by_a_tls_only_server_with_its_reason() {
    let server = server();
    let db = server.database().await;
    let error = pg_store_error(&server.url("127.0.0.1", &db, "sslmode=disable")).await;
    assert!(error.contains("store_unavailable"), "{error}");
    assert!(
        error.contains("pg_hba.conf rejects connection") && error.contains("no encryption"),
        "{error}"
    );
}

#[tokio::test]
async fn pg_store_authenticates_with_a_client_certificate() {
    let server = server();
    let db = server.database().await;
    let base = format!(
        "postgres://certuser@127.0.0.1:{}/{db}?sslmode=verify-full&sslrootcert={}",
        server.port,
        server.ca()
    );
    let with_cert = format!(
        "{base}&sslcert={}&sslkey={}",
        server.file("client.pem").display(),
        server.file("client.key").display()
    );
    let store = PgStore::connect(&with_cert).unwrap();
    let client = store.client().await.unwrap();
    let user: String = client
        .query_one("SELECT current_user", &[])
        .await
        .unwrap()
        .get(0);
    assert_eq!(user, "certuser");
    let client_dn: Option<String> = client
        .query_one(
            "SELECT client_dn FROM pg_stat_ssl WHERE pid = pg_backend_pid()",
            &[],
        )
        .await
        .unwrap()
        .get(0);
    assert_eq!(client_dn.as_deref(), Some("/CN=certuser"));
    // Without the certificate the server refuses certuser.
    let store = PgStore::connect(&base).unwrap();
    let error = chain(&store.client().await.expect_err("refused"));
    assert!(error.contains("certificate"), "{error}");
}

/// A service that configures its own TLS and pool keeps them: the store
/// serves from the caller's deadpool pool, whose connector (a rustls
/// configuration of the caller's, trusting the test CA) encrypts and
/// verifies.
#[tokio::test]
async fn pg_store_serves_from_a_callers_pool_and_connector() {
    use rustls::pki_types::{pem::PemObject, CertificateDer};

    let server = server();
    let db = server.database().await;
    let mut roots = rustls::RootCertStore::empty();
    for cert in CertificateDer::pem_file_iter(server.file("ca.pem")).unwrap() {
        roots.add(cert.unwrap()).unwrap();
    }
    let provider = std::sync::Arc::new(rustls::crypto::ring::default_provider());
    let rustls_config = rustls::ClientConfig::builder_with_provider(provider)
        .with_safe_default_protocol_versions()
        .unwrap()
        .with_root_certificates(roots)
        .with_no_client_auth();
    let tls = tokio_postgres_rustls::MakeRustlsConnect::new(rustls_config);
    let config: tokio_postgres::Config = format!(
        "host=localhost port={} user=app password={PASSWORD} dbname={db} sslmode=require",
        server.port
    )
    .parse()
    .unwrap();
    let manager = deadpool_postgres::Manager::new(config.clone(), tls.clone());
    let pool = deadpool_postgres::Pool::builder(manager)
        .max_size(2)
        .build()
        .unwrap();
    let store = PgStore::builder(config)
        .tls(tls)
        .pool(pool.clone())
        .build()
        .unwrap();
    store.migrate().await.unwrap();
    create_and_replay(store).await;
    let status = pool.status();
    assert!(status.size >= 1 && status.size <= 2, "{status:?}");

    // The caller's connector verifies: against another CA it refuses.
    let mut other = rustls::RootCertStore::empty();
    for cert in CertificateDer::pem_file_iter(server.file("other-ca.pem")).unwrap() {
        other.add(cert.unwrap()).unwrap();
    }
    let provider = std::sync::Arc::new(rustls::crypto::ring::default_provider());
    let untrusting = rustls::ClientConfig::builder_with_provider(provider)
        .with_safe_default_protocol_versions()
        .unwrap()
        .with_root_certificates(other)
        .with_no_client_auth();
    let config: tokio_postgres::Config = format!(
        "host=localhost port={} user=app password={PASSWORD} dbname={db} sslmode=require",
        server.port
    )
    .parse()
    .unwrap();
    let store = PgStore::builder(config)
        .tls(tokio_postgres_rustls::MakeRustlsConnect::new(untrusting))
        .build()
        .unwrap();
    let error = chain(&store.migrate().await.expect_err("refused"));
    assert!(error.contains("UnknownIssuer"), "{error}");
}

/// Settings that cannot work fail when the store is built, saying which.
#[test]
fn tls_settings_that_cannot_work_are_refused_at_build() {
    let server_less = "postgres://app@127.0.0.1:1/db";
    for (query, expected) in [
        ("sslmode=verify-full", "needs sslrootcert"),
        (
            "sslmode=require&sslrootcert=system",
            "needs sslmode=verify-full",
        ),
        (
            "sslmode=verify-ca&sslrootcert=/nonexistent/ca.pem",
            "/nonexistent/ca.pem",
        ),
        ("sslmode=allow", "not supported"),
        // prefer (the default) could fall back to plain text: libpq refuses it.
        (
            "sslnegotiation=direct",
            "sslnegotiation=direct needs sslmode=require",
        ),
        ("sslcert=/tmp/c.pem", "without sslkey"),
    ] {
        let error = PgStoreBuilder::from_conninfo(&format!("{server_less}?{query}"))
            .and_then(PgStoreBuilder::build)
            .expect_err(query);
        assert!(error.to_string().contains(expected), "{query}: {error}");
    }
}

/// A handler cut off at its deadline while its statement runs: the cancel
/// request goes out through the store's TLS connector and ends the statement.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_timed_out_statement_is_cancelled_over_tls() {
    let server = server();
    let db = server.database().await;
    let url = server.url(
        "127.0.0.1",
        &db,
        &format!("sslmode=verify-full&sslrootcert={}", server.ca()),
    );
    let store = PgStoreBuilder::from_conninfo(&url)
        .unwrap()
        .max_connections(1)
        .build()
        .unwrap();
    store.migrate().await.unwrap();
    let service = layer(store.clone())
        .handler_timeout(Duration::from_millis(300))
        .layer(handler(|tx: PgTx| async move {
            tx.execute("SELECT pg_sleep(60)", &[]).await?;
            Ok(created("{}"))
        }));
    let answer = send(service, tenant_a_post("slow")).await;
    assert_eq!(answer.json()["code"], "handler_timeout");
    // The pool has one connection: the next request gets it only once the
    // cancelled statement has ended and its transaction rolled back.
    let client = tokio::time::timeout(Duration::from_secs(20), store.client())
        .await
        .expect("the connection came back without waiting out pg_sleep(60)")
        .unwrap();
    let sleeping: i64 = client
        .query_one(
            "SELECT count(*) FROM pg_stat_activity WHERE query LIKE 'SELECT pg_sleep(60)%' AND state = 'active'",
            &[],
        )
        .await
        .unwrap()
        .get(0);
    assert_eq!(sleeping, 0);
    let records: i64 = client
        .query_one("SELECT count(*) FROM idempotency_requests", &[])
        .await
        .unwrap()
        .get(0);
    assert_eq!(records, 0, "the key is free again");
}

#[tokio::test]
async fn sqlx_store_reaches_the_tls_only_server_with_verify_full() {
    let server = server();
    let db = server.database().await;
    let url = server.url(
        "localhost",
        &db,
        &format!("sslmode=verify-full&sslrootcert={}", server.ca()),
    );
    let pool = sqlx::PgPool::connect(&url).await.unwrap();
    let store = SqlxStore::new(pool.clone());
    store.migrate().await.unwrap();
    let ssl: bool = sqlx::query_scalar("SELECT ssl FROM pg_stat_ssl WHERE pid = pg_backend_pid()")
        .fetch_one(&pool)
        .await
        .unwrap();
    assert!(ssl);
    let version: i32 = sqlx::query_scalar("SELECT max(version) FROM tower_idempotency_migrations")
        .fetch_one(&pool)
        .await
        .unwrap();
    assert!(version >= 1);

    let refused = server.url(
        "localhost",
        &db,
        &format!("sslmode=verify-full&sslrootcert={}", server.other_ca()),
    );
    let error = sqlx::PgPool::connect(&refused).await.expect_err("refused");
    assert!(chain(&error).contains("UnknownIssuer"), "{}", chain(&error));
    let plain = server.url("localhost", &db, "sslmode=disable");
    let error = sqlx::PgPool::connect(&plain).await.expect_err("refused");
    assert!(chain(&error).contains("no encryption"), "{}", chain(&error));
}

/// The example server as a process, `DATABASE_URL` with `verify-full`, in
/// both modes of `POST /orders`: a create and its replay, every connection
/// of the server encrypted (the relay's `LISTEN` connection too).
async fn the_example_server_serves_over_tls(mode: example_binary::Mode) {
    let server = server();
    let db = server.database().await;
    let url = server.url(
        "localhost",
        &db,
        &format!("sslmode=verify-full&sslrootcert={}", server.ca()),
    );
    // Direct: cached statements, and the relay LISTENs on a connection of
    // its own, which must be encrypted too.
    let mut child = tokio::process::Command::new(example_binary::example_binary())
        .env("DATABASE_URL", &url)
        .env("DATABASE_POOL_MODE", "direct")
        .env("IDEMPOTENCY_MODE", mode.name())
        .env("ORDER_SERVER_ADDR", "127.0.0.1:0")
        .env("RUST_LOG", "warn")
        .stdin(Stdio::null())
        .stdout(Stdio::piped())
        .stderr(Stdio::inherit())
        .kill_on_drop(true)
        .spawn()
        .expect("the example server starts");
    let mut line = String::new();
    BufReader::new(child.stdout.take().unwrap())
        .read_line(&mut line)
        .await
        .unwrap();
    let base = line
        .trim()
        .strip_prefix("listening on ")
        .unwrap_or_else(|| panic!("unexpected first line: {line:?}"))
        .to_owned();
    let http = hyper_util::client::legacy::Client::builder(hyper_util::rt::TokioExecutor::new())
        .build_http::<Full<Bytes>>();
    let body = r#"{"checkout_id":"chk-tls","currency":"JPY","items":[{"sku":"S","quantity":1,"unit_price":100}],"shipping_address_id":"a"}"#;
    let post = || {
        http::Request::post(format!("{base}/orders"))
            .header("authorization", "Bearer demo-token-a")
            .header("content-type", "application/json")
            .header("idempotency-key", "tls-order")
            .body(Full::new(Bytes::from_static(body.as_bytes())))
            .unwrap()
    };
    let first = http.request(post()).await.unwrap();
    assert_eq!(first.status(), StatusCode::CREATED);
    let first = first.into_body().collect().await.unwrap().to_bytes();
    let replay = http.request(post()).await.unwrap();
    assert_eq!(replay.headers()["idempotent-replayed"], "true");
    assert_eq!(
        replay.into_body().collect().await.unwrap().to_bytes(),
        first
    );

    let store = PgStore::connect(&url).unwrap();
    let sql = store.client().await.unwrap();
    let orders: i64 = sql
        .query_one(
            "SELECT count(*) FROM orders WHERE checkout_id = 'chk-tls'",
            &[],
        )
        .await
        .unwrap()
        .get(0);
    assert_eq!(orders, 1);
    // Every client connection to this database came over TCP (the server
    // listens on no other way for app), and each is encrypted.
    let (connections, encrypted): (i64, i64) = {
        let row = sql
            .query_one(
                "SELECT count(*), count(*) FILTER (WHERE s.ssl)
                   FROM pg_stat_activity a JOIN pg_stat_ssl s USING (pid)
                  WHERE a.datname = current_database() AND a.usename = 'app'",
                &[],
            )
            .await
            .unwrap();
        (row.get(0), row.get(1))
    };
    assert!(connections >= 2, "{connections}");
    assert_eq!(encrypted, connections);
    let listening = async {
        loop {
            let row = sql
                .query_opt(
                    "SELECT s.ssl FROM pg_stat_activity a JOIN pg_stat_ssl s USING (pid)
                      WHERE a.datname = current_database()
                        AND a.query = 'LISTEN tower_idempotency_outbox'",
                    &[],
                )
                .await
                .unwrap();
            match row {
                Some(row) => break row.get::<_, bool>(0),
                // Polled until the relay has connected, within the timeout below.
                None => tokio::time::sleep(Duration::from_millis(20)).await,
            }
        }
    };
    let listener_encrypted = tokio::time::timeout(Duration::from_secs(30), listening)
        .await
        .expect("the relay LISTENs in direct mode");
    assert!(listener_encrypted);
    child.kill().await.ok();
}

example_binary::both_modes!(the_example_server_serves_over_tls);

/// With another CA the example server does not start, and says why in one
/// line; an unknown `DATABASE_POOL_MODE` is refused the same way.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_example_server_refuses_an_unverified_certificate() {
    let server = server();
    let db = server.database().await;
    let url = server.url(
        "localhost",
        &db,
        &format!("sslmode=verify-full&sslrootcert={}", server.ca()),
    );

    let refused = server.url(
        "localhost",
        &db,
        &format!("sslmode=verify-full&sslrootcert={}", server.other_ca()),
    );
    let out = tokio::process::Command::new(example_binary::example_binary())
        .env("DATABASE_URL", &refused)
        .env("ORDER_SERVER_ADDR", "127.0.0.1:0")
        .env("RUST_LOG", "off")
        .stdin(Stdio::null())
        .output();
    let out = tokio::time::timeout(Duration::from_secs(60), out)
        .await
        .expect("it stops by itself")
        .unwrap();
    assert_eq!(out.status.code(), Some(1));
    assert!(out.stdout.is_empty(), "it never listened");
    let stderr = String::from_utf8_lossy(&out.stderr);
    let lines: Vec<&str> = stderr.lines().collect();
    assert_eq!(lines.len(), 1, "{stderr}");
    assert!(
        lines[0].contains("invalid peer certificate") && lines[0].contains("UnknownIssuer"),
        "{stderr}"
    );

    let out = tokio::process::Command::new(example_binary::example_binary())
        .env("DATABASE_URL", &url)
        .env("DATABASE_POOL_MODE", "session")
        .env("ORDER_SERVER_ADDR", "127.0.0.1:0")
        .env("RUST_LOG", "off")
        .stdin(Stdio::null())
        .output()
        .await
        .unwrap();
    assert_eq!(out.status.code(), Some(1));
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(
        stderr.trim().contains("DATABASE_POOL_MODE=\"session\""),
        "{stderr}"
    );
}

/// A rustls connector of the caller's, trusting no root: enough for a
/// server that never gets as far as a handshake.
fn callers_connector() -> tokio_postgres_rustls::MakeRustlsConnect {
    let provider = std::sync::Arc::new(rustls::crypto::ring::default_provider());
    let config = rustls::ClientConfig::builder_with_provider(provider)
        .with_safe_default_protocol_versions()
        .unwrap()
        .with_root_certificates(rustls::RootCertStore::empty())
        .with_no_client_auth();
    tokio_postgres_rustls::MakeRustlsConnect::new(config)
}

/// The test cluster reached over loopback TCP through a proxy: a server
/// that offers no TLS (a Unix socket never does), as a plaintext server or
/// anyone on the path who answers "no TLS" to the TLS request. Returns the
/// proxy and a connection string to it with `sslmode`.
async fn plaintext_server(
    db: &tower_idempotency::testing::TestDatabase,
    sslmode: &str,
) -> (common::proxy::SlowProxy, String) {
    let proxy = common::proxy::SlowProxy::start(db.config()).await;
    let config = db.config();
    let url = format!(
        "host=127.0.0.1 port={} user={} dbname={} sslmode={sslmode}",
        proxy.port(),
        config.get_user().unwrap(),
        config.get_dbname().unwrap(),
    );
    (proxy, url)
}

/// A connector of one's own never weakens the connection string's
/// `sslmode`: with `require` (and `verify-*`, which a caller's connector
/// verifies) a server that offers no TLS is refused, never spoken to in
/// plaintext; with `prefer` and `disable` it connects without TLS, as
/// libpq does.
#[tokio::test]
async fn a_callers_connector_keeps_the_sslmode_of_the_connection_string() {
    let db = tower_idempotency::testing::TestDatabase::create().await;
    let (_proxy, url) = plaintext_server(&db, "require").await;
    let store = PgStoreBuilder::from_conninfo(&url)
        .unwrap()
        .tls(callers_connector())
        .build()
        .expect("the store builds");
    let error = chain(&store.client().await.expect_err("no plaintext session"));
    assert!(error.contains("server does not support TLS"), "{error}");
    assert!(error.contains("store_unavailable"), "{error}");

    for mode in ["prefer", "disable"] {
        let (_proxy, url) = plaintext_server(&db, mode).await;
        let store = PgStoreBuilder::from_conninfo(&url)
            .unwrap()
            .tls(callers_connector())
            .build()
            .unwrap();
        let client = store
            .client()
            .await
            .unwrap_or_else(|e| panic!("{mode}: {e}"));
        assert!(!encrypted(&client).await, "{mode}");
    }
}

/// The relay's `LISTEN` connection, opened outside the pool with the
/// builder's configuration and connector, keeps `sslmode=require` too:
/// the pool here is the caller's (plaintext over the local socket), the
/// relay's listener goes through the plaintext TCP proxy and is refused
/// at every attempt, so no `LISTEN` session ever exists.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_relays_listener_keeps_sslmode_require_with_a_callers_connector() {
    use tower_idempotency::outbox::{DeliveryError, OutboxEvent, Relay, Sink};
    struct Nowhere;
    impl Sink for Nowhere {
        async fn deliver(&self, _: &OutboxEvent) -> Result<(), DeliveryError> {
            Ok(())
        }
    }
    let db = tower_idempotency::testing::TestDatabase::create().await;
    let (proxy, url) = plaintext_server(&db, "require").await;
    let manager = deadpool_postgres::Manager::new(db.config(), tokio_postgres::NoTls);
    let pool = deadpool_postgres::Pool::builder(manager)
        .max_size(2)
        .build()
        .unwrap();
    let store = PgStoreBuilder::from_conninfo(&url)
        .unwrap()
        .tls(callers_connector())
        .pool(pool)
        .build()
        .unwrap();
    store.migrate().await.unwrap();
    let (stop, stopped) = tokio::sync::oneshot::channel::<()>();
    let relay = Relay::new(store.clone(), Nowhere).poll_interval(Duration::from_millis(50));
    let running = tokio::spawn(async move {
        relay
            .run(async {
                let _ = stopped.await;
            })
            .await
    });
    // The listener reconnects after a failed attempt: a second attempt
    // through the proxy means the first one was refused. (A plaintext
    // session would have stayed connected, LISTENing.)
    let retried = async {
        while proxy.connections() < 2 {
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
    };
    tokio::time::timeout(Duration::from_secs(20), retried)
        .await
        .expect("the listener's first connection was refused and it tried again");
    let client = db.client().await;
    let listening: i64 = client
        .query_one(
            "SELECT count(*) FROM pg_stat_activity
              WHERE datname = current_database() AND query = 'LISTEN tower_idempotency_outbox'",
            &[],
        )
        .await
        .unwrap()
        .get(0);
    assert_eq!(listening, 0, "no plaintext LISTEN session");
    let _ = stop.send(());
    running.await.unwrap().unwrap();
}

/// Certificate files in the connection string beside a connector of one's
/// own are refused when the store is built, not dropped: the connector
/// does not read them.
#[test]
fn certificate_files_beside_a_callers_connector_are_refused_at_build() {
    let base = "postgres://app@127.0.0.1:1/db?sslmode=require";
    for (query, expected) in [
        ("&sslrootcert=/tmp/ca.pem", "sslrootcert cannot be used"),
        (
            "&sslcert=/tmp/c.pem&sslkey=/tmp/c.key",
            "sslcert and sslkey cannot be used",
        ),
    ] {
        let error = PgStoreBuilder::from_conninfo(&format!("{base}{query}"))
            .unwrap()
            .tls(callers_connector())
            .build()
            .expect_err(query);
        assert!(error.to_string().contains(expected), "{query}: {error}");
    }
    // Without them the same builder is fine, and so is verify-full, which
    // a connector of one's own verifies (no sslrootcert of ours needed).
    for url in [
        base.to_owned(),
        "postgres://app@127.0.0.1:1/db?sslmode=verify-full".to_owned(),
    ] {
        PgStoreBuilder::from_conninfo(&url)
            .unwrap()
            .tls(callers_connector())
            .build()
            .unwrap_or_else(|e| panic!("{url}: {e}"));
    }
}

/// The TLS test server's Unix socket directory, for libpq's `host=/dir`.
fn socket_dir(server: &tls_server::TlsServer) -> String {
    match &server.cluster.config().get_hosts()[0] {
        tokio_postgres::config::Host::Unix(path) => path.display().to_string(),
        other @ tokio_postgres::config::Host::Tcp(_) => {
            panic!("the cluster listens on a Unix socket, not {other:?}")
        }
    }
}

/// A Unix socket carries no TLS, and libpq ignores `sslmode` there:
/// `require` and `prefer` connect (without TLS) where tokio-postgres alone
/// asks the socket for TLS and gives up; `verify-*`, which promise a
/// checked certificate, are refused when the store is built.
#[tokio::test]
async fn require_and_prefer_over_a_unix_socket_connect_without_tls() {
    let server = server();
    let db = server.database().await;
    let conninfo = |mode: &str| {
        format!(
            "host={} port={} user=app dbname={db} sslmode={mode}",
            socket_dir(server),
            server.port
        )
    };
    for mode in ["require", "prefer"] {
        let store = PgStore::connect(&conninfo(mode)).unwrap();
        let client = store
            .client()
            .await
            .unwrap_or_else(|e| panic!("{mode}: {}", chain(&e)));
        assert!(!encrypted(&client).await, "{mode}: a local socket");
    }
    for mode in ["verify-ca", "verify-full"] {
        let conninfo = format!("{} sslrootcert='{}'", conninfo(mode), server.ca());
        let error = PgStore::connect(&conninfo).expect_err(mode);
        assert!(error.to_string().contains("Unix socket"), "{mode}: {error}");
    }
}

/// `hostaddr` without `host`: below `verify-full` the address serves as
/// the TLS name (nothing checks it), so `require` and `verify-ca` connect
/// encrypted; `verify-full` has no name to check and is refused at build.
#[tokio::test]
async fn hostaddr_without_host_connects_below_verify_full() {
    let server = server();
    let db = server.database().await;
    let conninfo = |mode: &str| {
        format!(
            "hostaddr=127.0.0.1 port={} user=app password={PASSWORD} dbname={db} sslmode={mode} sslrootcert='{}'",
            server.port,
            server.ca()
        )
    };
    for mode in ["require", "verify-ca"] {
        let store = PgStore::connect(&conninfo(mode)).unwrap();
        let client = store
            .client()
            .await
            .unwrap_or_else(|e| panic!("{mode}: {}", chain(&e)));
        assert!(encrypted(&client).await, "{mode}");
    }
    let error = PgStore::connect(&conninfo("verify-full")).expect_err("no name to verify");
    assert!(error.to_string().contains("needs host"), "{error}");
    // The other CA is still refused: the address names the server, it
    // does not vouch for it.
    let other = format!(
        "hostaddr=127.0.0.1 port={} user=app password={PASSWORD} dbname={db} sslmode=verify-ca sslrootcert='{}'",
        server.port,
        server.other_ca()
    );
    let error = pg_store_error(&other).await;
    assert!(error.contains("UnknownIssuer"), "{error}");
}

/// The store's TLS names its protocol by ALPN (`postgresql`), which
/// PostgreSQL 17 requires of a direct TLS connection
/// (`sslnegotiation=direct`): seen by a TLS server that records what the
/// client offered.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn direct_tls_offers_the_postgresql_alpn() {
    use rustls::pki_types::{pem::PemObject, CertificateDer, PrivateKeyDer};

    let ca = tls_server::Ca::new("ALPN test CA");
    let (cert, key) = ca.sign("localhost", &["localhost"]);
    let listener = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
    let port = listener.local_addr().unwrap().port();
    let offered = std::thread::spawn(move || {
        let (mut socket, _) = listener.accept().unwrap();
        socket
            .set_read_timeout(Some(Duration::from_secs(20)))
            .unwrap();
        let chain = CertificateDer::pem_slice_iter(cert.as_bytes())
            .collect::<Result<Vec<_>, _>>()
            .unwrap();
        let key = PrivateKeyDer::from_pem_slice(key.as_bytes()).unwrap();
        let provider = std::sync::Arc::new(rustls::crypto::ring::default_provider());
        let mut config = rustls::ServerConfig::builder_with_provider(provider)
            .with_safe_default_protocol_versions()
            .unwrap()
            .with_no_client_auth()
            .with_single_cert(chain, key)
            .unwrap();
        config.alpn_protocols = vec![b"postgresql".to_vec()];
        let mut tls = rustls::ServerConnection::new(std::sync::Arc::new(config)).unwrap();
        while tls.is_handshaking() {
            tls.complete_io(&mut socket)
                .expect("the handshake completes");
        }
        tls.alpn_protocol().map(<[u8]>::to_vec)
    });
    let url = format!(
        "host=localhost port={port} user=app dbname=app sslmode=require sslnegotiation=direct"
    );
    let store = PgStoreBuilder::from_conninfo(&url)
        .unwrap()
        .build()
        .unwrap();
    // No PostgreSQL behind the handshake: the connection then fails.
    let _ = store.client().await;
    let offered = offered.join().unwrap();
    assert_eq!(offered.as_deref(), Some(&b"postgresql"[..]));
}

/// A server that takes TLS or not, for `prefer`.
fn either_server() -> &'static tls_server::TlsServer {
    static SERVER: std::sync::OnceLock<tls_server::TlsServer> = std::sync::OnceLock::new();
    SERVER.get_or_init(|| tls_server::TlsServer::start(tls_server::EITHER, false))
}

/// `prefer` tries TLS and, when the handshake fails, connects again
/// without it, as libpq does (here the certificate does not chain to the
/// given root); `require` with the same root is refused.
#[tokio::test]
async fn prefer_connects_without_tls_after_a_failed_handshake() {
    let server = either_server();
    let db = server.database().await;
    let url = |mode: &str| {
        server.url(
            "localhost",
            &db,
            &format!("sslmode={mode}&sslrootcert={}", server.other_ca()),
        )
    };
    let store = PgStore::connect(&url("prefer")).unwrap();
    store.migrate().await.unwrap();
    let client = store
        .client()
        .await
        .unwrap_or_else(|e| panic!("{}", chain(&e)));
    assert!(
        !encrypted(&client).await,
        "plaintext after the failed handshake"
    );
    let error = pg_store_error(&url("require")).await;
    assert!(error.contains("UnknownIssuer"), "{error}");
    // With the right root, prefer gets TLS.
    let trusted = server.url(
        "localhost",
        &db,
        &format!("sslmode=prefer&sslrootcert={}", server.ca()),
    );
    let store = PgStore::connect(&trusted).unwrap();
    assert!(encrypted(&store.client().await.unwrap()).await);
}

/// A loopback address the TLS test server's certificate does not name
/// (127.0.0.2, forwarded to the server): the host a provider's
/// certificate does not carry, for `verify-ca`.
async fn unnamed_address(server: &tls_server::TlsServer) -> std::net::SocketAddr {
    let listener = tokio::net::TcpListener::bind("127.0.0.2:0").await.unwrap();
    let addr = listener.local_addr().unwrap();
    let target = format!("127.0.0.1:{}", server.port);
    tokio::spawn(async move {
        while let Ok((mut client, _)) = listener.accept().await {
            let target = target.clone();
            tokio::spawn(async move {
                if let Ok(mut upstream) = tokio::net::TcpStream::connect(&target).await {
                    let _ = tokio::io::copy_bidirectional(&mut client, &mut upstream).await;
                }
            });
        }
    });
    addr
}

/// `SqlxStore` takes the application's `sqlx::PgPool`, whose TLS is
/// sqlx 0.9's own; the deploying guide's table states where it departs from
/// libpq, and these pin each such row (a sqlx that changes fails here, and
/// the table with it):
/// - `verify-ca` checks the chain, not the name, as libpq: a certificate
///   that does not name the host dialled is taken, one from another CA is
///   refused (sqlx 0.8 checked the name too);
/// - `require` never checks the certificate, even with `sslrootcert`
///   (`PgStore` checks the chain then, as libpq);
/// - `require` over a Unix socket fails (`PgStore` connects without TLS).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn sqlx_tls_departs_from_libpq_where_the_guide_says() {
    let server = server();
    let db = server.database().await;
    let unnamed = unnamed_address(server).await;
    let verify_ca = format!(
        "postgres://app:{PASSWORD}@{unnamed}/{db}?sslmode=verify-ca&sslrootcert={}",
        server.ca()
    );
    let pool = sqlx::PgPool::connect(&verify_ca)
        .await
        .expect("sqlx: verify-ca checks the chain only");
    let ssl: bool = sqlx::query_scalar("SELECT ssl FROM pg_stat_ssl WHERE pid = pg_backend_pid()")
        .fetch_one(&pool)
        .await
        .unwrap();
    assert!(ssl);
    pool.close().await;
    let verify_ca_other_ca = format!(
        "postgres://app:{PASSWORD}@{unnamed}/{db}?sslmode=verify-ca&sslrootcert={}",
        server.other_ca()
    );
    let error = sqlx::PgPool::connect(&verify_ca_other_ca)
        .await
        .expect_err("sqlx: verify-ca checks the chain");
    assert!(chain(&error).contains("UnknownIssuer"), "{}", chain(&error));
    let store = PgStore::connect(&verify_ca).unwrap();
    assert!(
        encrypted(&store.client().await.unwrap()).await,
        "PgStore: verify-ca checks the chain only"
    );

    let require_other_ca = server.url(
        "localhost",
        &db,
        &format!("sslmode=require&sslrootcert={}", server.other_ca()),
    );
    let pool = sqlx::PgPool::connect(&require_other_ca)
        .await
        .expect("sqlx: require does not check the chain");
    let ssl: bool = sqlx::query_scalar("SELECT ssl FROM pg_stat_ssl WHERE pid = pg_backend_pid()")
        .fetch_one(&pool)
        .await
        .unwrap();
    assert!(ssl);
    let error = pg_store_error(&require_other_ca).await;
    assert!(error.contains("UnknownIssuer"), "PgStore: {error}");

    let socket = format!(
        "postgres://app@localhost/{db}?host={}&port={}&sslmode=require",
        socket_dir(server),
        server.port
    );
    let error = sqlx::PgPool::connect(&socket)
        .await
        .expect_err("sqlx asks a Unix socket for TLS");
    assert!(
        chain(&error).contains("server does not support TLS"),
        "{}",
        chain(&error)
    );
}
