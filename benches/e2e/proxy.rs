//! A loopback TCP proxy in front of PostgreSQL's Unix socket that delays
//! every chunk by a fixed time in each direction, as if the database were on
//! another machine.
//!
//! Each direction of a connection is a queue: a chunk read at `t` is written
//! at `t + delay`, in order, whatever is queued before it (chunks are not
//! serialized behind one another's sleep). tokio's timer has a 1 ms
//! resolution, too coarse for 0.5 ms, so one clock thread wakes the writers
//! at their due time (a futex wait, precise to some tens of microseconds).
//! The proxy runs on its own single-threaded runtime and thread. It counts
//! the delay each chunk really got, to check the 0.5 ms.

use std::{
    cmp::Reverse,
    collections::BinaryHeap,
    net::SocketAddr,
    path::PathBuf,
    sync::{
        atomic::{AtomicU64, Ordering},
        mpsc, Arc,
    },
    time::{Duration, Instant},
};

use axum::body::Bytes;
use tokio::{
    io::{AsyncRead, AsyncReadExt, AsyncWrite, AsyncWriteExt},
    sync::oneshot,
};

/// Histogram buckets of 10 µs (to 100 ms), the last one open.
const BUCKETS: usize = 10_000;

pub(crate) struct Proxy {
    pub(crate) addr: SocketAddr,
    delays: Arc<[AtomicU64; BUCKETS]>,
}

impl Proxy {
    /// Starts the proxy on 127.0.0.1, forwarding to the Unix socket `target`.
    pub(crate) fn start(target: PathBuf, delay: Duration) -> Proxy {
        let delays: Arc<[AtomicU64; BUCKETS]> =
            Arc::new(std::array::from_fn(|_| AtomicU64::new(0)));
        let listener = std::net::TcpListener::bind("127.0.0.1:0").expect("bind");
        listener.set_nonblocking(true).expect("nonblocking");
        let addr = listener.local_addr().expect("addr");
        let clock = Clock::start();
        let counted = delays.clone();
        std::thread::Builder::new()
            .name("e2e-proxy".into())
            .spawn(move || {
                let runtime = tokio::runtime::Builder::new_current_thread()
                    .enable_all()
                    .build()
                    .expect("proxy runtime");
                runtime.block_on(async move {
                    let listener = tokio::net::TcpListener::from_std(listener).expect("listener");
                    while let Ok((client, _)) = listener.accept().await {
                        let _ = client.set_nodelay(true);
                        let Ok(server) = tokio::net::UnixStream::connect(&target).await else {
                            continue;
                        };
                        let (client_read, client_write) = client.into_split();
                        let (server_read, server_write) = server.into_split();
                        let (clock, counted) = (clock.clone(), counted.clone());
                        tokio::spawn(async move {
                            tokio::join!(
                                pipe(client_read, server_write, delay, &clock, &counted),
                                pipe(server_read, client_write, delay, &clock, &counted),
                            );
                        });
                    }
                });
            })
            .expect("proxy thread");
        Proxy { addr, delays }
    }

    /// The delay chunks really got since the last call, (p50, p99) in ms.
    pub(crate) fn take_delays(&self) -> (f64, f64) {
        let counts: Vec<u64> = self
            .delays
            .iter()
            .map(|b| b.swap(0, Ordering::Relaxed))
            .collect();
        let total: u64 = counts.iter().sum();
        let at = |p: f64| {
            let rank = (total as f64 * p).ceil() as u64;
            let mut seen = 0;
            for (i, c) in counts.iter().enumerate() {
                seen += c;
                if seen >= rank.max(1) {
                    return (i as f64 + 0.5) * 0.01;
                }
            }
            f64::NAN
        };
        (at(0.5), at(0.99))
    }
}

/// One direction: a reader queueing chunks with their due time, a writer
/// writing each at its time.
async fn pipe(
    mut from: impl AsyncRead + Unpin,
    mut to: impl AsyncWrite + Unpin,
    delay: Duration,
    clock: &Clock,
    delays: &[AtomicU64; BUCKETS],
) {
    let (queue, mut queued) = tokio::sync::mpsc::unbounded_channel::<(Instant, Bytes)>();
    let reader = async move {
        let mut buf = vec![0u8; 64 * 1024];
        while let Ok(n @ 1..) = from.read(&mut buf).await {
            let chunk = Bytes::copy_from_slice(&buf[..n]);
            if queue.send((Instant::now(), chunk)).is_err() {
                break;
            }
        }
        // Dropping the queue ends the writer once it has written the rest.
    };
    let writer = async move {
        while let Some((read_at, chunk)) = queued.recv().await {
            clock.until(read_at + delay).await;
            let waited = read_at.elapsed().as_micros() as usize / 10;
            delays[waited.min(BUCKETS - 1)].fetch_add(1, Ordering::Relaxed);
            if to.write_all(&chunk).await.is_err() {
                break;
            }
        }
        let _ = to.shutdown().await;
    };
    tokio::join!(reader, writer);
}

/// Wakes tasks at a due time, finer than tokio's 1 ms timer.
#[derive(Clone)]
struct Clock(mpsc::Sender<(Instant, oneshot::Sender<()>)>);

struct Due(Instant, u64, oneshot::Sender<()>);

impl PartialEq for Due {
    fn eq(&self, other: &Self) -> bool {
        (self.0, self.1) == (other.0, other.1)
    }
}
impl Eq for Due {}
impl PartialOrd for Due {
    fn partial_cmp(&self, other: &Self) -> Option<std::cmp::Ordering> {
        Some(self.cmp(other))
    }
}
impl Ord for Due {
    fn cmp(&self, other: &Self) -> std::cmp::Ordering {
        (self.0, self.1).cmp(&(other.0, other.1))
    }
}

impl Clock {
    fn start() -> Clock {
        let (sender, requests) = mpsc::channel::<(Instant, oneshot::Sender<()>)>();
        std::thread::Builder::new()
            .name("e2e-proxy-clock".into())
            .spawn(move || {
                let mut heap: BinaryHeap<Reverse<Due>> = BinaryHeap::new();
                let mut seq = 0u64;
                loop {
                    let now = Instant::now();
                    while heap.peek().is_some_and(|Reverse(d)| d.0 <= now) {
                        if let Some(Reverse(Due(_, _, wake))) = heap.pop() {
                            let _ = wake.send(());
                        }
                    }
                    let request = match heap.peek() {
                        None => match requests.recv() {
                            Ok(r) => Some(r),
                            Err(_) => return,
                        },
                        Some(Reverse(d)) => match requests.recv_timeout(d.0 - now) {
                            Ok(r) => Some(r),
                            Err(mpsc::RecvTimeoutError::Timeout) => None,
                            Err(mpsc::RecvTimeoutError::Disconnected) => return,
                        },
                    };
                    if let Some((at, wake)) = request {
                        seq += 1;
                        heap.push(Reverse(Due(at, seq, wake)));
                    }
                }
            })
            .expect("clock thread");
        Clock(sender)
    }

    async fn until(&self, at: Instant) {
        if at <= Instant::now() {
            return;
        }
        let (wake, woken) = oneshot::channel();
        if self.0.send((at, wake)).is_ok() {
            let _ = woken.await;
        }
    }
}
