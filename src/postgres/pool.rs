//! The connection pool: [`PgStoreBuilder`] (its size, timeouts, TCP
//! keepalives and TLS), building the deadpool pool, and taking a [`Conn`]
//! from it.

use std::{
    str::FromStr,
    sync::atomic::{AtomicBool, Ordering},
    time::Duration,
};

use deadpool_postgres::{
    Hook, HookError, ManagerConfig, Pool, PoolError, RecyclingMethod, Runtime,
};
use tokio_postgres::{
    tls::{MakeTlsConnect, TlsConnect},
    SimpleQueryMessage, Socket,
};

use super::{
    conn::{Conn, SessionDefaults},
    conninfo::{self, SslMode, TlsParams},
    tls::{config_error, Connector, StartupSetting},
    PgStore,
};
use crate::{
    protocol::{
        session_reset::{check_hold_limit, hold_limit_value, set_hold_limit, HOLD_LIMIT_SETTING},
        transaction::READ_COMMITTED,
    },
    store::{StoreError, StoreErrorKind},
};

/// Builds a [`PgStore`] with pool and TLS settings.
#[derive(Debug, Clone)]
pub struct PgStoreBuilder {
    config: tokio_postgres::Config,
    tls_params: TlsParams,
    tls: Option<Connector>,
    pool: Option<Pool>,
    max_connections: usize,
    acquire_timeout: Duration,
    connect_timeout: Duration,
    keepalive_idle: Duration,
    transaction_pooling: bool,
    hold_limit: Duration,
    session_reset: SessionReset,
}

/// When the store resets a session it gives back to its pool
/// ([`PgStoreBuilder::session_reset`]).
///
/// The reset undoes what a request may have left on its connection's
/// session that would outlive it: settings a function changed with
/// `set_config(…, false)` (the hold limit among them), a role set with
/// `SET ROLE` or `SET SESSION AUTHORIZATION` inside a function, holdable
/// cursors, `LISTEN` registrations, session advisory locks and temporary
/// tables. [`PgTx`](super::PgTx) refuses the plain statements that change
/// the session (`SET`, `LISTEN`, `DECLARE … WITH HOLD`, …); only a
/// function the handler calls can do it behind the guard's back.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
#[non_exhaustive]
pub enum SessionReset {
    /// After every owner's transaction, committed or rolled back (the
    /// default).
    #[default]
    Always,
    /// Not after an owner's transaction that committed; still after a
    /// rollback, a failed statement or a failed commit. An assertion that
    /// the handlers' statements, and the functions they call, change no
    /// session state. If it is false, the next request on that connection
    /// inherits what was left: a changed setting (a `search_path` that
    /// makes its statements read other tables; a zero or larger
    /// `idle_in_transaction_session_timeout`, so that an owner whose
    /// process freezes holds its key past the hold limit), another role's
    /// privileges, a session advisory lock still held (the next request
    /// that takes it waits), a `LISTEN` (notifications queue on the
    /// session), a holdable cursor or a temporary table; a changed
    /// `default_transaction_isolation` even changes the level of the next
    /// owner's transaction, which begins with a plain `BEGIN` where the
    /// store checked its sessions' default. Saves the reset's
    /// work on every committed request: about 40,000 of PostgreSQL's
    /// instructions a create (`benches/pg_instructions.rs`).
    TrustedHandlers,
}

impl PgStoreBuilder {
    /// The defaults documented on each setting.
    pub(super) fn new(config: tokio_postgres::Config) -> Self {
        use tokio_postgres::config::SslMode as Wire;
        let mode = match config.get_ssl_mode() {
            Wire::Disable => SslMode::Disable,
            Wire::Require => SslMode::Require,
            _ => SslMode::Prefer,
        };
        PgStoreBuilder {
            config,
            tls_params: TlsParams {
                mode: Some(mode),
                ..TlsParams::default()
            },
            tls: None,
            pool: None,
            max_connections: 16,
            acquire_timeout: Duration::from_secs(5),
            connect_timeout: Duration::from_secs(5),
            keepalive_idle: Duration::from_secs(15),
            transaction_pooling: false,
            hold_limit: crate::store::limits::DEFAULT_HOLD_LIMIT,
            session_reset: SessionReset::Always,
        }
    }

    /// When the session of a connection that served an owner's
    /// transaction is reset: after every one ([`SessionReset::Always`], the
    /// default), or only after those that did not commit
    /// ([`SessionReset::TrustedHandlers`], which says exactly what may leak
    /// when its assertion is false). Behind a transaction pooler
    /// ([`transaction_pooling`](Self::transaction_pooling)) the store sends
    /// no reset either way: the session is the pooler's.
    pub fn session_reset(mut self, reset: SessionReset) -> Self {
        self.session_reset = reset;
        self
    }

