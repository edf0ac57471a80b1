//! In-process coalescing of concurrent duplicates (single-flight).
//!
//! Without it, N concurrent duplicates of one hot key would each hold a pooled
//! connection while they wait on the key's row lock, and starve every other
//! key. With it, only the first request of a key in this process goes to the
//! store; the others wait here, holding nothing, and go to the store once it
//! has finished (where they find its record). The database stays the
//! arbiter: this only decides who waits where.

use std::{
    collections::HashMap,
    sync::{Arc, Mutex},
};

use tokio::sync::watch;

use crate::{key::IdempotencyKey, scope::Scope};

type Key = (Scope, IdempotencyKey);

#[derive(Debug, Default)]
pub(crate) struct InFlight {
    leaders: Mutex<HashMap<Key, watch::Receiver<bool>>>,
}

pub(crate) enum Turn {
    /// Go to the store; the others wait until this guard is dropped.
    Lead(LeadGuard),
    /// Another request of this process has the key: wait for it to finish.
    Follow(Follower),
}

pub(crate) struct LeadGuard {
    in_flight: Arc<InFlight>,
    key: Key,
    // Dropping the sender wakes every follower; the value says whether the
    // key now has a record.
    done: watch::Sender<bool>,
}

/// Waits for a leader.
pub(crate) struct Follower(watch::Receiver<bool>);

/// How a wait for the leader ended.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Woken {
    /// The key has a record now: every follower may read it at once.
    Settled,
    /// The leader finished without a record (rolled back): one follower
    /// leads next, so the others do not all claim together.
    Unsettled,
    /// The deadline passed first.
    TimedOut,
}

impl Follower {
    pub(crate) async fn wait(mut self, deadline: tokio::time::Instant) -> Woken {
        // `changed` fails once the leader's sender is dropped: it finished.
        match tokio::time::timeout_at(deadline, self.0.changed()).await {
            Err(_) => Woken::TimedOut,
            Ok(_) if *self.0.borrow() => Woken::Settled,
            Ok(_) => Woken::Unsettled,
        }
    }
}

impl LeadGuard {
    /// The key has a record (this leader committed, or found one): followers
    /// go straight to it.
    pub(crate) fn settled(&self) {
        self.done.send_replace(true);
    }
}

impl InFlight {
    pub(crate) fn enter(self: &Arc<Self>, scope: &Scope, key: &IdempotencyKey) -> Turn {
        let key = (scope.clone(), key.clone());
        let mut leaders = self.leaders.lock().unwrap_or_else(|p| p.into_inner());
        if let Some(done) = leaders.get(&key) {
            return Turn::Follow(Follower(done.clone()));
        }
        let (done, done_rx) = watch::channel(false);
        leaders.insert(key.clone(), done_rx);
        Turn::Lead(LeadGuard {
            in_flight: self.clone(),
            key,
            done,
        })
    }
}

impl Drop for LeadGuard {
    fn drop(&mut self) {
        let mut leaders = self
            .in_flight
            .leaders
            .lock()
            .unwrap_or_else(|p| p.into_inner());
        leaders.remove(&self.key);
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::scope::TenantId;

    #[tokio::test]
    async fn followers_learn_whether_the_leader_settled_the_key() {
        let in_flight = Arc::new(InFlight::default());
        let scope = Scope::new(TenantId::new("t"), "e");
        let key = IdempotencyKey::parse(b"k").unwrap();
        let far = tokio::time::Instant::now() + std::time::Duration::from_secs(60);
        let Turn::Lead(guard) = in_flight.enter(&scope, &key) else {
            panic!("first leads")
        };
        let Turn::Follow(follower) = in_flight.enter(&scope, &key) else {
            panic!("second follows")
        };
        let other = IdempotencyKey::parse(b"other").unwrap();
        assert!(
            matches!(in_flight.enter(&scope, &other), Turn::Lead(_)),
            "other keys are independent"
        );
        drop(guard);
        assert_eq!(
            follower.wait(far).await,
            Woken::Unsettled,
            "a leader that rolled back leaves it unsettled"
        );
        let Turn::Lead(guard) = in_flight.enter(&scope, &key) else {
            panic!("the key is free again")
        };
        let Turn::Follow(follower) = in_flight.enter(&scope, &key) else {
            panic!("follows the new leader")
        };
        guard.settled();
        drop(guard);
        assert_eq!(follower.wait(far).await, Woken::Settled);
        let Turn::Lead(_guard) = in_flight.enter(&scope, &key) else {
            panic!("free")
        };
        let Turn::Follow(follower) = in_flight.enter(&scope, &key) else {
            panic!("follows")
        };
        let soon = tokio::time::Instant::now() + std::time::Duration::from_millis(10);
        assert_eq!(follower.wait(soon).await, Woken::TimedOut);
    }
}
