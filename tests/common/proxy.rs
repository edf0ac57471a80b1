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
    target: tokio_postgres::Config,
}

impl SlowProxy {
    pub(crate) async fn start(target: tokio_postgres::Config) -> SlowProxy {
        let listener = TcpListener::bind("127.0.0.1:0").await.unwrap();
        let port = listener.local_addr().unwrap().port();
        let delay_ms = Arc::new(AtomicU64::new(0));
        let (host, server_port) = (
            target.get_hosts()[0].clone(),
            target.get_ports().first().copied().unwrap_or(5432),
        );
        let delay = delay_ms.clone();
        tokio::spawn(async move {
            while let Ok((client, _)) = listener.accept().await {
                let (host, delay) = (host.clone(), delay.clone());
                tokio::spawn(async move {
                    match host {
                        Host::Tcp(name) => {
                            if let Ok(server) =
                                TcpStream::connect((name.as_str(), server_port)).await
                            {
                                pipe(client, server, delay).await;
                            }
                        }
                        Host::Unix(dir) => {
                            let socket = dir.join(format!(".s.PGSQL.{server_port}"));
                            if let Ok(server) = UnixStream::connect(socket).await {
                                pipe(client, server, delay).await;
                            }
                        }
                    }
                });
            }
        });
        SlowProxy {
            port,
            delay_ms,
            target,
        }
    }

    /// Connection settings that go through the proxy.
    pub(crate) fn config(&self) -> tokio_postgres::Config {
        let mut config = tokio_postgres::Config::new();
        config.host("127.0.0.1").port(self.port);
        if let Some(user) = self.target.get_user() {
            config.user(user);
        }
        if let Some(password) = self.target.get_password() {
            config.password(password);
        }
        if let Some(dbname) = self.target.get_dbname() {
            config.dbname(dbname);
        }
        config
    }

    /// From now on the server's answers arrive `delay` late.
    pub(crate) fn set_delay(&self, delay: Duration) {
        self.delay_ms
            .store(delay.as_millis() as u64, Ordering::SeqCst);
    }
}

async fn pipe<S>(client: TcpStream, server: S, delay: Arc<AtomicU64>)
where
    S: AsyncRead + AsyncWrite + Unpin + Send + 'static,
{
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
