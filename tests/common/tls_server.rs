//! A PostgreSQL that accepts TLS connections only, as managed services are
//! set up, with a CA and certificates made for the run (rcgen): for
//! `tests/deployment/tls.rs` and `benches/tls.rs`.
// Each user takes part of it.
#![allow(dead_code)]

use std::{path::PathBuf, sync::OnceLock};

use rcgen::{BasicConstraints, CertificateParams, DnType, IsCa, Issuer, KeyPair, KeyUsagePurpose};
use tower_idempotency::testing::TempPostgres;

/// A CA, and certificates it signed, as PEM.
pub(crate) struct Ca {
    cert: String,
    issuer: Issuer<'static, KeyPair>,
}

impl Ca {
    pub(crate) fn new(name: &str) -> Ca {
        let mut params = CertificateParams::new(Vec::<String>::new()).unwrap();
        params.is_ca = IsCa::Ca(BasicConstraints::Unconstrained);
        params.distinguished_name.push(DnType::CommonName, name);
        params.key_usages = vec![KeyUsagePurpose::KeyCertSign, KeyUsagePurpose::CrlSign];
        let key = KeyPair::generate().unwrap();
        let cert = params.self_signed(&key).unwrap().pem();
        Ca {
            cert,
            issuer: Issuer::new(params, key),
        }
    }

    /// A certificate for `names` (DNS names or IP addresses) with common
    /// name `cn`, and its key.
    pub(crate) fn sign(&self, cn: &str, names: &[&str]) -> (String, String) {
        let names: Vec<String> = names.iter().map(|n| n.to_string()).collect();
        let mut params = CertificateParams::new(names).unwrap();
        params.distinguished_name.push(DnType::CommonName, cn);
        let key = KeyPair::generate().unwrap();
        let cert = params.signed_by(&key, &self.issuer).unwrap();
        (cert.pem(), key.serialize_pem())
    }
}

/// The TLS-only server of this test binary, and the files a client needs.
pub(crate) struct TlsServer {
    pub(crate) cluster: TempPostgres,
    pub(crate) port: u16,
    files: tempfile_dir::Dir,
}

mod tempfile_dir {
    /// A directory removed on drop.
    pub(crate) struct Dir(pub(crate) std::path::PathBuf);
    impl Drop for Dir {
        fn drop(&mut self) {
            let _ = std::fs::remove_dir_all(&self.0);
        }
    }
}

pub(crate) const PASSWORD: &str = "tls-test-secret";

/// The shared server lives in a static, which is never dropped: its files
/// outlive the test process. Those of processes that are gone are removed
/// here.
fn remove_left_by_dead_processes() {
    let dirs = std::fs::read_dir(std::env::temp_dir())
        .into_iter()
        .flatten()
        .flatten();
    for entry in dirs {
        let name = entry.file_name().to_string_lossy().into_owned();
        let pid = name
            .strip_prefix("tower-idempotency-tls-")
            .and_then(|rest| rest.split('-').next());
        if pid.is_some_and(|pid| !std::path::Path::new("/proc").join(pid).exists()) {
            let _ = std::fs::remove_dir_all(entry.path());
        }
    }
}

fn free_port() -> u16 {
    std::net::TcpListener::bind("127.0.0.1:0")
        .and_then(|l| l.local_addr())
        .map(|a| a.port())
        .expect("a free port")
}

/// Over TCP only TLS gets in: a password over SCRAM (with channel binding
/// where the client offers it), a client certificate for certuser. The local
/// line serves the harness (readiness, test databases).
pub(crate) const TLS_ONLY: &str = "local all all trust\n\
    hostssl all certuser 127.0.0.1/32 cert\n\
    hostssl all all 127.0.0.1/32 scram-sha-256\n\
    hostnossl all all 0.0.0.0/0 reject\n";

/// TLS or not, as the client asks (for comparing the two).
pub(crate) const EITHER: &str = "local all all trust\n\
    host all all 127.0.0.1/32 scram-sha-256\n";