    /// A builder for a connection string, a `postgres://` URL or libpq's
    /// `key=value` pairs, including libpq's TLS parameters, which have
    /// libpq's meaning:
    ///
    /// | parameter | meaning |
    /// | --- | --- |
    /// | `sslmode=disable` | no TLS |
    /// | `sslmode=prefer` (the default) | TLS if the server offers it, plain if it does not or if the handshake fails (as libpq) |
    /// | `sslmode=require` | TLS or no connection; the certificate is not checked, unless `sslrootcert` is given (then as `verify-ca`) |
    /// | `sslmode=verify-ca` | TLS, the certificate must chain to `sslrootcert` |
    /// | `sslmode=verify-full` | as `verify-ca`, and the certificate must name the host connected to (a DNS name or an IP address in its subject alternative names) |
    /// | `sslrootcert=FILE` | trusted CA certificates (PEM) |
    /// | `sslrootcert=system` | the platform's trusted roots; implies `verify-full` and refuses a weaker `sslmode`, as libpq 16 does |
    /// | `sslcert=FILE`, `sslkey=FILE` | a client certificate (PEM chain) and its private key, for `hostssl … cert` authentication |
    ///
    /// `verify-ca` and `verify-full` without `sslrootcert` are refused by
    /// [`build`](Self::build), unless a connector of your own
    /// ([`tls`](Self::tls)) does the verifying
    /// (libpq would look for `~/.postgresql/root.crt`; nothing is read from
    /// the home directory or from `PGSSL*` variables). `sslmode=allow` is
    /// refused. A certificate that does not verify fails the connection, with
    /// the reason ("invalid peer certificate: UnknownIssuer", "… certificate
    /// not valid for name …"); nothing falls back to a connection the `sslmode`
    /// excludes. Over Unix sockets only (every host a socket), which carry
    /// no TLS, `prefer` and `require` connect without it and `verify-*` are
    /// refused; `hostaddr`
    /// without `host` serves as the TLS name below `verify-full`, which needs
    /// `host`. TLS is rustls with ring (feature `tls-rustls`, on by default),
    /// which offers ALPN `postgresql` (`sslnegotiation=direct` works, with
    /// `require` or stronger) and is
    /// stricter than OpenSSL in what it verifies (no version 1 or SHA-1
    /// certificates, names from the subject alternative names only): see the
    /// [deploying guide](crate::guide::deploying). [`tls`](Self::tls)
    /// replaces it with a connector of your own.
    ///
    /// ```
    /// use tower_idempotency::postgres::PgStoreBuilder;
    ///
    /// let builder = PgStoreBuilder::from_conninfo(
    ///     "postgres://app@db.internal:5432/app?sslmode=require",
    /// )?;
    /// # Ok::<(), tower_idempotency::store::StoreError>(())
    /// ```
    pub fn from_conninfo(conninfo: &str) -> Result<Self, StoreError> {
        let (rest, tls_params) = conninfo::split(conninfo).map_err(config_error)?;
        let config = tokio_postgres::Config::from_str(&rest).map_err(|e| {
            StoreError::new(StoreErrorKind::Backend, "invalid connection string").with_source(e)
        })?;
        Ok(PgStoreBuilder {
            tls_params,
            ..PgStoreBuilder::new(config)
        })
    }

    /// Connects with your own TLS connector instead of the one the
    /// connection string asks for: `tokio_postgres_rustls`, `postgres-native-tls`
    /// or `postgres-openssl` configured as your service needs it. It opens the
    /// pool's connections, the outbox relay's `LISTEN` connection and the
    /// cancel requests of timed-out handlers.
    ///
    /// The connection string's `sslmode` still decides whether TLS is
    /// required: `disable` connects in plaintext, `prefer` uses TLS when the
    /// server offers it, and `require`, `verify-ca` and `verify-full` use TLS
    /// or do not connect ("server does not support TLS"), never plaintext.
    /// Verifying the certificate is the connector's job: a connection string
    /// that also names `sslrootcert`, `sslcert` or `sslkey` is refused by
    /// [`build`](Self::build), since a connector of your own does not read
    /// them (configure them on the connector instead).
    pub fn tls<T>(self, tls: T) -> Self
    where
        T: MakeTlsConnect<Socket> + Clone + Send + Sync + 'static,
        T::Stream: Send + Sync + 'static,
        T::TlsConnect: Send + Sync,
        <T::TlsConnect as TlsConnect<Socket>>::Future: Send,
    {
        crate::setter::with(self, |b| {
            b.tls = Some(Connector::new(tls, "a caller's connector"))
        })
    }

