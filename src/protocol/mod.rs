//! The PostgreSQL protocol both drivers speak: the schema and its
//! migrations, every statement both send, the reading of the columns they
//! return, what the server's errors mean, the SQL guard a handler's
//! statements pass, the identity of a key's owner that both drivers'
//! handles hold, how long the protocol waits, and the owner's transaction
//! itself (`owner`), written once over the seam a driver implements
//! (`driver`). `postgres/` (tokio-postgres and deadpool) and `sqlx/` each
//! implement the seam in one file and never use each other; nothing here
//! names a driver or its feature (`tests/layering.rs`).

pub(crate) mod admin;
pub(crate) mod at_commit;
pub(crate) mod cancel;
pub(crate) mod citus;
#[cfg(all(test, feature = "test-util"))]
mod citus_tests;
pub(crate) mod claim;
pub(crate) mod complete;
pub(crate) mod driver;
pub(crate) mod errors;
pub(crate) mod identity;
pub(crate) mod lease;
pub(crate) mod lexer;
pub(crate) mod migration_session;
pub(crate) mod migrations;
pub(crate) mod outbox;
pub(crate) mod owner;
pub(crate) mod record;
pub(crate) mod retention;
pub(crate) mod session_reset;
pub(crate) mod sql;
pub(crate) mod telemetry;
#[cfg(test)]
mod tests;
pub(crate) mod transaction;
pub(crate) mod user_types;
pub(crate) mod waits;

/// [`Store`](crate::store::Store) and
/// [`CommitStore`](crate::store::CommitStore) for a store `$store` (a
/// [`Driver`](driver::Driver)) whose handle is `$tx` (a
/// [`Handle`](owner::Handle) of the driver's connection): the owner's
/// transaction of [`owner`], the same for every driver.
macro_rules! forward_store {
    ($store:ty, $tx:ty) => {
        impl crate::store::Store for $store {
            type Tx = $tx;

            async fn claim(
                &self,
                request: &crate::store::ClaimRequest,
            ) -> Result<crate::store::Claim<$tx>, crate::store::StoreError> {
                crate::protocol::telemetry::start(self, crate::protocol::telemetry::CLAIM)
                    .end(crate::protocol::owner::claim(self, request).await)
            }

            async fn complete(
                &self,
                tx: $tx,
                response: &crate::record::StoredResponse,
            ) -> Result<(), crate::store::StoreError> {
                crate::protocol::telemetry::start(self, crate::protocol::telemetry::COMPLETE)
                    .end(crate::protocol::owner::complete(tx, response).await)
            }

            async fn abort(&self, tx: $tx) -> Result<(), crate::store::StoreError> {
                crate::protocol::owner::abort(tx).await
            }

            async fn lookup(
                &self,
                request: &crate::store::ClaimRequest,
            ) -> Result<Option<crate::record::Record>, crate::store::StoreError> {
                crate::protocol::telemetry::start(self, crate::protocol::telemetry::LOOKUP)
                    .end(crate::protocol::owner::lookup(self, request).await)
            }
        }

        impl crate::store::CommitStore for $store {
            async fn begin(
                &self,
                request: &crate::store::ClaimRequest,
            ) -> Result<$tx, crate::store::StoreError> {
                crate::protocol::owner::begin_at_commit(self, request).await
            }

            async fn commit(
                &self,
                tx: $tx,
                request: &crate::store::ClaimRequest,
                response: &crate::record::StoredResponse,
            ) -> Result<crate::store::Committed, crate::store::StoreError> {
                crate::protocol::telemetry::start(self, crate::protocol::telemetry::COMMIT).end(
                    crate::protocol::owner::commit_at_commit(self, tx, request, response).await,
                )
            }
        }
    };
}

pub(crate) use forward_store;

/// [`LeaseStore`](crate::store::LeaseStore) for a store `$store` (a
/// [`Driver`](driver::Driver)) whose lease is `$lease` (made by
/// `$lease::new(store, identity)`, answering `identity()`) and whose
/// handle is `$tx`: the protocol's calls ([`lease`]) and the fenced
/// transaction ([`owner`]).
macro_rules! forward_lease_store {
    ($store:ty, $lease:ident, $tx:ty) => {
        impl crate::store::LeaseStore for $store {
            type Lease = $lease;

            async fn acquire(
                &self,
                claim: &crate::store::ClaimRequest,
                request: &crate::store::LeaseRequest,
            ) -> Result<crate::store::Acquired<$lease>, crate::store::StoreError> {
                crate::protocol::telemetry::start(self, crate::protocol::telemetry::CLAIM).end(
                    crate::protocol::lease::acquire(self, claim, request, |id| {
                        $lease::new(self.clone(), id)
                    })
                    .await,
                )
            }

            async fn heartbeat(
                &self,
                lease: &$lease,
                extend: std::time::Duration,
            ) -> Result<(), crate::store::StoreError> {
                crate::protocol::lease::heartbeat(self, lease.identity(), extend).await
            }

            async fn fenced(&self, lease: &$lease) -> Result<$tx, crate::store::StoreError> {
                crate::protocol::owner::open_fenced(self, lease.identity()).await
            }

            async fn commit_fenced(&self, tx: $tx) -> Result<(), crate::store::StoreError> {
                crate::protocol::owner::commit_fenced(tx).await
            }

            async fn finish(
                &self,
                lease: &$lease,
                response: &crate::record::StoredResponse,
            ) -> Result<(), crate::store::StoreError> {
                crate::protocol::telemetry::start(self, crate::protocol::telemetry::COMPLETE)
                    .end(crate::protocol::lease::finish(self, lease.identity(), response).await)
            }

            async fn release(&self, lease: &$lease) -> Result<(), crate::store::StoreError> {
                crate::protocol::lease::release(self, lease.identity()).await
            }

            async fn fail(
                &self,
                lease: &$lease,
                response: &crate::record::StoredResponse,
                attempts: u32,
            ) -> Result<(), crate::store::StoreError> {
                crate::protocol::lease::fail(self, lease.identity(), response, attempts).await
            }

            async fn operation(
                &self,
                tenant: &crate::scope::TenantId,
                id: crate::store::OperationId,
            ) -> Result<Option<crate::store::Operation>, crate::store::StoreError> {
                crate::protocol::lease::operation(self, tenant, id).await
            }

            async fn recover(
                &self,
                endpoint: &str,
                lease: std::time::Duration,
                retention: std::time::Duration,
                backoff: crate::store::Backoff,
            ) -> Result<Option<crate::store::Recovered<$lease>>, crate::store::StoreError> {
                crate::protocol::lease::recover(self, endpoint, lease, retention, backoff, |id| {
                    $lease::new(self.clone(), id)
                })
                .await
            }
        }
    };
}

pub(crate) use forward_lease_store;