/// The TLS-only server of this test binary.
pub(crate) fn server() -> &'static TlsServer {
    static SERVER: OnceLock<TlsServer> = OnceLock::new();
    SERVER.get_or_init(|| TlsServer::start(TLS_ONLY, false))
}

impl TlsServer {
    /// A server with `ssl = on`, `hba` as its `pg_hba.conf`, durable
    /// (`fsync` on) when `durable`.
    pub(crate) fn start(hba: &str, durable: bool) -> TlsServer {
        let ca = Ca::new("tower-idempotency test CA");
        let (server_cert, server_key) = ca.sign("postgres", &["localhost", "127.0.0.1"]);
        let (client_cert, client_key) = ca.sign("certuser", &[]);
        let other = Ca::new("another CA");
        static NEXT: std::sync::atomic::AtomicU32 = std::sync::atomic::AtomicU32::new(0);
        let dir = std::env::temp_dir().join(format!(
            "tower-idempotency-tls-{}-{}",
            std::process::id(),
            NEXT.fetch_add(1, std::sync::atomic::Ordering::Relaxed)
        ));
        let _ = std::fs::remove_dir_all(&dir);
        remove_left_by_dead_processes();
        std::fs::create_dir_all(&dir).unwrap();
        for (name, contents) in [
            ("ca.pem", &ca.cert),
            ("other-ca.pem", &other.cert),
            ("client.pem", &client_cert),
            ("client.key", &client_key),
        ] {
            std::fs::write(dir.join(name), contents).unwrap();
        }
        let port = free_port();
        let cluster = TempPostgres::builder()
            .durable(durable)
            .tcp(port)
            .hba(hba)
            .file("server.crt", server_cert)
            .file("server.key", server_key)
            .file("root.crt", ca.cert.clone())
            .setting("ssl", "on")
            .setting("ssl_cert_file", "server.crt")
            .setting("ssl_key_file", "server.key")
            .setting("ssl_ca_file", "root.crt")
            .setting("password_encryption", "scram-sha-256")
            .start()
            .unwrap_or_else(|e| panic!("{e}"));
        TlsServer {
            cluster,
            port,
            files: tempfile_dir::Dir(dir),
        }
    }
}

impl TlsServer {
    pub(crate) fn file(&self, name: &str) -> PathBuf {
        self.files.0.join(name)
    }

    /// A fresh database owned by `app` (a password user), made over the
    /// Unix socket.
    pub(crate) async fn database(&self) -> String {
        static NEXT: std::sync::atomic::AtomicU32 = std::sync::atomic::AtomicU32::new(0);
        let name = format!(
            "tls_{}",
            NEXT.fetch_add(1, std::sync::atomic::Ordering::Relaxed)
        );
        let (admin, connection) = self
            .cluster
            .config()
            .connect(tokio_postgres::NoTls)
            .await
            .unwrap();
        tokio::spawn(connection);
        admin
            .batch_execute(&format!(
                "DO $$ BEGIN
                   IF NOT EXISTS (SELECT FROM pg_roles WHERE rolname = 'app') THEN
                     CREATE ROLE app LOGIN PASSWORD '{PASSWORD}';
                   END IF;
                   IF NOT EXISTS (SELECT FROM pg_roles WHERE rolname = 'certuser') THEN
                     CREATE ROLE certuser LOGIN;
                   END IF;
                 END $$"
            ))
            .await
            .ok();
        admin
            .batch_execute(&format!("CREATE DATABASE {name} OWNER app"))
            .await
            .unwrap();
        name
    }

    /// A URL for `db` as `app` at `host`, with the query `tls`.
    pub(crate) fn url(&self, host: &str, db: &str, tls: &str) -> String {
        format!("postgres://app:{PASSWORD}@{host}:{}/{db}?{tls}", self.port)
    }

    pub(crate) fn ca(&self) -> String {
        self.file("ca.pem").display().to_string()
    }

    pub(crate) fn other_ca(&self) -> String {
        self.file("other-ca.pem").display().to_string()
    }
}
