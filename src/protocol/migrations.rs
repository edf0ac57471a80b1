//! The schema, as versioned migrations, and the one runner both drivers
//! apply them with. Append only; never edit a released migration. The
//! rules a migration follows are in the migration guide
//! (`docs/migrations.md`).
//!
//! The runner is written for a table under load. Each transactional
//! migration runs in a transaction of its own, under the migration lock (an
//! advisory lock held to the transaction's end) and with a short
//! `lock_timeout`: a DDL statement that queues for its table's lock makes
//! every claim queue behind it, so it gives up after [`LOCK_TIMEOUT`], rolls
//! back, lets the claims through for a jittered backoff and tries again (at
//! most [`LOCK_ATTEMPTS`] times). Indexes are built with `CREATE INDEX
//! CONCURRENTLY` outside any transaction, checked valid, and rebuilt when an
//! interrupted build left a dead one. Nothing relies on session state
//! between statements, so it runs through a transaction pooler too.
//!
//! Migrators racing on a fresh database (every first deploy) leave the
//! schema one migrator leaves: a migrator that waited out another's index
//! build reads the record under the migration lock before it looks at the
//! index again, and stops once the migration is recorded (a later version
//! may have taken the index under another name since); a version missing
//! under recorded later ones is recorded, never run again
//! ([`Standing::Superseded`]); and an index built again under a name a
//! later version took is dropped at the run's end
//! (`Step::ConcurrentIndex::taken_by`).
//!
//! A driver adds only a [`MigrationSession`]: how it sends the runner's
//! statements.

use std::{
    fmt,
    time::{Duration, Instant},
};

use super::{
    driver::Driver,
    errors::LOCK_NOT_AVAILABLE,
    migration_session::{MigrationSession, OnConnection, MIGRATION_LOCK},
    transaction::BEGIN,
};
use crate::store::{StoreError, StoreErrorKind};

/// The SQLSTATE of a deadlock PostgreSQL broke by ending one statement.
const DEADLOCK_DETECTED: &str = "40P01";

/// PostgreSQL's internal error: how a build that raced another migrator's
/// build or drop of the same index on the catalog's rows may end ("tuple
/// concurrently updated"). A build step that ends so looks again, as after
/// a lock timeout: the index's state decides what comes next.
const INTERNAL_ERROR: &str = "XX000";

/// How long one statement of a migration waits for a lock before its
/// transaction gives up and is tried again. While a DDL statement waits for
/// its table's lock, the claims on that table wait behind it: this is the
/// longest a migration holds them up at a time.
pub(crate) const LOCK_TIMEOUT: Duration = Duration::from_secs(2);

/// How many times a transaction of the runner is tried before the migration
/// gives up with [`StoreErrorKind::Unavailable`].
pub(crate) const LOCK_ATTEMPTS: u32 = 10;

/// How many times a concurrent index is built before the runner gives up
/// on it (a build that fails leaves an invalid index, which is dropped and
/// built again).
pub(crate) const INDEX_BUILDS: u32 = 3;

/// How long a migrator waits for another one's build of the same index
/// before it gives up with [`StoreErrorKind::Unavailable`].
pub(crate) const BUILD_WAIT: Duration = Duration::from_secs(60 * 60);