    /// Serves the store from a pool you built (with IAM tokens, rotated
    /// passwords or a `deadpool_postgres::Manager` of your own) instead of
    /// one the builder opens. The pool's size and timeouts are then the
    /// pool's: [`max_connections`](Self::max_connections),
    /// [`acquire_timeout`](Self::acquire_timeout),
    /// [`connect_timeout`](Self::connect_timeout) and
    /// [`keepalive_idle`](Self::keepalive_idle) do not apply. The builder's
    /// configuration and connector still open what the store opens outside
    /// the pool (the relay's `LISTEN` connection, cancel requests): give it the
    /// same host and TLS as the pool, with [`tls`](Self::tls) if the pool
    /// uses a connector of its own. Every connection a store hands back
    /// goes back to your pool rolled back and reset, as with its own.
    pub fn pool(self, pool: Pool) -> Self {
        crate::setter::with(self, |b| b.pool = Some(pool))
    }

    /// The most connections the store's pool opens (default 16). Requests
    /// beyond it wait up to the acquire timeout.
    pub fn max_connections(self, n: usize) -> Self {
        crate::setter::with(self, |b| b.max_connections = n.max(1))
    }

    /// How long a request waits for a pooled connection before the layer
    /// answers `503 store_unavailable` (default 5 s).
    pub fn acquire_timeout(self, timeout: Duration) -> Self {
        crate::setter::with(self, |b| b.acquire_timeout = timeout)
    }

    /// How long opening a new connection may take (default 5 s).
    pub fn connect_timeout(self, timeout: Duration) -> Self {
        crate::setter::with(self, |b| b.connect_timeout = timeout)
    }

    /// How long a pooled connection may be silent before TCP keepalive
    /// probes check that the server is still there (default 15 s; probes
    /// every 5 s, 3 of them). A database host that vanished without closing
    /// its sockets is then noticed in about 30 s instead of hours, and a
    /// request waiting on it gets an error instead of hanging. The same
    /// bound applies to data sent and not acknowledged (the TCP user
    /// timeout, `tcp_user_timeout`, set to this plus 15 s): a connection
    /// whose statement crossed into a network partition is given up by the
    /// kernel then, not after its retransmissions run out (many minutes).
    /// A request never waits that long anyway: the layer keeps deadlines of
    /// its own on every round trip and closes a connection that missed one.
    /// Replaces the connection configuration's keepalive settings; no effect
    /// on Unix sockets.
    pub fn keepalive_idle(self, idle: Duration) -> Self {
        crate::setter::with(self, |b| b.keepalive_idle = idle)
    }

    /// The connection string names a pooler in transaction pooling mode
    /// (PgBouncer's `pool_mode = transaction`; RDS Proxy, Supavisor and PgCat
    /// behave alike): the server connection behind a pooled connection may
    /// change after every transaction, and after every statement outside
    /// one. Default `false` (PostgreSQL reached directly, or through a pooler
    /// in session mode).
    ///
    /// With `true`, nothing the store does relies on the server connection
    /// outliving a transaction:
    ///
    /// - the store's own statements go out unnamed, with their parameter
    ///   types given, in one round trip each (Parse, Bind, Execute and Sync
    ///   in one message: tokio-postgres `query_typed`), instead of prepared
    ///   once per connection and cached; the server plans them each time;
    /// - [`PgTx`](super::PgTx)'s statements are prepared for their one use
    ///   and closed inside the transaction, which costs a round trip each
    ///   ([`PgTx::query_typed`](super::PgTx::query_typed) saves it);
    /// - no session reset is sent after a transaction: it would run on
    ///   whichever server connection the pooler picks next (settings a
    ///   handler's function changed with `set_config(…, false)` are the
    ///   pooler's to reset: PgBouncer's `server_reset_query_always`);
    /// - the outbox [`Relay`](crate::outbox::Relay) does not `LISTEN`: it
    ///   polls.
    ///
    /// Application statements on [`PgStore::client`] must follow the same
    /// rule: inside an explicit transaction anything goes; outside one, use
    /// `query_typed`/`execute_typed` or `simple_query`, never a prepared or
    /// cached statement. Migrations work through the pooler (they hold a
    /// transaction-scoped advisory lock). See the
    /// [deploying guide](crate::guide::deploying) for the pooler's settings.
    pub fn transaction_pooling(self, on: bool) -> Self {
        crate::setter::with(self, |b| b.transaction_pooling = on)
    }

