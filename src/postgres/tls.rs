//! The store's TLS connector: one value that opens the pool's connections,
//! the relay's dedicated connection and the cancel requests of timed-out
//! handlers, whichever `MakeTlsConnect` it wraps: rustls configured from
//! libpq's parameters ([`Connector::from_params`]), a caller's own
//! ([`PgStoreBuilder::tls`](super::PgStoreBuilder::tls)), or none.

use std::{
    fmt,
    future::Future,
    pin::Pin,
    sync::{
        atomic::{AtomicBool, Ordering},
        Arc,
    },
};

use deadpool_postgres::{Manager, ManagerConfig};
use futures_util::stream::{BoxStream, StreamExt};
use tokio_postgres::{
    tls::{MakeTlsConnect, TlsConnect},
    AsyncMessage, CancelToken, Client, Config, Error, NoTls, Socket,
};

use super::conninfo::{SslMode, TlsParams};
use crate::store::{StoreError, StoreErrorKind};

type BoxFuture<'a, T> = Pin<Box<dyn Future<Output = T> + Send + 'a>>;

/// The messages of a dedicated connection (notifications, notices), driving
/// it while they are read.
pub(crate) type Messages = BoxStream<'static, Result<AsyncMessage, Error>>;

/// A `MakeTlsConnect` with its type erased, so that the store is one type
/// whatever TLS it uses.
#[derive(Clone)]
pub(crate) struct Connector {
    inner: Arc<dyn Connect>,
    name: &'static str,
}

impl fmt::Debug for Connector {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.name)
    }
}

trait Connect: Send + Sync {
    fn connect<'a>(
        &'a self,
        config: &'a Config,
    ) -> BoxFuture<'a, Result<(Client, Messages), Error>>;
    fn cancel<'a>(&'a self, token: &'a CancelToken) -> BoxFuture<'a, Result<(), Error>>;
}

impl<T> Connect for T
where
    T: MakeTlsConnect<Socket> + Clone + Send + Sync + 'static,
    T::Stream: Send + Sync + 'static,
    T::TlsConnect: Send + Sync,
    <T::TlsConnect as TlsConnect<Socket>>::Future: Send,
{
    fn connect<'a>(
        &'a self,
        config: &'a Config,
    ) -> BoxFuture<'a, Result<(Client, Messages), Error>> {
        Box::pin(async move {
            let (client, mut connection) = config.connect(self.clone()).await?;
            let messages = futures_util::stream::poll_fn(move |cx| connection.poll_message(cx));
            Ok((client, messages.boxed()))
        })
    }

    fn cancel<'a>(&'a self, token: &'a CancelToken) -> BoxFuture<'a, Result<(), Error>> {
        Box::pin(token.cancel_query(self.clone()))
    }
}