/// One step of a [`Migration`]. A migration's steps are all of one kind
/// (see [`Migration`]).
#[derive(Debug, Clone, Copy)]
pub(crate) enum Step {
    /// Statements (one simple-query string) run in the migration's
    /// transaction.
    Transactional(&'static str),
    /// `CREATE [UNIQUE] INDEX CONCURRENTLY IF NOT EXISTS {name} ON {table} …`,
    /// one statement, run outside any transaction.
    ConcurrentIndex {
        name: &'static str,
        table: &'static str,
        sql: &'static str,
        /// The later version that takes the index under another name (makes
        /// it a constraint's, or renames it), if one does. Once that version
        /// is recorded the name is free for good, and an index that bears it
        /// is a leftover: built again by a migrator that looked for it after
        /// that version ran. The runner drops such leftovers (a second
        /// unique index on the key columns, which every insert maintains and
        /// which can fail an insert that `ON CONFLICT` on the primary key
        /// would have settled).
        taken_by: Option<i32>,
    },
}

/// A version of the schema: the steps that bring the previous one to it.
///
/// Either transactional steps only, run in one transaction with the record
/// of the migration (all or nothing), or index builds only, each built
/// concurrently and checked valid, and then the migration recorded. Never
/// both: such a migration is recorded only after its builds, so a second
/// migrator would run its transactional steps again, and its `ALTER`
/// queued behind one migrator's build while that build waits out the
/// `ALTER`'s transaction (`CREATE INDEX CONCURRENTLY` waits for every older
/// snapshot) is a deadlock.
#[derive(Debug, Clone, Copy)]
pub(crate) struct Migration {
    pub(crate) version: i32,
    pub(crate) name: &'static str,
    pub(crate) steps: &'static [Step],
}

/// Every migration, in order: append only; never edit a released one.
pub(crate) const MIGRATIONS: &[Migration] = &[
    Migration {
        version: 1,
        name: "baseline",
        steps: &[Step::Transactional(include_str!(
            "schema/0001_baseline.sql"
        ))],
    },
    Migration {
        version: 2,
        name: "lz4_stored_bodies",
        steps: &[Step::Transactional(include_str!(
            "schema/0002_lz4_stored_bodies.sql"
        ))],
    },
    Migration {
        version: 3,
        name: "session_reset_function",
        steps: &[Step::Transactional(include_str!(
            "schema/0003_session_reset_function.sql"
        ))],
    },
    Migration {
        version: 4,
        name: "session_reset_keeps_hold_limit",
        steps: &[Step::Transactional(include_str!(
            "schema/0004_session_reset_keeps_hold_limit.sql"
        ))],
    },
    Migration {
        version: 5,
        name: "session_reset_static",
        steps: &[Step::Transactional(include_str!(
            "schema/0005_session_reset_static.sql"
        ))],
    },
    // Versions 6 to 9 make the key columns whose values differ from one
    // key to the next (the idempotency key, the outbox's aggregate id, the
    // inbox's consumer and event id) compare byte by byte, collation "C",
    // whatever the database's locale, without rebuilding an index while its
    // table is locked: 6 builds each index again with those columns in "C",
    // concurrently (the key table's last: from the moment it takes inserts
    // until version 7, the claims' `ON CONFLICT ON CONSTRAINT` names only
    // one of two unique indexes); 7, 8 and 9 make the columns "C", a table at a time, and
    // put those indexes in the old ones' places. PostgreSQL reuses an index
    // whose collations already are the columns' new ones, so they change the
    // catalog only. tenant_id and endpoint stay as they are: Citus cannot
    // change the type of the column a table is distributed by; the endpoint
    // is in the lease index, which is partial, and PostgreSQL rebuilds a
    // partial index whenever one of its columns changes type; and both are
    // mostly equal from one key to the next, which PostgreSQL sees without
    // the locale (equal bytes are equal).
    Migration {
        version: 6,
        name: "bytewise_key_indexes",
        steps: &[
            Step::ConcurrentIndex {
                name: "outbox_events_aggregate_bytewise",
                table: "outbox_events",
                sql: "CREATE INDEX CONCURRENTLY IF NOT EXISTS \
                      outbox_events_aggregate_bytewise ON outbox_events \
                      (tenant_id, aggregate_id COLLATE \"C\")",
                taken_by: Some(8),
            },
            Step::ConcurrentIndex {
                name: "inbox_events_key_bytewise",
                table: "inbox_events",
                sql: "CREATE UNIQUE INDEX CONCURRENTLY IF NOT EXISTS \
                      inbox_events_key_bytewise ON inbox_events \
                      (tenant_id, consumer COLLATE \"C\", event_id COLLATE \"C\")",
                taken_by: Some(9),
            },
            Step::ConcurrentIndex {
                name: "idempotency_requests_key_bytewise",
                table: "idempotency_requests",
                sql: "CREATE UNIQUE INDEX CONCURRENTLY IF NOT EXISTS \
                      idempotency_requests_key_bytewise ON idempotency_requests \
                      (tenant_id, endpoint, idempotency_key COLLATE \"C\")",
                taken_by: Some(7),
            },
        ],
    },
    // One statement a step (Citus forwards a table's DDL by its text, one
    // statement at a time, and refuses `ADD CONSTRAINT` beside other
    // changes), one table a migration (a transaction that held one table's
    // lock while it waited for another's would hold the claims up longer
    // than the lock timeout, and could deadlock with a handler's
    // transaction writing both). Each old index is dropped before its
    // columns change, or the change would rebuild it under the lock.
    Migration {
        version: 7,
        name: "bytewise_request_keys",
        steps: &[
            Step::Transactional(
                "ALTER TABLE idempotency_requests DROP CONSTRAINT idempotency_requests_pkey",
            ),
            Step::Transactional(
                "ALTER TABLE idempotency_requests \
                 ALTER COLUMN idempotency_key TYPE text COLLATE \"C\"",
            ),
            Step::Transactional(
                "ALTER TABLE idempotency_requests ADD CONSTRAINT idempotency_requests_pkey \
                 PRIMARY KEY USING INDEX idempotency_requests_key_bytewise",
            ),
        ],
    },
    Migration {
        version: 8,
        name: "bytewise_outbox_aggregate",
        steps: &[
            Step::Transactional("DROP INDEX outbox_events_aggregate_idx"),
            Step::Transactional(
                "ALTER TABLE outbox_events ALTER COLUMN aggregate_id TYPE text COLLATE \"C\"",
            ),
            Step::Transactional(
                "ALTER INDEX outbox_events_aggregate_bytewise RENAME TO outbox_events_aggregate_idx",
            ),
        ],
    },
    Migration {
        version: 9,
        name: "bytewise_inbox_keys",
        steps: &[
            Step::Transactional("ALTER TABLE inbox_events DROP CONSTRAINT inbox_events_pkey"),
            Step::Transactional(
                "ALTER TABLE inbox_events \
                 ALTER COLUMN consumer TYPE text COLLATE \"C\", \
                 ALTER COLUMN event_id TYPE text COLLATE \"C\"",
            ),
            Step::Transactional(
                "ALTER TABLE inbox_events ADD CONSTRAINT inbox_events_pkey \
                 PRIMARY KEY USING INDEX inbox_events_key_bytewise",
            ),
        ],
    },
    Migration {
        version: 10,
        name: "request_trace_ids",
        steps: &[Step::Transactional(include_str!(
            "schema/0010_request_trace_ids.sql"
        ))],
    },
];

/// The newest schema version this build knows (the runner reads it off the
/// list it is given).
#[cfg_attr(not(test), allow(dead_code))]
pub(crate) const LATEST: i32 = MIGRATIONS[MIGRATIONS.len() - 1].version;

/// The migration table, created by the first migrator.
pub(crate) const MIGRATION_TABLE: &str = "CREATE TABLE IF NOT EXISTS tower_idempotency_migrations (
    version    integer PRIMARY KEY,
    name       text NOT NULL,
    applied_at timestamptz NOT NULL DEFAULT now()
)";

