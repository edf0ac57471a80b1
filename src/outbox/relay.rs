//! The relay: delivers committed outbox events at least once.

use std::{fmt, future::Future, panic::AssertUnwindSafe, sync::Arc, time::Duration};

use futures_util::FutureExt;
use tokio::sync::Notify;
use tokio_postgres::{types::ToSql, AsyncMessage};

use super::{
    event::OutboxEvent,
    sink::{BatchReport, DeliveryError, OutboxStatus, Sink},
};
use crate::{
    metrics,
    postgres::PgStore,
    protocol::claim::begin_with_waits,
    protocol::outbox as statements,
    protocol::waits::{answered_within, BACKGROUND_DEADLINE},
    store::StoreError,
};

/// Delivers undelivered `outbox_events` rows to a [`Sink`], at least once.
///
/// Each batch, in one transaction, claims due events with `FOR UPDATE SKIP
/// LOCKED` (so any number of relays, in one process or many, never deliver
/// the same event at the same moment), delivers them, and marks each
/// published, or schedules its retry with capped exponential backoff and
/// jitter, or parks it after the last allowed attempt. A batch stops starting
/// deliveries once its delivery timeout has passed, so its transaction stays
/// short however slow the sink is; the rest wait for the next batch. A relay that dies
/// mid-batch rolls back: its events are delivered again later, which the
/// sink's derived keys make harmless.
///
/// It wakes on `LISTEN tower_idempotency_outbox` (a trigger notifies at the
/// commit of every transaction that adds or re-drives events), so new events
/// leave within milliseconds without polling the table in a tight loop; a
/// fallback poll (default 1 s) picks up retries that come due and anything a
/// lost listener connection missed. Behind a transaction pooler
/// ([`PgStoreBuilder::transaction_pooling`](crate::postgres::PgStoreBuilder::transaction_pooling))
/// a `LISTEN` would stay on whichever server connection ran it, so the relay
/// does not listen and relies on the poll alone: choose the poll interval as
/// the delivery delay you accept.
///
/// ```no_run
/// # use tower_idempotency::{postgres::PgStore, outbox::{Relay, Sink, OutboxEvent, DeliveryError}};
/// struct Printer;
/// impl Sink for Printer {
///     async fn deliver(&self, event: &OutboxEvent) -> Result<(), DeliveryError> {
///         println!("{} {}", event.event_type, event.derived_key("print"));
///         Ok(())
///     }
/// }
/// # async fn run(store: PgStore) -> Result<(), tower_idempotency::store::StoreError> {
/// let relay = Relay::new(store, Printer).batch_size(64);
/// relay.run(async { let _ = tokio::signal::ctrl_c().await; }).await
/// # }
/// ```
pub struct Relay<K> {
    store: PgStore,
    sink: Arc<K>,
    batch_size: i64,
    max_attempts: i32,
    backoff_base: Duration,
    backoff_cap: Duration,
    poll_interval: Duration,
    delivery_timeout: Duration,
}

impl<K> fmt::Debug for Relay<K> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("Relay")
            .field("batch_size", &self.batch_size)
            .field("max_attempts", &self.max_attempts)
            .field("backoff_base", &self.backoff_base)
            .field("backoff_cap", &self.backoff_cap)
            .field("poll_interval", &self.poll_interval)
            .field("delivery_timeout", &self.delivery_timeout)
            .finish_non_exhaustive()
    }
}

/// The longest backoff, poll interval and delivery timeout a relay takes.
const LONGEST: Duration = Duration::from_secs(365 * 24 * 60 * 60);
/// The shortest poll interval and delivery timeout.
const SHORTEST: Duration = Duration::from_millis(1);

impl<K: Sink> Relay<K> {
    /// A relay over `store`'s database delivering to `sink`, with the
    /// defaults each setter states.
    pub fn new(store: PgStore, sink: K) -> Self {
        Relay {
            store,
            sink: Arc::new(sink),
            batch_size: 32,
            max_attempts: 10,
            backoff_base: Duration::from_millis(500),
            backoff_cap: Duration::from_secs(300),
            poll_interval: Duration::from_secs(1),
            delivery_timeout: Duration::from_secs(10),
        }
    }

    /// Events claimed per batch (and held locked while they are delivered):
    /// 32 by default, from 1 to 10,000.
    ///
    /// The relay holds a batch's rows in memory while it delivers them, so
    /// a batch costs up to this many times the largest payload your
    /// handlers write (an event's payload is yours to bound; one built from
    /// the request is under the layer's request body limit, 1 MiB by
    /// default). A relay holds one batch at a time, whatever the backlog.
    pub fn batch_size(self, n: usize) -> Self {
        crate::setter::with(self, |r| r.batch_size = n.clamp(1, 10_000) as i64)
    }

