//! The PostgreSQL protocol both drivers speak: the schema and its
//! migrations, every statement both send, the reading of the columns they
//! return, the SQL guard a handler's statements pass, the identity of a
//! key's owner that both drivers' handles hold, and how long the protocol
//! waits. `postgres/`
//! (tokio-postgres and deadpool) and `sqlx/` each use this module and never
//! each other; nothing here depends on a driver.

pub(crate) mod errors;
pub(crate) mod identity;
pub(crate) mod lease;
pub(crate) mod lexer;
pub(crate) mod migrations;
pub(crate) mod statements;
pub(crate) mod waits;

/// [`Store`](crate::store::Store) for a store `$store` whose handle is
/// `$tx`: the same forwarding for both drivers, to the `claim::claim`,
/// `finish::complete` and `finish::abort` of the module that invokes it.
macro_rules! forward_store {
    ($store:ty, $tx:ty) => {
        impl crate::store::Store for $store {
            type Tx = $tx;

            async fn claim(
                &self,
                request: &crate::store::ClaimRequest,
            ) -> Result<crate::store::Claim<$tx>, crate::store::StoreError> {
                claim::claim(self, request).await
            }

            async fn complete(
                &self,
                tx: $tx,
                response: &crate::record::StoredResponse,
            ) -> Result<(), crate::store::StoreError> {
                finish::complete(tx, response).await
            }

            async fn abort(&self, tx: $tx) -> Result<(), crate::store::StoreError> {
                finish::abort(tx).await
            }
        }
    };
}

pub(crate) use forward_store;
