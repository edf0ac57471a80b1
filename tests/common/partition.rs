//! A loopback proxy in front of the test database that can stop moving
//! bytes without closing anything: a network partition (a cloud partition,
//! a security-group change, a dead NAT entry). Nothing is reset and nothing
//! is lost: bytes sent during the partition are held and delivered once it
//! heals, as TCP's retransmissions would deliver them. New connections are
//! accepted but carry nothing until then.

use tokio::{
    io::{AsyncRead, AsyncReadExt, AsyncWrite, AsyncWriteExt},
    sync::watch,
};

use super::proxy::{listen, through};

/// Forwards every connection to the database of `target` while the path
/// is up.
pub(crate) struct PartitionProxy {
    port: u16,
    up: watch::Sender<bool>,
    target: tokio_postgres::Config,
}

impl PartitionProxy {
    pub(crate) async fn start(target: tokio_postgres::Config) -> PartitionProxy {
        let (up, path) = watch::channel(true);
        let port = listen(&target, move |client, server| {
            let path = path.clone();
            async move {
                let (client_read, client_write) = client.into_split();
                let (server_read, server_write) = tokio::io::split(server);
                tokio::join!(
                    carry(client_read, server_write, path.clone()),
                    carry(server_read, client_write, path),
                );
            }
        })
        .await;
        PartitionProxy { port, up, target }
    }

    /// Connection settings that go through the proxy.
    pub(crate) fn config(&self) -> tokio_postgres::Config {
        through(&self.target, self.port)
    }

    /// The loopback port it listens on.
    pub(crate) fn port(&self) -> u16 {
        self.port
    }

    /// From now on no byte crosses, in either direction, on any connection.
    pub(crate) fn partition(&self) {
        self.up.send_replace(false);
    }

    /// The path is back: what was held is delivered, and bytes flow again.
    pub(crate) fn heal(&self) {
        self.up.send_replace(true);
    }
}

/// Moves bytes from `from` to `to`, holding each chunk (and the end of the
/// stream) while the path is down.
async fn carry(
    mut from: impl AsyncRead + Unpin,
    mut to: impl AsyncWrite + Unpin,
    mut path: watch::Receiver<bool>,
) {
    let mut buffer = vec![0u8; 64 * 1024];
    loop {
        let read = from.read(&mut buffer).await;
        if path.wait_for(|up| *up).await.is_err() {
            return;
        }
        match read {
            Ok(0) | Err(_) => break,
            Ok(n) => {
                if to.write_all(&buffer[..n]).await.is_err() {
                    return;
                }
            }
        }
    }
    let _ = to.shutdown().await;
}
