//! Long-running operations: a committed `in_progress` record, a lease kept
//! alive by heartbeats, and a fencing token that stale workers cannot get past.
//!
//! The default mode holds the key in one open transaction from claim to
//! commit: right for work that takes milliseconds, wrong for work that waits
//! tens of seconds on a slow warehouse or a payment provider. For those,
//! [`IdempotencyLayer::long_running`](crate::IdempotencyLayer::long_running)
//! switches an endpoint to the two-phase mode:
//!
//! ```text
//!              acquire (short tx, COMMIT)
//!   (none) ───────────────────────────────▶ in_progress {lease, token T}
//!                                             │  heartbeat: lease extended WHERE token = T
//!                                             │  fenced tx: row held WHERE token = T; writes; COMMIT
//!        lease expired: a duplicate or the    │
//!        recovery worker takes over ──────────┤  CAS T → T' > T; the work runs again
//!                                             │
//!                                             ▼  finish: response stored WHERE token = T
//!                                          completed ──▶ replayed byte for byte
//!
//!   stale owner (token T < T') ──▶ heartbeat, fenced tx, finish: Fenced; it stops, changing nothing
//! ```
//!
//! 1. The first request commits an `in_progress` record with a lease and an
//!    attempt token ([`LeaseStore::acquire`](crate::store::LeaseStore::acquire))
//!    and its work starts on a task of its own, with the lease handle
//!    ([`PgLease`](crate::postgres::PgLease)) in the request extensions.
//! 2. If the work answers within [`LeaseConfig::respond_within`], the client
//!    gets that answer; otherwise `202 Accepted` with `Location:
//!    /operations/{id}` and `{"operation_id": "…", "state": "running"}`.
//! 3. While the lease is valid, a duplicate gets the same `202` (marked
//!    `Idempotent-Replayed: true`) and never a second execution; once
//!    completed, the final answer byte for byte. A different request under
//!    the key is `409 idempotency_key_reused`.
//! 4. The layer heartbeats every [`LeaseConfig::heartbeat`]. Should the owner
//!    die or stall, its lease runs out and the next duplicate (or the
//!    [`Recovery`] worker) takes the operation over under a larger token.
//! 5. **An operation keeps its identity.** An attempt that ends without an
//!    answer to remember (a 5xx, an error, a panic, the handler timeout, a
//!    crash) does not forget the operation: fenced work may have committed
//!    and downstream calls keyed by it may have been sent. Its lease is
//!    given up ([`LeaseStore::release`](crate::store::LeaseStore::release):
//!    the lease expires now and the token moves on), and the next attempt,
//!    a retry with the same key (at once) or the [`Recovery`] worker (after
//!    its backoff, [`LeaseConfig::recovery_backoff`]), resumes the **same
//!    operation id** under a larger token. Another request under the key
//!    gets `409 idempotency_key_reused` meanwhile.
//! 6. **Attempts are bounded.** Each attempt is counted (the first run,
//!    takeovers, recoveries; [`Owned::attempt`](crate::store::Owned::attempt)).
//!    After [`LeaseConfig::max_attempts`] (default 5) attempts without an
//!    answer the operation ends **failed**: a remembered
//!    `500 operation_failed` answered, replayed to every retry with
//!    `Idempotent-Replayed: true`, and shown by the status resource as
//!    `{"state": "failed", "attempts": N, "error": {…}}`. A last attempt
//!    that took its process down is failed by the next acquisition, which
//!    then runs nothing. `202` and `409 idempotency_in_progress` carry
//!    `Retry-After` (the heartbeat, in whole seconds).
//! 7. Every write the work makes goes through a fenced transaction
//!    ([`PgLease::transaction`](crate::postgres::PgLease::transaction)),
//!    which holds the record at the owner's token until it commits, and the
//!    final answer is stored by a compare-and-swap on the token. A stale
//!    owner gets [`Fenced`](crate::store::StoreErrorKind::Fenced) on both,
//!    and the layer stops its work when a heartbeat finds it fenced.
//!
//! # Writing a re-drivable handler
//!
//! A takeover runs the handler again from the start, possibly after the
//! first owner already did part of the work. So the handler must:
//!
//! - **Resume from its own recovery point.** Read what earlier attempts
//!   committed (in a fenced transaction) and continue from there rather than
//!   redo it: a shipment already recorded is returned, not requested again.
//! - **Key downstream calls by the stable operation id**
//!   ([`PgLease::operation_id`](crate::postgres::PgLease::operation_id), e.g.
//!   through [`derive_key`](crate::outbox::derive_key)), never by the attempt,
//!   so a call repeated by a takeover is recognised downstream; and send the
//!   attempt token ([`PgLease::attempt_token`](crate::postgres::PgLease::attempt_token))
//!   along (a `Fencing-Token` header), so a downstream that can refuses calls
//!   from a stale attempt. A lease cannot undo a side effect already sent;
//!   downstream idempotency does.
//! - **Need nothing the request does not carry.** The recovery worker
//!   re-drives from the stored request: method, path and query,
//!   `Content-Type`, body, and the tenant (as a
//!   [`TenantId`](crate::scope::TenantId) extension). Credentials are not
//!   stored.
//!
//! # When to use which mode
//!
//! | | short transaction (default) | long-running |
//! | --- | --- | --- |
//! | work takes | milliseconds | seconds to minutes |
//! | handler writes and answer commit | in one transaction | in fenced transactions; the answer by CAS |
//! | a crash mid-work | rolls back: nothing happened | lease expires: taken over, re-driven |
//! | a failed attempt | rolls back; the key is free | the operation stays for its next attempt; `failed` after the last |
//! | first answer | always final | final, or `202` + status resource |
//! | the handler must | write through `PgTx` | be re-drivable (above) |

// The long-running mode's public face: everything is defined where it
// works (the mode and its services in the server, the id with the stores)
// and named here.
pub use crate::server::{
    LeaseConfig, LongRunning, Mode, Recovery, ShortTransaction, StatusFuture, StatusService,
};
pub use crate::store::id::{OperationId, OperationIdError};
