//! A loopback proxy in front of the test database that reads the frontend
//! protocol the store speaks and cuts one connection at a chosen statement:
//! before the statement reaches PostgreSQL, or after PostgreSQL received it
//! (and will run it) but before its answer reaches the store. The second is
//! the fault a client can never resolve by itself: a `COMMIT` that may or may
//! not have happened.

use std::{
    collections::HashMap,
    sync::{Arc, Mutex},
};

use tokio::{
    io::{AsyncReadExt, AsyncWriteExt},
    net::TcpStream,
    sync::Notify,
};

use super::proxy::{listen, through, Upstream};

/// Where, relative to the matching statement, the connection is cut.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum Cut {
    /// The statement never reaches the server.
    Before,
    /// The server receives the statement (through its `Sync`) and runs it;
    /// the store never hears its answer.
    After,
}

type Matcher = Arc<dyn Fn(&str) -> bool + Send + Sync>;

struct Armed {
    matches: Matcher,
    cut: Cut,
}

#[derive(Default)]
struct Shared {
    armed: Mutex<Option<Armed>>,
    /// What the last cut matched, once it happened.
    fired: Mutex<Option<String>>,
    /// Whether the last cut connection's server side is gone.
    finished: Mutex<bool>,
    cut_done: Notify,
}

/// Forwards every connection to the database of `target`; armed with
/// [`cut_at`](Self::cut_at), it cuts the first connection that runs a
/// matching statement, once.
pub(crate) struct FaultProxy {
    port: u16,
    shared: Arc<Shared>,
    target: tokio_postgres::Config,
}

impl FaultProxy {
    pub(crate) async fn start(target: tokio_postgres::Config) -> FaultProxy {
        let shared = Arc::new(Shared::default());
        let accepted = shared.clone();
        let port = listen(&target, move |client, server| {
            relay(client, server, accepted.clone())
        })
        .await;
        FaultProxy {
            port,
            shared,
            target,
        }
    }

    /// Connection settings that reach the database through the proxy.
    pub(crate) fn config(&self) -> tokio_postgres::Config {
        through(&self.target, self.port)
    }

    /// Cuts the next connection that runs a statement `matches` accepts
    /// (simple query text, or a prepared statement's text at its `Bind`).
    pub(crate) fn cut_at(&self, cut: Cut, matches: impl Fn(&str) -> bool + Send + Sync + 'static) {
        *self.shared.fired.lock().unwrap() = None;
        *self.shared.finished.lock().unwrap() = false;
        *self.shared.armed.lock().unwrap() = Some(Armed {
            matches: Arc::new(matches),
            cut,
        });
    }

    /// The statement the last cut happened at, if it happened.
    pub(crate) fn fired(&self) -> Option<String> {
        self.shared.fired.lock().unwrap().clone()
    }

    /// Disarms a cut that has not happened.
    pub(crate) fn disarm(&self) {
        self.shared.armed.lock().unwrap().take();
    }

    /// Waits until a cut connection's server side is gone: after a
    /// [`Cut::After`], the server has run (or refused) the statement.
    pub(crate) async fn cut_finished(&self) {
        loop {
            let done = self.shared.cut_done.notified();
            tokio::pin!(done);
            done.as_mut().enable();
            if *self.shared.finished.lock().unwrap() {
                return;
            }
            done.await;
        }
    }
}

