//! Who owns a key: what both drivers' handles (`PgTx`/`SqlxTx`,
//! `PgLease`/`SqlxLease`) know about the owner they stand for, and the one
//! place that answers their accessors. Each handle holds an [`Identity`]
//! and delegates to it; only the connection or pool differs per driver.
//! The handles' public accessors are written once, in `tx_accessors!` and
//! `lease_accessors!`, which each handle's `impl` block invokes.

use std::{
    fmt,
    sync::atomic::{AtomicBool, Ordering},
    time::Duration,
};

use crate::{fingerprint::Fingerprint, key::IdempotencyKey, scope::Scope, store::OperationId};

/// An owner of a key: its scope, the key, the attempt token it holds it at
/// and the retention its answer is remembered for, plus what its role
/// adds (a claim's transaction: [`Tx`]; a long-running operation's lease:
/// [`Lease`]).
pub(crate) struct Identity<R> {
    scope: Scope,
    key: IdempotencyKey,
    /// The request's fingerprint: with the scope and the key, what an
    /// operation is (its derived ids follow from all of them).
    fingerprint: Fingerprint,
    token: i64,
    retention: Duration,
    role: R,
}

/// The identity behind a transaction handle (`PgTx`, `SqlxTx`).
pub(crate) type TxIdentity = Identity<Tx>;

/// The identity behind a lease handle (`PgLease`, `SqlxLease`).
pub(crate) type LeaseIdentity = Identity<Lease>;

/// What a transaction's owner adds: the transaction it claimed the key in.
pub(crate) struct Tx {
    xid: String,
}

impl Tx {
    /// `xid`: the transaction id the claim ran in (text form of `xid8`).
    pub(crate) fn new(xid: String) -> Self {
        Tx { xid }
    }
}

/// What a lease's owner adds: the operation, how long a heartbeat renews
/// the lease for, and whether the store has told this owner a newer one
/// took over (a fenced owner is an owner no more).
pub(crate) struct Lease {
    operation_id: OperationId,
    lease: Duration,
    fenced: AtomicBool,
}

impl Lease {
    /// A lease on `operation_id`, renewed for `lease` at each heartbeat;
    /// not fenced (yet).
    pub(crate) fn new(operation_id: OperationId, lease: Duration) -> Self {
        Lease {
            operation_id,
            lease,
            fenced: AtomicBool::new(false),
        }
    }
}

impl<R> Identity<R> {
    pub(crate) fn new(
        scope: Scope,
        key: IdempotencyKey,
        fingerprint: Fingerprint,
        token: i64,
        retention: Duration,
        role: R,
    ) -> Self {
        Identity {
            scope,
            key,
            fingerprint,
            token,
            retention,
            role,
        }
    }

    /// The tenant the request acts for.
    pub(crate) fn tenant(&self) -> &str {
        self.scope.tenant().as_str()
    }

    /// The endpoint of the owned key.
    pub(crate) fn endpoint(&self) -> &str {
        self.scope.endpoint()
    }

    pub(crate) fn scope(&self) -> &Scope {
        &self.scope
    }

    pub(crate) fn key(&self) -> &IdempotencyKey {
        &self.key
    }

    /// The key as the client sent it.
    pub(crate) fn idempotency_key(&self) -> &str {
        self.key.as_str()
    }

    pub(crate) fn attempt_token(&self) -> i64 {
        self.token
    }

    /// The fingerprint of the request the owner runs.
    pub(crate) fn fingerprint(&self) -> &Fingerprint {
        &self.fingerprint
    }

    /// The id of what this operation creates, `name` saying which.
    pub(crate) fn derived_id(&self, name: &str) -> String {
        self.scope
            .derived_id(self.key.as_str(), &self.fingerprint, name)
    }

    pub(crate) fn retention(&self) -> Duration {
        self.retention
    }

    /// The key's row and the token, in the order every statement on the
    /// row binds them (`$1` to `$4`): tenant, endpoint, key, token.
    pub(crate) fn columns(&self) -> (&str, &str, &str, i64) {
        (
            self.tenant(),
            self.endpoint(),
            self.idempotency_key(),
            self.token,
        )
    }
}

impl TxIdentity {
    /// The transaction id the claim ran in (text form of `xid8`).
    pub(crate) fn xid(&self) -> &str {
        &self.role.xid
    }

    /// A transaction handle's `Debug`, named `handle` (the key's text
    /// stays out: [`IdempotencyKey`]'s own `Debug` hides it).
    pub(crate) fn fmt_debug(&self, handle: &str, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct(handle)
            .field("scope", &self.scope)
            .field("key", &self.key)
            .field("attempt_token", &self.token)
            .finish_non_exhaustive()
    }