/// How the runner waits and retries; [`Settings::DEFAULT`] but in tests.
#[derive(Debug, Clone, Copy)]
pub(crate) struct Settings {
    pub(crate) lock_timeout: Duration,
    pub(crate) attempts: u32,
    /// The backoff after the first timed-out attempt, doubling to `max_backoff`.
    pub(crate) first_backoff: Duration,
    pub(crate) max_backoff: Duration,
    pub(crate) index_builds: u32,
    /// How long to wait for another migrator's build of an index.
    pub(crate) build_wait: Duration,
}

impl Settings {
    pub(crate) const DEFAULT: Settings = Settings {
        lock_timeout: LOCK_TIMEOUT,
        attempts: LOCK_ATTEMPTS,
        first_backoff: Duration::from_millis(100),
        max_backoff: LOCK_TIMEOUT,
        index_builds: INDEX_BUILDS,
        build_wait: BUILD_WAIT,
    };

    /// The wait after `attempts` timed-out attempts: exponential, with
    /// "equal jitter" (half fixed, half random), so that migrators that
    /// timed out together do not queue for the table together again.
    fn backoff(&self, attempts: u32) -> Duration {
        let doublings = attempts.saturating_sub(1).min(20);
        let full = self
            .first_backoff
            .saturating_mul(1 << doublings)
            .min(self.max_backoff);
        full.mul_f64(0.5_f64.mul_add(crate::jitter::unit(), 0.5))
    }
}

/// What a run did.
#[derive(Debug, Default, Clone, PartialEq, Eq)]
pub(crate) struct Summary {
    /// The versions this run recorded, in order.
    pub(crate) applied: Vec<i32>,
    /// Transactions rolled back because a lock wait ran out, and tried again.
    pub(crate) lock_timeouts: u32,
    /// Invalid indexes dropped and built again.
    pub(crate) rebuilds: u32,
    /// Index builds that met another migrator's build and were ended by
    /// PostgreSQL's deadlock detection, checked again after a backoff.
    pub(crate) build_races: u32,
    /// Versions found unrecorded under recorded later ones, recorded without
    /// running them (see [`Standing::Superseded`]).
    pub(crate) superseded: Vec<i32>,
    /// Leftover indexes dropped: built again under a name a later version
    /// had taken (see `Step::ConcurrentIndex::taken_by`).
    pub(crate) leftovers: u32,
    /// The run changed a database default that sessions read when they
    /// start (see [`super::citus`]): the connection it ran on is closed
    /// rather than pooled again, so that every session from here on has it.
    pub(crate) reconnect: bool,
    /// The database is a Citus coordinator.
    pub(crate) citus: bool,
}

/// [`run`] on a connection of `driver`'s pool.
pub(crate) async fn migrate<D: Driver>(driver: &D) -> Result<Summary, StoreError> {
    let mut session = OnConnection::open(driver).await?;
    let summary = run(&mut session).await?;
    session.finish(summary.reconnect);
    Ok(summary)
}

/// [`run_list`] on a connection of `driver`'s pool.
#[cfg(test)]
pub(crate) async fn run_on<D: Driver>(
    driver: &D,
    list: &[Migration],
    settings: &Settings,
) -> Result<Summary, StoreError> {
    let mut session = OnConnection::open(driver).await?;
    let summary = run_list(&mut session, list, settings).await?;
    session.finish(false);
    Ok(summary)
}

/// Applies the migrations the database lacks.
///
/// On a Citus coordinator the crate's tables are then distributed by
/// tenant (see [`super::citus`]).
pub(crate) async fn run<T: MigrationSession>(transport: &mut T) -> Result<Summary, StoreError> {
    let mut summary = run_list(transport, MIGRATIONS, &Settings::DEFAULT).await?;
    let distribution = super::citus::distribute(transport, &super::citus::OWN_TABLES).await?;
    summary.reconnect = distribution.reconnect;
    summary.citus = distribution.citus;
    Ok(summary)
}

/// Applies those of `list` the database lacks: [`run`] with a list and
/// settings of the caller's.
pub(crate) async fn run_list<T: MigrationSession>(
    transport: &mut T,
    list: &[Migration],
    settings: &Settings,
) -> Result<Summary, StoreError> {
    check_list(list)?;
    let mut runner = Runner {
        transport,
        settings,
        summary: Summary::default(),
    };
    let Done::Read(applied) = runner.transaction(&Label::Table, Work::Bootstrap).await? else {
        unreachable!("the bootstrap reads the recorded versions")
    };
    check_recorded(&applied, list)?;
    for migration in list {
        if applied
            .iter()
            .any(|(version, _)| *version == migration.version)
        {
            continue;
        }
        runner.apply(migration).await?;
    }
    // Every migrator looks for leftovers at its end, so the last of racing
    // ones looks after every build: a migrator's look under the lock and
    // its `CREATE INDEX CONCURRENTLY` are two transactions (the build runs
    // outside any), and in the moment between them another migrator may
    // have finished the index, recorded the migration and run the version
    // that takes the index's name. A build then makes a leftover.
    runner.drop_leftovers(list).await?;
    Ok(runner.summary)
}

