//! The examples' binaries, for the process-level tests (shared by
//! `tests/order_server/contract.rs`, `tests/order_server/fulfilment.rs`, `tests/order_server/two_instances.rs`,
//! `tests/order_server/chaos.rs`, `tests/order_server/failover.rs`, the pooler's and others), and the
//! two modes the order server's `POST /orders` runs in ([`Mode`],
//! [`both_modes!`]).
// Each test binary uses part of this module.
#![allow(dead_code)]

/// How the example order server makes `POST /orders` idempotent: its
/// `IDEMPOTENCY_MODE`. Its HTTP contract is the same in both; the process
/// tests of `POST /orders` run in each (see [`both_modes!`]).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum Mode {
    /// `claim-first` (the default): the key is claimed before the
    /// handler runs; one owner runs it.
    ClaimFirst,
    /// `one-commit`: the key's record is inserted with the `COMMIT`. One
    /// commit wins; duplicates that reach two processes at once may both
    /// run the handler, and the loser rolls back and answers the winner's
    /// response (docs/modes.md).
    OneCommit,
}

impl Mode {
    /// Both modes, the default first.
    pub(crate) const BOTH: [Mode; 2] = [Mode::ClaimFirst, Mode::OneCommit];

    /// The value of `IDEMPOTENCY_MODE` for this mode.
    pub(crate) fn name(self) -> &'static str {
        match self {
            Mode::ClaimFirst => "claim-first",
            Mode::OneCommit => "one-commit",
        }
    }

    /// The server's environment entry that selects this mode.
    pub(crate) fn env(self) -> (&'static str, &'static str) {
        ("IDEMPOTENCY_MODE", self.name())
    }

    /// Fails unless `metrics` (the text of `GET /metrics`) comes from a
    /// server whose `POST /orders` runs in this mode: only the one-commit
    /// mode exports `idempotency_commits_lost_total` for it, at 0 from the
    /// start. A test of both modes that ran one of them twice would pass
    /// without this.
    pub(crate) fn assert_serves(self, metrics: &str) {
        assert_eq!(
            commits_lost(metrics).is_some(),
            self == Mode::OneCommit,
            "the server does not run POST /orders in the {} mode:\n{metrics}",
            self.name()
        );
    }
}

/// `idempotency_commits_lost_total` of `POST /orders v1` in `metrics` (the
/// text of `GET /metrics`): one-commit requests whose handler ran and whose
/// commit lost to another commit of the key. `None` when the series is not
/// exported (the claim-first mode).
pub(crate) fn commits_lost(metrics: &str) -> Option<u64> {
    metrics.lines().find_map(|line| {
        line.strip_prefix("idempotency_commits_lost_total{endpoint=\"POST /orders v1\"} ")
            .map(|n| n.trim().parse().expect("a counter's value"))
    })
}

/// `both_modes!(test_fn, …)`: for each `async fn test_fn(mode: Mode)`, a
/// module `test_fn` holding two tests, `test_fn::claim_first` and
/// `test_fn::one_commit`, each running it in its mode (`cargo test
/// one_commit` runs every test of the one-commit mode). `both_modes!(sync
/// test_fn, …)` does the same for a blocking `fn test_fn(mode: Mode)`.
// Only the tests of POST /orders use it.
#[allow(unused_macros)]
macro_rules! both_modes {
    (sync $($test:ident),+ $(,)?) => {$(
        mod $test {
            #[test]
            fn claim_first() {
                super::$test(crate::common::example_binary::Mode::ClaimFirst)
            }

            #[test]
            fn one_commit() {
                super::$test(crate::common::example_binary::Mode::OneCommit)
            }
        }
    )+};
    ($($test:ident),+ $(,)?) => {$(
        mod $test {
            #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
            async fn claim_first() {
                super::$test(crate::common::example_binary::Mode::ClaimFirst).await
            }

            #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
            async fn one_commit() {
                super::$test(crate::common::example_binary::Mode::OneCommit).await
            }
        }
    )+};
}
#[allow(unused_imports)]
pub(crate) use both_modes;

/// The example order server's binary (see [`example`]).
pub(crate) fn example_binary() -> std::path::PathBuf {
    example("order_server", &["examples/order_server", "Cargo.toml"])
}

/// The binary of example `name`, checked to be newer than `sources`
/// (paths relative to the crate root, files or directories).
///
/// `cargo test` builds the examples next to the test binaries; `cargo test
/// --test NAME` does not, and an edit of the example alone does not even
/// rebuild the test: refuse to test an example older than its own sources
/// rather than pass or fail on old code. (Library sources are left out:
/// others may edit them while a suite runs on what it built.)
pub(crate) fn example(name: &str, sources: &[&str]) -> std::path::PathBuf {
    let exe = std::env::current_exe().expect("test binary path");
    let dir = exe
        .parent()
        .and_then(|deps| deps.parent())
        .expect("target dir");
    let binary = dir.join("examples").join(name);
    let built = std::fs::metadata(&binary)
        .and_then(|m| m.modified())
        .unwrap_or_else(|_| {
            panic!(
                "{} is missing: build it with `cargo build --all-features --examples` (or run the whole suite)",
                binary.display()
            )
        });
    let root = std::path::Path::new(env!("CARGO_MANIFEST_DIR"));
    let newest = sources
        .iter()
        .filter_map(|p| newest_modification(&root.join(p)))
        .max();
    assert!(
        newest.is_none_or(|newest| newest <= built),
        "{} is older than its sources: build it with `cargo build --all-features --examples` (or run the whole suite)",
        binary.display()
    );
    binary
}

/// The latest modification time of `path` or, for a directory, of anything in it.
fn newest_modification(path: &std::path::Path) -> Option<std::time::SystemTime> {
    let meta = std::fs::metadata(path).ok()?;
    if !meta.is_dir() {
        return meta.modified().ok();
    }
    std::fs::read_dir(path)
        .ok()?
        .filter_map(|entry| newest_modification(&entry.ok()?.path()))
        .max()
}

/// One answer of the example server, as the process tests read it.
#[derive(Debug)]
pub(crate) struct Answer {
    pub(crate) status: http::StatusCode,
    pub(crate) headers: http::HeaderMap,
    pub(crate) body: bytes::Bytes,
}

impl Answer {
    /// The body as JSON; the test fails on anything else.
    pub(crate) fn json(&self) -> serde_json::Value {
        serde_json::from_slice(&self.body)
            .unwrap_or_else(|e| panic!("not JSON ({e}): {:?}", self.body))
    }

    /// Marked `Idempotent-Replayed: true`.
    pub(crate) fn replayed(&self) -> bool {
        self.headers
            .get("idempotent-replayed")
            .is_some_and(|v| v == "true")
    }

    /// The status and the problem code of the answer.
    pub(crate) fn status_and_code(&self) -> (http::StatusCode, serde_json::Value) {
        (self.status, self.json()["code"].clone())
    }
}

/// The base URL a started example announces on its first line of standard
/// output (`listening on http://HOST:PORT`), read from `child`'s piped
/// stdout.
pub(crate) async fn listening_base(child: &mut tokio::process::Child) -> String {
    use tokio::io::AsyncBufReadExt;
    let mut line = String::new();
    tokio::io::BufReader::new(child.stdout.take().expect("stdout is piped"))
        .read_line(&mut line)
        .await
        .expect("reads stdout");
    line.trim()
        .strip_prefix("listening on ")
        .unwrap_or_else(|| panic!("unexpected first line: {line:?}"))
        .to_owned()
}