impl Connector {
    /// Wraps a caller's connector.
    pub(crate) fn new<T>(tls: T, name: &'static str) -> Self
    where
        T: MakeTlsConnect<Socket> + Clone + Send + Sync + 'static,
        T::Stream: Send + Sync + 'static,
        T::TlsConnect: Send + Sync,
        <T::TlsConnect as TlsConnect<Socket>>::Future: Send,
    {
        Connector {
            inner: Arc::new(tls),
            name,
        }
    }

    /// The connector libpq's parameters ask for in `mode` (their
    /// effective mode, or what the hosts make of it: see
    /// `conninfo::settle_hosts`), and the `sslmode` to set on tokio-postgres's
    /// configuration (which knows only disable, prefer and require: the
    /// verification is the connector's).
    pub(crate) fn from_params(
        params: &TlsParams,
        mode: SslMode,
    ) -> Result<(Connector, tokio_postgres::config::SslMode), StoreError> {
        if mode == SslMode::Disable {
            return Ok((Connector::new(NoTls, "no TLS"), wire(mode)));
        }
        Ok((rustls_connector(mode, params)?, wire(mode)))
    }

    /// The `sslmode` to set on tokio-postgres's configuration for a
    /// caller's connector: the one the connection string asks for, so a
    /// connector of one's own never weakens it. The certificate files of
    /// the string are refused rather than dropped: the caller's connector
    /// does not read them, and silently ignoring a CA the operator named
    /// would verify against something else.
    pub(crate) fn wire_mode_for_own(
        params: &TlsParams,
        mode: SslMode,
    ) -> Result<tokio_postgres::config::SslMode, StoreError> {
        let named: Vec<&str> = [
            params.root.as_ref().map(|_| "sslrootcert"),
            params.client.as_ref().map(|_| "sslcert and sslkey"),
        ]
        .into_iter()
        .flatten()
        .collect();
        if !named.is_empty() {
            return Err(config_error(format!(
                "{} cannot be used with a TLS connector of your own (PgStoreBuilder::tls), \
                 which does not read them: configure them on the connector and leave them \
                 out of the connection string",
                named.join(" and ")
            )));
        }
        Ok(wire(mode))
    }

    /// A pool manager whose connections this connector opens, as
    /// [`connect`](Self::connect) does.
    pub(crate) fn manager(
        &self,
        config: Config,
        manager: ManagerConfig,
        startup: Option<Arc<StartupSetting>>,
    ) -> Manager {
        Manager::from_connect(config, PoolConnect(self.clone(), startup), manager)
    }

    /// A connection, and its messages. With `sslmode=prefer`, a TLS
    /// handshake that fails is tried again without TLS, as libpq does:
    /// `prefer` promises encryption only where it works, and a server whose
    /// certificate the connector refuses (or that closes the handshake)
    /// would otherwise be unreachable in a mode that accepts plaintext.
    pub(crate) async fn connect(&self, config: &Config) -> Result<(Client, Messages), Error> {
        use tokio_postgres::config::SslMode as Wire;
        match self.inner.connect(config).await {
            Err(e) if config.get_ssl_mode() == Wire::Prefer && handshake_failed(&e) => {
                tracing::debug!(error = %e, source = ?std::error::Error::source(&e), "TLS handshake failed with sslmode=prefer; connecting without TLS");
                let mut plain = config.clone();
                plain.ssl_mode(Wire::Disable);
                self.inner.connect(&plain).await
            }
            other => other,
        }
    }

    /// Cancels what runs on the connection `token` came from, over the same
    /// TLS as the connection itself.
    pub(crate) async fn cancel(&self, token: &CancelToken) -> Result<(), Error> {
        self.inner.cancel(token).await
    }
}

/// Whether connecting failed in the TLS handshake (tokio-postgres's
/// `Kind::Tls`, which it shows only through its text).
fn handshake_failed(e: &Error) -> bool {
    e.to_string() == "error performing TLS handshake"
}

/// Opens the pool's connections through a [`Connector`], each driven by a
/// task of its own until its client goes.
struct PoolConnect(Connector, Option<Arc<StartupSetting>>);

/// A setting each pooled connection asks the server for as it starts
/// (`options=-c name=value`), so that it is the session's own default: a
/// `RESET ALL` keeps it, and nothing has to set it again. Left out from
/// the first server that refuses it on (a pooler that does not pass
/// `options` through, as PgBouncer without `options` in its
/// `ignore_startup_parameters`): the connection is opened again without it,
/// and so is every later one.
#[derive(Debug)]
pub(crate) struct StartupSetting {
    option: String,
    refused: AtomicBool,
}

impl StartupSetting {
    /// `name` at `value` from the start of every session.
    pub(crate) fn new(name: &str, value: &str) -> Self {
        StartupSetting {
            option: format!("-c {name}={value}"),
            refused: AtomicBool::new(false),
        }
    }