/// Where a migration stands in what is recorded.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Standing {
    /// Recorded: applied, by this migrator or another.
    Recorded,
    /// Not recorded, but a later version is: applied, and what it made
    /// possibly taken since under other names.
    ///
    /// The runner records versions in order: it applies a version only once
    /// every earlier one is recorded (by it or by another migrator), so a
    /// later version on record proves this one was applied. Its steps must
    /// not run again: version 6's indexes became versions 7 to 9's primary
    /// keys and aggregate index, under those indexes' names, and building
    /// them again would put a second unique index beside each primary key.
    /// So the missing row is put back and nothing is run. (No migrator sees
    /// such a gap in a record only the runner wrote: an earlier version's row
    /// commits before a later one is applied. A gap is a hand-edited table.)
    /// Asking each step whether its result exists under its final names
    /// instead would need every step to know what later versions make of
    /// it, and would take an index an operator made for one the migration
    /// needs; the order of the record says it for every migration.
    Superseded,
    /// Neither: to apply.
    Pending,
}

impl Standing {
    fn of(migration: &Migration, applied: &[(i32, String)]) -> Standing {
        if applied.iter().any(|(v, _)| *v == migration.version) {
            Standing::Recorded
        } else if applied.iter().any(|(v, _)| *v > migration.version) {
            Standing::Superseded
        } else {
            Standing::Pending
        }
    }
}

/// Refuses a database whose recorded migrations are not a prefix of `list`:
/// a development schema, or a newer one.
fn check_recorded(applied: &[(i32, String)], list: &[Migration]) -> Result<(), StoreError> {
    let latest = list.last().map_or(0, |m| m.version);
    for (version, name) in applied {
        let known = list.iter().find(|m| m.version == *version);
        if *version <= latest && known.is_none_or(|m| m.name != name) {
            return Err(StoreError::new(
                StoreErrorKind::Schema,
                format!(
                    "the database holds a development schema of tower-idempotency from before its \
                     first release (migration {version} is recorded as `{name}`, which this build \
                     does not know); it cannot be upgraded: migrate a fresh database, or move this \
                     one to the released schema without losing events. First drain the outbox \
                     relay until outbox_events holds no event with published_at and parked_at \
                     both NULL, and copy inbox_events' rows aside (they are what stops a consumer \
                     from applying an event twice); then drop the crate's tables \
                     (idempotency_requests, outbox_events, inbox_events, \
                     tower_idempotency_migrations), migrate, and copy the inbox rows back. The \
                     migration guide (docs/migrations.md, \"Leaving a development schema\") has \
                     the SQL"
                ),
            ));
        }
    }
    if let Some((newer, _)) = applied.iter().find(|(version, _)| *version > latest) {
        return Err(StoreError::new(
            StoreErrorKind::Schema,
            format!("the database has schema version {newer}, newer than this build's {latest}"),
        ));
    }
    Ok(())
}

/// Refuses a list the runner cannot apply safely: versions out of order,
/// a migration without steps or with both kinds.
fn check_list(list: &[Migration]) -> Result<(), StoreError> {
    let refuse = |m: &Migration, why: &str| {
        Err(StoreError::new(
            StoreErrorKind::Backend,
            format!("migration {} ({}) {why}", m.version, m.name),
        ))
    };
    for (i, migration) in list.iter().enumerate() {
        let indexes = migration
            .steps
            .iter()
            .filter(|step| matches!(step, Step::ConcurrentIndex { .. }))
            .count();
        if usize::try_from(migration.version) != Ok(i + 1) {
            return refuse(migration, "is out of order: versions are 1, 2, 3, …");
        }
        if migration.steps.is_empty() {
            return refuse(migration, "has no steps");
        }
        if indexes != 0 && indexes != migration.steps.len() {
            return refuse(
                migration,
                "mixes transactional steps and concurrent index builds",
            );
        }
    }
    Ok(())
}

/// A run in progress.
struct Runner<'a, T> {
    transport: &'a mut T,
    settings: &'a Settings,
    summary: Summary,
}

/// What one transaction of the runner does.
#[derive(Clone, Copy)]
enum Work<'a> {
    /// Creates the migration table if it is missing and reads what is
    /// recorded.
    Bootstrap,
    /// Unless `migration` is recorded: runs its transactional steps if
    /// `steps`, then records it if `record`. A superseded migration is
    /// recorded, its steps never run, whatever the flags.
    Apply {
        migration: &'a Migration,
        steps: bool,
        record: bool,
    },
    /// Whether index `name` on `table` is valid, and whether anything
    /// holds the table's SHARE UPDATE EXCLUSIVE lock (a build). With a
    /// `migration`, first whether it is recorded or superseded, under the
    /// migration lock ([`Done::AlreadyRecorded`]: nothing more to build).
    IndexState {
        name: &'static str,
        table: &'static str,
        migration: Option<&'a Migration>,
    },
    /// Under the migration lock: the indexes of `list`'s index steps whose
    /// names a recorded version took, that exist.
    Leftovers { list: &'a [Migration] },
}

