//! A loopback TCP proxy in front of the test database that can be told to
//! answer slowly: a database that is slow without any lock being involved.

use std::{
    sync::{
        atomic::{AtomicU64, Ordering},
        Arc,
    },
    time::Duration,
};

use tokio::{
    io::{AsyncRead, AsyncReadExt, AsyncWrite, AsyncWriteExt},
    net::{TcpListener, TcpStream, UnixStream},
};
use tokio_postgres::config::Host;

/// Forwards every connection to the database of `target`; each chunk the
/// server sends is held back by the current delay first.
pub(crate) struct SlowProxy {
    port: u16,
    delay_ms: Arc<AtomicU64>,
    connections: Arc<AtomicU64>,
    target: tokio_postgres::Config,
}

impl SlowProxy {
    pub(crate) async fn start(target: tokio_postgres::Config) -> SlowProxy {
        let delay_ms = Arc::new(AtomicU64::new(0));
        let connections = Arc::new(AtomicU64::new(0));
        let (delay, accepted) = (delay_ms.clone(), connections.clone());
        let port = listen(&target, move |client, server| {
            accepted.fetch_add(1, Ordering::SeqCst);
            pipe(client, server, delay.clone())
        })
        .await;
        SlowProxy {
            port,
            delay_ms,
            connections,
            target,
        }
    }

    /// The loopback port it listens on.
    pub(crate) fn port(&self) -> u16 {
        self.port
    }

    /// How many connections clients have opened through it so far.
    pub(crate) fn connections(&self) -> u64 {
        self.connections.load(Ordering::SeqCst)
    }

    /// Connection settings that go through the proxy.
    pub(crate) fn config(&self) -> tokio_postgres::Config {
        through(&self.target, self.port)
    }

    /// From now on the server's answers arrive `delay` late.
    pub(crate) fn set_delay(&self, delay: Duration) {
        self.delay_ms
            .store(delay.as_millis() as u64, Ordering::SeqCst);
    }
}

/// A connection to the database server, over TCP or a Unix socket.
pub(crate) trait Upstream: AsyncRead + AsyncWrite + Unpin + Send + 'static {}
impl<T: AsyncRead + AsyncWrite + Unpin + Send + 'static> Upstream for T {}

/// Listens on a loopback port (returned) and hands each client that
/// connects, with a fresh connection to the database server of `target`, to
/// `serve`.
pub(crate) async fn listen<F, Fut>(target: &tokio_postgres::Config, serve: F) -> u16
where
    F: Fn(TcpStream, Box<dyn Upstream>) -> Fut + Send + 'static,
    Fut: std::future::Future<Output = ()> + Send + 'static,
{
    let listener = TcpListener::bind("127.0.0.1:0").await.unwrap();
    let port = listener.local_addr().unwrap().port();
    let (host, server_port) = (
        target.get_hosts()[0].clone(),
        target.get_ports().first().copied().unwrap_or(5432),
    );
    tokio::spawn(async move {
        while let Ok((client, _)) = listener.accept().await {
            let server: Option<Box<dyn Upstream>> = match &host {
                Host::Tcp(name) => TcpStream::connect((name.as_str(), server_port))
                    .await
                    .ok()
                    .map(|s| Box::new(s) as Box<dyn Upstream>),
                Host::Unix(dir) => UnixStream::connect(dir.join(format!(".s.PGSQL.{server_port}")))
                    .await
                    .ok()
                    .map(|s| Box::new(s) as Box<dyn Upstream>),
            };
            if let Some(server) = server {
                tokio::spawn(serve(client, server));
            }
        }
    });
    port
}

/// `target`'s user, password and database, reached through a proxy on
/// loopback `port`.
pub(crate) fn through(target: &tokio_postgres::Config, port: u16) -> tokio_postgres::Config {
    let mut config = tokio_postgres::Config::new();
    config.host("127.0.0.1").port(port);
    if let Some(user) = target.get_user() {
        config.user(user);
    }
    if let Some(password) = target.get_password() {
        config.password(password);
    }
    if let Some(dbname) = target.get_dbname() {
        config.dbname(dbname);
    }
    config
}

async fn pipe(client: TcpStream, server: Box<dyn Upstream>, delay: Arc<AtomicU64>) {
    let (mut client_read, mut client_write) = client.into_split();
    let (mut server_read, mut server_write) = tokio::io::split(server);
    let upstream = async move {
        let _ = tokio::io::copy(&mut client_read, &mut server_write).await;
        let _ = server_write.shutdown().await;
    };
    let downstream = async move {
        let mut buffer = vec![0u8; 64 * 1024];
        loop {
            let n = match server_read.read(&mut buffer).await {
                Ok(0) | Err(_) => break,
                Ok(n) => n,
            };
            let ms = delay.load(Ordering::SeqCst);
            if ms > 0 {
                tokio::time::sleep(Duration::from_millis(ms)).await;
            }
            if client_write.write_all(&buffer[..n]).await.is_err() {
                break;
            }
        }
    };
    tokio::join!(upstream, downstream);
}
