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

use std::{fmt, future::Future, sync::Arc, time::Duration};

use bytes::Bytes;
use http::{HeaderMap, StatusCode};
use serde::{de::DeserializeOwned, Serialize};

use crate::{
    fingerprint::{canonical_json, Fingerprint},
    key::{IdempotencyKey, KeyError},
    record::StoredResponse,
    scope::{Scope, TenantId},
    store::{Claim, ClaimRequest, Store, StoreError},
};

/// Runs work once per key; see the [module](self) docs.
#[derive(Clone)]
pub struct Idempotent<St> {
    store: St,
    name: Arc<str>,
    retention: Duration,
    wait: Duration,
}

impl<St> fmt::Debug for Idempotent<St> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("Idempotent")
            .field("name", &self.name)
            .field("retention", &self.retention)
            .field("wait", &self.wait)
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
        }
    }
}

impl<E: fmt::Debug + fmt::Display> std::error::Error for RunError<E> {}

impl<St: Store> Idempotent<St> {
    /// Work named `name` (a stable name with a version, as an endpoint's:
    /// it scopes the keys and the input's fingerprint), on `store`;
    /// results remembered 24 h, a concurrent call waiting at most 5 s.
    pub fn new(store: St, name: impl Into<Arc<str>>) -> Self {
        Idempotent {
            store,
            name: name.into(),
            retention: Duration::from_secs(24 * 3600),
            wait: Duration::from_secs(5),
        }
    }

    /// How long a result is remembered, counted from the claim (default
    /// 24 h).
    pub fn retention(self, retention: Duration) -> Self {
        crate::setter::with(self, |s| s.retention = retention)
    }

    /// How long a call waits for another call that holds the same key
    /// (default 5 s).
    pub fn wait(self, wait: Duration) -> Self {
        crate::setter::with(self, |s| s.wait = wait)
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
        let claim = ClaimRequest::new(
            Scope::new(tenant.clone(), self.name.clone()),
            key,
            fingerprint,
        )
        .with_retention(self.retention)
        .with_wait(self.wait);
        let tx = match self.store.claim(&claim).await.map_err(RunError::Store)? {
            Claim::Owned(tx) => tx,
            Claim::Completed(record) if record.fingerprint != claim.fingerprint => {
                return Err(RunError::KeyReused)
            }
            Claim::Completed(record) => {
                return serde_json::from_slice(&record.response.body).map_err(RunError::Serde)
            }
            Claim::InProgress => return Err(RunError::InProgress),
        };
        let output = match work(tx.clone()).await {
            Ok(output) => output,
            Err(e) => {
                // The work's error is the answer; a failed rollback ends the
                // transaction on the store's side all the same.
                if let Err(abort) = self.store.abort(tx).await {
                    tracing::warn!(error = %abort, "rolling back failed work failed");
                }
                return Err(RunError::Work(e));
            }
        };
        let body = match serde_json::to_vec(&output) {
            Ok(body) => Bytes::from(body),
            Err(e) => {
                let _ = self.store.abort(tx).await;
                return Err(RunError::Serde(e));
            }
        };
        let result = StoredResponse::new(StatusCode::OK, &HeaderMap::new(), &[], body);
        self.store
            .complete(tx, &result)
            .await
            .map_err(RunError::Store)?;
        Ok(output)
    }
}