async fn relay(client: TcpStream, server: Box<dyn Upstream>, shared: Arc<Shared>) {
    let (mut client_read, mut client_write) = client.into_split();
    let (mut server_read, mut server_write) = tokio::io::split(server);
    // Server to client: copied as is, until the proxy cuts.
    let stop = Arc::new(Notify::new());
    let stopped = stop.clone();
    let downstream = tokio::spawn(async move {
        let mut buffer = vec![0u8; 16 * 1024];
        loop {
            tokio::select! {
                () = stopped.notified() => return server_read,
                read = server_read.read(&mut buffer) => match read {
                    Ok(0) | Err(_) => return server_read,
                    Ok(n) => {
                        if client_write.write_all(&buffer[..n]).await.is_err() {
                            return server_read;
                        }
                    }
                },
            }
        }
    });
    // Client to server: message by message.
    let mut frames = Frames::default();
    let mut buffer = vec![0u8; 16 * 1024];
    let mut cut_after_sync = false;
    let cut = 'read: loop {
        let n = match client_read.read(&mut buffer).await {
            Ok(0) | Err(_) => break 'read None,
            Ok(n) => n,
        };
        frames.push(&buffer[..n]);
        let mut forward = Vec::new();
        while let Some(message) = frames.next() {
            if cut_after_sync {
                forward.extend_from_slice(&message.bytes);
                if message.tag == Some(b'S') {
                    break 'read Some((forward, Cut::After));
                }
                continue;
            }
            let statement = frames.statement_of(&message);
            let hit = statement.as_deref().and_then(|sql| {
                let mut armed = shared.armed.lock().unwrap();
                let fires = armed.as_ref().is_some_and(|a| (a.matches)(sql));
                fires.then(|| {
                    *shared.fired.lock().unwrap() = Some(sql.to_owned());
                    armed.take().expect("armed").cut
                })
            });
            match hit {
                Some(Cut::Before) => break 'read Some((forward, Cut::Before)),
                Some(Cut::After) if message.tag == Some(b'Q') => {
                    forward.extend_from_slice(&message.bytes);
                    break 'read Some((forward, Cut::After));
                }
                Some(Cut::After) => {
                    forward.extend_from_slice(&message.bytes);
                    cut_after_sync = true;
                }
                None => forward.extend_from_slice(&message.bytes),
            }
        }
        if server_write.write_all(&forward).await.is_err() {
            break 'read None;
        }
    };
    let Some((last, how)) = cut else {
        stop.notify_one();
        return;
    };
    // The store's side goes first: it sees the connection die with its
    // statement unanswered.
    stop.notify_one();
    let mut server_read = downstream.await.expect("downstream");
    drop(client_read);
    if how == Cut::After {
        // Hand the server the statement, then end the stream cleanly (FIN,
        // not a reset that could discard it) and read until the server has
        // run it and closed its side.
        let _ = server_write.write_all(&last).await;
        let _ = server_write.flush().await;
        let _ = server_write.shutdown().await;
        let mut sink = vec![0u8; 16 * 1024];
        while matches!(server_read.read(&mut sink).await, Ok(n) if n > 0) {}
    }
    drop(server_write);
    drop(server_read);
    *shared.finished.lock().unwrap() = true;
    shared.cut_done.notify_waiters();
}

struct Message {
    /// `None` for the untyped startup-phase messages.
    tag: Option<u8>,
    bytes: Vec<u8>,
}

/// Splits the frontend byte stream into messages and remembers the text of
/// the connection's prepared statements.
#[derive(Default)]
struct Frames {
    pending: Vec<u8>,
    started: bool,
    statements: HashMap<String, String>,
}

impl Frames {
    fn push(&mut self, bytes: &[u8]) {
        self.pending.extend_from_slice(bytes);
    }

    fn next(&mut self) -> Option<Message> {
        let header = if self.started { 5 } else { 4 };
        if self.pending.len() < header {
            return None;
        }
        let at = header - 4;
        let length = u32::from_be_bytes(self.pending[at..at + 4].try_into().unwrap()) as usize;
        let total = at + length;
        if self.pending.len() < total {
            return None;
        }
        let bytes: Vec<u8> = self.pending.drain(..total).collect();
        if !self.started {
            // SSL and GSS encryption requests come before the startup packet.
            let code = u32::from_be_bytes(bytes[4..8].try_into().unwrap());
            self.started = !matches!(code, 80_877_103 | 80_877_104);
            return Some(Message { tag: None, bytes });
        }
        let tag = bytes[0];
        if tag == b'P' {
            let mut fields = bytes[5..].split(|b| *b == 0);
            let name = String::from_utf8_lossy(fields.next().unwrap_or_default()).into_owned();
            let sql = String::from_utf8_lossy(fields.next().unwrap_or_default()).into_owned();
            self.statements.insert(name, sql);
        }
        Some(Message {
            tag: Some(tag),
            bytes,
        })
    }

    /// The statement a message runs: a simple query's text, or the text of
    /// the prepared statement a `Bind` binds.
    fn statement_of(&self, message: &Message) -> Option<String> {
        let body = message.bytes.get(5..)?;
        match message.tag? {
            b'Q' => Some(
                String::from_utf8_lossy(body.split(|b| *b == 0).next().unwrap_or_default())
                    .into_owned(),
            ),
            b'B' => {
                let mut fields = body.split(|b| *b == 0);
                let _portal = fields.next()?;
                let name = String::from_utf8_lossy(fields.next()?).into_owned();
                self.statements.get(&name).cloned()
            }
            _ => None,
        }
    }
}