/// What a transaction found.
enum Done {
    Read(Vec<(i32, String)>),
    /// Another migrator recorded the migration first.
    AlreadyRecorded,
    /// The migration was superseded ([`Standing::Superseded`]) and is now
    /// recorded, nothing of it run.
    Superseded,
    Ran,
    Index {
        /// `None`: no such index.
        valid: Option<bool>,
        /// The table's SHARE UPDATE EXCLUSIVE lock is held: a build of an
        /// index on it (or a vacuum) runs.
        busy: bool,
    },
    /// Leftover indexes: `(name, table)`.
    Leftovers(Vec<(&'static str, &'static str)>),
}

/// How an index build ended.
enum Built {
    /// The index is there and valid.
    Valid,
    /// The migration got recorded (or superseded) meanwhile: nothing of it
    /// is to be built any more.
    Recorded,
}

/// What a transaction is for, in logs and errors.
enum Label<'a> {
    Table,
    Migration(&'a Migration),
    Leftovers,
}

impl fmt::Display for Label<'_> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Label::Table => f.write_str("the migration table"),
            Label::Migration(m) => write!(f, "migration {} ({})", m.version, m.name),
            Label::Leftovers => f.write_str("the leftover indexes"),
        }
    }
}

impl<T: MigrationSession> Runner<'_, T> {
    /// Applies `migration` and records it, unless another migrator did.
    async fn apply(&mut self, migration: &Migration) -> Result<(), StoreError> {
        let label = Label::Migration(migration);
        let started = Instant::now();
        let lock_timeouts = self.summary.lock_timeouts;
        let builds: Vec<_> = migration
            .steps
            .iter()
            .filter_map(|step| match *step {
                Step::ConcurrentIndex {
                    name, table, sql, ..
                } => Some((name, table, sql)),
                Step::Transactional(_) => None,
            })
            .collect();
        let done = if builds.is_empty() {
            let work = Work::Apply {
                migration,
                steps: true,
                record: true,
            };
            self.transaction(&label, work).await?
        } else {
            // Recorded meanwhile by another migrator: nothing to build.
            let check = Work::Apply {
                migration,
                steps: false,
                record: false,
            };
            match self.transaction(&label, check).await? {
                Done::Ran => {
                    for (name, table, sql) in builds {
                        // Recorded while this migrator waited for another's
                        // build: what it would build may already be taken
                        // under another name by a later version.
                        if let Built::Recorded = self
                            .build_index(&label, migration, name, table, sql)
                            .await?
                        {
                            break;
                        }
                    }
                    let record = Work::Apply {
                        migration,
                        steps: false,
                        record: true,
                    };
                    self.transaction(&label, record).await?
                }
                done => done,
            }
        };
        match done {
            Done::AlreadyRecorded => return Ok(()),
            Done::Superseded => {
                self.summary.superseded.push(migration.version);
                tracing::warn!(
                    version = migration.version,
                    name = migration.name,
                    "an idempotency migration was not recorded while later ones are; \
                     recorded it without running it again"
                );
                return Ok(());
            }
            _ => {}
        }
        self.summary.applied.push(migration.version);
        tracing::info!(
            version = migration.version,
            name = migration.name,
            lock_timeouts = self.summary.lock_timeouts - lock_timeouts,
            elapsed_ms = started.elapsed().as_millis() as u64,
            "applied idempotency migration"
        );
        Ok(())
    }

    /// Builds index `name` with `sql` (`CREATE INDEX CONCURRENTLY IF NOT
    /// EXISTS`) unless it is there and valid, or `migration` got recorded
    /// ([`Built::Recorded`]).
    ///
    /// No `lock_timeout`: the build's SHARE UPDATE EXCLUSIVE lock does not
    /// conflict with the claims' row writes. Two builds on one table must
    /// not overlap: the second queues for the table's lock holding a
    /// snapshot, which the first waits out before it ends (`CREATE INDEX
    /// CONCURRENTLY` waits for every older snapshot), a deadlock that
    /// PostgreSQL breaks by ending one of them. So a migrator that finds the
    /// index being built (invalid, its table's lock held) waits for it by
    /// looking again after a backoff, and builds only an index that is
    /// missing, or invalid with nothing building it (a dead leftover of an
    /// interrupted build, which `IF NOT EXISTS` would take for done: it is
    /// dropped first). Migrators that found it missing at the same moment
    /// may still start two builds: the one PostgreSQL ends backs off and
    /// looks again.
    ///
    /// Every look first reads, under the migration lock, whether
    /// `migration` is recorded: a migrator that waited out another's build
    /// wakes, as often as not, after that one recorded the migration and
    /// ran later ones, which may have taken the index under another name.
    /// Looking for it by its name then finds nothing, and building it would
    /// make a second index beside its successor.
    async fn build_index(
        &mut self,
        label: &Label<'_>,
        migration: &Migration,
        name: &'static str,
        table: &'static str,
        sql: &'static str,
    ) -> Result<Built, StoreError> {
        let started = Instant::now();
        let (mut drops, mut races, mut looks) = (0, 0, 0);
        loop {
            looks += 1;
            let look = Work::IndexState {
                name,
                table,
                migration: Some(migration),
            };
            let (valid, busy) = match self.transaction(label, look).await? {
                Done::Index { valid, busy } => (valid, busy),
                Done::AlreadyRecorded => return Ok(Built::Recorded),
                _ => unreachable!("an index check reads the index or the record"),
            };
            let build = match (valid, busy) {
                (Some(true), _) => return Ok(Built::Valid),
                (Some(false), true) => {
                    self.wait_for_build(label, name, started, looks).await?;
                    continue;
                }
                (Some(false), false) => {
                    if drops >= self.settings.index_builds {
                        return Err(StoreError::new(
                            StoreErrorKind::Unavailable,
                            format!("{label}: index {name} is still invalid after {drops} builds"),
                        ));
                    }
                    drops += 1;
                    self.summary.rebuilds += 1;
                    tracing::warn!(
                        %label,
                        index = name,
                        "dropping an invalid index left by an interrupted build, to build it again"
                    );
                    let drop = format!("DROP INDEX CONCURRENTLY IF EXISTS {name}");
                    match self.transport.batch(&drop).await {
                        Ok(()) => self.transport.batch(sql).await,
                        Err(e) => Err(e),
                    }
                }
                (None, _) => self.transport.batch(sql).await,
            };
            if let Err(e) = build {
                races += 1;
                self.after_race(label, name, e, races).await?;
            }
        }
    }

    /// Drops the indexes of `list`'s index steps whose names a recorded
    /// version took (`Step::ConcurrentIndex::taken_by`).
    ///
    /// Decided under the migration lock, on what is recorded: once the
    /// version that took a name is recorded, no migration builds that name
    /// legitimately again (it is in the past of every migrator that reads
    /// the record), so the drop itself may run outside the lock, as it
    /// must (`DROP INDEX CONCURRENTLY` runs outside any transaction; a plain
    /// `DROP INDEX` would hold the claims up behind its table's lock).
    async fn drop_leftovers(&mut self, list: &[Migration]) -> Result<(), StoreError> {
        let label = Label::Leftovers;
        let Done::Leftovers(leftovers) = self.transaction(&label, Work::Leftovers { list }).await?
        else {
            unreachable!("a look for leftovers lists them")
        };
        for (name, table) in leftovers {
            self.drop_leftover(&label, name, table).await?;
        }
        Ok(())
    }

    /// Drops leftover index `name` on `table`, once nothing builds it (a
    /// migrator still building it is waited for, as in
    /// [`build_index`](Self::build_index), and drops it too at its end).
    async fn drop_leftover(
        &mut self,
        label: &Label<'_>,
        name: &'static str,
        table: &'static str,
    ) -> Result<(), StoreError> {
        let started = Instant::now();
        let (mut races, mut looks) = (0, 0);
        loop {
            looks += 1;
            let look = Work::IndexState {
                name,
                table,
                migration: None,
            };
            let Done::Index { valid, busy } = self.transaction(label, look).await? else {
                unreachable!("an index check without a migration reads the index")
            };
            match (valid, busy) {
                // Looked at in a transaction that committed: the run still
                // ends with a `COMMIT`.
                (None, _) => return Ok(()),
                (Some(_), true) => {
                    self.wait_for_build(label, name, started, looks).await?;
                    continue;
                }
                (Some(_), false) => {}
            }
            tracing::warn!(
                %label,
                index = name,
                "dropping an index built again after a later migration took its name"
            );
            let drop = format!("DROP INDEX CONCURRENTLY IF EXISTS {name}");
            match self.transport.batch(&drop).await {
                Ok(()) => self.summary.leftovers += 1,
                Err(e) => {
                    races += 1;
                    self.after_race(label, name, e, races).await?;
                }
            }
        }
    }

    /// Waits before looking again at index `name`, which another migrator
    /// builds (or its table is locked); gives up after `build_wait`.
    async fn wait_for_build(
        &self,
        label: &Label<'_>,
        name: &str,
        started: Instant,
        looks: u32,
    ) -> Result<(), StoreError> {
        let waited = started.elapsed();
        if waited >= self.settings.build_wait {
            return Err(StoreError::new(
                StoreErrorKind::Unavailable,
                format!(
                    "{label}: index {name} has been built by another migrator, or its table \
                     locked, for {waited:?}; migrate again later"
                ),
            ));
        }
        tokio::time::sleep(self.settings.backoff(looks)).await;
        Ok(())
    }

    /// What follows an index build or drop that ended with `e`, the
    /// `races`th: a lock wait, a deadlock or a catalog row updated by
    /// another migrator's build or drop of the same index backs off to look
    /// again (at most `attempts` times); anything else is the run's error.
    async fn after_race(
        &mut self,
        label: &Label<'_>,
        name: &str,
        e: StoreError,
        races: u32,
    ) -> Result<(), StoreError> {
        let race = T::lock_timed_out(&e)
            || matches!(e.sql_state(), Some(DEADLOCK_DETECTED | INTERNAL_ERROR));
        if !race {
            return Err(e);
        }
        self.summary.build_races += 1;
        if races >= self.settings.attempts {
            return Err(e);
        }
        let backoff = self.settings.backoff(races);
        tracing::warn!(
            %label,
            index = name,
            backoff_ms = backoff.as_millis() as u64,
            error = %e,
            "an index build met another migrator's; looking again"
        );
        tokio::time::sleep(backoff).await;
        Ok(())
    }

    /// Runs `work` in a transaction of its own, tried again after a jittered
    /// backoff when a lock wait ran out, at most `attempts` times.
    async fn transaction(&mut self, label: &Label<'_>, work: Work<'_>) -> Result<Done, StoreError> {
        let started = Instant::now();
        let mut attempts = 0;
        loop {
            attempts += 1;
            let error = match self.attempt(work).await {
                Ok(done) => return Ok(done),
                // A deadlock PostgreSQL broke by ending this transaction's
                // statement (one waiting for the migration lock while
                // holding a snapshot that another migrator's index build
                // waits out, say): rolled back whole like a lock wait.
                Err(e) if T::lock_timed_out(&e) || e.sql_state() == Some(DEADLOCK_DETECTED) => e,
                // The driver closes a connection left inside a transaction.
                Err(e) => return Err(e),
            };
            self.transport.batch("ROLLBACK").await?;
            self.summary.lock_timeouts += 1;
            let lock_timeout = self.settings.lock_timeout;
            if attempts >= self.settings.attempts {
                return Err(StoreError::new(
                    StoreErrorKind::Unavailable,
                    format!(
                        "{label} could not get its locks: {attempts} attempts, each waiting at \
                         most {lock_timeout:?}, timed out over {:?}; a long transaction holds a \
                         lock on its table. Nothing of it was applied: migrate again later",
                        started.elapsed()
                    ),
                )
                .with_sql_state(Some(LOCK_NOT_AVAILABLE.to_owned()))
                .with_source(error));
            }
            let backoff = self.settings.backoff(attempts);
            tracing::warn!(
                %label,
                attempt = attempts,
                lock_timeout_ms = lock_timeout.as_millis() as u64,
                backoff_ms = backoff.as_millis() as u64,
                "a migration's lock wait ran out; rolled back, trying again"
            );
            tokio::time::sleep(backoff).await;
        }
    }

    async fn attempt(&mut self, work: Work<'_>) -> Result<Done, StoreError> {
        let t = &mut *self.transport;
        let lock_timeout = self.settings.lock_timeout.as_millis();
        let begin_locked = format!(
            "{BEGIN}; SELECT pg_advisory_xact_lock({MIGRATION_LOCK}); \
             SET LOCAL lock_timeout = '{lock_timeout}ms'"
        );
        let done = match work {
            Work::Bootstrap => {
                t.batch(&begin_locked).await?;
                t.batch(MIGRATION_TABLE).await?;
                Done::Read(t.applied().await?)
            }
            Work::Apply {
                migration,
                steps,
                record,
            } => {
                t.batch(&begin_locked).await?;
                // Read under the lock: what another migrator committed
                // while this one waited for it (READ COMMITTED: each
                // statement sees the latest commits).
                let applied = t.applied().await?;
                match Standing::of(migration, &applied) {
                    Standing::Recorded => Done::AlreadyRecorded,
                    Standing::Superseded => {
                        t.record(migration.version, migration.name).await?;
                        Done::Superseded
                    }
                    Standing::Pending => {
                        if steps {
                            for step in migration.steps {
                                if let Step::Transactional(sql) = *step {
                                    t.batch(sql).await?;
                                }
                            }
                        }
                        if record {
                            t.record(migration.version, migration.name).await?;
                        }
                        Done::Ran
                    }
                }
            }
            Work::IndexState {
                name,
                table,
                migration,
            } => {
                let settled = match migration {
                    // Under the lock, as a later version that takes the
                    // index under another name runs.
                    Some(migration) => {
                        t.batch(&begin_locked).await?;
                        Standing::of(migration, &t.applied().await?) != Standing::Pending
                    }
                    None => {
                        t.batch(BEGIN).await?;
                        false
                    }
                };
                if settled {
                    Done::AlreadyRecorded
                } else {
                    // Asked without waiting: a statement queued for the
                    // lock may hold a snapshot (the catalog's), which the
                    // running build waits out before it ends: a deadlock.
                    let lock = format!("LOCK TABLE {table} IN SHARE UPDATE EXCLUSIVE MODE NOWAIT");
                    let busy = match t.batch(&lock).await {
                        Ok(()) => false,
                        Err(e) if T::lock_timed_out(&e) => {
                            t.batch("ROLLBACK").await?;
                            t.batch(BEGIN).await?;
                            true
                        }
                        Err(e) => return Err(e),
                    };
                    Done::Index {
                        valid: t.index_valid(name).await?,
                        busy,
                    }
                }
            }
            Work::Leftovers { list } => {
                t.batch(&begin_locked).await?;
                let applied = t.applied().await?;
                let mut leftovers = Vec::new();
                for step in list.iter().flat_map(|m| m.steps) {
                    let Step::ConcurrentIndex {
                        name,
                        table,
                        taken_by: Some(taker),
                        ..
                    } = *step
                    else {
                        continue;
                    };
                    if applied.iter().any(|(v, _)| *v == taker)
                        && t.index_valid(name).await?.is_some()
                    {
                        leftovers.push((name, table));
                    }
                }
                Done::Leftovers(leftovers)
            }
        };
        t.commit().await?;
        Ok(done)
    }
}

