//! End-to-end cost of the layer: the same order + outbox inserts served over
//! loopback HTTP, bare and behind `IdempotencyLayer`, against a throwaway
//! PostgreSQL with production durability (fsync on), load from a client in
//! the same run. Scenarios alternate and repeat; medians are reported.
//!
//!     cargo bench --bench e2e
//!
//! Environment: `E2E_SECONDS` (per scenario run, default 5), `E2E_ROUNDS`
//! (default 3). The last line is
//! `RATIOS create_vs_bare=<x.xx> replay_vs_create=<x.xx> p99_create_vs_bare=<x.xx> mixed_vs_bare=<x.xx>`.
#![allow(unsafe_code)] // the counting allocator below, and nothing else

use std::{
    alloc::{GlobalAlloc, Layout, System},
    net::SocketAddr,
    sync::{
        atomic::{AtomicIsize, AtomicUsize, Ordering},
        Arc, Mutex,
    },
    time::{Duration, Instant},
};

use axum::{body::Bytes, extract::State, response::IntoResponse, routing::post, Json, Router};
use http::{Request, StatusCode};
use http_body_util::{BodyExt, Full};
use hyper_util::{client::legacy::Client, rt::TokioExecutor};
use serde::{Deserialize, Serialize};
use tokio::sync::Notify;
use tower::ServiceExt;
use tower_idempotency::{
    fingerprint::{TypedFingerprinter, Validated},
    memory::MemoryStore,
    outbox,
    postgres::{PgStore, PgTx},
    scope::SingleTenant,
    testing::TempPostgres,
    IdempotencyLayer, RequestBody,
};

const POOL: usize = 16;
const CONCURRENCY: usize = 32;
const HOT_DUPLICATES: usize = 50;

// ---------------------------------------------------------------- memory

/// Counts live heap bytes, to measure the layer's memory per in-flight request.
/// (A global allocator is unsafe to implement; it only forwards to `System`.)
struct Counting;
static LIVE: AtomicIsize = AtomicIsize::new(0);

unsafe impl GlobalAlloc for Counting {
    unsafe fn alloc(&self, layout: Layout) -> *mut u8 {
        LIVE.fetch_add(layout.size() as isize, Ordering::Relaxed);
        unsafe { System.alloc(layout) }
    }
    unsafe fn dealloc(&self, ptr: *mut u8, layout: Layout) {
        LIVE.fetch_sub(layout.size() as isize, Ordering::Relaxed);
        unsafe { System.dealloc(ptr, layout) }
    }
    unsafe fn realloc(&self, ptr: *mut u8, layout: Layout, new_size: usize) -> *mut u8 {
        LIVE.fetch_add(
            new_size as isize - layout.size() as isize,
            Ordering::Relaxed,
        );
        unsafe { System.realloc(ptr, layout, new_size) }
    }
}

#[global_allocator]
static ALLOCATOR: Counting = Counting;

// ---------------------------------------------------------------- servers

#[derive(Debug, Serialize, Deserialize)]
struct NewOrder {
    checkout_id: String,
    total: i64,
}

const INSERT_ORDER: &str =
    "INSERT INTO orders (tenant_id, checkout_id, total) VALUES ($1, $2, $3) RETURNING id::text";

fn created(id: String, order: &NewOrder) -> axum::response::Response {
    (
        StatusCode::CREATED,
        Json(serde_json::json!({"id": id, "checkout_id": order.checkout_id, "total": order.total})),
    )
        .into_response()
}

/// The same writes in the handler's own transaction, no layer.
async fn bare(State(store): State<PgStore>, body: Bytes) -> axum::response::Response {
    let Ok(order) = serde_json::from_slice::<NewOrder>(&body) else {
        return StatusCode::UNPROCESSABLE_ENTITY.into_response();
    };
    let Ok(client) = store.client().await else {
        return StatusCode::SERVICE_UNAVAILABLE.into_response();
    };
    let result = async {
        let insert = client.prepare_cached(INSERT_ORDER).await?;
        let enqueue = client
            .prepare_cached(
                "INSERT INTO outbox_events (tenant_id, aggregate_id, event_type, payload) VALUES ($1, $2, 'OrderCreated', $3)",
            )
            .await?;
        let params: [&(dyn tokio_postgres::types::ToSql + Sync); 3] = [&"bench", &order.checkout_id, &order.total];
        let (_, row) = tokio::try_join!(biased; client.batch_execute("BEGIN"), client.query_one(&insert, &params))?;
        let id: String = row.get(0);
        let payload = serde_json::json!({"id": id, "total": order.total});
        client.execute(&enqueue, &[&"bench", &id, &payload]).await?;
        client.batch_execute("COMMIT").await?;
        Ok::<_, tokio_postgres::Error>(id)
    }
    .await;
    match result {
        Ok(id) => created(id, &order),
        Err(_) => {
            let _ = client.batch_execute("ROLLBACK").await;
            StatusCode::SERVICE_UNAVAILABLE.into_response()
        }
    }
}

