//! For unit tests: what a tracing subscriber wrote while some code ran,
//! to read a warning back.

use std::{
    io,
    sync::{Arc, Mutex},
};

/// What a subscriber wrote.
#[derive(Clone, Default)]
struct Written(Arc<Mutex<Vec<u8>>>);

impl io::Write for Written {
    fn write(&mut self, bytes: &[u8]) -> io::Result<usize> {
        self.0.lock().unwrap().extend_from_slice(bytes);
        Ok(bytes.len())
    }
    fn flush(&mut self) -> io::Result<()> {
        Ok(())
    }
}

/// Runs `calls` (on a runtime of this thread) under a subscriber of this
/// thread, and returns what it logged.
pub(crate) fn logged(calls: impl std::future::Future<Output = ()>) -> String {
    let written = Written::default();
    let sink = written.clone();
    let subscriber = tracing_subscriber::fmt()
        .with_writer(move || sink.clone())
        .with_ansi(false)
        .finish();
    let runtime = tokio::runtime::Builder::new_current_thread()
        .enable_time()
        .build()
        .unwrap();
    tracing::subscriber::with_default(subscriber, || runtime.block_on(calls));
    let bytes = written.0.lock().unwrap().clone();
    String::from_utf8(bytes).unwrap()
}
