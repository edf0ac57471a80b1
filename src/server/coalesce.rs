//! In-process coalescing of concurrent duplicates (single-flight).
//!
//! Without it, N concurrent duplicates of one hot key would each hold a pooled
//! connection while they wait on the key's row lock, and starve every other
//! key. With it, only the first request of a key in this process goes to the
//! store; the others wait here, holding nothing, and go to the store once it
//! has finished (where they find its record). The database stays the
//! arbiter: this only decides who waits where.

use std::{ops::ControlFlow, sync::Arc};

use super::{
    in_flight::{InFlight, LeadGuard, Turn, Woken},
    settled::{Settled, Timings},
};
use crate::{fingerprint::Fingerprint, record::Record, store::ClaimRequest};

/// Waits while another request of this process works on the same key, and
/// says how this request goes on.
pub(crate) async fn coalesce(
    in_flight: &Arc<InFlight>,
    claim: &ClaimRequest,
    deadline: tokio::time::Instant,
) -> Coalesced {
    let mut followed = false;
    loop {
        match in_flight.enter(&claim.scope, &claim.key) {
            Turn::Lead(guard) => return Coalesced::Lead { guard, followed },
            Turn::Follow(follower) => {
                followed = true;
                match follower.wait(deadline).await {
                    Woken::Answer(record) => return Coalesced::Answered(record),
                    // The key has a record: read it without leading.
                    Woken::Recorded => return Coalesced::Read,
                    // The leader rolled back: one of us leads next.
                    Woken::Released => {}
                    Woken::TimedOut => return Coalesced::TimedOut,
                }
            }
        }
    }
}

/// A request that goes on to the store after [`coalesce`].
pub(crate) struct Proceed {
    /// Its guard, if it leads the key in this process.
    pub(crate) lead: Option<LeadGuard>,
    /// It waited behind another request of this process first.
    pub(crate) followed: bool,
}

/// How a request goes on after [`coalesce`].
pub(crate) enum Coalesced {
    /// To the store, as the key's leader in this process.
    Lead {
        guard: LeadGuard,
        /// It waited behind another request of this process first.
        followed: bool,
    },
    /// To the store, after a leader of this process settled the key.
    Read,
    /// Answered from the leader's record: no store needed.
    Answered(Arc<Record>),
    /// The wait ran out first.
    TimedOut,
}

impl Coalesced {
    /// `Continue` if the request goes on to the store (as the key's leader
    /// here, or not), else `Break` with how it settled in memory, its wait
    /// recorded in `timings`.
    pub(crate) fn go_on<B, E>(
        self,
        fingerprint: &Fingerprint,
        timings: &mut Timings,
        retry_after: u64,
    ) -> ControlFlow<Settled<B, E>, Proceed> {
        let settled = match self {
            Coalesced::Lead { guard, followed } => {
                return ControlFlow::Continue(Proceed {
                    lead: Some(guard),
                    followed,
                })
            }
            Coalesced::Read => {
                return ControlFlow::Continue(Proceed {
                    lead: None,
                    followed: true,
                })
            }
            Coalesced::Answered(record) => Coalesced::answer(&record, fingerprint),
            Coalesced::TimedOut => Settled::InProgress { retry_after },
        };
        timings.waited = Some(timings.since_arrival());
        timings.claimed = timings.waited;
        ControlFlow::Break(settled)
    }

    /// The record the leader handed over, compared with this request's own
    /// fingerprint: its replay, or a refusal.
    pub(crate) fn answer<B, E>(record: &Record, fingerprint: &Fingerprint) -> Settled<B, E> {
        if record.fingerprint == *fingerprint {
            Settled::Replayed(record.response.clone())
        } else {
            Settled::KeyReused
        }
    }
}