/// The same writes through the layer's transaction.
async fn layered(tx: PgTx, order: Validated<NewOrder>) -> axum::response::Response {
    let result = async {
        let row = tx
            .query_one(
                INSERT_ORDER,
                &[&tx.tenant(), &order.checkout_id, &order.total],
            )
            .await?;
        let id: String = row.get(0);
        outbox::enqueue(
            &tx,
            &id,
            "OrderCreated",
            &serde_json::json!({"id": id, "total": order.total}),
        )
        .await?;
        Ok::<_, tower_idempotency::postgres::TxError>(id)
    }
    .await;
    match result {
        Ok(id) => created(id, &order),
        Err(_) => StatusCode::SERVICE_UNAVAILABLE.into_response(),
    }
}

/// Issue 12's item 5 as an end-to-end experiment, written by hand (it is not
/// a strategy of the layer): "claim at commit". The handler's writes come
/// first; the key row goes in last, already completed with its response,
/// pipelined with `COMMIT`, and the unique index arbitrates. The key row is a
/// plain `INSERT`: a duplicate's unique violation aborts its transaction, so
/// the pipelined `COMMIT` rolls its order back, and it replays the winner's
/// record. (No expired-record takeover and no in-process waiting: an upper
/// bound of what the strategy could reach.)
async fn at_commit(
    State(store): State<PgStore>,
    headers: http::HeaderMap,
    body: Bytes,
) -> axum::response::Response {
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
    let Ok(client) = store.client().await else {
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
        Ok(Ok(id)) => created(id, &order),
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

async fn serve(app: Router) -> SocketAddr {
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0")
        .await
        .expect("bind");
    let addr = listener.local_addr().expect("addr");
    tokio::spawn(async move { axum::serve(listener, app).await });
    addr
}

// ---------------------------------------------------------------- load

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Scenario {
    Bare,
    Create,
    Replay,
    Mixed,
    HotKey,
    AtCommit,
}

impl Scenario {
    const ALL: [Scenario; 6] = [
        Scenario::Bare,
        Scenario::Create,
        Scenario::Replay,
        Scenario::Mixed,
        Scenario::HotKey,
        Scenario::AtCommit,
    ];
    /// The scenarios also run open loop, at one fixed rate.
    const OPEN_LOOP: [Scenario; 3] = [Scenario::Bare, Scenario::Create, Scenario::AtCommit];
    fn name(self) -> &'static str {
        match self {
            Scenario::Bare => "1 bare (no layer)",
            Scenario::Create => "2 layered create",
            Scenario::Replay => "3 replay",
            Scenario::Mixed => "4 mixed 5% retry, 0.1% reuse",
            Scenario::HotKey => "5 hot key (50 duplicates)",
            Scenario::AtCommit => "6 create, claim at commit (experiment)",
        }
    }
}

#[derive(Clone, Default, Debug)]
struct Run {
    requests: usize,
    unexpected: usize,
    seconds: f64,
    latencies_us: Vec<u64>,
    /// Hot key only: each duplicate's latency minus its owner's.
    duplicate_extra_us: Vec<i64>,
}

impl Run {
    fn throughput(&self) -> f64 {
        self.requests as f64 / self.seconds
    }
    fn percentile(&self, p: f64) -> f64 {
        percentile(&self.latencies_us, p) as f64 / 1000.0
    }
}

fn percentile<T: Copy + Ord + Default>(values: &[T], p: f64) -> T {
    if values.is_empty() {
        return T::default();
    }
    let mut sorted = values.to_vec();
    sorted.sort_unstable();
    sorted[((sorted.len() - 1) as f64 * p).round() as usize]
}

struct Load {
    http: Client<hyper_util::client::legacy::connect::HttpConnector, Full<Bytes>>,
    bare: SocketAddr,
    layered: SocketAddr,
    at_commit: SocketAddr,
    /// Completed (key, body) pairs, for replays and retries.
    completed: Mutex<Vec<(String, String)>>,
    next: AtomicUsize,
}

struct Answer {
    status: StatusCode,
    replayed: bool,
    micros: u64,
}

impl Load {
    fn fresh(&self) -> (String, String) {
        let n = self.next.fetch_add(1, Ordering::Relaxed);
        let body = format!(r#"{{"checkout_id":"chk-{n}","total":2400}}"#);
        (format!("key-{n}"), body)
    }

    async fn post(&self, addr: SocketAddr, key: Option<&str>, body: String) -> Answer {
        let mut request = Request::post(format!("http://{addr}/orders"))
            .header("content-type", "application/json");
        if let Some(key) = key {
            request = request.header("idempotency-key", key);
        }
        let request = request.body(Full::new(Bytes::from(body))).expect("request");
        let started = Instant::now();
        let (status, replayed) = match self.http.request(request).await {
            Ok(response) => {
                let status = response.status();
                let replayed = response.headers().contains_key("idempotent-replayed");
                let _ = response.into_body().collect().await;
                (status, replayed)
            }
            Err(_) => (StatusCode::BAD_GATEWAY, false),
        };
        Answer {
            status,
            replayed,
            micros: started.elapsed().as_micros() as u64,
        }
    }

    async fn one(&self, scenario: Scenario, rng: &mut u64) -> (bool, u64) {
        // Per mille: 1 key reuse, 50 retries of completed keys, the rest new.
        let roll = xorshift(rng) % 1000;
        let pick = |rng: &mut u64| {
            let completed = self.completed.lock().unwrap();
            completed[(xorshift(rng) as usize) % completed.len()].clone()
        };
        match scenario {
            Scenario::Bare => {
                let (_, body) = self.fresh();
                let a = self.post(self.bare, None, body).await;
                (a.status == StatusCode::CREATED, a.micros)
            }
            Scenario::AtCommit => {
                let (key, body) = self.fresh();
                let a = self.post(self.at_commit, Some(&key), body).await;
                (a.status == StatusCode::CREATED && !a.replayed, a.micros)
            }
            Scenario::Replay => {
                let (key, body) = pick(rng);
                let a = self.post(self.layered, Some(&key), body).await;
                (a.status == StatusCode::CREATED && a.replayed, a.micros)
            }
            Scenario::Mixed if roll == 0 => {
                let (key, _) = pick(rng);
                let a = self
                    .post(
                        self.layered,
                        Some(&key),
                        r#"{"checkout_id":"other","total":1}"#.into(),
                    )
                    .await;
                (a.status == StatusCode::CONFLICT, a.micros)
            }
            Scenario::Mixed if roll <= 50 => {
                let (key, body) = pick(rng);
                let a = self.post(self.layered, Some(&key), body).await;
                (a.status == StatusCode::CREATED && a.replayed, a.micros)
            }
            _ => {
                let (key, body) = self.fresh();
                let a = self.post(self.layered, Some(&key), body.clone()).await;
                let ok = a.status == StatusCode::CREATED && !a.replayed;
                if ok {
                    self.completed.lock().unwrap().push((key, body));
                }
                (ok, a.micros)
            }
        }
    }

    async fn run(self: &Arc<Self>, scenario: Scenario, duration: Duration) -> Run {
        if scenario == Scenario::HotKey {
            return self.hot_key(duration).await;
        }
        let started = Instant::now();
        let deadline = started + duration;
        let workers: Vec<_> = (0..CONCURRENCY)
            .map(|w| {
                let load = self.clone();
                tokio::spawn(async move {
                    let mut rng = 0x9E37_79B9_7F4A_7C15 ^ ((w as u64 + 1) * 0x2545_F491_4F6C_DD1D);
                    let mut run = Run::default();
                    while Instant::now() < deadline {
                        let (ok, micros) = load.one(scenario, &mut rng).await;
                        run.requests += 1;
                        run.unexpected += usize::from(!ok);
                        run.latencies_us.push(micros);
                    }
                    run
                })
            })
            .collect();
        let mut total = Run::default();
        for worker in workers {
            let run = worker.await.expect("worker");
            total.requests += run.requests;
            total.unexpected += run.unexpected;
            total.latencies_us.extend(run.latencies_us);
        }
        total.seconds = started.elapsed().as_secs_f64();
        total
    }

    /// Open loop: requests sent at a fixed rate whatever the answers, each
    /// latency counted from its scheduled send time (no coordinated omission).
    async fn fixed_rate(
        self: &Arc<Self>,
        scenario: Scenario,
        rate: f64,
        duration: Duration,
    ) -> Run {
        let started = tokio::time::Instant::now();
        let interval = Duration::from_secs_f64(1.0 / rate);
        let mut requests = Vec::new();
        let mut i = 0u32;
        loop {
            let at = started + interval * i;
            if at >= started + duration {
                break;
            }
            tokio::time::sleep_until(at).await;
            let load = self.clone();
            requests.push(tokio::spawn(async move {
                let mut rng = u64::from(i).wrapping_mul(0x2545_F491_4F6C_DD1D) | 1;
                let (ok, _) = load.one(scenario, &mut rng).await;
                (ok, at.elapsed().as_micros() as u64)
            }));
            i += 1;
        }
        let mut run = Run::default();
        for request in requests {
            let (ok, micros) = request.await.expect("request");
            run.requests += 1;
            run.unexpected += usize::from(!ok);
            run.latencies_us.push(micros);
        }
        run.seconds = started.elapsed().as_secs_f64();
        run
    }

    /// Rounds of 50 simultaneous requests with one fresh key.
    async fn hot_key(self: &Arc<Self>, duration: Duration) -> Run {
        let started = Instant::now();
        let mut total = Run::default();
        while started.elapsed() < duration {
            let (key, body) = self.fresh();
            let answers: Vec<_> = (0..HOT_DUPLICATES)
                .map(|_| {
                    let (load, key, body) = (self.clone(), key.clone(), body.clone());
                    tokio::spawn(async move { load.post(load.layered, Some(&key), body).await })
                })
                .collect();
            let mut round = Vec::new();
            for answer in answers {
                round.push(answer.await.expect("request"));
            }
            let owners: Vec<_> = round
                .iter()
                .filter(|a| a.status == StatusCode::CREATED && !a.replayed)
                .collect();
            let owner_micros = owners.first().map_or(0, |a| a.micros) as i64;
            for a in &round {
                total.requests += 1;
                total.latencies_us.push(a.micros);
                if a.status != StatusCode::CREATED {
                    total.unexpected += 1;
                }
                if a.replayed {
                    total
                        .duplicate_extra_us
                        .push(a.micros as i64 - owner_micros);
                }
            }
            total.unexpected += owners.len().abs_diff(1);
        }
        total.seconds = started.elapsed().as_secs_f64();
        total
    }
}

fn xorshift(state: &mut u64) -> u64 {
    *state ^= *state << 13;
    *state ^= *state >> 7;
    *state ^= *state << 17;
    *state
}

// ---------------------------------------------------------------- pgbench

const PGBENCH_BARE: &str = r#"\set c random(1, 9000000000000000)
BEGIN;
INSERT INTO orders (tenant_id, checkout_id, total) VALUES ('pgb', 'pgb-' || (:c)::text, 2400) RETURNING id;
INSERT INTO outbox_events (tenant_id, aggregate_id, event_type, payload) VALUES ('pgb', 'x', 'OrderCreated', '{}');
COMMIT;
"#;

const PGBENCH_LAYERED: &str = r#"\set k random(1, 9000000000000000)
SELECT state FROM idempotency_requests WHERE tenant_id = 'pgb' AND endpoint = 'e' AND idempotency_key = 'k' || (:k)::text AND expires_at > now();
BEGIN;
INSERT INTO idempotency_requests AS r (tenant_id, endpoint, idempotency_key, request_fingerprint, state, expires_at) VALUES ('pgb', 'e', 'k' || (:k)::text, '\x00', 'in_progress', now() + interval '1 day') ON CONFLICT ON CONSTRAINT idempotency_requests_pkey DO UPDATE SET state = 'in_progress' WHERE r.expires_at <= now() RETURNING attempt_token;
INSERT INTO orders (tenant_id, checkout_id, total) VALUES ('pgb', 'pgbl-' || (:k)::text, 2400) RETURNING id;
INSERT INTO outbox_events (tenant_id, aggregate_id, event_type, payload) VALUES ('pgb', 'x', 'OrderCreated', '{}');
UPDATE idempotency_requests SET state = 'completed', response_status = 201, response_body = '\x00', completed_at = now(), expires_at = now() + interval '1 day' WHERE tenant_id = 'pgb' AND endpoint = 'e' AND idempotency_key = 'k' || (:k)::text;
COMMIT;
"#;

/// The layered SQL plus the session reset that follows every owner's
/// `COMMIT` (`SESSION_RESET` in the store), as one message (`\;` joins the
/// statements; both scripts then run with the simple protocol). An upper
/// bound of its cost: pgbench waits for each command, so the reset costs it
/// a round trip that the store, which pipelines the reset behind the
/// `COMMIT`, does not pay.
const PGBENCH_LAYERED_RESET: &str = r#"\set k random(1, 9000000000000000)
SELECT state FROM idempotency_requests WHERE tenant_id = 'pgb' AND endpoint = 'e' AND idempotency_key = 'r' || (:k)::text AND expires_at > now();
BEGIN;
INSERT INTO idempotency_requests AS r (tenant_id, endpoint, idempotency_key, request_fingerprint, state, expires_at) VALUES ('pgb', 'e', 'r' || (:k)::text, '\x00', 'in_progress', now() + interval '1 day') ON CONFLICT ON CONSTRAINT idempotency_requests_pkey DO UPDATE SET state = 'in_progress' WHERE r.expires_at <= now() RETURNING attempt_token;
INSERT INTO orders (tenant_id, checkout_id, total) VALUES ('pgb', 'pgbr-' || (:k)::text, 2400) RETURNING id;
INSERT INTO outbox_events (tenant_id, aggregate_id, event_type, payload) VALUES ('pgb', 'x', 'OrderCreated', '{}');
UPDATE idempotency_requests SET state = 'completed', response_status = 201, response_body = '\x00', completed_at = now(), expires_at = now() + interval '1 day' WHERE tenant_id = 'pgb' AND endpoint = 'e' AND idempotency_key = 'r' || (:k)::text;
COMMIT;
SET SESSION AUTHORIZATION DEFAULT\; RESET ALL\; CLOSE ALL\; UNLISTEN *\; SELECT pg_advisory_unlock_all()\; DISCARD TEMP;
"#;

// The protocol variants, statement for statement as the store sends them,
// pipelined where it pipelines. `:k` makes each transaction's key and
// checkout new; replays read keys `rp1` … `rp20000`, completed at setup.
const V_BEGIN: &str = "BEGIN ISOLATION LEVEL READ COMMITTED;
SET LOCAL lock_timeout = '5000ms';
SET LOCAL idle_in_transaction_session_timeout = '35000ms';
";
/// The begin batch before the statement diet: claims also tagged themselves
/// with `application_name` for the oldest-in-progress gauge.
const V_BEGIN_BEFORE: &str = "BEGIN ISOLATION LEVEL READ COMMITTED;
SET LOCAL lock_timeout = '5000ms';
SET LOCAL application_name = 'tower-idempotency';
SET LOCAL idle_in_transaction_session_timeout = '35000ms';
";
const V_LOOKUP: &str = "SELECT request_fingerprint, state, response_status, response_headers, response_body FROM idempotency_requests WHERE tenant_id = 'pgb' AND endpoint = 'e' AND idempotency_key = :key AND expires_at > now();
";
const V_CLAIM_OLD: &str = "INSERT INTO idempotency_requests AS r (tenant_id, endpoint, idempotency_key, request_fingerprint, state, expires_at) VALUES ('pgb', 'e', :key, '\\x00', 'in_progress', now() + interval '1 day') ON CONFLICT ON CONSTRAINT idempotency_requests_pkey DO UPDATE SET state = 'in_progress' WHERE r.expires_at <= now() RETURNING attempt_token, pg_current_xact_id()::text, set_config('lock_timeout', NULL, true);
";
const V_CLAIM_FIRST: &str = "WITH claimed AS (INSERT INTO idempotency_requests AS r (tenant_id, endpoint, idempotency_key, request_fingerprint, state, expires_at) VALUES ('pgb', 'e', :key, '\\x00', 'in_progress', now() + interval '1 day') ON CONFLICT ON CONSTRAINT idempotency_requests_pkey DO NOTHING RETURNING attempt_token, pg_current_xact_id()::text AS xid, set_config('lock_timeout', NULL, true)) SELECT true, attempt_token, xid, NULL::bytea, NULL::text, NULL::int2, NULL::bytea, NULL::bytea, false FROM claimed UNION ALL SELECT false, NULL::int8, NULL::text, request_fingerprint, state, response_status, response_headers, response_body, expires_at <= now() FROM idempotency_requests WHERE tenant_id = 'pgb' AND endpoint = 'e' AND idempotency_key = :key AND NOT EXISTS (SELECT FROM claimed);
";
const V_WRITES: &str = "INSERT INTO orders (tenant_id, checkout_id, total) VALUES ('pgb', 'v-' || (:k)::text, 2400) RETURNING id;
INSERT INTO outbox_events (tenant_id, aggregate_id, event_type, payload) VALUES ('pgb', 'x', 'OrderCreated', '{}');
";
const V_COMPLETE_GUARDED: &str = "WITH done AS (UPDATE idempotency_requests SET state = 'completed', response_status = 201, response_headers = '\\x00', response_body = '\\x00', completed_at = statement_timestamp(), expires_at = statement_timestamp() + interval '1 day' WHERE tenant_id = 'pgb' AND endpoint = 'e' AND idempotency_key = :key AND state = 'in_progress' AND pg_current_xact_id() = pg_current_xact_id() RETURNING 1) SELECT 1 / (SELECT count(*)::int FROM done);
";
const V_COMPLETE_PLAIN: &str = "UPDATE idempotency_requests SET state = 'completed', response_status = 201, response_headers = '\\x00', response_body = '\\x00', completed_at = statement_timestamp(), expires_at = statement_timestamp() + interval '1 day' WHERE tenant_id = 'pgb' AND endpoint = 'e' AND idempotency_key = :key AND state = 'in_progress';
";

/// Item 5's experiment, "claim at commit": the handler's writes first, then
/// the key row inserted with its response, and `COMMIT`; the unique index
/// arbitrates at the end (a loser would roll back and replay).
const PGBENCH_CLAIM_AT_COMMIT: &str = "\\set k random(1, 9000000000000000)
BEGIN;
INSERT INTO orders (tenant_id, checkout_id, total) VALUES ('pgb', 'c-' || (:k)::text, 2400) RETURNING id;
INSERT INTO outbox_events (tenant_id, aggregate_id, event_type, payload) VALUES ('pgb', 'x', 'OrderCreated', '{}');
\\startpipeline
INSERT INTO idempotency_requests (tenant_id, endpoint, idempotency_key, request_fingerprint, state, response_status, response_headers, response_body, completed_at, expires_at) VALUES ('pgb', 'e', 'c' || (:k)::text, '\\x00', 'completed', 201, '\\x00', '\\x00', now(), now() + interval '1 day');
COMMIT;
\\endpipeline
";

/// A create of one protocol variant: its claim (after an optional lookup),
/// the handler's writes, its completion and `COMMIT`.
fn create_script(lookup_first: bool, begin: &str, claim: &str, complete: &str) -> String {
    let mut script = String::from("\\set k random(1, 9000000000000000)\n");
    let key = |sql: &str| sql.replace(":key", "'k' || (:k)::text");
    if lookup_first {
        script.push_str(&key(V_LOOKUP));
    }
    script.push_str("\\startpipeline\n");
    script.push_str(begin);
    script.push_str(&key(claim));
    script.push_str("\\endpipeline\n");
    script.push_str(V_WRITES);
    script.push_str("\\startpipeline\n");
    script.push_str(&key(complete));
    script.push_str("COMMIT;\n\\endpipeline\n");
    script
}

/// A replay of a completed key by one protocol variant.
fn replay_script(lookup_first: bool) -> String {
    let key = |sql: &str| sql.replace(":key", "'rp' || (:r)::text");
    let mut script = String::from("\\set r random(1, 20000)\n");
    if lookup_first {
        script.push_str(&key(V_LOOKUP));
    } else {
        script.push_str("\\startpipeline\n");
        script.push_str(V_BEGIN);
        script.push_str(&key(V_CLAIM_FIRST));
        script.push_str("\\endpipeline\n");
        // Off the request's path in the store, but still work for the server.
        script.push_str("ROLLBACK;\n");
    }
    script
}

/// Every variant in alternating rounds (so that drift is shared), median tx/s each.
fn pgbench_variants(pg: &TempPostgres, seconds: u64) -> Vec<(&'static str, Option<f64>)> {
    let one_set = "BEGIN ISOLATION LEVEL READ COMMITTED;\nSET LOCAL lock_timeout = '5000ms';\n";
    let scripts: Vec<(&'static str, String)> = vec![
        (
            "bare: BEGIN, order, outbox, COMMIT",
            PGBENCH_BARE.to_owned(),
        ),
        (
            "create, lookup first, three settings (before)",
            create_script(true, V_BEGIN_BEFORE, V_CLAIM_OLD, V_COMPLETE_GUARDED),
        ),
        (
            "create, claim first, three settings",
            create_script(false, V_BEGIN_BEFORE, V_CLAIM_FIRST, V_COMPLETE_GUARDED),
        ),
        (
            "create, claim first, two settings (the default now)",
            create_script(false, V_BEGIN, V_CLAIM_FIRST, V_COMPLETE_GUARDED),
        ),
        (
            "create, claim first, lock_timeout only",
            create_script(false, one_set, V_CLAIM_FIRST, V_COMPLETE_GUARDED),
        ),
        (
            "create, claim first, completion UPDATE without its guard",
            create_script(false, V_BEGIN, V_CLAIM_FIRST, V_COMPLETE_PLAIN),
        ),
        (
            "create, claim at commit (one INSERT of key and response, no claim)",
            PGBENCH_CLAIM_AT_COMMIT.to_owned(),
        ),
        ("replay, lookup first (before)", replay_script(true)),
        (
            "replay, claim first (the default now, no cache)",
            replay_script(false),
        ),
    ];
    let rounds = 2;
    let mut seen: Vec<Vec<f64>> = vec![Vec::new(); scripts.len()];
    for _ in 0..rounds {
        for (i, (_, script)) in scripts.iter().enumerate() {
            if let Some(tps) = pgbench(pg, "variant", script, seconds) {
                seen[i].push(tps);
            }
        }
    }
    scripts
        .iter()
        .zip(seen)
        .map(|((name, _), mut tps)| (*name, (!tps.is_empty()).then(|| median(&mut tps))))
        .collect()
}

/// `pgbench` with the same SQL, same connection count: what the database
/// itself reaches on this machine.
fn pgbench(pg: &TempPostgres, name: &str, script: &str, seconds: u64) -> Option<f64> {
    pgbench_with(pg, name, script, seconds, "prepared")
}

/// [`pgbench`] with a query protocol of choice (`simple` runs compound
/// `\;` commands, which `prepared` cannot).
fn pgbench_with(
    pg: &TempPostgres,
    name: &str,
    script: &str,
    seconds: u64,
    protocol: &str,
) -> Option<f64> {
    let file = std::env::temp_dir().join(format!(
        "tower-idempotency-{name}-{}.sql",
        std::process::id()
    ));
    std::fs::write(&file, script).ok()?;
    let config = pg.config();
    let host = match config.get_hosts().first()? {
        tokio_postgres::config::Host::Unix(path) => path.display().to_string(),
        tokio_postgres::config::Host::Tcp(host) => host.clone(),
    };
    let output = std::process::Command::new(pg.bin_dir().join("pgbench"))
        .args([
            "-n",
            "-M",
            protocol,
            "-c",
            &POOL.to_string(),
            "-j",
            "2",
            "-T",
            &seconds.to_string(),
        ])
        .args([
            "-h",
            &host,
            "-p",
            &config.get_ports().first()?.to_string(),
            "-U",
            "postgres",
            "-f",
        ])
        .arg(&file)
        .arg("postgres")
        .output()
        .ok()?;
    let _ = std::fs::remove_file(&file);
    let text = String::from_utf8_lossy(&output.stdout);
    let tps = text.lines().find(|l| l.starts_with("tps = "))?;
    tps.trim_start_matches("tps = ")
        .split_whitespace()
        .next()?
        .parse()
        .ok()
}

// ---------------------------------------------------------------- memory per in-flight request

/// Live heap bytes per request held inside a handler, with and without the
/// layer (MemoryStore, no HTTP), minus the buffered request body.
async fn memory_per_in_flight_request() -> (f64, usize) {
    const N: usize = 1000;
    let body = Bytes::from_static(br#"{"checkout_id":"chk-mem","total":2400}"#);
    let measure = |layered: bool| {
        let body = body.clone();
        async move {
            let (reached, release) = (Arc::new(AtomicUsize::new(0)), Arc::new(Notify::new()));
            let all_in = Arc::new(Notify::new());
            let handler = tower::service_fn({
                let (reached, release, all_in) = (reached.clone(), release.clone(), all_in.clone());
                move |_request: Request<RequestBody>| {
                    let (reached, release, all_in) =
                        (reached.clone(), release.clone(), all_in.clone());
                    async move {
                        let notified = release.notified();
                        if reached.fetch_add(1, Ordering::SeqCst) + 1 == N {
                            all_in.notify_one();
                        }
                        notified.await;
                        Ok::<_, std::convert::Infallible>(http::Response::new(Full::new(
                            Bytes::from_static(b"{}"),
                        )))
                    }
                }
            });
            let store = MemoryStore::new();
            let layer = IdempotencyLayer::new(
                store,
                "POST /orders v1",
                TypedFingerprinter::<NewOrder>::new("orders.v1"),
            )
            .tenant_resolver(SingleTenant::new("mem"));
            let before = LIVE.load(Ordering::SeqCst);
            let tasks: Vec<_> = (0..N)
                .map(|i| {
                    let request = Request::post("/orders")
                        .header("idempotency-key", format!("mem-{i:06}"))
                        .body(Full::new(body.clone()))
                        .expect("request");
                    if layered {
                        let service = tower::Layer::layer(&layer, handler.clone());
                        tokio::spawn(async move { service.oneshot(request).await.map(|_| ()).ok() })
                    } else {
                        let service = handler.clone();
                        let request = request.map(|_| RequestBody::from(body.clone()));
                        tokio::spawn(async move { service.oneshot(request).await.map(|_| ()).ok() })
                    }
                })
                .collect();
            all_in.notified().await;
            let live = LIVE.load(Ordering::SeqCst) - before;
            release.notify_waiters();
            for task in tasks {
                let _ = task.await;
            }
            live as f64 / N as f64
        }
    };
    let bare = measure(false).await;
    let layered = measure(true).await;
    (layered - bare - body.len() as f64, body.len())
}

// ---------------------------------------------------------------- main

fn median(values: &mut [f64]) -> f64 {
    values.sort_by(|a, b| a.total_cmp(b));
    values[values.len() / 2]
}

fn main() {
    let seconds: u64 = std::env::var("E2E_SECONDS")
        .ok()
        .and_then(|s| s.parse().ok())
        .unwrap_or(5);
    let rounds: usize = std::env::var("E2E_ROUNDS")
        .ok()
        .and_then(|s| s.parse().ok())
        .unwrap_or(3);
    let runtime = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_all()
        .build()
        .expect("runtime");
    runtime.block_on(run(Duration::from_secs(seconds), rounds));
}

async fn run(duration: Duration, rounds: usize) {
    let pg = tokio::task::spawn_blocking(|| {
        TempPostgres::builder()
            .durable(true)
            .setting("max_connections", "200")
            .start()
    })
    .await
    .expect("start")
    .unwrap_or_else(|e| panic!("{e}"));
    let config = pg.config();
    let setup = PgStore::builder(config.clone()).build().expect("store");
    setup.migrate().await.expect("migrate");
    setup
        .client()
        .await
        .expect("client")
        .batch_execute(
            "CREATE TABLE orders (id uuid PRIMARY KEY DEFAULT gen_random_uuid(), tenant_id text NOT NULL,
                                  checkout_id text NOT NULL, total bigint NOT NULL, created_at timestamptz NOT NULL DEFAULT now(),
                                  UNIQUE (tenant_id, checkout_id));
             -- No relay runs here: measure the layer, not NOTIFY.
             DROP TRIGGER outbox_events_notify_insert ON outbox_events;
             -- Completed keys for the pgbench replay variants.
             INSERT INTO idempotency_requests (tenant_id, endpoint, idempotency_key, request_fingerprint, state,
                                               response_status, response_headers, response_body, completed_at, expires_at)
             SELECT 'pgb', 'e', 'rp' || n, '\\x00', 'completed', 201, '', '{}', now(), now() + interval '1 day'
             FROM generate_series(1, 20000) n;",
        )
        .await
        .expect("schema");
    let bare_store = PgStore::builder(config.clone())
        .max_connections(POOL)
        .build()
        .expect("store");
    let layered_store = PgStore::builder(config.clone())
        .max_connections(POOL)
        .build()
        .expect("store");
    let at_commit_store = PgStore::builder(config.clone())
        .max_connections(POOL)
        .build()
        .expect("store");
    let at_commit_addr = serve(
        Router::new()
            .route("/orders", post(at_commit))
            .with_state(at_commit_store),
    )
    .await;
    let bare_addr = serve(
        Router::new()
            .route("/orders", post(bare))
            .with_state(bare_store),
    )
    .await;
    let layer = IdempotencyLayer::new(
        layered_store,
        "POST /orders v1",
        TypedFingerprinter::<NewOrder>::new("orders.v1"),
    )
    .tenant_resolver(SingleTenant::new("bench"));
    let layered_addr = serve(Router::new().route("/orders", post(layered).layer(layer))).await;
    let load = Arc::new(Load {
        http: Client::builder(TokioExecutor::new())
            .pool_max_idle_per_host(HOT_DUPLICATES * 2)
            .build_http(),
        bare: bare_addr,
        layered: layered_addr,
        at_commit: at_commit_addr,
        completed: Mutex::new(Vec::new()),
        next: AtomicUsize::new(0),
    });

    println!("warming up (and creating keys to replay)…");
    load.run(Scenario::Bare, Duration::from_secs(1)).await;
    load.run(Scenario::Create, Duration::from_secs(2)).await;

    let mut results: Vec<Vec<Run>> = vec![Vec::new(); Scenario::ALL.len()];
    for round in 1..=rounds {
        for (i, scenario) in Scenario::ALL.iter().enumerate() {
            let run = load.run(*scenario, duration).await;
            println!(
                "round {round} {:<30} {:>8.0} req/s  p50 {:>6.2} ms  p99 {:>6.2} ms  unexpected {}",
                scenario.name(),
                run.throughput(),
                run.percentile(0.5),
                run.percentile(0.99),
                run.unexpected
            );
            results[i].push(run);
        }
    }

    // Latency at equal load: both at half the layered create throughput.
    let create_tput = median(&mut results[1].iter().map(Run::throughput).collect::<Vec<_>>());
    let rate = (create_tput * 0.5).max(1.0);
    let mut open: Vec<Vec<Run>> = vec![Vec::new(); Scenario::OPEN_LOOP.len()];
    for round in 1..=rounds {
        for (i, scenario) in Scenario::OPEN_LOOP.into_iter().enumerate() {
            let run = load.fixed_rate(scenario, rate, duration).await;
            println!(
                "round {round} {:<30} at {rate:.0} req/s: p50 {:>6.2} ms  p99 {:>6.2} ms  unexpected {}",
                scenario.name(),
                run.percentile(0.5),
                run.percentile(0.99),
                run.unexpected
            );
            open[i].push(run);
        }
    }

    let pgbench_seconds = duration.as_secs().max(5);
    let pgbench_bare = pgbench(&pg, "bare", PGBENCH_BARE, pgbench_seconds);
    let pgbench_layered = pgbench(&pg, "layered", PGBENCH_LAYERED, pgbench_seconds);
    // The session reset's cost is a few percent at most: alternate two
    // rounds of each so that drift does not pass for it.
    let mut reset_rounds = Vec::new();
    for _ in 0..2 {
        let without = pgbench_with(&pg, "layered", PGBENCH_LAYERED, pgbench_seconds, "simple");
        let with = pgbench_with(
            &pg,
            "reset",
            PGBENCH_LAYERED_RESET,
            pgbench_seconds,
            "simple",
        );
        if let (Some(without), Some(with)) = (without, with) {
            reset_rounds.push((without, with));
        }
    }
    let variants = pgbench_variants(&pg, pgbench_seconds);
    let (memory, body) = memory_per_in_flight_request().await;

    println!();
    println!("| scenario | req/s | p50 ms | p99 ms | unexpected answers |");
    println!("| --- | ---: | ---: | ---: | ---: |");
    let mut medians = Vec::new();
    for (i, scenario) in Scenario::ALL.iter().enumerate() {
        let runs = &results[i];
        let tput = median(&mut runs.iter().map(Run::throughput).collect::<Vec<_>>());
        let p50 = median(&mut runs.iter().map(|r| r.percentile(0.5)).collect::<Vec<_>>());
        let p99 = median(&mut runs.iter().map(|r| r.percentile(0.99)).collect::<Vec<_>>());
        let unexpected: usize = runs.iter().map(|r| r.unexpected).sum();
        println!(
            "| {} | {tput:.0} | {p50:.2} | {p99:.2} | {unexpected} |",
            scenario.name()
        );
        medians.push((tput, p99));
    }
    println!();
    println!("At a fixed {rate:.0} req/s (half the layered create throughput), open loop:");
    println!();
    println!("| scenario | p50 ms | p99 ms |");
    println!("| --- | ---: | ---: |");
    for (i, scenario) in Scenario::OPEN_LOOP.into_iter().enumerate() {
        let p50 = median(
            &mut open[i]
                .iter()
                .map(|r| r.percentile(0.5))
                .collect::<Vec<_>>(),
        );
        let p99 = median(
            &mut open[i]
                .iter()
                .map(|r| r.percentile(0.99))
                .collect::<Vec<_>>(),
        );
        println!("| {} | {p50:.2} | {p99:.2} |", scenario.name());
    }
    let hot: Vec<i64> = results[4]
        .iter()
        .flat_map(|r| r.duplicate_extra_us.iter().copied())
        .collect();
    println!();
    println!(
        "hot key: duplicates answered at p99 {:.2} ms after their first request's own answer (target <= 50 ms)",
        percentile(&hot, 0.99) as f64 / 1000.0
    );
    println!("layer memory per in-flight request (excluding the {body}-byte buffered body): {memory:.0} bytes");
    match (pgbench_bare, pgbench_layered) {
        (Some(bare), Some(layered)) => println!(
            "pgbench, same SQL, {POOL} connections: bare {bare:.0} tx/s, with claim + completion {layered:.0} tx/s (ratio {:.2})",
            layered / bare
        ),
        _ => println!("pgbench: not available"),
    }
    if !reset_rounds.is_empty() {
        let n = reset_rounds.len() as f64;
        let without = reset_rounds.iter().map(|r| r.0).sum::<f64>() / n;
        let with = reset_rounds.iter().map(|r| r.1).sum::<f64>() / n;
        println!(
            "pgbench, session reset after COMMIT (upper bound: one more round trip here, none in the store): without {without:.0} tx/s, with {with:.0} tx/s (ratio {:.3}, mean of {} alternating rounds)",
            with / without,
            reset_rounds.len()
        );
    }
    println!();
    println!("pgbench, {POOL} connections, the statements of each protocol variant with the store's pipelining (\\startpipeline), alternating rounds, median tx/s:");
    println!();
    println!("| variant | tx/s | vs bare |");
    println!("| --- | ---: | ---: |");
    for (name, tps) in &variants {
        let ratio = variants[0]
            .1
            .map_or(f64::NAN, |bare| tps.unwrap_or(f64::NAN) / bare);
        match tps {
            Some(tps) => println!("| {name} | {tps:.0} | {ratio:.2} |"),
            None => println!("| {name} | – | – |"),
        }
    }
    let (bare, create, replay, mixed) = (medians[0], medians[1], medians[2], medians[3]);
    let at_commit = medians[5];
    println!();
    println!(
        "claim at commit (experiment, end to end): {:.2} of bare, {:.2} of the layered create (ship gate: >= 1.15)",
        at_commit.0 / bare.0,
        at_commit.0 / create.0
    );
    println!(
        "RATIOS create_vs_bare={:.2} replay_vs_create={:.2} p99_create_vs_bare={:.2} mixed_vs_bare={:.2}",
        create.0 / bare.0,
        replay.0 / create.0,
        create.1 / bare.1,
        mixed.0 / bare.0
    );
}