    /// Attempts before an event is parked (kept, visible, never deleted):
    /// 10 by default.
    pub fn max_attempts(self, n: u32) -> Self {
        crate::setter::with(self, |r| {
            r.max_attempts = n.clamp(1, i32::MAX as u32) as i32
        })
    }

    /// The first retry delay and the cap of the doubling (each at most a
    /// year), with jitter: by default from 500 ms doubling to at most 5 min.
    pub fn backoff(self, base: Duration, cap: Duration) -> Self {
        crate::setter::with(self, |r| {
            r.backoff_base = base.min(LONGEST);
            r.backoff_cap = cap.min(LONGEST).max(r.backoff_base);
        })
    }

    /// How often the relay looks without being woken (at least a
    /// millisecond, at most a year): every second by default.
    pub fn poll_interval(self, interval: Duration) -> Self {
        crate::setter::with(self, |r| {
            r.poll_interval = interval.clamp(SHORTEST, LONGEST)
        })
    }

    /// How long one delivery may take before it counts as failed (at least
    /// a millisecond, at most a year): 10 s by default. A batch stops starting deliveries
    /// once this much time has passed, after its first.
    pub fn delivery_timeout(self, timeout: Duration) -> Self {
        crate::setter::with(self, |r| {
            r.delivery_timeout = timeout.clamp(SHORTEST, LONGEST)
        })
    }

    /// The delay before retry number `attempts` (1-based): capped doubling,
    /// then "equal jitter" (half fixed, half random) so that many failed
    /// events do not retry in lockstep.
    fn retry_delay(&self, attempts: i32) -> Duration {
        let doubling = 2_f64.powi(attempts.saturating_sub(1).min(30));
        let delay =
            (self.backoff_base.as_secs_f64() * doubling).min(self.backoff_cap.as_secs_f64());
        crate::jitter::equal(delay)
    }