#[cfg(test)]
mod list_tests {
    use super::*;

    /// The list's shape: versions 1, 2, … with distinct names, each
    /// migration of one kind; every concurrent index step one `CREATE
    /// [UNIQUE] INDEX CONCURRENTLY IF NOT EXISTS` of the index it names.
    #[test]
    fn migrations_are_numbered_in_order_and_index_steps_are_concurrent() {
        check_list(MIGRATIONS).unwrap();
        for migration in MIGRATIONS {
            assert_eq!(
                MIGRATIONS
                    .iter()
                    .filter(|m| m.name == migration.name)
                    .count(),
                1
            );
            for step in migration.steps {
                if let Step::ConcurrentIndex {
                    name,
                    table,
                    sql,
                    taken_by,
                } = step
                {
                    // The version that takes the index comes later and
                    // names it in one of its steps.
                    if let Some(taker) = taken_by {
                        let taker = MIGRATIONS
                            .iter()
                            .find(|m| m.version == *taker)
                            .unwrap_or_else(|| panic!("{name} is taken by a version of the list"));
                        assert!(taker.version > migration.version, "{name}");
                        assert!(
                            taker.steps.iter().any(
                                |step| matches!(step, Step::Transactional(sql) if sql.contains(name))
                            ),
                            "version {} takes {name}",
                            taker.version
                        );
                    }
                    let sql = sql.trim().trim_end_matches(';');
                    assert!(!sql.contains(';'), "one statement: {sql}");
                    let head = format!("INDEX CONCURRENTLY IF NOT EXISTS {name} ON {table}");
                    assert!(
                        sql.starts_with(&format!("CREATE {head}"))
                            || sql.starts_with(&format!("CREATE UNIQUE {head}")),
                        "{sql}"
                    );
                }
            }
        }
        assert_eq!(LATEST, MIGRATIONS.len() as i32);
    }

