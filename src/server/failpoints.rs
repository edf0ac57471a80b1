//! Named fault points in the request flow, for tests (feature `failpoints`).
//!
//! A test attaches an [`InjectFault`] to one request's extensions; when that
//! request's work reaches the named [`FaultPoint`], it panics there. The panic
//! ends the task that runs the request's work, as a crash of the process
//! would end it at that instant: the claim's transaction handle is dropped
//! mid-flight, nothing after the point runs, and the caller never gets an
//! answer (the panic resumes in the response future). Unlike a real crash,
//! destructors run: the process-level faults (a killed server, a connection
//! cut on the wire) are tested separately, with a killed example server and
//! a fault-injecting proxy.
//!
//! Only the request carrying the extension is affected, so tests that run in
//! parallel in one process do not disturb each other. The points are in the
//! short-transaction flow; without the feature they compile to nothing.
//!
//! ```
//! use tower_idempotency::failpoints::{FaultPoint, InjectFault};
//!
//! let mut request = http::Request::post("/orders").body(()).unwrap();
//! request
//!     .extensions_mut()
//!     .insert(InjectFault::panic_at(FaultPoint::AfterCommit));
//! ```

use std::fmt;

/// Where in the request flow a fault is injected, in the order a request
/// passes them.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
#[non_exhaustive]
pub enum FaultPoint {
    /// Admitted (key, tenant, body and fingerprint checked), before the
    /// store is asked for the key.
    BeforeClaim,
    /// The request owns its key (its transaction is open), before the
    /// handler is called.
    AfterClaim,
    /// The handler returned (its writes are made in the open transaction)
    /// and its response is buffered, before it is remembered.
    AfterHandler,
    /// The response is to be remembered: immediately before the store is
    /// asked to commit it with the handler's writes.
    BeforeCommit,
    /// The store committed the response with the handler's writes, before
    /// the answer leaves (and before the replay cache and the waiting
    /// duplicates of this process hear of it).
    AfterCommit,
}

impl FaultPoint {
    /// Every point, in flow order.
    pub const ALL: [FaultPoint; 5] = [
        FaultPoint::BeforeClaim,
        FaultPoint::AfterClaim,
        FaultPoint::AfterHandler,
        FaultPoint::BeforeCommit,
        FaultPoint::AfterCommit,
    ];

    /// Whether a request stopped at this point has committed its work.
    pub fn committed(self) -> bool {
        matches!(self, FaultPoint::AfterCommit)
    }
}

impl fmt::Display for FaultPoint {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(match self {
            FaultPoint::BeforeClaim => "before_claim",
            FaultPoint::AfterClaim => "after_claim",
            FaultPoint::AfterHandler => "after_handler",
            FaultPoint::BeforeCommit => "before_commit",
            FaultPoint::AfterCommit => "after_commit",
        })
    }
}

/// A request extension: the request's work panics at [`FaultPoint`].
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct InjectFault {
    point: FaultPoint,
}

impl InjectFault {
    /// Panic when the request reaches `point`.
    pub fn panic_at(point: FaultPoint) -> Self {
        InjectFault { point }
    }

    /// Where the fault fires.
    pub fn point(&self) -> FaultPoint {
        self.point
    }

    /// Fires if `point` is this fault's.
    pub(crate) fn hit(this: Option<Self>, point: FaultPoint) {
        if this.is_some_and(|fault| fault.point == point) {
            panic!("injected fault at {point}");
        }
    }
}