    /// `config` asking for the setting too, unless a server refused it.
    fn apply(&self, config: &Config) -> Option<Config> {
        if self.refused.load(Ordering::Relaxed) {
            return None;
        }
        let mut with = config.clone();
        match config.get_options() {
            Some(options) if !options.is_empty() => {
                with.options(format!("{options} {}", self.option))
            }
            _ => with.options(self.option.as_str()),
        };
        Some(with)
    }
}

/// Whether connecting failed because the server (a pooler) does not take
/// the `options` startup parameter.
fn refuses_options(e: &Error) -> bool {
    e.as_db_error().is_some_and(|db| {
        let message = db.message().to_ascii_lowercase();
        message.contains("startup parameter") && message.contains("options")
    })
}

impl deadpool_postgres::Connect for PoolConnect {
    fn connect(
        &self,
        config: &Config,
    ) -> BoxFuture<'_, Result<(Client, tokio::task::JoinHandle<()>), Error>> {
        let config = config.clone();
        Box::pin(async move {
            let asked = self.1.as_deref().and_then(|s| Some((s, s.apply(&config)?)));
            let connected = match asked {
                Some((setting, with)) => match self.0.connect(&with).await {
                    Err(e) if refuses_options(&e) => {
                        setting.refused.store(true, Ordering::Relaxed);
                        tracing::info!(
                            error = %e,
                            "the server does not take startup options; connections set the hold limit with SET instead"
                        );
                        self.0.connect(&config).await
                    }
                    other => other,
                },
                None => self.0.connect(&config).await,
            };
            let (client, mut messages) = connected?;
            let driver = tokio::spawn(async move {
                // Notices are not the pool's business; an error ends the
                // connection, which its client reports on its next use.
                while let Some(message) = messages.next().await {
                    if let Err(e) = message {
                        tracing::debug!(error = %e, "pooled connection closed");
                        break;
                    }
                }
            });
            Ok((client, driver))
        })
    }
}

/// What tokio-postgres is told for `mode`: it knows only disable, prefer and
/// require, and the verification is the connector's.
fn wire(mode: SslMode) -> tokio_postgres::config::SslMode {
    use tokio_postgres::config::SslMode as Wire;
    match mode {
        SslMode::Disable => Wire::Disable,
        SslMode::Prefer => Wire::Prefer,
        SslMode::Require | SslMode::VerifyCa | SslMode::VerifyFull => Wire::Require,
    }
}

/// Cancels what runs on one connection, over the TLS it was opened with.
#[derive(Clone)]
pub(crate) struct Canceller {
    token: CancelToken,
    connector: Connector,
}

impl Canceller {
    pub(crate) fn new(token: CancelToken, connector: Connector) -> Self {
        Canceller { token, connector }
    }

    pub(crate) async fn cancel(&self) -> Result<(), Error> {
        self.connector.cancel(&self.token).await
    }
}

pub(super) fn config_error(message: String) -> StoreError {
    StoreError::new(
        StoreErrorKind::Backend,
        format!("invalid connection string: {message}"),
    )
}

#[cfg(feature = "tls-rustls")]
fn rustls_connector(mode: SslMode, params: &TlsParams) -> Result<Connector, StoreError> {
    let config = rustls_config::client_config(mode, params).map_err(config_error)?;
    Ok(Connector::new(
        tokio_postgres_rustls::MakeRustlsConnect::new(config),
        "rustls",
    ))
}

#[cfg(not(feature = "tls-rustls"))]
fn rustls_connector(mode: SslMode, params: &TlsParams) -> Result<Connector, StoreError> {
    // Without a TLS stack, `prefer` is what it always was here: plain.
    if mode == SslMode::Prefer && params.root.is_none() && params.client.is_none() {
        return Ok(Connector::new(NoTls, "no TLS"));
    }
    Err(config_error(format!(
        "sslmode={} needs TLS: build with the tls-rustls feature, or give a connector (PgStoreBuilder::tls)",
        mode.name()
    )))
}

#[cfg(feature = "tls-rustls")]
mod rustls_config {
    //! rustls's client configuration for each `sslmode`.

    use std::{path::Path, sync::Arc};

    use rustls::{
        client::{
            danger::{HandshakeSignatureValid, ServerCertVerified, ServerCertVerifier},
            WebPkiServerVerifier,
        },
        crypto::{ring, CryptoProvider, WebPkiSupportedAlgorithms},
        pki_types::{
            pem::PemObject, CertificateDer, PrivateKeyDer, ServerName, SubjectPublicKeyInfoDer,
            UnixTime,
        },
        CertificateError, ClientConfig, DigitallySignedStruct, RootCertStore, SignatureScheme,
    };

    use super::super::conninfo::{RootCert, SslMode, TlsParams};

