//! Retention: expired keys are removed in small batches, and the gauges an
//! operator watches are refreshed.
//!
//! [`Cleanup`] runs in every instance, or from cron ([`Cleanup::run_once`]).
//! What the retention promises, how cleanup stays out of the claims' way, and
//! the key table at scale: [the retention guide](crate::guide::retention).

use std::{fmt, future::Future, time::Duration};

use tokio_postgres::types::ToSql;

use crate::{
    metrics,
    postgres::PgStore,
    protocol::retention as statements,
    protocol::waits::{answered_within, BACKGROUND_DEADLINE},
    store::StoreError,
};

/// Removes expired idempotency records in batches and refreshes the
/// retention and in-progress gauges.
///
/// ```no_run
/// # async fn run(store: tower_idempotency::postgres::PgStore) -> Result<(), tower_idempotency::store::StoreError> {
/// use std::time::Duration;
/// use tower_idempotency::retention::Cleanup;
///
/// // In the service: every minute, until shutdown.
/// let cleanup = Cleanup::new(store.clone()).interval(Duration::from_secs(60));
/// tokio::spawn(async move { cleanup.run(std::future::pending()).await });
///
/// // From cron: one pass, then exit.
/// let removed = Cleanup::new(store).run_once().await?;
/// println!("removed {removed} expired keys");
/// # Ok(()) }
/// ```
#[derive(Clone)]
pub struct Cleanup {
    store: PgStore,
    batch_size: i64,
    interval: Duration,
}

impl fmt::Debug for Cleanup {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("Cleanup")
            .field("batch_size", &self.batch_size)
            .field("interval", &self.interval)
            .finish_non_exhaustive()
    }
}

/// What the gauges say, as [`Cleanup::refresh_gauges`] read them.
#[derive(Debug, Clone, Copy, PartialEq)]
#[non_exhaustive]
pub struct RetentionStatus {
    /// Expired rows not yet removed.
    pub cleanup_backlog: u64,
    /// Age of the oldest operation still holding its key (zero when none),
    /// long-running operations included.
    pub oldest_in_progress: Duration,
    /// Age of the oldest long-running operation still in progress (zero
    /// when none).
    pub oldest_lease: Duration,
    /// Long-running operations whose lease expired and that nobody has
    /// taken over yet.
    pub expired_leases: u64,
}

impl Cleanup {
    /// A cleaner for `store`'s database: batches of 1,000, every 60 s.
    pub fn new(store: PgStore) -> Self {
        Cleanup {
            store,
            batch_size: 1000,
            interval: Duration::from_secs(60),
        }
    }

    /// Rows removed per `DELETE` (each its own transaction).
    pub fn batch_size(self, rows: usize) -> Self {
        crate::setter::with(self, |s| s.batch_size = rows.clamp(1, 100_000) as i64)
    }

    /// The pause between passes of [`run`](Self::run).
    pub fn interval(self, interval: Duration) -> Self {
        crate::setter::with(self, |s| s.interval = interval)
    }

    /// Removes one batch (up to the batch size, from the tenants of the
    /// oldest expired rows, one `DELETE` per tenant); returns how many rows
    /// went.
    pub async fn delete_batch(&self) -> Result<u64, StoreError> {
        let mut session = self.store.session().await?;
        let limit: [&(dyn ToSql + Sync); 1] = [&self.batch_size];
        let tenants = session.query(statements::EXPIRED_TENANTS, &limit).await?;
        let mut removed = 0;
        for tenant in &tenants {
            let tenant: &str = tenant.get(0);
            let left = self.batch_size - removed as i64;
            if left <= 0 {
                break;
            }
            let params: [&(dyn ToSql + Sync); 2] = [&tenant, &left];
            removed += session.execute(statements::DELETE_BATCH, &params).await?;
        }
        session.answered();
        metrics::expired_removed(removed);
        Ok(removed)
    }

