//! One call's state, shared by its attempts, the retry policy (which tower
//! clones into the call) and the call's own future (which reads it at the
//! end).

use std::sync::{Arc, Mutex, MutexGuard, PoisonError};

use super::report::{GiveUp, RetryReason};

/// What one call's attempts have done so far; shared by the policy (which
/// tower clones into the call) and the call's own future (which reads it at
/// the end).
#[derive(Clone, Default)]
pub(crate) struct Shared(Arc<Mutex<CallState>>);

#[derive(Default)]
pub(crate) struct CallState {
    pub(crate) attempts: u32,
    pub(crate) retries: Vec<RetryReason>,
    pub(crate) gave_up: Option<GiveUp>,
    pub(crate) not_replayable: bool,
}

impl Shared {
    pub(crate) fn lock(&self) -> MutexGuard<'_, CallState> {
        // Held only for a few assignments, never across an await; a panic
        // elsewhere leaves nothing half-written worth refusing.
        self.0.lock().unwrap_or_else(PoisonError::into_inner)
    }

    /// Counts an attempt and returns its number (1 for the first).
    pub(crate) fn attempt_started(&self) -> u32 {
        let mut state = self.lock();
        state.attempts += 1;
        state.attempts
    }
}