    pub(super) fn client_config(mode: SslMode, params: &TlsParams) -> Result<ClientConfig, String> {
        // The process's default provider where the application installed
        // one (rustls's aws-lc-rs default, a FIPS build's), so that the
        // store's TLS is the application's; else ring, which this feature
        // builds in.
        let provider = CryptoProvider::get_default()
            .cloned()
            .unwrap_or_else(|| Arc::new(ring::default_provider()));
        let verifier: Arc<dyn ServerCertVerifier> = match (&params.root, mode) {
            (Some(root), _) => {
                let roots = Arc::new(root_store(root)?);
                let webpki = WebPkiServerVerifier::builder_with_provider(roots, provider.clone())
                    .build()
                    .map_err(|e| format!("cannot use the root certificates: {e}"))?;
                match mode {
                    SslMode::VerifyFull => webpki,
                    // libpq: with a root certificate, require (and prefer)
                    // check the chain as verify-ca does.
                    _ => Arc::new(ChainOnly(webpki)),
                }
            }
            // `effective_mode` refused verify-* without a root.
            (None, _) => Arc::new(Unverified(provider.clone())),
        };
        let builder = ClientConfig::builder_with_provider(provider)
            .with_safe_default_protocol_versions()
            .map_err(|e| format!("cannot configure TLS: {e}"))?
            .dangerous()
            .with_custom_certificate_verifier(verifier);
        let mut config = match &params.client {
            None => builder.with_no_client_auth(),
            Some((cert, key)) => {
                let chain = certificates(cert, "sslcert")?;
                let key = PrivateKeyDer::from_pem_file(key)
                    .map_err(|e| format!("cannot read sslkey {}: {e}", key.display()))?;
                builder.with_client_auth_cert(chain, key).map_err(|e| {
                    format!("sslcert and sslkey do not make a client certificate: {e}")
                })?
            }
        };
        // PostgreSQL 17 refuses a direct TLS connection
        // (`sslnegotiation=direct`) that does not name its protocol by
        // ALPN, as libpq 17 always does; older servers ignore it.
        config.alpn_protocols = vec![b"postgresql".to_vec()];
        Ok(config)
    }

