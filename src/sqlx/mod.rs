//! [`SqlxStore`]: the store on a [`sqlx::PgPool`] (feature `sqlx`).
//!
//! Most Rust web services on PostgreSQL already hold a `sqlx::PgPool`.
//! With this store the layer claims keys on that pool, and the handler
//! writes its rows through the claim's own `sqlx` transaction, which it
//! finds in the request extensions as a [`SqlxTx`]: the rows and the
//! remembered response commit together, or not at all.
//!
//! ```no_run
//! use axum::{routing::post, Router};
//! use tower_idempotency::{
//!     fingerprint::JsonFingerprinter,
//!     sqlx::{SqlxStore, SqlxTx},
//!     IdempotencyLayer,
//! };
//!
//! // With the `axum` feature `SqlxTx` is an extractor; without it, take
//! // `Extension<SqlxTx>` (or read the request extensions in any service).
//! async fn create_order(tx: SqlxTx) -> Result<String, String> {
//!     let mut conn = tx.conn().await.map_err(|e| e.to_string())?;
//!     let (id,): (i64,) =
//!         sqlx::query_as("INSERT INTO orders (tenant_id) VALUES ($1) RETURNING id")
//!             .bind(tx.tenant())
//!             .fetch_one(&mut *conn)
//!             .await
//!             .map_err(|e| e.to_string())?;
//!     Ok(id.to_string())
//! }
//!
//! # async fn run() -> Result<(), Box<dyn std::error::Error>> {
//! let pool = sqlx::PgPool::connect("postgres://app@localhost/app").await?;
//! let store = SqlxStore::new(pool);
//! store.migrate().await?; // the same schema as PgStore's
//! let layer = IdempotencyLayer::new(store, "POST /orders v1", JsonFingerprinter::new("orders.v1"));
//! let app: Router = Router::new().route("/orders", post(create_order).layer(layer));
//! // Your auth layer, outside this one, inserts a `tower_idempotency::scope::TenantId`.
//! # Ok(()) }
//! ```
//!
//! # How it keeps the [`Store`](crate::store::Store) guarantees
//!
//! It uses the table and migrations of [`PgStore`](crate::postgres::PgStore)
//! (either store's `migrate` brings a database to the same schema, and
//! records written by one replay through the other), and sends the same
//! statements, written once for both stores, one at a time:
//!
//! 1. **One owner.** A claim begins a transaction and inserts the key's row
//!    (`INSERT … ON CONFLICT DO NOTHING`, which otherwise returns the record
//!    that holds the key): the primary key decides, never a read before the
//!    insert. The row stays uncommitted, and so locked, for as long as the
//!    owner works.
//! 2. **Atomic completion.** The handler's statements run in that same
//!    transaction; `complete` updates the row with the response (only if
//!    the claim's token, state and transaction id still match: otherwise
//!    the statement fails and nothing commits) and commits.
//! 3. **Abort frees the key.** `abort` rolls back, and with it the row; so
//!    does dropping every clone of the [`SqlxTx`] (its connection is closed
//!    instead of going back to the pool, and PostgreSQL rolls back).
//! 4. **Bounded waiting.** `SET LOCAL lock_timeout` to the claim's wait: a
//!    claim that meets an owner's row waits at most that long (`55P03`),
//!    then answers [`Claim::InProgress`](crate::store::Claim::InProgress);
//!    the whole claim is also cut off on the client shortly after.
//! 5. **Expiry.** A record whose retention ended (or a committed
//!    in-progress row no transaction holds) is taken over by a second
//!    `INSERT … ON CONFLICT DO UPDATE … WHERE expired` in the claim's
//!    transaction, under a new attempt token.
//!
//! What it has and lacks beside `PgStore` is one table in the [custom
//! stores guide](crate::guide::custom_stores).
//!
//! `tests/stores/sqlx_store.rs` runs the [conformance
//! suite](crate::testing::conformance) against it on a real PostgreSQL.
//!
//! # Long-running operations
//!
//! `SqlxStore` implements [`LeaseStore`](crate::store::LeaseStore) with
//! the statements of `PgStore`'s lease protocol: an operation's record is
//! committed `in_progress` with a lease and an attempt token, the handler
//! finds a [`SqlxLease`] in its request extensions, writes through fenced
//! transactions ([`SqlxLease::transaction`], holding the record `FOR SHARE`
//! at its token until [`SqlxLease::commit`]), and the layer stores the
//! answer by a compare-and-swap on the token. Both stores can serve the same
//! table. `tests/stores/sqlx_store.rs` runs the lease conformance suite against it.
//!
//! # Compared with `PgStore`
//!
//! `PgStore` pipelines the claim behind `BEGIN`, and the `COMMIT` and the
//! session reset behind the response (two round trips per created
//! resource, where this store takes five: `BEGIN` with its waits,
//! the claim, the completion, the `COMMIT` and the reset). Both guard the handler's
//! connection alike: statements that would end the transaction or change
//! the pooled session are refused ([`GuardedConnection`]), and the session
//! is reset before the connection serves anyone else. Both cancel a statement the handler left running when the layer rolls
//! its transaction back (this store by `pg_cancel_backend` after half a
//! second). This store's worth is the pool and the transaction type your
//! code already uses.
//!
//! Behind a pooler in transaction pooling mode (PgBouncer), build it with
//! [`SqlxStore::transaction_pooling`] and give your own statements
//! `.persistent(false)`; see the [deploying guide](crate::guide::deploying).
//!
//! # TLS
//!
//! The pool is yours, and so is its TLS: sqlx reads libpq's `sslmode`,
//! `sslrootcert`, `sslcert` and `sslkey` from the URL, once sqlx is built
//! with a TLS feature: turn on `tls-rustls` or `tls-native-tls` in your own
//! `sqlx` dependency (this crate's `tls-rustls` is `PgStore`'s only).
//! For a managed database use `sslmode=verify-full` with the provider's
//! root certificate; without `sslrootcert` sqlx trusts the webpki roots
//! (sqlx has no `sslrootcert=system`). A certificate that does not verify
//! fails `PgPool::connect` with the reason.
//!
//! ```no_run
//! # async fn run() -> Result<(), Box<dyn std::error::Error>> {
//! let pool = sqlx::PgPool::connect(
//!     "postgres://app@db.example.com/app?sslmode=verify-full&sslrootcert=/etc/ssl/db-ca.pem",
//! )
//! .await?;
//! let store = tower_idempotency::sqlx::SqlxStore::new(pool);
//! # Ok(()) }
//! ```

