//! The client layer against a scripted in-process service, on tokio's paused
//! clock: which outcomes are retried, with which key, after how long, and
//! where it stops. (Against the real order server: `tests/order_server/client_order_server.rs`.)

use std::{
    collections::VecDeque,
    convert::Infallible,
    future::Future,
    pin::Pin,
    sync::{Arc, Mutex},
    task::{Context, Poll},
    time::Duration,
};

use bytes::Bytes;
use http::{Method, Request, Response, StatusCode};
use http_body_util::{combinators::BoxBody, BodyExt, Full};
use tokio::time::Instant;
use tower::{Layer, Service, ServiceExt};
use tower_idempotency::{
    client::{
        CallReport, ClientError, ClientErrorKind, ConflictProblem, GiveUp, IdempotentClient,
        IdempotentClientLayer, RetryBudget, RetryReason,
    },
    outbox::derive_key,
};

type BoxError = Box<dyn std::error::Error + Send + Sync>;

/// What the scripted server does with one attempt.
#[derive(Clone)]
enum Step {
    /// Answers with a status, headers and a body.
    Answer(u16, Vec<(&'static str, &'static str)>, &'static str),
    /// Fails the call, as a refused connection does.
    Fail,
    /// Never answers.
    Hang,
}

fn answer(status: u16) -> Step {
    Step::Answer(status, vec![], "")
}

fn problem(status: u16, code: &'static str, retry_after: Option<&'static str>) -> Step {
    let body = match code {
        "idempotency_in_progress" => {
            r#"{"type":"urn:tower-idempotency:problem:idempotency_in_progress","status":409,"code":"idempotency_in_progress"}"#
        }
        "idempotency_key_reused" => {
            r#"{"type":"urn:tower-idempotency:problem:idempotency_key_reused","status":409,"code":"idempotency_key_reused"}"#
        }
        "checkout_already_ordered" => {
            r#"{"status":409,"code":"checkout_already_ordered","order_id":"o1"}"#
        }
        "store_unavailable" => r#"{"status":503,"code":"store_unavailable"}"#,
        _ => r#"{"code":"other"}"#,
    };
    let mut headers = vec![("content-type", "application/problem+json")];
    if let Some(seconds) = retry_after {
        headers.push(("retry-after", seconds));
    }
    Step::Answer(status, headers, body)
}

/// One attempt as the scripted server saw it.
#[derive(Debug, Clone)]
struct Seen {
    method: Method,
    key: Option<String>,
    headers: http::HeaderMap,
    at: Duration,
}

/// A server that plays its steps in order (the last one repeats) and
/// records every attempt.
#[derive(Clone)]
struct Script {
    steps: Arc<Mutex<VecDeque<Step>>>,
    seen: Arc<Mutex<Vec<Seen>>>,
    start: Instant,
}

impl Script {
    fn new(steps: Vec<Step>) -> Script {
        Script {
            steps: Arc::new(Mutex::new(steps.into())),
            seen: Arc::default(),
            start: Instant::now(),
        }
    }

    fn seen(&self) -> Vec<Seen> {
        self.seen.lock().unwrap().clone()
    }

    /// The key of every attempt (all present).
    fn keys(&self) -> Vec<String> {
        self.seen()
            .into_iter()
            .map(|s| s.key.expect("every attempt carries a key"))
            .collect()
    }

    /// When each attempt arrived, since the script was made.
    fn times(&self) -> Vec<Duration> {
        self.seen().into_iter().map(|s| s.at).collect()
    }
}

impl<B: Send + 'static> Service<Request<B>> for Script {
    type Response = Response<Full<Bytes>>;
    type Error = BoxError;
    type Future = Pin<Box<dyn Future<Output = Result<Self::Response, BoxError>> + Send>>;

    fn poll_ready(&mut self, _: &mut Context<'_>) -> Poll<Result<(), BoxError>> {
        Poll::Ready(Ok(()))
    }

    fn call(&mut self, request: Request<B>) -> Self::Future {
        self.seen.lock().unwrap().push(Seen {
            method: request.method().clone(),
            key: request
                .headers()
                .get("idempotency-key")
                .map(|v| v.to_str().unwrap().to_owned()),
            headers: request.headers().clone(),
            at: self.start.elapsed(),
        });
        let step = {
            let mut steps = self.steps.lock().unwrap();
            if steps.len() > 1 {
                steps.pop_front().unwrap()
            } else {
                steps.front().cloned().expect("a scripted step")
            }
        };
        Box::pin(async move {
            match step {
                Step::Answer(status, headers, body) => {
                    let mut response = Response::builder().status(status);
                    for (name, value) in headers {
                        response = response.header(name, value);
                    }
                    Ok(response.body(Full::new(Bytes::from_static(body.as_bytes())))?)
                }
                Step::Fail => Err("connection refused".into()),
                Step::Hang => std::future::pending().await,
            }
        })
    }
}

fn client(script: &Script, layer: IdempotentClientLayer) -> IdempotentClient<Script> {
    layer.layer(script.clone())
}