    /// Claims, delivers and records one batch. For tests, cron-style use and
    /// [`run`](Self::run).
    ///
    /// Each of its two database phases (claiming the batch, recording it)
    /// is answered within 10 s whatever the database or
    /// the network does: past it the batch's connection is closed (the
    /// server rolls back and its events stay due) and this returns an
    /// `Unavailable` error, so a stopped network path cannot stall the relay.
    pub async fn run_once(&self) -> Result<BatchReport, StoreError> {
        let mut session = answered_within(
            BACKGROUND_DEADLINE,
            self.store.session(),
            "taking a connection",
        )
        .await?;
        let claimed = async {
            let (due, claim) = tokio::try_join!(
                session.prepare(statements::DUE_TENANTS),
                session.prepare(statements::CLAIM_EVENTS),
            )?;
            let limit: [&(dyn ToSql + Sync); 1] = [&self.batch_size];
            // The batch's transaction sits idle while it delivers (about two
            // delivery timeouts at most): it carries an idle limit of its own
            // past that, whatever hold limit the store's sessions carry for
            // the layer's owners, which may be shorter.
            let idle = self
                .delivery_timeout
                .saturating_mul(2)
                .saturating_add(BACKGROUND_DEADLINE);
            let begin = begin_with_waits(None, Some(idle));
            let (_, tenants) = tokio::try_join!(
                biased;
                session.batch_execute(&begin),
                session.query_prepared(&due, &limit),
            )?;
            // The events are locked one tenant at a time (one shard on Citus).
            let mut rows = Vec::new();
            for tenant in &tenants {
                let tenant: &str = tenant.get(0);
                let left = self.batch_size - rows.len() as i64;
                if left <= 0 {
                    break;
                }
                let params: [&(dyn ToSql + Sync); 2] = [&tenant, &left];
                rows.extend(session.query_prepared(&claim, &params).await?);
            }
            Ok::<_, StoreError>(rows)
        };
        let rows = answered_within(BACKGROUND_DEADLINE, claimed, "claiming a batch").await?;
        let mut report = BatchReport {
            claimed: rows.len(),
            ..BatchReport::default()
        };
        // Each event by its key: tenant and id, in parallel arrays.
        let (mut delivered_tenants, mut delivered) = (Vec::new(), Vec::new());
        let (mut retry_tenants, mut retry_ids, mut retry_errors, mut retry_delays) =
            (Vec::new(), Vec::new(), Vec::new(), Vec::new());
        let (mut park_tenants, mut park_ids, mut park_errors) =
            (Vec::new(), Vec::new(), Vec::new());
        // The batch's transaction (and its row locks) stays open while it
        // delivers: whatever the sink does, it ends within about two
        // delivery timeouts. Events not attempted by then go to the next batch.
        let batch_deadline = tokio::time::Instant::now() + self.delivery_timeout;
        for (at, row) in rows.iter().enumerate() {
            // The first event is always attempted, so every batch gets on.
            if at > 0 && tokio::time::Instant::now() >= batch_deadline {
                report.deferred += 1;
                continue;
            }
            let event = OutboxEvent {
                id: row.get(0),
                tenant_id: row.get(1),
                aggregate_id: row.get(2),
                event_type: row.get(3),
                payload: row.get(4),
                attempts: row.get(5),
            };
            // The async block defers the call to `deliver` into the first
            // poll, so a sink that panics before returning its future is caught too.
            // Unwind safety is asserted: a panicked delivery is never polled
            // again, and what the sink shares between deliveries is the
            // sink's to keep sound. The panic's payload is dropped unread.
            let delivery =
                AssertUnwindSafe(async { self.sink.deliver(&event).await }).catch_unwind();
            let outcome = match tokio::time::timeout(self.delivery_timeout, delivery).await {
                Ok(Ok(outcome)) => outcome,
                Ok(Err(_panic)) => {
                    tracing::error!(event_id = %event.id, event_type = %event.event_type, "the outbox sink panicked; counted as a failed attempt");
                    Err(DeliveryError::retryable("the sink panicked"))
                }
                Err(_) => Err(DeliveryError::retryable("delivery timed out")),
            };
            let event_type = event.event_type.clone();
            match outcome {
                Ok(()) => {
                    metrics::outbox_delivery(metrics::Delivery::Delivered, &event_type);
                    delivered_tenants.push(event.tenant_id);
                    delivered.push(event.id);
                }
                Err(error) => {
                    let attempts = event.attempts.saturating_add(1);
                    // Counted in rounds of `max_attempts`: a parked event
                    // that an operator re-drives gets a round of its own,
                    // its backoff starting over.
                    let in_round = (attempts - 1) % self.max_attempts + 1;
                    metrics::outbox_delivery(metrics::Delivery::Failed, &event_type);
                    if error.permanent || in_round >= self.max_attempts {
                        tracing::warn!(event_id = %event.id, event_type, attempts, error = %error, "outbox event parked");
                        metrics::outbox_delivery(metrics::Delivery::Parked, &event_type);
                        park_tenants.push(event.tenant_id);
                        park_ids.push(event.id);
                        park_errors.push(error.message);
                    } else {
                        let delay = self.retry_delay(in_round);
                        tracing::info!(event_id = %event.id, event_type, attempts, retry_in_ms = delay.as_millis() as u64, error = %error, "outbox delivery failed; will retry");
                        retry_delays.push(delay.as_secs_f64() * 1000.0);
                        retry_tenants.push(event.tenant_id);
                        retry_ids.push(event.id);
                        retry_errors.push(error.message);
                    }
                }
            }
        }
        report.delivered = delivered.len();
        report.retried = retry_ids.len();
        report.parked = park_ids.len();
        let recorded = async {
            let (mark_delivered, mark_failed, mark_parked) = tokio::try_join!(
                session.prepare(statements::MARK_DELIVERED),
                session.prepare(statements::MARK_FAILED),
                session.prepare(statements::MARK_PARKED),
            )?;
            let delivered_params: [&(dyn ToSql + Sync); 2] = [&delivered_tenants, &delivered];
            let failed_params: [&(dyn ToSql + Sync); 4] =
                [&retry_tenants, &retry_ids, &retry_errors, &retry_delays];
            let parked_params: [&(dyn ToSql + Sync); 3] = [&park_tenants, &park_ids, &park_errors];
            let (.., committed) = tokio::try_join!(
                biased;
                session.execute_prepared(&mark_delivered, &delivered_params),
                session.execute_prepared(&mark_failed, &failed_params),
                session.execute_prepared(&mark_parked, &parked_params),
                session.commit(),
            )?;
            Ok::<_, StoreError>(committed)
        };
        // Not answered in time: the deliveries stand, unrecorded; the
        // events are due again and delivered again under their keys.
        let committed = answered_within(BACKGROUND_DEADLINE, recorded, "recording a batch").await?;
        session.mark_clean(committed);
        Ok(report)
    }