    /// The idle limit the store's connections carry in their sessions
    /// (`idle_in_transaction_session_timeout`); default 35 s, the hold
    /// limit of an endpoint with the default handler timeout (30 s) plus
    /// the layer's 5 s margin.
    ///
    /// Every owner's transaction has a hold limit (its endpoint's handler
    /// timeout plus 5 s): should the process freeze while it holds the
    /// transaction open, the server ends it after that long idle. An owner
    /// whose hold limit is the session's sends nothing for it; any other
    /// sends a `SET LOCAL` with its first statement, one statement more a
    /// request. Set this to `handler_timeout + 5 s` of your busiest
    /// endpoint when you change its handler timeout.
    ///
    /// Every connection the store opens asks for it as it starts (the
    /// `options` startup parameter), so that it is the session's own
    /// default: the session reset (behind every owner's `COMMIT` or
    /// `ROLLBACK`, and on every [`PooledClient`](super::PooledClient) given
    /// back) puts it back with `RESET ALL`, whatever a handler's function
    /// did to it, without setting it again. The store checks, as each
    /// connection opens, that the session has it; where the server refuses
    /// startup options or drops them (a session-mode PgBouncer without
    /// `options` in `ignore_startup_parameters`), the connection is opened
    /// again without them and the limit is set with `SET`, on that
    /// connection and every later one, and the session reset sets it again
    /// each time. It applies to the
    /// application's transactions on [`PgStore::client`] too. Not with a pool
    /// of your own ([`pool`](Self::pool)) nor with
    /// [`transaction_pooling`](Self::transaction_pooling) (the session is the
    /// pooler's): then every owner sends its `SET LOCAL`.
    pub fn hold_limit(self, limit: Duration) -> Self {
        crate::setter::with(self, |b| b.hold_limit = limit)
    }

