//! The examples' binaries, for the process-level tests (shared by
//! `tests/order_server.rs`, `tests/fulfilment.rs`, `tests/two_instances.rs`
//! and `tests/chaos.rs`).

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
