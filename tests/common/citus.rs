//! The Citus cluster the tests of one process share (a coordinator and two
//! workers, started once), and the tests' backends on a fresh database of
//! it: the crate's tables distributed by `migrate`, the tests' `orders`
//! table distributed beside them.

use std::sync::OnceLock;

use tower_idempotency::{postgres::PgStore, sqlx::SqlxStore, testing::TempCitus};

use super::{sqlx_pool, Postgres, Sqlx};

static CLUSTER: OnceLock<Result<TempCitus, String>> = OnceLock::new();

/// The process's Citus cluster.
///
/// # Panics
///
/// When it cannot start; the message says what to install.
pub(crate) async fn cluster() -> &'static TempCitus {
    let started = tokio::task::spawn_blocking(|| {
        CLUSTER
            .get_or_init(|| TempCitus::start(2).map_err(|e| e.to_string()))
            .as_ref()
            .map(|_| ())
            .map_err(Clone::clone)
    })
    .await
    .expect("the cluster's start does not panic");
    if let Err(e) = started {
        panic!("{e}");
    }
    CLUSTER
        .get()
        .and_then(|c| c.as_ref().ok())
        .expect("started")
}

/// The tests' `orders` table, keyed by tenant so that it can be
/// distributed.
const ORDERS: &str = "CREATE TABLE orders (tenant_id text NOT NULL, id text NOT NULL, \
     PRIMARY KEY (tenant_id, id))";

/// A [`Postgres`] backend on a fresh database of the cluster.
pub(crate) async fn postgres() -> Postgres {
    let db = cluster()
        .await
        .database()
        .await
        .unwrap_or_else(|e| panic!("{e}"));
    let store = PgStore::builder(db.config()).build().expect("store builds");
    store.migrate().await.expect("migrations apply");
    let client = db.client().await;
    client.batch_execute(ORDERS).await.expect("orders table");
    let distributed = store.distribute_by_tenant(&["orders"]).await;
    assert!(distributed.expect("orders distributes"), "Citus is there");
    Postgres { db, store, client }
}

/// A [`Sqlx`] backend on a fresh database of the cluster.
pub(crate) async fn sqlx() -> Sqlx {
    let db = cluster()
        .await
        .database()
        .await
        .unwrap_or_else(|e| panic!("{e}"));
    let store = SqlxStore::new(sqlx_pool(&db, 16).await);
    store.migrate().await.expect("migrations apply");
    let client = db.client().await;
    client.batch_execute(ORDERS).await.expect("orders table");
    let distributed = store.distribute_by_tenant(&["orders"]).await;
    assert!(distributed.expect("orders distributes"), "Citus is there");
    Sqlx { db, store, client }
}