    /// Counts undelivered events and the age of the oldest, and publishes
    /// them as the backlog and lag gauges.
    pub async fn refresh_backlog(&self) -> Result<OutboxStatus, StoreError> {
        let read = async {
            let mut session = self.store.session().await?;
            let row = session.query_one(statements::OUTBOX_BACKLOG, &[]).await?;
            session.answered();
            Ok(row)
        };
        let row = answered_within(BACKGROUND_DEADLINE, read, "counting the backlog").await?;
        let (count, lag): (i64, f64) = (row.get(0), row.get(1));
        metrics::outbox_backlog(count as f64, lag);
        Ok(OutboxStatus {
            backlog: count.max(0) as u64,
            lag: Duration::from_secs_f64(lag.max(0.0)),
        })
    }

    /// Runs until `shutdown` completes; the batch in flight then finishes
    /// (delivered events are recorded) before this returns.
    ///
    /// A batch that fails or panics is logged and tried again after the poll
    /// interval; its events stay due. Supervise the task anyway (log, count
    /// and restart it if it ends before shutdown), as the example order
    /// server does.
    pub async fn run(&self, shutdown: impl Future<Output = ()> + Send) -> Result<(), StoreError> {
        let wake = Arc::new(Notify::new());
        // Aborted however `run` ends: returned, dropped, or unwound by a panic.
        let _listener = (!self.store.uses_transaction_pooling())
            .then(|| AbortOnDrop(tokio::spawn(listen(self.store.clone(), wake.clone()))));
        let mut shutdown = std::pin::pin!(shutdown);
        let mut gauges_due = tokio::time::Instant::now();
        loop {
            // A panic outside the sink (a bug) must not end the relay: the
            // batch's connection is closed on unwinding, so its transaction
            // rolls back and its events are claimed again later.
            let report = match AssertUnwindSafe(self.run_once()).catch_unwind().await {
                Ok(Ok(report)) => report,
                Ok(Err(e)) => {
                    tracing::error!(error = %e, "outbox batch failed; retrying after the poll interval");
                    BatchReport::default()
                }
                Err(_panic) => {
                    tracing::error!("outbox batch panicked; retrying after the poll interval");
                    BatchReport::default()
                }
            };
            // Counting a large backlog costs more than a batch: once per poll interval.
            if tokio::time::Instant::now() >= gauges_due {
                if let Err(e) = self.refresh_backlog().await {
                    tracing::debug!(error = %e, "cannot refresh the outbox backlog gauges");
                }
                gauges_due = tokio::time::Instant::now() + self.poll_interval;
            }
            if report.claimed as i64 == self.batch_size {
                // A full batch: there is probably more right now.
                tokio::select! {
                    biased;
                    _ = &mut shutdown => break,
                    _ = std::future::ready(()) => continue,
                }
            }
            tokio::select! {
                _ = &mut shutdown => break,
                _ = wake.notified() => {}
                _ = tokio::time::sleep(self.poll_interval) => {}
            }
        }
        Ok(())
    }
}

struct AbortOnDrop(tokio::task::JoinHandle<()>);

impl Drop for AbortOnDrop {
    fn drop(&mut self) {
        self.0.abort();
    }
}

/// Forwards `NOTIFY tower_idempotency_outbox` to `wake`, reconnecting after
/// failures (the relay's poll covers the gaps).
async fn listen(store: PgStore, wake: Arc<Notify>) {
    loop {
        match store.dedicated().await {
            Ok((client, mut incoming)) => {
                let listening = async {
                    client
                        .batch_execute("LISTEN tower_idempotency_outbox")
                        .await?;
                    Ok::<_, tokio_postgres::Error>(())
                };
                let mut messages = std::pin::pin!(async {
                    while let Some(message) = futures_util::StreamExt::next(&mut incoming).await {
                        match message {
                            Ok(AsyncMessage::Notification(_)) => wake.notify_one(),
                            Ok(_) => {}
                            Err(e) => return e,
                        }
                    }
                    tracing::debug!("outbox listener connection closed");
                    std::future::pending().await
                });
                tokio::select! {
                    result = listening => {
                        if let Err(e) = result {
                            tracing::warn!(error = %e, "cannot LISTEN for outbox events");
                        } else {
                            // Keep the client alive while the connection is driven.
                            let e = messages.as_mut().await;
                            tracing::warn!(error = %e, "outbox listener lost its connection");
                        }
                    }
                    e = messages.as_mut() => tracing::warn!(error = %e, "outbox listener lost its connection"),
                }
                drop(client);
            }
            Err(e) => tracing::warn!(error = %e, "cannot connect the outbox listener"),
        }
        tokio::time::sleep(Duration::from_secs(1)).await;
    }
}