    /// The warning for a transaction whose last handle went before the
    /// layer committed or rolled it back: its connection is closed instead
    /// of going back to the pool, and PostgreSQL rolls back.
    pub(crate) fn warn_dropped_unfinished(&self) {
        tracing::warn!(
            endpoint = self.endpoint(),
            key_hash = %self.key.short_hash(),
            "idempotency transaction dropped unfinished; closing its connection (rolled back)"
        );
    }
}

impl LeaseIdentity {
    /// The operation's id: the same for every attempt.
    pub(crate) fn operation_id(&self) -> OperationId {
        self.role.operation_id
    }

    /// How long a heartbeat renews the lease for.
    pub(crate) fn lease(&self) -> Duration {
        self.role.lease
    }

    /// Whether the store has told this owner it was fenced.
    pub(crate) fn is_fenced(&self) -> bool {
        self.role.fenced.load(Ordering::Relaxed)
    }

    /// Remembers that the store refused this owner.
    pub(crate) fn mark_fenced(&self) {
        self.role.fenced.store(true, Ordering::Relaxed);
    }

    /// A lease handle's `Debug`, named `handle`.
    pub(crate) fn fmt_debug(&self, handle: &str, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct(handle)
            .field("scope", &self.scope)
            .field("key", &self.key)
            .field("operation_id", &self.role.operation_id)
            .field("attempt_token", &self.token)
            .field("fenced", &self.is_fenced())
            .finish_non_exhaustive()
    }
}

/// The public accessors of a transaction handle (`PgTx`, `SqlxTx`), for
/// its `impl` block: both drivers' handles answer and document them alike.
/// The handle has a `fn identity(&self) -> &TxIdentity`.
macro_rules! tx_accessors {
    () => {
        /// The tenant the request acts for, as a string (handy as a query
        /// parameter).
        pub fn tenant(&self) -> &str {
            self.identity().tenant()
        }

        /// The scope (tenant and endpoint) of the owned key.
        pub fn scope(&self) -> &$crate::scope::Scope {
            self.identity().scope()
        }

        /// This attempt's token: a new owner of the key (the first, or one
        /// that took over an expired record) always gets a larger one than
        /// every owner before it, even after the key's row was removed.
        /// Tokens come from one sequence, so they are not consecutive per
        /// key.
        pub fn attempt_token(&self) -> i64 {
            self.identity().attempt_token()
        }

        /// The idempotency key this transaction owns, as the client sent it.
        /// Handlers may store it (a provider recording which key charged);
        /// keep it out of logs.
        pub fn idempotency_key(&self) -> &str {
            self.identity().idempotency_key()
        }

        /// The id of what this operation creates, `name` saying which
        /// ("order"): a UUID from the tenant, the endpoint, the key, the
        /// request's fingerprint and `name`, the same whenever the same
        /// request is redone under the key (after a rollback, or after an
        /// asynchronous failover lost its commit), so that keys derived from
        /// it downstream stay the same, and new for a new request under a
        /// key whose retention ended
        /// ([`Scope::derived_id`]($crate::scope::Scope::derived_id)).
        pub fn derived_id(&self, name: &str) -> String {
            self.identity().derived_id(name)
        }
    };
}

/// The public accessors of a lease handle (`PgLease`, `SqlxLease`), for its
/// `impl` block. The handle has a `fn identity(&self) -> &LeaseIdentity`.
macro_rules! lease_accessors {
    () => {
        /// The operation's id: the same for every attempt, so the key for
        /// downstream calls.
        pub fn operation_id(&self) -> $crate::store::OperationId {
            self.identity().operation_id()
        }

        /// This attempt's fencing token: larger than every earlier attempt's
        /// for this key, even after its record was removed.
        pub fn attempt_token(&self) -> i64 {
            self.identity().attempt_token()
        }

        /// The tenant the operation acts for.
        pub fn tenant(&self) -> &str {
            self.identity().tenant()
        }

        /// The scope (tenant and endpoint) of the operation.
        pub fn scope(&self) -> &$crate::scope::Scope {
            self.identity().scope()
        }

        /// The client's idempotency key; keep it out of logs.
        pub fn idempotency_key(&self) -> &str {
            self.identity().idempotency_key()
        }

        /// The id of what this operation creates, `name` saying which
        /// ("shipment"): the same for every attempt, and for the same
        /// request redone after an asynchronous failover lost it (its
        /// [`operation_id`](Self::operation_id) is drawn anew then); new for
        /// a new request under a key whose retention ended
        /// ([`Scope::derived_id`]($crate::scope::Scope::derived_id)).
        pub fn derived_id(&self, name: &str) -> String {
            self.identity().derived_id(name)
        }

        /// Whether the store has told this owner it was fenced (a heartbeat,
        /// a fenced transaction or the completion found a newer token). Once
        /// `true`, every write is refused; stop early.
        pub fn is_fenced(&self) -> bool {
            self.identity().is_fenced()
        }
    };
}

pub(crate) use {lease_accessors, tx_accessors};