fn post() -> Request<Full<Bytes>> {
    Request::post("/orders")
        .header("content-type", "application/json")
        .body(Full::new(Bytes::from_static(br#"{"checkout_id":"chk_1"}"#)))
        .unwrap()
}

fn post_with_key(key: &str) -> Request<Full<Bytes>> {
    let mut request = post();
    request
        .headers_mut()
        .insert("idempotency-key", key.parse().unwrap());
    request
}

/// Sends `request` through `client`; the answer's status, report and body.
async fn send<B>(
    client: IdempotentClient<Script>,
    request: Request<B>,
) -> Result<(StatusCode, CallReport, Bytes), ClientError>
where
    B: tower_idempotency::client::ReplayBody + Send + 'static,
{
    let response = client.oneshot(request).await?;
    let report = response
        .extensions()
        .get::<CallReport>()
        .cloned()
        .expect("a report on every answer to an unsafe method");
    let status = response.status();
    let body = response.into_body().collect().await.unwrap().to_bytes();
    Ok((status, report, body))
}

#[tokio::test(start_paused = true)]
async fn sets_one_random_key_and_sends_it_on_every_retry() {
    let script = Script::new(vec![answer(503), answer(503), answer(201)]);
    let (status, report, _) = send(client(&script, IdempotentClientLayer::new()), post())
        .await
        .unwrap();
    assert_eq!(status, StatusCode::CREATED);
    assert_eq!(report.attempts(), 3);
    assert_eq!(
        report.retries(),
        [RetryReason::Unavailable, RetryReason::Unavailable]
    );
    let keys = script.keys();
    assert_eq!(keys.len(), 3);
    assert!(
        keys.iter().all(|k| *k == keys[0]),
        "one key per call: {keys:?}"
    );
    assert_eq!(report.key().as_str(), keys[0]);
    // Each retry says which attempt it is; the first says nothing.
    let attempts: Vec<_> = script
        .seen()
        .iter()
        .map(|s| {
            s.headers
                .get("idempotency-attempt")
                .map(|v| v.to_str().unwrap().to_owned())
        })
        .collect();
    assert_eq!(attempts, [None, Some("2".into()), Some("3".into())]);
    let uuid = uuid::Uuid::parse_str(&keys[0]).expect("a UUID");
    assert_eq!(uuid.get_version_num(), 4);

    // The next call is another operation: another key.
    let again = Script::new(vec![answer(201)]);
    send(client(&again, IdempotentClientLayer::new()), post())
        .await
        .unwrap();
    assert_ne!(again.keys()[0], keys[0]);
}

#[tokio::test(start_paused = true)]
async fn keeps_the_callers_key_and_never_shows_it_raw() {
    let key = derive_key("order-1", "payment.charge");
    let script = Script::new(vec![Step::Fail, answer(201)]);
    let (status, report, _) = send(
        client(&script, IdempotentClientLayer::new()),
        post_with_key(&key),
    )
    .await
    .unwrap();
    assert_eq!(status, StatusCode::CREATED);
    assert_eq!(script.keys(), [key.clone(), key.clone()]);
    assert_eq!(report.retries(), [RetryReason::Transport]);
    let shown = format!("{report:?}");
    assert!(!shown.contains(&key), "Debug hashes the key: {shown}");
}

#[tokio::test(start_paused = true)]
async fn in_progress_waits_retry_after_then_gets_the_result() {
    let script = Script::new(vec![
        problem(409, "idempotency_in_progress", Some("3")),
        Step::Answer(201, vec![("idempotent-replayed", "true")], r#"{"id":"o1"}"#),
    ]);
    let (status, report, body) = send(client(&script, IdempotentClientLayer::new()), post())
        .await
        .unwrap();
    assert_eq!(status, StatusCode::CREATED);
    assert_eq!(&body[..], br#"{"id":"o1"}"#);
    assert_eq!(
        script.times(),
        [Duration::ZERO, Duration::from_secs(3)],
        "the retry waits exactly Retry-After"
    );
    assert_eq!(report.retries(), [RetryReason::InProgress]);
    assert!(report.replayed(), "the replay is surfaced");
    assert_eq!(report.gave_up(), None);
}

#[tokio::test(start_paused = true)]
async fn key_reused_is_returned_at_once() {
    // Even with a Retry-After, the code decides.
    let script = Script::new(vec![
        problem(409, "idempotency_key_reused", Some("1")),
        answer(201),
    ]);
    let started = Instant::now();
    let (status, report, body) = send(client(&script, IdempotentClientLayer::new()), post())
        .await
        .unwrap();
    assert_eq!(status, StatusCode::CONFLICT);
    assert_eq!(started.elapsed(), Duration::ZERO, "no wait");
    assert_eq!(script.seen().len(), 1, "not retried");
    assert_eq!(report.attempts(), 1);
    assert_eq!(report.gave_up(), None);
    let problem: serde_json::Value = serde_json::from_slice(&body).unwrap();
    assert_eq!(
        problem["code"], "idempotency_key_reused",
        "the body read for its code reaches the caller whole"
    );
}

#[tokio::test(start_paused = true)]
async fn final_answers_are_not_retried() {
    for step in [
        answer(200),
        answer(201),
        Step::Answer(201, vec![("idempotent-replayed", "true")], "{}"),
        answer(400),
        answer(404),
        problem(409, "checkout_already_ordered", None),
        answer(409),
        answer(422),
        answer(429),
        answer(500),
    ] {
        let script = Script::new(vec![step, answer(201)]);
        let (status, report, _) = send(client(&script, IdempotentClientLayer::new()), post())
            .await
            .unwrap();
        assert_eq!(script.seen().len(), 1, "{status} is final");
        assert_eq!(report.attempts(), 1);
        assert!(report.retries().is_empty());
    }
}

#[tokio::test(start_paused = true)]
async fn gateway_errors_and_timeouts_are_retried() {
    let script = Script::new(vec![answer(502), answer(504), Step::Hang, answer(201)]);
    let layer = IdempotentClientLayer::new()
        .attempt_timeout(Duration::from_secs(2))
        .backoff(Duration::from_millis(100), Duration::from_millis(100));
    let (status, report, _) = send(client(&script, layer), post()).await.unwrap();
    assert_eq!(status, StatusCode::CREATED);
    assert_eq!(
        report.retries(),
        [
            RetryReason::Gateway,
            RetryReason::Gateway,
            RetryReason::Timeout
        ]
    );
    let times = script.times();
    // The hung attempt was cut at its 2 s bound, then a short backoff.
    assert!(times[3] - times[2] >= Duration::from_millis(2050));
    assert!(times[3] - times[2] <= Duration::from_millis(2100));
    let keys = script.keys();
    assert!(keys.iter().all(|k| *k == keys[0]));
}

#[tokio::test(start_paused = true)]
async fn attempts_are_bounded_and_the_last_answer_is_returned() {
    let script = Script::new(vec![problem(503, "store_unavailable", None)]);
    let layer = IdempotentClientLayer::new()
        .max_attempts(4)
        .backoff(Duration::from_millis(200), Duration::from_secs(10));
    let (status, report, body) = send(client(&script, layer), post()).await.unwrap();
    assert_eq!(status, StatusCode::SERVICE_UNAVAILABLE);
    assert_eq!(script.seen().len(), 4);
    assert_eq!(report.attempts(), 4);
    assert_eq!(report.gave_up(), Some(GiveUp::AttemptsExhausted));
    let problem: serde_json::Value = serde_json::from_slice(&body).unwrap();
    assert_eq!(problem["code"], "store_unavailable");
    // Equal jitter: before retry n, between half and all of 200 ms * 2^(n-1).
    let times = script.times();
    for n in 1..4 {
        let waited = times[n] - times[n - 1];
        let full = Duration::from_millis(200 * (1 << (n - 1)));
        assert!(
            waited >= full / 2 && waited <= full,
            "retry {n} waited {waited:?}, full backoff {full:?}"
        );
    }
}

#[tokio::test(start_paused = true)]
async fn no_wait_is_started_past_the_total_time_bound() {
    let script = Script::new(vec![problem(503, "store_unavailable", Some("2"))]);
    let layer = IdempotentClientLayer::new()
        .max_attempts(10)
        .total_timeout(Duration::from_secs(5));
    let started = Instant::now();
    let (status, report, _) = send(client(&script, layer), post()).await.unwrap();
    assert_eq!(status, StatusCode::SERVICE_UNAVAILABLE);
    assert_eq!(
        script.times(),
        [
            Duration::ZERO,
            Duration::from_secs(2),
            Duration::from_secs(4)
        ]
    );
    assert_eq!(report.gave_up(), Some(GiveUp::Deadline));
    assert_eq!(
        started.elapsed(),
        Duration::from_secs(4),
        "gave up at once rather than waiting past 5 s"
    );

    // A Retry-After longer than the whole bound is not waited for at all.
    let script = Script::new(vec![problem(409, "idempotency_in_progress", Some("3600"))]);
    let started = Instant::now();
    let (status, report, _) = send(client(&script, IdempotentClientLayer::new()), post())
        .await
        .unwrap();
    assert_eq!(status, StatusCode::CONFLICT);
    assert_eq!(report.gave_up(), Some(GiveUp::Deadline));
    assert_eq!(started.elapsed(), Duration::ZERO);
}

#[tokio::test(start_paused = true)]
async fn an_attempt_running_at_the_deadline_is_abandoned() {
    let script = Script::new(vec![Step::Hang]);
    let layer = IdempotentClientLayer::new()
        .attempt_timeout(Duration::from_secs(30))
        .total_timeout(Duration::from_secs(3));
    let started = Instant::now();
    let error = send(client(&script, layer), post()).await.unwrap_err();
    assert_eq!(error.kind(), ClientErrorKind::DeadlineExceeded);
    assert_eq!(error.code(), "deadline_exceeded");
    assert_eq!(error.attempts(), 1);
    assert_eq!(started.elapsed(), Duration::from_secs(3));
    assert_eq!(
        error.key().map(|k| k.as_str().to_owned()),
        Some(script.keys()[0].clone()),
        "the caller learns the key to retry the operation with later"
    );
}

#[tokio::test(start_paused = true)]
async fn failing_attempts_end_in_attempts_exhausted() {
    let script = Script::new(vec![Step::Fail]);
    let layer = IdempotentClientLayer::new().max_attempts(3);
    let error = send(client(&script, layer), post()).await.unwrap_err();
    assert_eq!(error.kind(), ClientErrorKind::AttemptsExhausted);
    assert_eq!(error.attempts(), 3);
    assert_eq!(script.seen().len(), 3);
    let source = std::error::Error::source(&error).expect("the last failure");
    assert_eq!(source.to_string(), "connection refused");
    let shown = error.to_string();
    assert!(shown.contains("attempts_exhausted"), "{shown}");
    assert!(!shown.contains(&script.keys()[0]), "key hashed: {shown}");
}

fn streaming_post() -> Request<BoxBody<Bytes, Infallible>> {
    Request::post("/orders")
        .body(Full::new(Bytes::from_static(b"{}")).boxed())
        .unwrap()
}

#[tokio::test(start_paused = true)]
async fn a_body_that_cannot_be_replayed_is_sent_once() {
    // An answer worth a retry comes back as it is, saying why it was not retried.
    let script = Script::new(vec![answer(503), answer(201)]);
    let (status, report, _) = send(
        client(&script, IdempotentClientLayer::new()),
        streaming_post(),
    )
    .await
    .unwrap();
    assert_eq!(status, StatusCode::SERVICE_UNAVAILABLE);
    assert_eq!(script.seen().len(), 1);
    assert_eq!(report.gave_up(), Some(GiveUp::BodyNotReplayable));

    // No answer at all: a clear error.
    let script = Script::new(vec![Step::Fail, answer(201)]);
    let error = send(
        client(&script, IdempotentClientLayer::new()),
        streaming_post(),
    )
    .await
    .unwrap_err();
    assert_eq!(error.kind(), ClientErrorKind::BodyNotReplayable);
    assert_eq!(error.code(), "body_not_replayable");
    assert_eq!(error.attempts(), 1);
    assert_eq!(script.seen().len(), 1);

    // A final answer is simply returned.
    let script = Script::new(vec![answer(201)]);
    let (status, report, _) = send(
        client(&script, IdempotentClientLayer::new()),
        streaming_post(),
    )
    .await
    .unwrap();
    assert_eq!(status, StatusCode::CREATED);
    assert_eq!(report.gave_up(), None);
    assert_eq!(script.keys().len(), 1, "a streaming request gets a key too");
}

#[tokio::test(start_paused = true)]
async fn an_invalid_key_is_refused_before_anything_is_sent() {
    let script = Script::new(vec![answer(201)]);
    let error = send(
        client(&script, IdempotentClientLayer::new()),
        post_with_key("has space"),
    )
    .await
    .unwrap_err();
    assert_eq!(error.kind(), ClientErrorKind::KeyInvalid);
    assert_eq!(error.attempts(), 0);

    let mut twice = post_with_key("a");
    twice
        .headers_mut()
        .append("idempotency-key", "b".parse().unwrap());
    let error = send(client(&script, IdempotentClientLayer::new()), twice)
        .await
        .unwrap_err();
    assert_eq!(error.code(), "idempotency_key_invalid");
    assert!(script.seen().is_empty(), "nothing was sent");
}

#[tokio::test(start_paused = true)]
async fn safe_methods_pass_through_once_without_a_key() {
    let script = Script::new(vec![answer(503), answer(200)]);
    let request = Request::get("/orders/1")
        .body(Full::new(Bytes::new()))
        .unwrap();
    let response = client(&script, IdempotentClientLayer::new())
        .oneshot(request)
        .await
        .unwrap();
    assert_eq!(response.status(), StatusCode::SERVICE_UNAVAILABLE);
    assert!(response.extensions().get::<CallReport>().is_none());
    let seen = script.seen();
    assert_eq!(seen.len(), 1);
    assert_eq!(seen[0].method, Method::GET);
    assert_eq!(seen[0].key, None);
}

#[tokio::test(start_paused = true)]
async fn a_custom_header_name_carries_the_key() {
    let script = Script::new(vec![answer(201)]);
    let layer =
        IdempotentClientLayer::new().header_name(http::HeaderName::from_static("x-request-key"));
    let response = client(&script, layer).oneshot(post()).await.unwrap();
    let report = response.extensions().get::<CallReport>().unwrap();
    let seen = &script.seen()[0];
    assert_eq!(seen.key, None, "not under the default name");
    assert_eq!(seen.headers["x-request-key"], report.key().as_str());
}

#[tokio::test(start_paused = true)]
async fn metrics_count_attempts_retries_give_ups_and_replays() {
    use metrics_util::debugging::{DebugValue, DebuggingRecorder};
    // The only test of this binary that installs a recorder and reads it;
    // its `client` label keeps the other tests' calls out of its counts.
    let recorder = DebuggingRecorder::new();
    let snapshotter = recorder.snapshotter();
    recorder
        .install()
        .expect("the only recorder of this binary");

    let layer = IdempotentClientLayer::new()
        .name("metrics-test")
        .max_attempts(3);
    let script = Script::new(vec![
        answer(503),
        problem(409, "idempotency_in_progress", Some("0")),
        Step::Answer(201, vec![("idempotent-replayed", "true")], "{}"),
    ]);
    send(client(&script, layer.clone()), post()).await.unwrap();
    let script = Script::new(vec![answer(503)]);
    send(client(&script, layer.clone()), post()).await.unwrap();
    // A budget that allows no retry at all: one attempt, one give-up.
    let script = Script::new(vec![answer(503)]);
    // Under a label of its own: the counts above stay the first scenario's.
    let none = layer
        .name("metrics-test-budget")
        .retry_budget(RetryBudget::ratio(0.0).min_per_sec(0));
    send(client(&script, none), post()).await.unwrap();

    let counters: std::collections::HashMap<(String, Vec<(String, String)>), u64> = snapshotter
        .snapshot()
        .into_vec()
        .into_iter()
        .filter_map(|(key, _, _, value)| {
            let DebugValue::Counter(n) = value else {
                return None;
            };
            let key = key.key();
            let mut labels: Vec<_> = key
                .labels()
                .map(|l| (l.key().to_owned(), l.value().to_owned()))
                .collect();
            labels.sort();
            Some(((key.name().to_owned(), labels), n))
        })
        .collect();
    let count_for = |client: &str, name: &str, extra: Option<(&str, &str)>| {
        let mut labels = vec![("client".to_owned(), client.to_owned())];
        if let Some((k, v)) = extra {
            labels.push((k.to_owned(), v.to_owned()));
        }
        labels.sort();
        counters
            .get(&(name.to_owned(), labels))
            .copied()
            .unwrap_or(0)
    };
    let count = |name: &str, extra: Option<(&str, &str)>| count_for("metrics-test", name, extra);
    use tower_idempotency::metrics::*;
    assert_eq!(count(CLIENT_ATTEMPTS_TOTAL, None), 6);
    assert_eq!(
        count(CLIENT_RETRIES_TOTAL, Some(("reason", "unavailable"))),
        3
    );
    assert_eq!(
        count(CLIENT_RETRIES_TOTAL, Some(("reason", "in_progress"))),
        1
    );
    assert_eq!(
        count(
            CLIENT_GIVE_UPS_TOTAL,
            Some(("reason", "attempts_exhausted"))
        ),
        1
    );
    assert_eq!(
        count_for(
            "metrics-test-budget",
            CLIENT_GIVE_UPS_TOTAL,
            Some(("reason", "retry_budget"))
        ),
        1
    );
    assert_eq!(
        count_for("metrics-test-budget", CLIENT_ATTEMPTS_TOTAL, None),
        1
    );
    assert_eq!(count(CLIENT_REPLAYED_TOTAL, None), 1);
}

/// A writer the test's log subscriber appends to.
#[derive(Clone, Default)]
struct Captured(Arc<Mutex<Vec<u8>>>);

impl std::io::Write for Captured {
    fn write(&mut self, buf: &[u8]) -> std::io::Result<usize> {
        self.0.lock().unwrap().extend_from_slice(buf);
        Ok(buf.len())
    }
    fn flush(&mut self) -> std::io::Result<()> {
        Ok(())
    }
}

/// Everything this test binary logs (one global subscriber: a scoped one
/// misses events when other threads settle the callsites' interest first).
fn logs() -> &'static Captured {
    static LOGS: std::sync::OnceLock<Captured> = std::sync::OnceLock::new();
    LOGS.get_or_init(|| {
        let logs = Captured::default();
        let writer = logs.clone();
        let subscriber = tracing_subscriber::fmt()
            .with_max_level(tracing::Level::TRACE)
            .with_ansi(false)
            .with_writer(move || writer.clone())
            .finish();
        tracing::subscriber::set_global_default(subscriber)
            .expect("the only subscriber of this binary");
        logs
    })
}

#[tokio::test(start_paused = true)]
async fn logs_show_the_key_only_hashed() {
    let logs = logs();
    let key = "caller-secret-key-42";
    let script = Script::new(vec![answer(503), Step::Fail, answer(503)]);
    let layer = IdempotentClientLayer::new().max_attempts(3);
    let (_, report, _) = send(client(&script, layer), post_with_key(key))
        .await
        .unwrap();
    assert_eq!(report.gave_up(), Some(GiveUp::AttemptsExhausted));

    let logs = String::from_utf8(logs.0.lock().unwrap().clone()).unwrap();
    // Other tests log too: only this call's lines (its hash) count.
    let hash = tower_idempotency::key::IdempotencyKey::parse(key.as_bytes())
        .unwrap()
        .short_hash();
    let ours: Vec<&str> = logs
        .lines()
        .filter(|line| line.contains(&format!("key_hash={hash}")))
        .collect();
    assert!(
        ours.iter()
            .any(|l| l.contains("retrying with the same key")),
        "{logs}"
    );
    assert!(ours.iter().any(|l| l.contains("giving up")), "{logs}");
    assert!(
        !logs.contains(key),
        "the raw key never reaches the logs: {logs}"
    );
}

/// `Retry-After` as an HTTP date (RFC 9110 IMF-fixdate) is waited for like
/// delay-seconds: until the date, at once if it has passed, and not at all
/// (the call gives up) if it lies past the total bound.
#[tokio::test(start_paused = true)]
async fn retry_after_as_an_http_date_is_waited_for() {
    let in_30s = httpdate::fmt_http_date(std::time::SystemTime::now() + Duration::from_secs(30));
    let in_30s: &'static str = Box::leak(in_30s.into_boxed_str());
    let script = Script::new(vec![
        problem(409, "idempotency_in_progress", Some(in_30s)),
        answer(201),
    ]);
    let (status, report, _) = send(client(&script, IdempotentClientLayer::new()), post())
        .await
        .unwrap();
    assert_eq!(status, StatusCode::CREATED);
    assert_eq!(report.retries(), [RetryReason::InProgress]);
    // The date has whole seconds, and the wall clock moved on a little.
    let waited = script.times()[1];
    assert!(
        waited > Duration::from_secs(28) && waited <= Duration::from_secs(30),
        "waited until the date, not the backoff: {waited:?}"
    );

    let script = Script::new(vec![
        problem(
            503,
            "store_unavailable",
            Some("Wed, 21 Oct 2015 07:28:00 GMT"),
        ),
        answer(201),
    ]);
    let (status, _, _) = send(client(&script, IdempotentClientLayer::new()), post())
        .await
        .unwrap();
    assert_eq!(status, StatusCode::CREATED);
    assert_eq!(
        script.times(),
        [Duration::ZERO, Duration::ZERO],
        "a date in the past: at once"
    );

    let in_an_hour =
        httpdate::fmt_http_date(std::time::SystemTime::now() + Duration::from_secs(3600));
    let in_an_hour: &'static str = Box::leak(in_an_hour.into_boxed_str());
    let script = Script::new(vec![problem(
        409,
        "idempotency_in_progress",
        Some(in_an_hour),
    )]);
    let started = Instant::now();
    let (status, report, _) = send(client(&script, IdempotentClientLayer::new()), post())
        .await
        .unwrap();
    assert_eq!(status, StatusCode::CONFLICT);
    assert_eq!(report.gave_up(), Some(GiveUp::Deadline));
    assert_eq!(started.elapsed(), Duration::ZERO);
    assert_eq!(script.seen().len(), 1);
}

/// A body whose length is not announced (as with chunked transfer coding),
/// arriving in `chunks`.
struct Chunked(VecDeque<Bytes>);

impl Chunked {
    fn new(chunks: &[&[u8]]) -> Self {
        Chunked(chunks.iter().map(|c| Bytes::copy_from_slice(c)).collect())
    }
}

impl http_body::Body for Chunked {
    type Data = Bytes;
    type Error = Infallible;

    fn poll_frame(
        self: Pin<&mut Self>,
        _: &mut Context<'_>,
    ) -> Poll<Option<Result<http_body::Frame<Bytes>, Infallible>>> {
        Poll::Ready(
            self.get_mut()
                .0
                .pop_front()
                .map(|c| Ok(http_body::Frame::data(c))),
        )
    }
}

type ChunkedServer =
    tower::util::BoxCloneService<Request<Full<Bytes>>, Response<Chunked>, BoxError>;

/// A server answering each attempt with the next of `answers` (status,
/// chunks), counting the attempts.
fn chunked_server(answers: Vec<(u16, Vec<&'static [u8]>)>) -> (ChunkedServer, Arc<Mutex<u32>>) {
    let attempts = Arc::new(Mutex::new(0_u32));
    let answers = Arc::new(answers);
    let server = tower::service_fn({
        let attempts = attempts.clone();
        move |_: Request<Full<Bytes>>| {
            let mut attempts = attempts.lock().unwrap();
            let (status, chunks) = &answers[(*attempts as usize).min(answers.len() - 1)];
            *attempts += 1;
            let response = Response::builder()
                .status(*status)
                .header("content-type", "application/problem+json")
                .header("retry-after", "1")
                .body(Chunked::new(chunks));
            std::future::ready(response.map_err(BoxError::from))
        }
    });
    (tower::util::BoxCloneService::new(server), attempts)
}

const IN_PROGRESS: &[u8] =
    br#"{"type":"urn:tower-idempotency:problem:idempotency_in_progress","status":409,"code":"idempotency_in_progress"}"#;

/// A `409` whose length is not announced is read all the same (bounded), so
/// an `idempotency_in_progress` is recognised and retried.
#[tokio::test(start_paused = true)]
async fn an_in_progress_409_of_unannounced_length_is_retried() {
    let (server, attempts) = chunked_server(vec![
        (409, vec![&IN_PROGRESS[..40], &IN_PROGRESS[40..]]),
        (201, vec![br#"{"id":"#, br#""o1"}"#]),
    ]);
    let response = IdempotentClientLayer::new()
        .layer(server)
        .oneshot(post())
        .await
        .unwrap();
    let report = response.extensions().get::<CallReport>().cloned().unwrap();
    assert_eq!(response.status(), StatusCode::CREATED);
    let body = response.into_body().collect().await.unwrap().to_bytes();
    assert_eq!(&body[..], br#"{"id":"o1"}"#, "the final answer is the 201");
    assert_eq!(*attempts.lock().unwrap(), 2);
    assert_eq!(report.attempts(), 2);
    assert_eq!(report.retries(), [RetryReason::InProgress]);
}

/// An unannounced `409` larger than the limit is passed on whole, every
/// byte, and not retried.
#[tokio::test(start_paused = true)]
async fn an_unannounced_409_over_the_limit_is_passed_on_whole() {
    let padding: &'static [u8] = Box::leak(vec![b' '; 70 * 1024].into_boxed_slice());
    let (server, attempts) = chunked_server(vec![
        (409, vec![&IN_PROGRESS[..40], padding, &IN_PROGRESS[40..]]),
        (201, vec![b"{}"]),
    ]);
    let response = IdempotentClientLayer::new()
        .layer(server)
        .oneshot(post())
        .await
        .unwrap();
    assert_eq!(response.status(), StatusCode::CONFLICT);
    let body = response.into_body().collect().await.unwrap().to_bytes();
    let sent = [&IN_PROGRESS[..40], padding, &IN_PROGRESS[40..]].concat();
    assert_eq!(body.len(), sent.len());
    assert!(body[..] == sent[..], "every byte, in order");
    assert_eq!(*attempts.lock().unwrap(), 1);
}

/// Sends `calls` POSTs at once through clones of one service (one budget)
/// to an upstream that always answers `503`; their reports.
async fn storm(script: &Script, layer: IdempotentClientLayer, calls: usize) -> Vec<CallReport> {
    let service = client(script, layer);
    let answers =
        futures_util::future::join_all((0..calls).map(|_| send(service.clone(), post()))).await;
    answers
        .into_iter()
        .map(|answer| {
            let (status, report, _) = answer.expect("an answer");
            assert_eq!(status, StatusCode::SERVICE_UNAVAILABLE, "the last outcome");
            report
        })
        .collect()
}

/// With the upstream down, `N` calls make at most `N × (1 + ratio) + floor`
/// attempts (counted where they arrive), not `N × max_attempts`; the calls
/// refused a retry get their last answer, marked as a budget give-up.
#[tokio::test(start_paused = true)]
async fn a_retry_budget_bounds_the_load_on_a_failing_upstream() {
    const CALLS: usize = 200;
    // Backoffs of at most 250 ms + 500 ms + 1 s + 2 s: every call ends
    // within the 10 s window, so no deposit or withdrawal expires.
    let layer = IdempotentClientLayer::new().max_attempts(5).retry_budget(
        RetryBudget::ratio(0.2)
            .min_per_sec(1)
            .window(Duration::from_secs(10)),
    );
    let script = Script::new(vec![answer(503)]);
    let reports = storm(&script, layer, CALLS).await;
    let attempts = script.seen().len();
    let floor = 10; // 1 a second over 10 s
    assert!(
        attempts <= CALLS * 12 / 10 + floor,
        "{attempts} attempts for {CALLS} calls"
    );
    assert!(attempts > CALLS, "the budget still allows some retries");
    let refused = reports
        .iter()
        .filter(|r| r.gave_up() == Some(GiveUp::RetryBudget))
        .count();
    assert!(refused > 0);
    assert_eq!(
        reports.iter().map(|r| r.attempts() as usize).sum::<usize>(),
        attempts,
        "every attempt is some call's"
    );

    // Without a budget, the same storm is five times the load.
    let script = Script::new(vec![answer(503)]);
    let layer = IdempotentClientLayer::new()
        .max_attempts(5)
        .retry_budget(RetryBudget::unlimited());
    storm(&script, layer, CALLS).await;
    assert_eq!(script.seen().len(), CALLS * 5);
}

/// A failure without an answer whose retry the budget refuses ends in
/// `retry_budget_exhausted`, with the key to retry later; each service the
/// layer makes has its own budget.
#[tokio::test(start_paused = true)]
async fn a_refused_retry_without_an_answer_is_a_budget_error() {
    // A floor of 1 a second over the 10 s default window: 10 retries, all
    // spent well within the window (10 ms waits).
    let layer = IdempotentClientLayer::new()
        .backoff(Duration::from_millis(10), Duration::from_millis(10))
        .retry_budget(RetryBudget::ratio(0.0).min_per_sec(1));
    let script = Script::new(vec![Step::Fail]);
    let service = client(&script, layer.clone());
    let mut errors = Vec::new();
    for _ in 0..4 {
        errors.push(send(service.clone(), post()).await.unwrap_err());
    }
    // 5 attempts (4 retries), 5 more (8), 3 (10: the floor is spent), 1.
    assert_eq!(script.seen().len(), 4 + 10);
    assert_eq!(errors[2].kind(), ClientErrorKind::RetryBudgetExhausted);
    assert_eq!(errors[2].attempts(), 3);
    let last = errors.last().unwrap();
    assert_eq!(last.kind(), ClientErrorKind::RetryBudgetExhausted);
    assert_eq!(last.code(), "retry_budget_exhausted");
    assert_eq!(last.attempts(), 1);
    assert!(last.key().is_some());

    // Another service from the same layer starts with a full budget.
    let other = Script::new(vec![Step::Fail]);
    let error = send(client(&other, layer), post()).await.unwrap_err();
    assert_eq!(error.kind(), ClientErrorKind::AttemptsExhausted);
    assert_eq!(other.seen().len(), 5);
}

/// `quote_keys(true)` sends keys as RFC 8941 strings, the generated one and
/// the caller's alike; the key (and the report's) is the same.
#[tokio::test(start_paused = true)]
async fn quoted_keys_are_sent_as_sf_strings() {
    let script = Script::new(vec![answer(503), answer(201)]);
    let layer = IdempotentClientLayer::new().quote_keys(true);
    let (_, report, _) = send(client(&script, layer.clone()), post()).await.unwrap();
    let sent = script.keys();
    assert_eq!(sent.len(), 2);
    assert_eq!(sent[0], sent[1]);
    assert_eq!(sent[0], format!("\"{}\"", report.key().as_str()));
    let parsed = tower_idempotency::key::IdempotencyKey::parse(sent[0].as_bytes()).unwrap();
    assert_eq!(&parsed, report.key());

    // The caller's bare key, quoted; a quote inside it escaped.
    let script = Script::new(vec![answer(201)]);
    let (_, report, _) = send(client(&script, layer.clone()), post_with_key(r#"a"b\c"#))
        .await
        .unwrap();
    assert_eq!(script.keys(), [r#""a\"b\\c""#]);
    assert_eq!(report.key().as_str(), r#"a"b\c"#);
    // Already quoted: the same.
    let script = Script::new(vec![answer(201)]);
    send(client(&script, layer), post_with_key(r#""k1""#))
        .await
        .unwrap();
    assert_eq!(script.keys(), [r#""k1""#]);
    // By default, bare.
    let script = Script::new(vec![answer(201)]);
    send(
        client(&script, IdempotentClientLayer::new()),
        post_with_key("k1"),
    )
    .await
    .unwrap();
    assert_eq!(script.keys(), ["k1"]);
}

/// Another server's in-progress answer, told by a predicate: a draft
/// server's plain `409`, or a `425` with a header; our own `409` code is
/// then an ordinary conflict.
#[tokio::test(start_paused = true)]
async fn a_custom_in_progress_predicate_decides_what_is_waited_for() {
    let draft = IdempotentClientLayer::new().in_progress_when(|answer| {
        answer.status == StatusCode::CONFLICT
            && answer
                .extensions
                .get::<ConflictProblem>()
                .and_then(ConflictProblem::type_uri)
                == Some("https://developer.example.com/idempotency")
    });
    let busy = Step::Answer(
        409,
        vec![("retry-after", "1")],
        r#"{"type":"https://developer.example.com/idempotency","title":"in flight"}"#,
    );
    let script = Script::new(vec![busy, answer(201)]);
    let (status, report, _) = send(client(&script, draft.clone()), post()).await.unwrap();
    assert_eq!(status, StatusCode::CREATED);
    assert_eq!(report.retries(), [RetryReason::InProgress]);
    assert_eq!(
        script.times()[1] - script.times()[0],
        Duration::from_secs(1)
    );

    // Our server's code no longer matches: returned at once.
    let script = Script::new(vec![problem(409, "idempotency_in_progress", Some("0"))]);
    let (status, report, _) = send(client(&script, draft), post()).await.unwrap();
    assert_eq!(status, StatusCode::CONFLICT);
    assert_eq!((report.attempts(), report.gave_up()), (1, None));

    // A head-only rule: 425 with a header.
    let early = IdempotentClientLayer::new().in_progress_when(|answer| {
        answer.status == StatusCode::TOO_EARLY && answer.headers.contains_key("x-in-flight")
    });
    let script = Script::new(vec![
        Step::Answer(425, vec![("x-in-flight", "1"), ("retry-after", "0")], ""),
        answer(201),
    ]);
    let (status, report, _) = send(client(&script, early), post()).await.unwrap();
    assert_eq!(status, StatusCode::CREATED);
    assert_eq!(report.retries(), [RetryReason::InProgress]);
}