    /// Removes batches until a batch comes back short: one pass over what
    /// was expired when it started (plus what expired meanwhile). The
    /// equivalent SQL, for a scheduler of your own, is to find the tenants
    /// with expired rows and, for each, repeat until it deletes fewer than
    /// 1000 rows (one tenant per statement, which also routes to one shard
    /// on Citus):
    ///
    /// ```sql
    /// SELECT DISTINCT tenant_id FROM idempotency_requests WHERE expires_at <= now();
    /// DELETE FROM idempotency_requests
    /// WHERE tenant_id = $1 AND (endpoint, idempotency_key) IN (
    ///     SELECT endpoint, idempotency_key FROM idempotency_requests
    ///     WHERE tenant_id = $1 AND expires_at <= now()
    ///     ORDER BY expires_at LIMIT 1000 FOR UPDATE SKIP LOCKED);
    /// ```
    ///
    /// Each batch is answered within 10 s whatever the database or the
    /// network does; past it the batch's connection is closed (the server
    /// rolls it back) and this returns an `Unavailable` error.
    pub async fn run_once(&self) -> Result<u64, StoreError> {
        let mut total = 0;
        loop {
            let removed =
                answered_within(BACKGROUND_DEADLINE, self.delete_batch(), "a cleanup batch")
                    .await?;
            total += removed;
            if (removed as i64) < self.batch_size {
                tracing::debug!(removed = total, "idempotency cleanup pass done");
                return Ok(total);
            }
        }
    }

    /// Reads the cleanup backlog, the oldest in-progress age and the
    /// long-running operations' gauges, and sets them.
    pub async fn refresh_gauges(&self) -> Result<RetentionStatus, StoreError> {
        answered_within(
            BACKGROUND_DEADLINE,
            self.read_gauges(),
            "the retention gauges",
        )
        .await
    }

    async fn read_gauges(&self) -> Result<RetentionStatus, StoreError> {
        let mut session = self.store.session().await?;
        let (backlog, oldest, leases) = tokio::try_join!(
            session.prepare(statements::CLEANUP_BACKLOG),
            session.prepare(statements::OLDEST_IN_PROGRESS),
            session.prepare(statements::LEASES),
        )?;
        // One transaction, one round trip: the three read one instant
        // (`now()` is the transaction's), so the gauges agree with each
        // other (the oldest lease is never older than the oldest operation).
        let (_, backlog, oldest, leases, committed) = tokio::try_join!(
            biased;
            session.batch_execute("BEGIN ISOLATION LEVEL REPEATABLE READ READ ONLY"),
            session.query_one_prepared(&backlog, &[]),
            session.query_one_prepared(&oldest, &[]),
            session.query_one_prepared(&leases, &[]),
            session.commit(),
        )?;
        session.mark_clean(committed);
        let backlog: i64 = backlog.get(0);
        let oldest: f64 = oldest.get(0);
        let (oldest_lease, expired_leases): (f64, i64) = (leases.get(0), leases.get(1));
        metrics::retention_gauges(backlog as f64, oldest);
        metrics::lease_gauges(oldest_lease, expired_leases as f64);
        Ok(RetentionStatus {
            cleanup_backlog: backlog.max(0) as u64,
            oldest_in_progress: Duration::from_secs_f64(oldest.max(0.0)),
            oldest_lease: Duration::from_secs_f64(oldest_lease.max(0.0)),
            expired_leases: expired_leases.max(0) as u64,
        })
    }

    /// Cleans up and refreshes the gauges every interval until `shutdown`
    /// completes (a pass in progress finishes first).
    pub async fn run(&self, shutdown: impl Future<Output = ()> + Send) -> Result<(), StoreError> {
        let mut shutdown = std::pin::pin!(shutdown);
        loop {
            if let Err(e) = self.run_once().await {
                tracing::warn!(error = %e, "idempotency cleanup failed; retrying next interval");
            }
            if let Err(e) = self.refresh_gauges().await {
                tracing::debug!(error = %e, "cannot refresh the retention gauges");
            }
            tokio::select! {
                _ = &mut shutdown => return Ok(()),
                _ = tokio::time::sleep(self.interval) => {}
            }
        }
    }
}
