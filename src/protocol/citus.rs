//! Citus: the crate's tables distributed by `tenant_id` when the database
//! has the `citus` extension (a coordinator), co-located, so that every
//! statement of a request is routed to the one worker that holds its
//! tenant's shards and commits there without a two-phase commit. Run by
//! the migrator after the migrations, and by [`distribute`] for a table of
//! the application's, which joins the same co-location group.
//!
//! What distribution changes is in the protocol's statements, not here:
//! times they compare in `ON CONFLICT … DO UPDATE` are bound or taken from
//! `EXCLUDED`, nothing volatile in an `UPDATE` or a `RETURNING`, and work
//! across tenants (the relay, cleanup, recovery) finds its tenants first and
//! then locks rows per tenant (see the deploying guide).

use super::{
    migration_session::{MigrationSession, MIGRATION_LOCK},
    sql::{Columns, Param, Sql},
    transaction::BEGIN,
};
use crate::store::{StoreError, StoreErrorKind};

/// The table every other one is co-located with.
pub(crate) const ANCHOR: &str = "idempotency_requests";

/// The crate's own tables, in the order they are distributed: the anchor
/// first.
pub(crate) const OWN_TABLES: [&str; 3] = [ANCHOR, "outbox_events", "inbox_events"];

/// Triggers Citus refuses on a distributed table: the outbox's wake-up
/// notifications (they would fire on a worker, where no relay listens). A
/// relay on Citus finds its work by polling.
const NOTIFY_TRIGGERS: &str =
    "DROP TRIGGER IF EXISTS outbox_events_notify_insert ON outbox_events; \
     DROP TRIGGER IF EXISTS outbox_events_notify_redrive ON outbox_events";

/// Whether the database is a Citus coordinator (has the extension).
pub(crate) const IS_CITUS: Sql<'static> =
    Sql::new("SELECT EXISTS (SELECT FROM pg_extension WHERE extname = 'citus')");

/// Whether the table named `$1` exists, and whether it is distributed
/// (two columns; the second NULL when it does not exist).
pub(crate) const TABLE_STATE: Sql<'static> = Sql::new(
    "SELECT to_regclass($1::text) IS NOT NULL, \
         EXISTS (SELECT FROM pg_dist_partition WHERE logicalrelid = to_regclass($1::text))",
);

/// The setting that makes Citus send a transaction's `SET LOCAL` on to
/// the workers it opens (`'local'`; the default, `'none'`, keeps them on
/// the coordinator). The claim's lock wait is a `SET LOCAL`, and the row
/// lock it bounds is waited for on a worker.
pub(crate) const PROPAGATION: Sql<'static> =
    Sql::new("SELECT current_setting('citus.propagate_set_commands')");

/// Makes [`PROPAGATION`] `'local'` the database's default, for every
/// session that starts from now on.
const PROPAGATE_LOCAL: &str = "DO $$ BEGIN \
     EXECUTE format('ALTER DATABASE %I SET citus.propagate_set_commands = local', current_database()); \
     END $$";

/// Distributes the table `$1` by `tenant_id`, co-located with `$2`
/// (`'default'` for the first).
pub(crate) const DISTRIBUTE: Sql<'static> = Sql::new(
    "SELECT create_distributed_table($1::text::regclass, 'tenant_id', colocate_with => $2::text)",
);

/// What [`distribute`] did.
#[derive(Debug, Clone, PartialEq, Eq, Default)]
pub(crate) struct Distribution {
    /// False when the database has no Citus: nothing was done.
    pub(crate) citus: bool,
    /// Tables distributed by this call (those already distributed are left
    /// as they are).
    pub(crate) distributed: Vec<String>,
    /// The database's default of [`PROPAGATION`] was set to `'local'`:
    /// sessions started before do not have it, so the one this ran on is
    /// closed rather than pooled again.
    pub(crate) reconnect: bool,
}

/// [`distribute`] on a connection of `driver`'s pool: whether the
/// database is a Citus coordinator.
pub(crate) async fn distribute_on<D: super::driver::Driver>(
    driver: &D,
    tables: &[&str],
) -> Result<bool, StoreError> {
    let mut session = super::migration_session::OnConnection::open(driver).await?;
    let done = distribute(&mut session, tables).await?;
    session.finish(done.reconnect);
    Ok(done.citus)
}

/// On a Citus coordinator, distributes each of `tables` by `tenant_id`
/// (co-located with [`ANCHOR`], or the anchor itself first), under the
/// migration lock so that several processes may call it at once; tables
/// already distributed, by this or by an operator, are left alone. It also
/// makes `citus.propagate_set_commands = 'local'` the database's default
/// unless sessions already have it (an operator may set it for a role
/// instead), so that a claim's `SET LOCAL lock_timeout` bounds its wait on
/// the worker. Without Citus it does nothing. Each table must exist and have a `tenant_id`
/// column in every primary key and unique constraint.
pub(crate) async fn distribute<T: MigrationSession>(
    transport: &mut T,
    tables: &[&str],
) -> Result<Distribution, StoreError> {
    transport
        .batch(&format!(
            "{BEGIN}; SELECT pg_advisory_xact_lock({MIGRATION_LOCK})"
        ))
        .await?;
    let rows = transport.query(IS_CITUS, &[]).await?;
    let citus = rows.first().map(|row| row.bool(0)).transpose()?;
    let mut done = Distribution {
        citus: citus.unwrap_or(false),
        distributed: Vec::new(),
        reconnect: false,
    };
    if done.citus {
        let rows = transport.query(PROPAGATION, &[]).await?;
        let propagation = rows.first().map(|row| row.text(0).map(str::to_owned));
        if propagation.transpose()?.as_deref() != Some("local") {
            transport.batch(PROPAGATE_LOCAL).await?;
            done.reconnect = true;
        }
        for table in tables {
            let rows = transport.query(TABLE_STATE, &[Param::Text(table)]).await?;
            let row = rows.first().ok_or_else(|| no_row(table))?;
            if !row.bool(0)? {
                return Err(StoreError::new(
                    StoreErrorKind::Backend,
                    format!("cannot distribute {table}: no such table"),
                ));
            }
            if row.bool(1)? {
                continue;
            }
            if *table == "outbox_events" {
                transport.batch(NOTIFY_TRIGGERS).await?;
            }
            let colocate = if *table == ANCHOR { "default" } else { ANCHOR };
            transport
                .query(DISTRIBUTE, &[Param::Text(table), Param::Text(colocate)])
                .await?;
            done.distributed.push((*table).to_owned());
        }
    }
    transport.commit().await?;
    if !done.distributed.is_empty() {
        tracing::info!(tables = ?done.distributed, "distributed by tenant_id on Citus");
    }
    Ok(done)
}

fn no_row(table: &str) -> StoreError {
    StoreError::new(
        StoreErrorKind::Backend,
        format!("cannot distribute {table}: the catalog query returned no row"),
    )
}