    #[test]
    fn a_list_that_mixes_kinds_or_skips_a_version_is_refused() {
        const INDEX: Step = Step::ConcurrentIndex {
            name: "i",
            table: "t",
            sql: "CREATE INDEX CONCURRENTLY IF NOT EXISTS i ON t (c)",
            taken_by: None,
        };
        let mixed = [Migration {
            version: 1,
            name: "mixed",
            steps: &[Step::Transactional("SELECT 1"), INDEX],
        }];
        let e = check_list(&mixed).unwrap_err();
        assert!(e.to_string().contains("mixes"), "{e}");
        let skipped = [Migration {
            version: 2,
            name: "second",
            steps: &[INDEX],
        }];
        assert!(check_list(&skipped).is_err());
        let empty = [Migration {
            version: 1,
            name: "empty",
            steps: &[],
        }];
        assert!(check_list(&empty).is_err());
    }

    #[test]
    fn a_development_schema_and_a_newer_one_are_refused() {
        let recorded = |rows: &[(i32, &str)]| -> Vec<(i32, String)> {
            rows.iter().map(|(v, n)| (*v, (*n).to_owned())).collect()
        };
        assert!(check_recorded(&[], MIGRATIONS).is_ok());
        assert!(check_recorded(&recorded(&[(1, "baseline")]), MIGRATIONS).is_ok());
        let development = recorded(&[(1, "idempotency_requests"), (2, "outbox_and_inbox")]);
        let e = check_recorded(&development, MIGRATIONS).unwrap_err();
        assert_eq!(e.kind(), StoreErrorKind::Schema);
        let message = e.to_string();
        assert!(message.contains("development schema"), "{message}");
        // Events are not to be lost on the way to a fresh schema: the relay
        // drained before any table is dropped, the inbox's rows (what keeps
        // a consumer from applying an event twice) copied aside and back,
        // the guide's section named for the SQL.
        let drain = message
            .find("drain")
            .unwrap_or_else(|| panic!("says to drain the relay: {message}"));
        let drop = message
            .find("drop")
            .unwrap_or_else(|| panic!("says what to drop: {message}"));
        assert!(
            drain < drop,
            "drained before anything is dropped: {message}"
        );
        assert!(
            message.contains("published_at") && message.contains("parked_at"),
            "{message}"
        );
        assert!(
            message.contains("copy")
                && message.contains("inbox_events")
                && message.contains("back"),
            "keeps the inbox's rows: {message}"
        );
        assert!(message.contains("docs/migrations.md"), "{message}");
        let newer = recorded(&[(1, "baseline"), (LATEST + 1, "later")]);
        let e = check_recorded(&newer, MIGRATIONS).unwrap_err();
        assert_eq!(e.kind(), StoreErrorKind::Schema);
        assert!(e.to_string().contains("newer than this build"), "{e}");
    }

    #[test]
    fn the_backoff_doubles_with_jitter_to_its_cap() {
        let settings = Settings::DEFAULT;
        for attempts in 1..=12 {
            let full = settings
                .first_backoff
                .saturating_mul(1 << (attempts - 1).min(20))
                .min(settings.max_backoff);
            let wait = settings.backoff(attempts);
            assert!(wait >= full / 2 && wait <= full, "{attempts}: {wait:?}");
        }
    }
}

#[cfg(all(test, feature = "test-util"))]
mod tests;
