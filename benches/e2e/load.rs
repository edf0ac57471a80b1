//! The load: what a scenario sends and which answer it expects, closed loop
//! (32 clients back to back), open loop (a fixed rate, latency counted from
//! each request's scheduled send time) and the hot key's rounds.

use std::{
    net::SocketAddr,
    sync::{
        atomic::{AtomicUsize, Ordering},
        Arc, Mutex,
    },
    time::{Duration, Instant},
};

use axum::body::Bytes;
use http::{Request, StatusCode};
use http_body_util::{BodyExt, Full};
use hyper_util::{client::legacy::Client, rt::TokioExecutor};

pub(crate) const CONCURRENCY: usize = 32;
pub(crate) const HOT_DUPLICATES: usize = 50;
/// Customers the five-statement handler reads (rows made at setup).
pub(crate) const CUSTOMERS: usize = 10_000;

/// What a scenario's requests do.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum Kind {
    /// No key: a new order every time (the bare servers).
    Plain,
    /// A new key every time: created, not replayed.
    Create,
    /// A key of the scenario's list, completed: replayed.
    Replay,
    /// 95 % new keys, 5 % retries of completed keys, 0.1 % key reuse with another body.
    Mixed,
    /// Rounds of 50 simultaneous requests with one fresh key.
    HotKey,
}

/// The shape of the keys a scenario makes.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum Keys {
    /// `key-<n>`: consecutive keys, neighbours in the key index.
    Counter,
    /// Random-looking UUIDs, spread over the whole key index as real
    /// clients' keys are (the key-table growth scenarios).
    Uuid,
}

/// The request body.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum Body {
    /// `{"checkout_id", "total"}`: the two-statement handlers.
    Order,
    /// `{"checkout_id", "customer_id", "total"}`: the five-statement handlers.
    Full,
    /// [`Body::Order`] with a 4 KB `note` the typed handlers ignore: what a
    /// larger request costs (buffering, hashing, the record's fingerprint).
    Large,
}

/// The length of [`Body::Large`]'s note.
const NOTE: usize = 4000;

/// Lists of completed (key, body) pairs, for replays and retries.
pub(crate) const MAIN_KEYS: usize = 0;
pub(crate) const GROWTH_KEYS: usize = 1;
/// Keys made again just before each run of a scenario that replays from
/// the cache (`fresh_hits`): within the cache's size and lifetime.
pub(crate) const HIT_KEYS: usize = 2;
/// How many keys [`HIT_KEYS`] holds.
const HITS: usize = 256;

#[derive(Clone, Copy, Debug)]
pub(crate) struct Scenario {
    pub(crate) name: &'static str,
    pub(crate) addr: SocketAddr,
    pub(crate) kind: Kind,
    pub(crate) keys: Keys,
    pub(crate) body: Body,
    /// Creates keep their keys in this list; replays and retries pick from it.
    pub(crate) list: Option<usize>,
    /// A replay whose keys are made again on its own server just before
    /// each run, so that every one is answered from the replay cache.
    pub(crate) fresh_hits: bool,
    /// Run with the tracing subscriber and the metrics recorder on.
    pub(crate) observed: bool,
    /// Replays say they are retries (`Idempotency-Attempt: 2`), as the
    /// crate's client says on its retries.
    pub(crate) hinted: bool,
}

impl Scenario {
    pub(crate) fn new(name: &'static str, addr: SocketAddr, kind: Kind) -> Self {
        Scenario {
            name,
            addr,
            kind,
            keys: Keys::Counter,
            body: Body::Order,
            list: None,
            fresh_hits: false,
            observed: false,
            hinted: false,
        }
    }
    /// Replays that say they are retries.
    pub(crate) fn hinted(mut self) -> Self {
        self.hinted = true;
        self
    }
    /// Replays of keys made on this server just before each run: cache hits.
    pub(crate) fn fresh_hits(mut self) -> Self {
        self.list = Some(HIT_KEYS);
        self.fresh_hits = true;
        self
    }
    pub(crate) fn observed(mut self) -> Self {
        self.observed = true;
        self
    }
    pub(crate) fn keys(mut self, keys: Keys) -> Self {
        self.keys = keys;
        self
    }
    pub(crate) fn body(mut self, body: Body) -> Self {
        self.body = body;
        self
    }
    pub(crate) fn list(mut self, list: usize) -> Self {
        self.list = Some(list);
        self
    }
}

#[derive(Clone, Default, Debug)]
pub(crate) struct Run {
    pub(crate) requests: usize,
    pub(crate) unexpected: usize,
    pub(crate) seconds: f64,
    pub(crate) latencies_us: Vec<u64>,
    /// Hot key only: each duplicate's latency minus its owner's.
    pub(crate) duplicate_extra_us: Vec<i64>,
}

