//! The retry budget: retries as a bounded share of the calls a client makes,
//! so that a fleet whose upstream is down does not multiply its load by
//! `max_attempts`.

use std::{sync::Arc, time::Duration};

use tower::retry::budget::{Budget, TpsBudget};

/// How many retries an [`IdempotentClient`](super::IdempotentClient) may
/// make, as a share of its calls over a sliding window: a retry the budget
/// refuses is not sent, and the call's last outcome is returned
/// ([`GiveUp::RetryBudget`](super::GiveUp::RetryBudget)).
///
/// Every call of an unsafe method deposits `ratio` of a retry; every retry
/// withdraws one; a floor of `min_per_sec` retries a second (over the
/// window) is always allowed, so that a client making few calls still
/// retries them. With the upstream down, `N` calls within one window make
/// at most `N × (1 + ratio) + min_per_sec × window` attempts, instead of
/// `N × max_attempts`.
///
/// The default ([`IdempotentClientLayer::new`](super::IdempotentClientLayer::new)):
/// 20 % extra load (`ratio` 0.2), a floor of 10 retries a second, a 10 s
/// window; as Finagle and gRPC budget retries. Each service the layer makes
/// ([`Layer::layer`](tower_layer::Layer::layer)) has its own budget, which
/// all its clones share.
///
/// ```
/// use std::time::Duration;
/// use tower_idempotency::client::{IdempotentClientLayer, RetryBudget};
///
/// let layer = IdempotentClientLayer::new().retry_budget(
///     RetryBudget::ratio(0.1).min_per_sec(2).window(Duration::from_secs(30)),
/// );
/// let unbounded = IdempotentClientLayer::new().retry_budget(RetryBudget::unlimited());
/// # let _ = (layer, unbounded);
/// ```
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct RetryBudget {
    /// `None`: every retry the policy allows is made.
    limit: Option<Limit>,
}

#[derive(Debug, Clone, Copy, PartialEq)]
struct Limit {
    ratio: f32,
    min_per_sec: u32,
    window: Duration,
}

/// tower's budget accepts windows of 1 to 60 s.
const SHORTEST_WINDOW: Duration = Duration::from_secs(1);
const LONGEST_WINDOW: Duration = Duration::from_secs(60);
/// tower's budget accepts ratios up to 1000 (retries per call).
const LARGEST_RATIO: f32 = 1000.0;
/// tower's budget asserts the floor is below `i32::MAX`; a million retries a
/// second is no floor anyway.
const LARGEST_FLOOR: u32 = 1_000_000;

impl Default for RetryBudget {
    fn default() -> Self {
        RetryBudget::ratio(0.2)
    }
}

impl RetryBudget {
    /// Retries up to `ratio` of the calls made (0.2: 20 % extra load), with
    /// the default floor (10 a second) and window (10 s). Clamped to
    /// 0–1000; not a number counts as 0 (only the floor's retries).
    pub fn ratio(ratio: f32) -> Self {
        // `clamp` keeps NaN, which tower's budget refuses: a nonsense
        // ratio allows only the floor.
        let ratio = if ratio.is_nan() {
            0.0
        } else {
            ratio.clamp(0.0, LARGEST_RATIO)
        };
        RetryBudget {
            limit: Some(Limit {
                ratio,
                min_per_sec: 10,
                window: Duration::from_secs(10),
            }),
        }
    }

    /// No budget: every retry the other bounds allow is made (the
    /// behaviour before budgets; for a client that is the only caller of
    /// its upstream).
    pub fn unlimited() -> Self {
        RetryBudget { limit: None }
    }

    /// The retries a second allowed whatever the ratio (default 10; at most
    /// a million). Over the window that is `min_per_sec × window` retries.
    pub fn min_per_sec(self, retries: u32) -> Self {
        self.with_limit(|l| l.min_per_sec = retries.min(LARGEST_FLOOR))
    }

    /// How long a call's deposit counts (default 10 s; 1–60 s, whole
    /// seconds count for the floor).
    pub fn window(self, window: Duration) -> Self {
        self.with_limit(|l| l.window = window.clamp(SHORTEST_WINDOW, LONGEST_WINDOW))
    }

    fn with_limit(mut self, set: impl FnOnce(&mut Limit)) -> Self {
        if let Some(limit) = &mut self.limit {
            set(limit);
        }
        self
    }

    /// The budget one service and its clones share.
    pub(crate) fn build(&self) -> Option<SharedBudget> {
        let limit = self.limit?;
        // The bounds tower asserts were enforced by the setters.
        let budget = TpsBudget::new(limit.window, limit.min_per_sec, limit.ratio);
        Some(SharedBudget(Arc::new(budget)))
    }
}

/// One service's budget, shared by its clones and their calls.
#[derive(Debug, Clone)]
pub(crate) struct SharedBudget(Arc<TpsBudget>);

impl SharedBudget {
    /// A call that may be retried starts.
    pub(crate) fn deposit(&self) {
        self.0.deposit();
    }

    /// Whether one more retry may be sent; if so it is counted.
    pub(crate) fn withdraw(&self) -> bool {
        self.0.withdraw()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The setters keep every value inside what tower's budget accepts,
    /// so building never panics.
    #[test]
    fn out_of_range_settings_are_clamped() {
        for ratio in [f32::NAN, -1.0, 0.0, 0.2, 5000.0, f32::INFINITY] {
            let budget = RetryBudget::ratio(ratio)
                .min_per_sec(u32::MAX)
                .window(Duration::ZERO);
            assert!(budget.build().is_some());
            let budget = RetryBudget::ratio(ratio).window(Duration::from_secs(3600));
            assert!(budget.build().is_some());
        }
        assert!(RetryBudget::unlimited().min_per_sec(3).build().is_none());
    }

    #[tokio::test(start_paused = true)]
    async fn a_floor_alone_allows_its_retries_then_refuses() {
        let budget = RetryBudget::ratio(0.0)
            .min_per_sec(2)
            .window(Duration::from_secs(5))
            .build()
            .unwrap();
        let allowed = (0..100).filter(|_| budget.withdraw()).count();
        assert_eq!(allowed, 10, "2 a second over 5 s");
    }
}