use std::fmt;

use ::sqlx::PgPool;

use crate::store::StoreError;

mod conn;
mod driver;
mod error;
mod lease;
mod tx;
mod types;

pub use conn::GuardedConnection;
pub use lease::SqlxLease;
pub use tx::{SqlxConn, SqlxTx};
pub use types::load_types;

/// The [`Store`](crate::store::Store) on a `sqlx` PostgreSQL pool.
///
/// Cheap to clone (a pool handle). Run [`migrate`](Self::migrate) once at
/// start-up (safe from many processes at once). The pool's acquire timeout
/// bounds how long a claim waits for a connection; each owner holds one
/// connection until its request completes, so size the pool for the
/// requests in flight.
#[derive(Clone)]
pub struct SqlxStore {
    pool: PgPool,
    transaction_pooling: bool,
}

impl fmt::Debug for SqlxStore {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("SqlxStore")
            .field("connections", &self.pool.size())
            .field("idle", &self.pool.num_idle())
            .field("transaction_pooling", &self.transaction_pooling)
            .finish()
    }
}

impl SqlxStore {
    /// A store on `pool`.
    pub fn new(pool: PgPool) -> Self {
        SqlxStore {
            pool,
            transaction_pooling: false,
        }
    }

    /// The pool reaches PostgreSQL through a pooler in transaction pooling
    /// mode (PgBouncer's `pool_mode = transaction`, RDS Proxy, Supavisor,
    /// PgCat). Default `false`.
    ///
    /// With `true`, every statement of the store is sent unnamed
    /// (`persistent(false)`: nothing is left prepared on the server
    /// connection) and inside a transaction (sqlx prepares even an unnamed
    /// statement in a round trip of its own, which outside a transaction the
    /// pooler may send to another server connection than the execution);
    /// no session reset is sent after a transaction (it would reach another
    /// server connection). Reads that ran on the pool run in a transaction
    /// of their own, which costs two round trips more.
    ///
    /// The handler's own statements through [`SqlxTx::conn`] run inside the
    /// claim's transaction; give each `.persistent(false)` (a persistent
    /// statement stays on the pooler's server connection, where another
    /// client's statement of the same name then fails), whatever the
    /// pool's statement cache. See the
    /// [deploying guide](crate::guide::deploying).
    pub fn transaction_pooling(self, on: bool) -> Self {
        crate::setter::with(self, |s| s.transaction_pooling = on)
    }

    /// Whether the store sends its statements for a transaction pooler
    /// ([`transaction_pooling`](Self::transaction_pooling)); the same as
    /// [`PgStore::uses_transaction_pooling`](crate::postgres::PgStore::uses_transaction_pooling).
    pub fn uses_transaction_pooling(&self) -> bool {
        self.transaction_pooling
    }

    /// The pool, e.g. for the service's own queries outside the layer.
    pub fn pool(&self) -> &PgPool {
        &self.pool
    }

    /// Creates or upgrades the schema (the same migrations as
    /// [`PgStore::migrate`](crate::postgres::PgStore::migrate), recorded in
    /// the same table). Safe from many processes at once, and on a table
    /// under load: each migration runs in a transaction of its own that
    /// waits for a table lock at most briefly, then backs off and tries
    /// again; see the [migration guide](crate::guide::migrations).
    ///
    /// [`StoreErrorKind::Schema`](crate::store::StoreErrorKind::Schema) if
    /// the database has a newer schema than this build knows, or a
    /// development schema from before the first release;
    /// [`StoreErrorKind::Unavailable`](crate::store::StoreErrorKind::Unavailable)
    /// if a migration could not get its locks.
    pub async fn migrate(&self) -> Result<(), StoreError> {
        crate::protocol::migrations::migrate(self).await.map(drop)
    }

    /// On a Citus coordinator, distributes the application's `tables` by
    /// `tenant_id`, co-located with the crate's own; `false`, having done
    /// nothing, without Citus. As
    /// [`PgStore::distribute_by_tenant`](crate::postgres::PgStore::distribute_by_tenant).
    pub async fn distribute_by_tenant(&self, tables: &[&str]) -> Result<bool, StoreError> {
        crate::protocol::citus::distribute_on(self, tables).await
    }
}

crate::protocol::forward_store!(SqlxStore, SqlxTx);

// Long-running operations; see [`lease`](crate::lease) and [`SqlxLease`].
crate::protocol::forward_lease_store!(SqlxStore, SqlxLease, SqlxTx);