impl Run {
    pub(crate) fn throughput(&self) -> f64 {
        self.requests as f64 / self.seconds
    }
    pub(crate) fn percentile(&self, p: f64) -> f64 {
        percentile(&self.latencies_us, p) as f64 / 1000.0
    }
}

/// One round's line, as it finishes: closed loop.
pub(crate) fn print_round(round: usize, name: &str, run: &Run) {
    println!(
        "round {round} {name:<30} {:>8.0} req/s  p50 {:>6.2} ms  p99 {:>6.2} ms  unexpected {}",
        run.throughput(),
        run.percentile(0.5),
        run.percentile(0.99),
        run.unexpected
    );
}

/// One round's line, as it finishes: open loop at `rate`.
pub(crate) fn print_open_round(round: usize, name: &str, rate: f64, run: &Run) {
    println!(
        "round {round} {name:<30} at {rate:.0} req/s: p50 {:>6.2} ms  p99 {:>6.2} ms  unexpected {}",
        run.percentile(0.5),
        run.percentile(0.99),
        run.unexpected
    );
}

/// Medians over rounds.
#[derive(Clone, Copy, Debug)]
pub(crate) struct Stats {
    pub(crate) tput: f64,
    pub(crate) p50: f64,
    pub(crate) p99: f64,
    pub(crate) unexpected: usize,
}

impl Stats {
    pub(crate) fn of(runs: &[Run]) -> Stats {
        let of = |f: &dyn Fn(&Run) -> f64| median(&mut runs.iter().map(f).collect::<Vec<_>>());
        Stats {
            tput: of(&Run::throughput),
            p50: of(&|r| r.percentile(0.5)),
            p99: of(&|r| r.percentile(0.99)),
            unexpected: runs.iter().map(|r| r.unexpected).sum(),
        }
    }
}

pub(crate) fn percentile<T: Copy + Ord + Default>(values: &[T], p: f64) -> T {
    if values.is_empty() {
        return T::default();
    }
    let mut sorted = values.to_vec();
    sorted.sort_unstable();
    sorted[((sorted.len() - 1) as f64 * p).round() as usize]
}

pub(crate) fn median(values: &mut [f64]) -> f64 {
    if values.is_empty() {
        return f64::NAN;
    }
    values.sort_by(|a, b| a.total_cmp(b));
    values[values.len() / 2]
}

pub(crate) struct Load {
    http: Client<hyper_util::client::legacy::connect::HttpConnector, Full<Bytes>>,
    completed: [Mutex<Vec<(String, String)>>; 3],
    next: AtomicUsize,
}

pub(crate) struct Answer {
    status: StatusCode,
    replayed: bool,
    micros: u64,
}

impl Load {
    pub(crate) fn new() -> Arc<Self> {
        Arc::new(Load {
            http: Client::builder(TokioExecutor::new())
                .pool_max_idle_per_host(HOT_DUPLICATES * 2)
                .build_http(),
            completed: Default::default(),
            next: AtomicUsize::new(0),
        })
    }

