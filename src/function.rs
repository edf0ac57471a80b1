//! Idempotent functions: the layer's guarantees for work that is not an
//! HTTP request (a queue consumer, a webhook processor, a scheduled job).
//!
//! [`Idempotent::run`] runs a piece of work once per (tenant, name, key):
//! it claims the key in the store, hands the work the store's transaction
//! handle (for [`PgStore`](crate::postgres::PgStore), a
//! [`PgTx`](crate::postgres::PgTx) to write its rows through), and commits
//! the work's rows together with its result (serialised as JSON) in one
//! transaction. A later call with the same key gets the remembered result
//! back without running the work; a call with the same key and another
//! input is refused ([`RunError::KeyReused`]); a call while another holds
//! the key waits for it, at most the wait, and then gets its result. Work
//! that fails, panics or is dropped rolls its writes back and frees the
//! key.
//!
//! The work has the layer's bounds: it may take at most its
//! [`work_timeout`](Idempotent::work_timeout) (default 30 s, as the
//! layer's handler timeout), past which it is dropped, a statement it left
//! running is cancelled, its writes roll back, the key is freed and `run`
//! returns [`RunError::TimedOut`]; the database ends the transaction of an
//! owner whose process froze 5 s after that; and the result is remembered
//! for at least that long from the claim
//! ([`effective_retention`](Idempotent::effective_retention)), so that a
//! work that commits late is not run again.
//!
//! ```rust,no_run
//! # use tower_idempotency::{function::Idempotent, postgres::{PgStore, PgTx}, scope::TenantId};
//! # #[derive(serde::Serialize)] struct OrderPaid { order_id: String, amount: i64 }
//! # async fn consume(store: PgStore, event: OrderPaid, message_id: &str) -> Result<(), Box<dyn std::error::Error>> {
//! let consume = Idempotent::new(store, "consume OrderPaid v1");
//! let event = &event;
//! let receipt: String = consume
//!     .run(&TenantId::new("tenant-a"), message_id, event, |tx: PgTx| async move {
//!         tx.execute(
//!             "UPDATE orders SET status = 'paid' WHERE tenant_id = $1 AND id = $2::text::uuid",
//!             &[&tx.tenant(), &event.order_id],
//!         )
//!         .await?;
//!         Ok::<_, tower_idempotency::postgres::TxError>(format!("paid {}", event.amount))
//!     })
//!     .await?;
//! # let _ = receipt; Ok(()) }
//! ```

use std::{
    fmt,
    future::Future,
    sync::{
        atomic::{AtomicBool, Ordering},
        Arc,
    },
    time::Duration,
};

use bytes::Bytes;
use http::{HeaderMap, StatusCode};
use serde::{de::DeserializeOwned, Serialize};

use crate::{
    fingerprint::{canonical_json, Fingerprint},
    key::{IdempotencyKey, KeyError},
    record::StoredResponse,
    scope::{Scope, TenantId},
    server::deadline::{self, Deadlines},
    store::{Claim, ClaimRequest, Store, StoreError, MAX_RETENTION, MAX_WAIT},
};

// The work's timeout unless it sets one, and how long past it the database
// itself ends the owner's transaction when it went silent (its process
// frozen, its network gone): the HTTP layer's, so that a function and an
// endpoint on one store are bounded alike, and an owner with the default
// timeout sends no `SET LOCAL` of its own (the hold limit `PgStore`'s
// sessions carry by default is the same sum).
use crate::store::limits::{DEFAULT_HANDLER_TIMEOUT as DEFAULT_WORK_TIMEOUT, HOLD_MARGIN};

/// Runs work once per key; see the [module](self) docs.
#[derive(Clone)]
pub struct Idempotent<St> {
    store: St,
    name: Arc<str>,
    retention: Duration,
    wait: Duration,
    work_timeout: Duration,
    // Whether the raise of the configured retention was logged: once per
    // configuration (a setter starts a new one), shared by its clones, so
    // that a consumer calling `run` per message does not log per message.
    raise_logged: Arc<AtomicBool>,
}