    /// Creates the store; connections are opened lazily. Fails on a TLS
    /// setting that cannot work (a root certificate file that cannot be
    /// read, `verify-full` without one, TLS asked for in a build without
    /// `tls-rustls` and no connector given, `sslrootcert`, `sslcert` or
    /// `sslkey` in the connection string beside a connector of your own).
    pub fn build(mut self) -> Result<PgStore, StoreError> {
        self.config
            .connect_timeout(self.connect_timeout)
            .keepalives(true)
            .keepalives_idle(self.keepalive_idle)
            .keepalives_interval(Duration::from_secs(5))
            .keepalives_retries(3)
            .tcp_user_timeout(self.keepalive_idle.saturating_add(Duration::from_secs(15)));
        // The wire mode always follows the parsed `sslmode`, whoever makes
        // the TLS: a caller's connector left with tokio-postgres's default
        // (`prefer`) would fall back to plaintext, and send a cleartext
        // password, to a server (or anyone on the path) that answers "no TLS".
        // With a connector of the caller's, verifying is the connector's:
        // `verify-*` need no `sslrootcert` of ours (and may not name one).
        let mode = match self.tls {
            Some(_) => Ok(self.tls_params.mode.unwrap_or(SslMode::Prefer)),
            None => self.tls_params.effective_mode(),
        }
        .map_err(config_error)?;
        let mode = conninfo::settle_hosts(&mut self.config, mode).map_err(config_error)?;
        // As libpq: a direct TLS connection cannot fall back to plain text,
        // so `prefer` (which would) is refused with it.
        if mode == SslMode::Prefer
            && self.config.get_ssl_negotiation() == tokio_postgres::config::SslNegotiation::Direct
        {
            return Err(config_error(
                "sslnegotiation=direct needs sslmode=require, verify-ca or verify-full \
                 (prefer could fall back to plain text)"
                    .into(),
            ));
        }
        let (connector, wire) = match self.tls {
            Some(tls) => (tls, Connector::wire_mode_for_own(&self.tls_params, mode)?),
            None => Connector::from_params(&self.tls_params, mode)?,
        };
        self.config.ssl_mode(wire);
        let config = std::sync::Arc::new(self.config.clone());
        // Checked on every connection the store opens (below); a pool of the
        // application's, or a pooler's server connections, are not.
        let read_committed = std::sync::Arc::new(AtomicBool::new(
            self.pool.is_none() && !self.transaction_pooling,
        ));
        // The sessions carry the hold limit only where the store opens them
        // itself and owns them (not behind a transaction pooler).
        let hold_limit =
            (self.pool.is_none() && !self.transaction_pooling).then_some(self.hold_limit);
        // Each connection asks for the hold limit as it starts, so that it
        // is the session's own default and the session reset has no
        // setting to restore (a pooler that refuses startup options gets
        // today's SET instead, and so do the connections after it).
        // Whether every connection so far has it from its start: checked as
        // each opens.
        let startup = hold_limit.map(|limit| {
            std::sync::Arc::new(StartupSetting::new(
                HOLD_LIMIT_SETTING,
                &hold_limit_value(limit),
            ))
        });
        let at_startup = std::sync::Arc::new(AtomicBool::new(hold_limit.is_some()));
        let pool = match self.pool {
            Some(pool) => pool,
            None => {
                let manager = connector.manager(
                    self.config,
                    ManagerConfig {
                        recycling_method: RecyclingMethod::Fast,
                    },
                    startup,
                );
                let mut pool = Pool::builder(manager);
                if self.transaction_pooling {
                    pool = pool.post_create(Hook::async_fn(|client, _| {
                        Box::pin(async move {
                            super::types::load_types(client)
                                .await
                                .map_err(HookError::Backend)
                        })
                    }));
                }
                if let Some(limit) = hold_limit {
                    // Whether the session has the hold limit from its start,
                    // and its default level, in one round trip as the
                    // connection opens; the limit set where it was not
                    // taken at startup (a second round trip, then only).
                    let check: std::sync::Arc<str> = check_hold_limit(limit).into();
                    let set: std::sync::Arc<str> = set_hold_limit(limit).into();
                    let read_committed = read_committed.clone();
                    let at_startup = at_startup.clone();
                    pool = pool.post_create(Hook::async_fn(move |client, _| {
                        let (check, set) = (check.clone(), set.clone());
                        let read_committed = read_committed.clone();
                        let at_startup = at_startup.clone();
                        Box::pin(async move {
                            let messages = client
                                .simple_query(&check)
                                .await
                                .map_err(HookError::Backend)?;
                            let row = messages.iter().find_map(|m| match m {
                                SimpleQueryMessage::Row(row) => {
                                    Some((row.get(0) == Some("t"), row.get(1).map(str::to_owned)))
                                }
                                _ => None,
                            });
                            let (has_limit, level) = row.unwrap_or((false, None));
                            if !has_limit {
                                // From now on every session reset sets it.
                                at_startup.store(false, Ordering::Relaxed);
                                client
                                    .simple_query(&set)
                                    .await
                                    .map_err(HookError::Backend)?;
                            }
                            if level.as_deref() != Some(READ_COMMITTED) {
                                // From now on every transaction names its level.
                                read_committed.store(false, Ordering::Relaxed);
                            }
                            Ok(())
                        })
                    }));
                }
                pool.max_size(self.max_connections)
                    .runtime(Runtime::Tokio1)
                    .wait_timeout(Some(self.acquire_timeout))
                    .create_timeout(Some(self.connect_timeout))
                    .recycle_timeout(Some(self.connect_timeout))
                    .build()
                    .map_err(|e| {
                        StoreError::new(StoreErrorKind::Backend, "cannot build the connection pool")
                            .with_source(e)
                    })?
            }
        };
        let session = SessionDefaults::new(
            hold_limit,
            config.get_user(),
            self.session_reset,
            read_committed,
            at_startup,
        );
        Ok(PgStore {
            pool,
            config,
            connector,
            transaction_pooling: self.transaction_pooling,
            citus: Default::default(),
            session,
        })
    }
}

impl PgStore {
    /// A pooled connection, waiting up to the acquire timeout.
    pub(super) async fn conn(&self) -> Result<Conn, StoreError> {
        let pooling = self.transaction_pooling;
        self.pool
            .get()
            .await
            .map(|o| {
                Conn::new(
                    o,
                    pooling,
                    self.connector.clone(),
                    self.pool.clone(),
                    self.session.clone(),
                    self.on_citus(),
                )
            })
            .map_err(|e| {
                let message = match &e {
                    PoolError::Timeout(_) => "timed out waiting for a pooled connection",
                    PoolError::Closed => "the connection pool is closed",
                    _ => "cannot open a database connection",
                };
                StoreError::new(StoreErrorKind::Unavailable, message).with_source(e)
            })
    }
}

impl FromStr for PgStoreBuilder {
    type Err = StoreError;

    /// [`PgStoreBuilder::from_conninfo`].
    fn from_str(conninfo: &str) -> Result<Self, StoreError> {
        PgStoreBuilder::from_conninfo(conninfo)
    }
}