    fn fresh(&self, keys: Keys, body: Body) -> (String, String) {
        let n = self.next.fetch_add(1, Ordering::Relaxed);
        let body = match body {
            Body::Order => format!(r#"{{"checkout_id":"chk-{n}","total":2400}}"#),
            Body::Full => format!(
                r#"{{"checkout_id":"chk-{n}","customer_id":{},"total":2400}}"#,
                1 + n % CUSTOMERS
            ),
            Body::Large => format!(
                r#"{{"checkout_id":"chk-{n}","total":2400,"note":"{}"}}"#,
                "n".repeat(NOTE)
            ),
        };
        let key = match keys {
            Keys::Counter => format!("key-{n}"),
            Keys::Uuid => uuid_key(n as u64),
        };
        (key, body)
    }

    fn pick(&self, list: Option<usize>, rng: &mut u64) -> Option<(String, String)> {
        let completed = self.completed[list.unwrap_or(MAIN_KEYS)].lock().unwrap();
        if completed.is_empty() {
            return None;
        }
        Some(completed[(xorshift(rng) as usize) % completed.len()].clone())
    }

    async fn post(&self, addr: SocketAddr, key: Option<&str>, body: String) -> Answer {
        self.post_as(addr, key, body, false).await
    }

    /// [`post`](Self::post), saying it is a retry when `retry` is set.
    async fn post_as(
        &self,
        addr: SocketAddr,
        key: Option<&str>,
        body: String,
        retry: bool,
    ) -> Answer {
        let mut request = Request::post(format!("http://{addr}/orders"))
            .header("content-type", "application/json");
        if let Some(key) = key {
            request = request.header("idempotency-key", key);
        }
        if retry {
            request = request.header("idempotency-attempt", "2");
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

    /// One request of `s`: whether its answer was the expected one, and its latency.
    async fn one(&self, s: Scenario, rng: &mut u64) -> (bool, u64) {
        // Per mille: 1 key reuse, 50 retries of completed keys, the rest new.
        let roll = xorshift(rng) % 1000;
        let replay = |a: Answer| (a.status == StatusCode::CREATED && a.replayed, a.micros);
        match s.kind {
            Kind::Plain => {
                let (_, body) = self.fresh(s.keys, s.body);
                let a = self.post(s.addr, None, body).await;
                (a.status == StatusCode::CREATED, a.micros)
            }
            Kind::Replay => match self.pick(s.list, rng) {
                Some((key, body)) => replay(self.post_as(s.addr, Some(&key), body, s.hinted).await),
                None => (false, 0),
            },
            Kind::Mixed if roll == 0 => match self.pick(s.list, rng) {
                Some((key, _)) => {
                    let other = r#"{"checkout_id":"other","total":1}"#.to_owned();
                    let a = self.post(s.addr, Some(&key), other).await;
                    (a.status == StatusCode::CONFLICT, a.micros)
                }
                None => (false, 0),
            },
            Kind::Mixed if roll <= 50 => match self.pick(s.list, rng) {
                Some((key, body)) => replay(self.post(s.addr, Some(&key), body).await),
                None => (false, 0),
            },
            Kind::Create | Kind::Mixed | Kind::HotKey => {
                let (key, body) = self.fresh(s.keys, s.body);
                let a = self.post(s.addr, Some(&key), body.clone()).await;
                let ok = a.status == StatusCode::CREATED && !a.replayed;
                if let (true, Some(list)) = (ok, s.list) {
                    self.completed[list].lock().unwrap().push((key, body));
                }
                (ok, a.micros)
            }
        }
    }

    /// What a run needs before its clock starts: the cache-hit keys made
    /// again (outside the measured window), and the observers turned on
    /// for an observed scenario (off again when the guard drops).
    async fn prepare(self: &Arc<Self>, s: Scenario) -> Option<crate::observed::On> {
        if s.fresh_hits {
            self.completed[HIT_KEYS].lock().unwrap().clear();
            let create = Scenario {
                kind: Kind::Create,
                fresh_hits: false,
                ..s
            };
            let workers: Vec<_> = (0..CONCURRENCY)
                .map(|w| {
                    let load = self.clone();
                    tokio::spawn(async move {
                        let mut rng = 0x2545_F491_4F6C_DD1D ^ (w as u64 + 1);
                        for _ in 0..HITS / CONCURRENCY {
                            let (ok, _) = load.one(create, &mut rng).await;
                            assert!(ok, "making a key to replay from the cache failed");
                        }
                    })
                })
                .collect();
            for worker in workers {
                worker.await.expect("worker");
            }
        }
        s.observed.then(crate::observed::On::new)
    }

    /// Closed loop: 32 clients sending back to back for `duration`.
    pub(crate) async fn run(self: &Arc<Self>, s: Scenario, duration: Duration) -> Run {
        let _observing = self.prepare(s).await;
        if s.kind == Kind::HotKey {
            return self.hot_key(s, duration).await;
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
                        let (ok, micros) = load.one(s, &mut rng).await;
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
    pub(crate) async fn fixed_rate(
        self: &Arc<Self>,
        s: Scenario,
        rate: f64,
        duration: Duration,
    ) -> Run {
        let _observing = self.prepare(s).await;
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
                let (ok, _) = load.one(s, &mut rng).await;
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
    async fn hot_key(self: &Arc<Self>, s: Scenario, duration: Duration) -> Run {
        let started = Instant::now();
        let mut total = Run::default();
        while started.elapsed() < duration {
            let (key, body) = self.fresh(s.keys, s.body);
            let answers: Vec<_> = (0..HOT_DUPLICATES)
                .map(|_| {
                    let (load, key, body) = (self.clone(), key.clone(), body.clone());
                    tokio::spawn(async move { load.post(s.addr, Some(&key), body).await })
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

fn splitmix(mut z: u64) -> u64 {
    z = z.wrapping_add(0x9E37_79B9_7F4A_7C15);
    z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
    z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
    z ^ (z >> 31)
}

/// A random-looking version-4 UUID made from `n` (the same `n`, the same key).
fn uuid_key(n: u64) -> String {
    let (a, b) = (splitmix(n), splitmix(n ^ 0x5DEE_CE66_D1CE_4E5B));
    format!(
        "{:08x}-{:04x}-4{:03x}-{:04x}-{:012x}",
        a >> 32,
        (a >> 16) & 0xffff,
        a & 0xfff,
        0x8000 | ((b >> 48) & 0x3fff),
        b & 0xffff_ffff_ffff
    )
}
