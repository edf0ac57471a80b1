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
    leaders: Mutex<HashMap<Key, watch::Receiver<()>>>,
}

pub(crate) enum Turn {
    /// Go to the store; the others wait until this guard is dropped.
    Lead(LeadGuard),
    /// Another request of this process has the key: wait for it to finish.
    Follow(watch::Receiver<()>),
}

pub(crate) struct LeadGuard {
    in_flight: Arc<InFlight>,
    key: Key,
    // Dropping the sender wakes every follower.
    _done: watch::Sender<()>,
}

impl InFlight {
    pub(crate) fn enter(self: &Arc<Self>, scope: &Scope, key: &IdempotencyKey) -> Turn {
        let key = (scope.clone(), key.clone());
        let mut leaders = self.leaders.lock().unwrap_or_else(|p| p.into_inner());
        if let Some(done) = leaders.get(&key) {
            return Turn::Follow(done.clone());
        }
        let (done, done_rx) = watch::channel(());
        leaders.insert(key.clone(), done_rx);
        Turn::Lead(LeadGuard {
            in_flight: self.clone(),
            key,
            _done: done,
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
    use crate::TenantId;

    #[tokio::test]
    async fn followers_wake_when_the_leader_finishes() {
        let in_flight = Arc::new(InFlight::default());
        let scope = Scope::new(TenantId::new("t"), "e");
        let key = IdempotencyKey::parse(b"k").unwrap();
        let Turn::Lead(guard) = in_flight.enter(&scope, &key) else {
            panic!("first leads")
        };
        let Turn::Follow(mut follower) = in_flight.enter(&scope, &key) else {
            panic!("second follows")
        };
        let other = IdempotencyKey::parse(b"other").unwrap();
        assert!(
            matches!(in_flight.enter(&scope, &other), Turn::Lead(_)),
            "other keys are independent"
        );
        drop(guard);
        assert!(
            follower.changed().await.is_err(),
            "the leader's end wakes the follower"
        );
        assert!(
            matches!(in_flight.enter(&scope, &key), Turn::Lead(_)),
            "the key is free again"
        );
    }
}