impl<St> fmt::Debug for Idempotent<St> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("Idempotent")
            .field("name", &self.name)
            .field("retention", &self.retention)
            .field("wait", &self.wait)
            .field("work_timeout", &self.work_timeout)
            .field("effective_retention", &self.effective_retention())
            .finish()
    }
}

/// Why [`Idempotent::run`] gave no result.
#[derive(Debug)]
#[non_exhaustive]
pub enum RunError<E> {
    /// The work failed: its writes were rolled back and the key is free,
    /// so a later call runs it again.
    Work(E),
    /// The key was used before with another input; nothing ran.
    KeyReused,
    /// Another call held the key for the whole wait; call again later.
    InProgress,
    /// The key is not a valid idempotency key.
    InvalidKey(KeyError),
    /// The input or the result could not be serialised, or a remembered
    /// result read back as the result type.
    Serde(serde_json::Error),
    /// The store failed. When it failed at the commit, the outcome may be
    /// unknown to this call: call again with the same key, which returns
    /// the result if the work committed and runs it if it did not.
    Store(StoreError),
    /// The work did not finish within its
    /// [`work_timeout`](Idempotent::work_timeout) (carried here): it was
    /// dropped, a statement it left running was cancelled, its writes were
    /// rolled back and the key is free, so a later call runs it again.
    TimedOut(Duration),
}

impl<E: fmt::Display> fmt::Display for RunError<E> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            RunError::Work(e) => write!(f, "the work failed and was rolled back: {e}"),
            RunError::KeyReused => f.write_str("the key was used before with another input"),
            RunError::InProgress => f.write_str("another call still holds the key"),
            RunError::InvalidKey(e) => write!(f, "invalid idempotency key: {e}"),
            RunError::Serde(e) => write!(f, "the input or the result does not serialise: {e}"),
            RunError::Store(e) => write!(f, "{e}"),
            RunError::TimedOut(timeout) => write!(
                f,
                "the work did not finish within its timeout of {timeout:?}: it was cancelled \
                 and rolled back, and the key is free"
            ),
        }
    }
}

impl<E: fmt::Debug + fmt::Display> std::error::Error for RunError<E> {}

impl<St> Idempotent<St> {
    /// The retention results are remembered for: the configured
    /// [`retention`](Self::retention), raised to the
    /// [`work_timeout`](Self::work_timeout) plus 5 s if it is shorter.
    pub fn effective_retention(&self) -> Duration {
        self.retention.max(self.hold_limit())
    }

    /// How long the owner may hold the key before the database ends its
    /// transaction: the work's deadline and the margin past it.
    fn hold_limit(&self) -> Duration {
        self.work_timeout.saturating_add(HOLD_MARGIN)
    }
}

impl<St: Store> Idempotent<St> {
    /// Rolls the work back, by the end's deadline.
    async fn abort(&self, tx: St::Tx, deadlines: Deadlines) -> Result<(), StoreError> {
        deadline::within(
            deadlines.end(),
            self.store.abort(tx),
            deadline::rollback_unanswered,
        )
        .await
    }

    /// Work named `name` (a stable name with a version, as an endpoint's:
    /// it scopes the keys and the input's fingerprint), on `store`;
    /// results remembered 24 h, a concurrent call waiting at most 5 s, the
    /// work taking at most 30 s.
    pub fn new(store: St, name: impl Into<Arc<str>>) -> Self {
        Idempotent {
            store,
            name: name.into(),
            retention: Duration::from_secs(24 * 3600),
            wait: Duration::from_secs(5),
            work_timeout: DEFAULT_WORK_TIMEOUT,
            raise_logged: Arc::default(),
        }
    }

    /// How long a result is remembered, counted from the claim (default
    /// 24 h). After that the same key runs the work again.
    ///
    /// Raised to cover the work: at least the
    /// [`work_timeout`](Self::work_timeout) plus 5 s (the margin within
    /// which the database ends a silent owner), as the layer does in its
    /// claim-first mode. A shorter one could expire while the work still
    /// runs, and a call right after its commit would run it again. When it
    /// is raised, the first [`run`](Self::run) logs a warning naming both
    /// values; [`effective_retention`](Self::effective_retention) is the
    /// one used.
    ///
    /// Values above 100 years are clamped to it.
    pub fn retention(self, retention: Duration) -> Self {
        crate::setter::with(self, |s| {
            s.retention = retention.min(MAX_RETENTION);
            s.raise_logged = Arc::default();
        })
    }

