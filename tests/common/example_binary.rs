//! The examples' binaries, for the process-level tests (shared by
//! `tests/order_server.rs`, `tests/fulfilment.rs`, `tests/two_instances.rs`
//! and `tests/chaos.rs`).
// Each test binary uses part of this module.
#![allow(dead_code)]

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
