//! The map of keys this process works on (single-flight): the first
//! request of a key leads, the others follow it and learn how it ended. How
//! a request uses it is `coalesce`.

use std::{
    collections::HashMap,
    sync::{Arc, Mutex},
};

use tokio::sync::watch;

use crate::{key::IdempotencyKey, record::Record, scope::Scope};

type Key = (Scope, IdempotencyKey);

/// What a leader has made known about its key so far.
#[derive(Debug, Clone, Default)]
enum LeadState {
    /// Nothing yet (or it finished without a record: rolled back).
    #[default]
    Pending,
    /// The key has a record in the store.
    Recorded,
    /// The key's completed record, as the leader committed or read it.
    /// One `Arc` for all its followers, and each replay shares the body's
    /// `Bytes`: however many wait, the answer is held once. What a follower
    /// holds of its own is its buffered request (under the request body
    /// limit), as every request in flight does.
    Answer(Arc<Record>),
}

/// A key's leader as its followers find it: what it made known, and, once
/// a follower came, the channel it is told through (made only then: most
/// keys are never followed, and a channel is an allocation a request). The
/// entry keeps one receiver, never read, that each follower clones: a clone
/// sees at once whatever the leader made known before it came.
struct Leader {
    state: LeadState,
    channel: Option<(watch::Sender<LeadState>, watch::Receiver<LeadState>)>,
}

#[derive(Default)]
pub(crate) struct InFlight {
    leaders: Mutex<HashMap<Key, Leader>>,
}

impl std::fmt::Debug for InFlight {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        let leaders = self.leaders.lock().unwrap_or_else(|p| p.into_inner());
        f.debug_struct("InFlight")
            .field("keys", &leaders.len())
            .finish()
    }
}

pub(crate) enum Turn {
    /// Go to the store; the others wait until this guard is dropped.
    Lead(LeadGuard),
    /// Another request of this process has the key: wait for it to finish.
    Follow(Follower),
}

/// Leads a key until dropped; dropping it (the key's entry, its channel's
/// sender with it) wakes every follower, and what the leader made known
/// says what the key now has.
pub(crate) struct LeadGuard {
    in_flight: Arc<InFlight>,
    key: Key,
}

/// Waits for a leader.
pub(crate) struct Follower {
    done: watch::Receiver<LeadState>,
}

/// How a wait for the leader ended.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) enum Woken {
    /// The key's completed record, from the leader: no store needed.
    Answer(Arc<Record>),
    /// The key has a record now: every follower may read it at once.
    Recorded,
    /// The leader finished without a record (rolled back): one follower
    /// leads next, so the others do not all claim together.
    Released,
    /// The deadline passed first.
    TimedOut,
}

impl Follower {
    pub(crate) async fn wait(mut self, deadline: tokio::time::Instant) -> Woken {
        // `changed` fails once the leader's sender is dropped: it finished.
        match tokio::time::timeout_at(deadline, self.done.changed()).await {
            Err(_) => Woken::TimedOut,
            Ok(_) => match &*self.done.borrow() {
                LeadState::Answer(record) => Woken::Answer(record.clone()),
                LeadState::Recorded => Woken::Recorded,
                LeadState::Pending => Woken::Released,
            },
        }
    }
}

impl LeadGuard {
    /// What the leader makes known: `update` the key's state, and tell the
    /// followers if there are any and it changed.
    fn tell(&self, update: impl FnOnce(&mut LeadState) -> bool) {
        let mut leaders = self
            .in_flight
            .leaders
            .lock()
            .unwrap_or_else(|p| p.into_inner());
        let Some(leader) = leaders.get_mut(&self.key) else {
            return;
        };
        if update(&mut leader.state) {
            if let Some((sender, _)) = &leader.channel {
                sender.send_replace(leader.state.clone());
            }
        }
    }

    /// The key has a record (this leader committed, or found one): followers
    /// go straight to it.
    pub(crate) fn settled(&self) {
        self.tell(|state| {
            let pending = matches!(state, LeadState::Pending);
            if pending {
                *state = LeadState::Recorded;
            }
            pending
        });
    }

    /// The key's completed record: followers answer from it, without the
    /// store.
    pub(crate) fn answered(&self, record: Arc<Record>) {
        self.tell(|state| {
            *state = LeadState::Answer(record);
            true
        });
    }
}

impl InFlight {
    pub(crate) fn enter(self: &Arc<Self>, scope: &Scope, key: &IdempotencyKey) -> Turn {
        let key = (scope.clone(), key.clone());
        let mut leaders = self.leaders.lock().unwrap_or_else(|p| p.into_inner());
        if let Some(leader) = leaders.get_mut(&key) {
            let (_, receiver) = leader.channel.get_or_insert_with(|| {
                // Made before the state is told, so that it counts as a
                // change for the receiver the followers clone.
                let (sender, receiver) = watch::channel(LeadState::Pending);
                if !matches!(leader.state, LeadState::Pending) {
                    sender.send_replace(leader.state.clone());
                }
                (sender, receiver)
            });
            return Turn::Follow(Follower {
                done: receiver.clone(),
            });
        }
        leaders.insert(
            key.clone(),
            Leader {
                state: LeadState::Pending,
                channel: None,
            },
        );
        Turn::Lead(LeadGuard {
            in_flight: self.clone(),
            key,
        })
    }
}

#[cfg(test)]
impl InFlight {
    /// How many requests wait behind the leader of `key` right now.
    pub(crate) fn waiting(&self, scope: &Scope, key: &IdempotencyKey) -> usize {
        let leaders = self.leaders.lock().unwrap_or_else(|p| p.into_inner());
        let key = (scope.clone(), key.clone());
        // The entry holds one receiver itself.
        leaders
            .get(&key)
            .and_then(|leader| leader.channel.as_ref())
            .map_or(0, |(sender, _)| sender.receiver_count() - 1)
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
            Woken::Released,
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
        assert_eq!(follower.wait(far).await, Woken::Recorded);
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