    /// How long a call waits for another call that holds the same key
    /// (default 5 s).
    pub fn wait(self, wait: Duration) -> Self {
        crate::setter::with(self, |s| s.wait = wait)
    }

    /// How long the work may take, from the moment the call owns its key
    /// until the work's future returns (default 30 s, as the layer's
    /// handler timeout).
    ///
    /// Past it the work's future is dropped, a statement it left running
    /// in the database is cancelled, its writes are rolled back, the key is
    /// freed and [`run`](Self::run) returns [`RunError::TimedOut`]. Without
    /// it a work that never returns would hold its key, its row lock and a
    /// pooled connection for good. The database also ends the owner's
    /// transaction by itself when it sits idle 5 s past this limit
    /// (`idle_in_transaction_session_timeout`, set for the transaction),
    /// should the process freeze.
    ///
    /// The [retention](Self::retention) is raised to at least this plus
    /// 5 s. Clamped to `i32::MAX` milliseconds (about 24.8 days),
    /// PostgreSQL's limit.
    pub fn work_timeout(self, timeout: Duration) -> Self {
        crate::setter::with(self, |s| {
            s.work_timeout = timeout.min(MAX_WAIT);
            s.raise_logged = Arc::default();
        })
    }

    /// Runs `work` for `key` of `tenant` with `input`, or returns the
    /// result remembered for them; see the [module](self) docs. The work
    /// gets the store's transaction handle; what it writes through it
    /// commits with its result, or not at all.
    pub async fn run<I, O, E, F, Fut>(
        &self,
        tenant: &TenantId,
        key: impl AsRef<str>,
        input: &I,
        work: F,
    ) -> Result<O, RunError<E>>
    where
        I: Serialize + ?Sized,
        O: Serialize + DeserializeOwned,
        F: FnOnce(St::Tx) -> Fut,
        Fut: Future<Output = Result<O, E>>,
    {
        let key = IdempotencyKey::parse(key.as_ref().as_bytes()).map_err(RunError::InvalidKey)?;
        let input = serde_json::to_value(input).map_err(RunError::Serde)?;
        let fingerprint = Fingerprint::digest(&self.name, &canonical_json(&input));
        let retention = self.effective_retention();
        if retention > self.retention && !self.raise_logged.swap(true, Ordering::Relaxed) {
            tracing::warn!(
                name = %self.name,
                configured = ?self.retention,
                effective = ?retention,
                work_timeout = ?self.work_timeout,
                "the retention is raised to cover the work (its timeout plus 5 s, counted from the claim)"
            );
        }
        // The record's retention counts from the claim, so it ends no
        // sooner than the work may still commit. Should this process freeze
        // past the work's deadline, the database ends the claim by itself.
        let claim = ClaimRequest::new(
            Scope::new(tenant.clone(), self.name.clone()),
            key,
            fingerprint,
        )
        .with_retention(retention)
        .with_wait(self.wait)
        .with_hold_limit(self.hold_limit());
        // The store calls have the layer's deadlines: a database that stops
        // answering (a network partition) ends the call with an error, and
        // its connection is closed.
        let deadlines = Deadlines::new(tokio::time::Instant::now() + self.wait, self.work_timeout);
        let claimed = deadline::within(
            deadlines.claim(),
            self.store.claim(&claim),
            deadline::claim_unanswered,
        );
        let tx = match claimed.await.map_err(RunError::Store)? {
            Claim::Owned(tx) => tx,
            Claim::Completed(record) if record.fingerprint != claim.fingerprint => {
                return Err(RunError::KeyReused)
            }
            Claim::Completed(record) => {
                return serde_json::from_slice(&record.response.body).map_err(RunError::Serde)
            }
            Claim::InProgress => return Err(RunError::InProgress),
        };
        // The work's future is dropped at its deadline (with its clones of
        // the handle); a statement it left running is the store's to cancel
        // in `abort`, as the layer's timed-out handlers' are.
        let output = match tokio::time::timeout(self.work_timeout, work(tx.clone())).await {
            Ok(Ok(output)) => output,
            Ok(Err(e)) => {
                // The work's error is the answer; a failed rollback ends the
                // transaction on the store's side all the same.
                if let Err(abort) = self.abort(tx, deadlines).await {
                    tracing::warn!(error = %abort, "rolling back failed work failed");
                }
                return Err(RunError::Work(e));
            }
            Err(_) => {
                if let Err(abort) = self.abort(tx, deadlines).await {
                    tracing::warn!(error = %abort, "rolling back timed-out work failed");
                    // The database, not the work, stopped answering.
                    if abort.kind() == crate::store::StoreErrorKind::Unavailable {
                        return Err(RunError::Store(abort));
                    }
                }
                return Err(RunError::TimedOut(self.work_timeout));
            }
        };
        let body = match serde_json::to_vec(&output) {
            Ok(body) => Bytes::from(body),
            Err(e) => {
                let _ = self.abort(tx, deadlines).await;
                return Err(RunError::Serde(e));
            }
        };
        let result = StoredResponse::new(StatusCode::OK, &HeaderMap::new(), &[], body);
        deadline::within(
            deadlines.end(),
            self.store.complete(tx, &result),
            deadline::commit_unanswered,
        )
        .await
        .map_err(RunError::Store)?;
        Ok(output)
    }
}