    fn certificates(path: &Path, what: &str) -> Result<Vec<CertificateDer<'static>>, String> {
        let read =
            |e: &dyn std::fmt::Display| format!("cannot read {what} {}: {e}", path.display());
        let certs = CertificateDer::pem_file_iter(path)
            .map_err(|e| read(&e))?
            .collect::<Result<Vec<_>, _>>()
            .map_err(|e| read(&e))?;
        if certs.is_empty() {
            return Err(format!("{what} {} holds no certificate", path.display()));
        }
        Ok(certs)
    }

    fn root_store(root: &RootCert) -> Result<RootCertStore, String> {
        let mut store = RootCertStore::empty();
        match root {
            RootCert::File(path) => {
                for cert in certificates(path, "sslrootcert")? {
                    store
                        .add(cert)
                        .map_err(|e| format!("sslrootcert {}: {e}", path.display()))?;
                }
            }
            RootCert::System => {
                let found = rustls_native_certs::load_native_certs();
                let (added, _) = store.add_parsable_certificates(found.certs);
                if added == 0 {
                    return Err(format!(
                        "sslrootcert=system: no trusted root certificate found on this platform ({} errors)",
                        found.errors.len()
                    ));
                }
            }
        }
        Ok(store)
    }

    /// verify-ca: the chain must end at a trusted root; the name is not
    /// checked (webpki checks it last, after the chain).
    #[derive(Debug)]
    struct ChainOnly(Arc<WebPkiServerVerifier>);

    impl ServerCertVerifier for ChainOnly {
        fn verify_server_cert(
            &self,
            end_entity: &CertificateDer<'_>,
            intermediates: &[CertificateDer<'_>],
            server_name: &ServerName<'_>,
            ocsp_response: &[u8],
            now: UnixTime,
        ) -> Result<ServerCertVerified, rustls::Error> {
            match self.0.verify_server_cert(
                end_entity,
                intermediates,
                server_name,
                ocsp_response,
                now,
            ) {
                Err(rustls::Error::InvalidCertificate(
                    CertificateError::NotValidForName
                    | CertificateError::NotValidForNameContext { .. },
                )) => Ok(ServerCertVerified::assertion()),
                other => other,
            }
        }

        fn verify_tls12_signature(
            &self,
            message: &[u8],
            cert: &CertificateDer<'_>,
            dss: &DigitallySignedStruct,
        ) -> Result<HandshakeSignatureValid, rustls::Error> {
            self.0.verify_tls12_signature(message, cert, dss)
        }

        fn verify_tls13_signature(
            &self,
            message: &[u8],
            cert: &CertificateDer<'_>,
            dss: &DigitallySignedStruct,
        ) -> Result<HandshakeSignatureValid, rustls::Error> {
            self.0.verify_tls13_signature(message, cert, dss)
        }

        fn supported_verify_schemes(&self) -> Vec<SignatureScheme> {
            self.0.supported_verify_schemes()
        }
    }

    /// require (and prefer) without a root certificate: encrypted, the
    /// certificate not checked, as libpq does. The handshake's signatures
    /// are still verified against the key the certificate carries, so the
    /// peer holds that key. The key is read with a plain X.509 parser, not
    /// webpki's, which refuses version 1 certificates: the self-signed ones
    /// some servers make for themselves (Citus does, on every node).
    #[derive(Debug)]
    struct Unverified(Arc<CryptoProvider>);

    impl Unverified {
        fn algorithms(&self) -> &WebPkiSupportedAlgorithms {
            &self.0.signature_verification_algorithms
        }
    }

    /// The certificate's public key: its `SubjectPublicKeyInfo` (DER), and
    /// the algorithm identifier and key bits inside it.
    struct PublicKey {
        spki: Vec<u8>,
        algorithm: Vec<u8>,
        key: Vec<u8>,
    }

    fn public_key(cert: &CertificateDer<'_>) -> Result<PublicKey, rustls::Error> {
        use x509_cert::der::{Decode, Encode};
        let bad = |_| rustls::Error::InvalidCertificate(CertificateError::BadEncoding);
        let cert = x509_cert::Certificate::from_der(cert.as_ref()).map_err(bad)?;
        let info = &cert.tbs_certificate.subject_public_key_info;
        // webpki's algorithm ids are the identifier's contents (the OID,
        // then the parameters if any), without the SEQUENCE header.
        let mut algorithm = info.algorithm.oid.to_der().map_err(bad)?;
        if let Some(parameters) = &info.algorithm.parameters {
            algorithm.extend(parameters.to_der().map_err(bad)?);
        }
        Ok(PublicKey {
            spki: info.to_der().map_err(bad)?,
            algorithm,
            key: info.subject_public_key.raw_bytes().to_vec(),
        })
    }

    impl ServerCertVerifier for Unverified {
        fn verify_server_cert(
            &self,
            _: &CertificateDer<'_>,
            _: &[CertificateDer<'_>],
            _: &ServerName<'_>,
            _: &[u8],
            _: UnixTime,
        ) -> Result<ServerCertVerified, rustls::Error> {
            Ok(ServerCertVerified::assertion())
        }

        fn verify_tls12_signature(
            &self,
            message: &[u8],
            cert: &CertificateDer<'_>,
            dss: &DigitallySignedStruct,
        ) -> Result<HandshakeSignatureValid, rustls::Error> {
            // TLS 1.2's scheme names several algorithms: the one for this
            // key's algorithm decides.
            let key = public_key(cert)?;
            let alg = self
                .algorithms()
                .mapping
                .iter()
                .filter(|(scheme, _)| *scheme == dss.scheme)
                .flat_map(|(_, algs)| algs.iter())
                .find(|alg| alg.public_key_alg_id().as_ref() == key.algorithm.as_slice())
                .ok_or(rustls::Error::InvalidCertificate(
                    CertificateError::BadSignature,
                ))?;
            alg.verify_signature(&key.key, message, dss.signature())
                .map(|()| HandshakeSignatureValid::assertion())
                .map_err(|_| rustls::Error::InvalidCertificate(CertificateError::BadSignature))
        }

        fn verify_tls13_signature(
            &self,
            message: &[u8],
            cert: &CertificateDer<'_>,
            dss: &DigitallySignedStruct,
        ) -> Result<HandshakeSignatureValid, rustls::Error> {
            let key = public_key(cert)?;
            rustls::crypto::verify_tls13_signature_with_raw_key(
                message,
                &SubjectPublicKeyInfoDer::from(key.spki.as_slice()),
                dss,
                self.algorithms(),
            )
        }

        fn supported_verify_schemes(&self) -> Vec<SignatureScheme> {
            self.0.signature_verification_algorithms.supported_schemes()
        }
    }
}