#[cfg(test)]
mod tests {
    use std::time::Duration;

    use super::{Idempotent, RunError};
    use crate::{memory::MemoryStore, scope::TenantId, test_log::logged};

    #[test]
    fn a_raised_retention_is_used_and_said_once() {
        let tenant = TenantId::new("t");
        let short = Idempotent::new(MemoryStore::new(), "job v1")
            .retention(Duration::from_secs(2))
            .work_timeout(Duration::from_secs(10));
        assert_eq!(short.effective_retention(), Duration::from_secs(15));
        let clone = short.clone();
        let log = logged(async {
            for (i, consumer) in [&short, &clone, &short].into_iter().enumerate() {
                let key = format!("k-{i}");
                consumer
                    .run(&tenant, key, &i, |_| async { Ok::<_, String>(1) })
                    .await
                    .unwrap();
            }
        });
        assert_eq!(log.matches("the retention is raised").count(), 1, "{log}");
        assert!(log.contains("configured=2s"), "{log}");
        assert!(log.contains("effective=15s"), "{log}");

        // Long enough: used as configured, nothing said.
        let long = Idempotent::new(MemoryStore::new(), "job v1")
            .work_timeout(Duration::from_secs(10))
            .retention(Duration::from_secs(15));
        assert_eq!(long.effective_retention(), Duration::from_secs(15));
        let default = Idempotent::new(MemoryStore::new(), "job v1");
        assert_eq!(
            default.effective_retention(),
            Duration::from_secs(24 * 3600)
        );
        let log = logged(async {
            for consumer in [&long, &default] {
                consumer
                    .run(&tenant, "k", &1, |_| async { Ok::<_, String>(1) })
                    .await
                    .unwrap();
            }
        });
        assert!(!log.contains("the retention is raised"), "{log}");
    }

    #[tokio::test]
    async fn a_work_past_its_timeout_is_dropped_and_frees_its_key() {
        let store = MemoryStore::new();
        let consumer =
            Idempotent::new(store.clone(), "job v1").work_timeout(Duration::from_millis(50));
        let tenant = TenantId::new("t");
        let hung = consumer
            .run(&tenant, "k", &1, |_| {
                std::future::pending::<Result<u32, String>>()
            })
            .await;
        let Err(error @ RunError::TimedOut(timeout)) = hung else {
            panic!("{hung:?}")
        };
        assert_eq!(timeout, Duration::from_millis(50));
        assert!(error.to_string().contains("timeout of 50ms"), "{error}");
        assert_eq!(store.completed_records(), 0);
        let again = consumer
            .run(&tenant, "k", &1, |_| async { Ok::<_, String>(7) })
            .await;
        assert_eq!(again.unwrap(), 7, "the key was free");
        assert_eq!(store.completed_records(), 1);
    }
}
