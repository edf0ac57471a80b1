//! An operator's command-line tool for the remembered keys, on the store's
//! operator API:
//!
//! ```text
//! export DATABASE_URL=postgres://ops@db/app
//! cargo run --example keys -- inspect TENANT ENDPOINT KEY
//! cargo run --example keys -- remove TENANT ENDPOINT KEY --reason "ticket 4521: client sent a new order under an old key"
//! cargo run --example keys -- expired
//! cargo run --example keys -- cleanup
//! ```
//!
//! - `inspect` prints one key's record (no body, no headers): its state,
//!   status, resource, fingerprint and times.
//! - `remove` forgets one key deliberately (`PgStore::remove_key`): the next
//!   request with it is a new operation. The reason is required; the call
//!   is audited through `tracing` (target `tower_idempotency::audit`, the
//!   key hashed), which this tool writes to stderr.
//! - `expired` prints how many expired rows wait for cleanup.
//! - `cleanup` runs retention once (`Cleanup::run_once`) and prints how many
//!   rows it removed.
//!
//! `DATABASE_URL` (a URL or libpq's `key=value` form, with libpq's TLS
//! parameters) is required: there is no private database to look at.
//! Exit codes: 0 done, 1 the database failed, 2 a usage error, 3 no record
//! of the key (`inspect`, `remove`).

use std::{process::ExitCode, time::SystemTime};

use time::{format_description::well_known::Rfc3339, OffsetDateTime};
use tower_idempotency::{
    key::IdempotencyKey,
    postgres::{KeyRecord, KeyState, PgStore, PgStoreBuilder},
    retention::Cleanup,
    scope::{Scope, TenantId},
};

const USAGE: &str = "usage: keys inspect TENANT ENDPOINT KEY
       keys remove TENANT ENDPOINT KEY --reason TEXT
       keys expired
       keys cleanup
DATABASE_URL names the database (required).";

/// What the command line asks for.
enum Command {
    Inspect(Scope, IdempotencyKey),
    Remove(Scope, IdempotencyKey, String),
    Expired,
    Cleanup,
    Help,
}

/// How the tool ends, and its exit code.
enum Failure {
    /// 2: the command line is wrong (printed with the usage).
    Usage(String),
    /// 2: the environment is wrong (one line).
    Setup(String),
    /// 1: the database refused or could not be reached.
    Database(String),
    /// 3: no record of the key.
    NoRecord(String),
}

fn main() -> ExitCode {
    // The audit line of `remove`, and the store's warnings, on stderr.
    tracing_subscriber::fmt()
        .with_writer(std::io::stderr)
        .with_env_filter(
            tracing_subscriber::EnvFilter::try_from_default_env().unwrap_or_else(|_| "warn".into()),
        )
        .init();
    let args: Vec<String> = std::env::args().skip(1).collect();
    match run(&args) {
        Ok(()) => ExitCode::SUCCESS,
        Err(Failure::Usage(problem)) => {
            eprintln!("keys: {problem}\n{USAGE}");
            ExitCode::from(2)
        }
        Err(Failure::Setup(problem)) => {
            eprintln!("keys: {problem}");
            ExitCode::from(2)
        }
        Err(Failure::Database(problem)) => {
            eprintln!("keys: {problem}");
            ExitCode::from(1)
        }
        Err(Failure::NoRecord(what)) => {
            eprintln!("keys: no record of {what}");
            ExitCode::from(3)
        }
    }
}

fn run(args: &[String]) -> Result<(), Failure> {
    // The command line first: a usage error needs no database.
    let command = parse(args)?;
    if let Command::Help = command {
        println!("{USAGE}");
        return Ok(());
    }
    let url = std::env::var("DATABASE_URL")
        .ok()
        .filter(|url| !url.trim().is_empty())
        .ok_or_else(|| {
            Failure::Setup(
                "DATABASE_URL is not set: set it to the database the keys are in".to_owned(),
            )
        })?;
    let store = PgStoreBuilder::from_conninfo(&url)
        .and_then(|builder| builder.build())
        .map_err(|e| Failure::Setup(format!("DATABASE_URL is not valid: {e}")))?;
    let runtime = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .map_err(|e| Failure::Database(format!("cannot start the runtime: {e}")))?;
    runtime.block_on(execute(store, command))
}

fn parse(args: &[String]) -> Result<Command, Failure> {
    let usage = |problem: &str| Failure::Usage(problem.to_owned());
    let (name, rest) = args
        .split_first()
        .ok_or_else(|| usage("no command given"))?;
    match name.as_str() {
        "inspect" => match rest {
            [tenant, endpoint, key] => {
                let (scope, key) = scope_and_key(tenant, endpoint, key)?;
                Ok(Command::Inspect(scope, key))
            }
            _ => Err(usage("inspect wants TENANT ENDPOINT KEY")),
        },
        "remove" => {
            let (positional, reason) = match rest {
                [tenant, endpoint, key, flag, reason] if flag == "--reason" => {
                    ([tenant, endpoint, key], reason)
                }
                [flag, reason, tenant, endpoint, key] if flag == "--reason" => {
                    ([tenant, endpoint, key], reason)
                }
                _ => return Err(usage("remove wants TENANT ENDPOINT KEY --reason TEXT")),
            };
            if reason.trim().is_empty() {
                return Err(usage("--reason must say why the key is removed"));
            }
            let [tenant, endpoint, key] = positional;
            let (scope, key) = scope_and_key(tenant, endpoint, key)?;
            Ok(Command::Remove(scope, key, reason.clone()))
        }
        "expired" if rest.is_empty() => Ok(Command::Expired),
        "cleanup" if rest.is_empty() => Ok(Command::Cleanup),
        "expired" | "cleanup" => Err(usage(&format!("{name} takes no arguments"))),
        "help" | "--help" | "-h" => Ok(Command::Help),
        other => Err(usage(&format!("unknown command {other:?}"))),
    }
}

/// The scope and the key as the layer writes them: the tenant and the
/// endpoint's name as they are stored, the key as a client would send it.
fn scope_and_key(
    tenant: &str,
    endpoint: &str,
    key: &str,
) -> Result<(Scope, IdempotencyKey), Failure> {
    let key = IdempotencyKey::parse(key.as_bytes())
        .map_err(|e| Failure::Usage(format!("not a valid idempotency key: {e}")))?;
    Ok((Scope::new(TenantId::new(tenant), endpoint), key))
}

async fn execute(store: PgStore, command: Command) -> Result<(), Failure> {
    let database = |e: tower_idempotency::store::StoreError| Failure::Database(e.to_string());
    match command {
        Command::Inspect(scope, key) => {
            let record = store.inspect_key(&scope, &key).await.map_err(database)?;
            let record = record.ok_or_else(|| Failure::NoRecord(described(&scope, &key)))?;
            print!("{}", shown(&record));
        }
        Command::Remove(scope, key, reason) => {
            let removed = store
                .remove_key(&scope, &key, &reason)
                .await
                .map_err(database)?;
            if !removed {
                return Err(Failure::NoRecord(described(&scope, &key)));
            }
            println!("removed {}", described(&scope, &key));
        }
        Command::Expired => {
            // The cleanup backlog gauge's count, read as the gauge reads it.
            let status = Cleanup::new(store)
                .refresh_gauges()
                .await
                .map_err(database)?;
            println!("{}", status.cleanup_backlog);
        }
        Command::Cleanup => {
            let removed = Cleanup::new(store).run_once().await.map_err(database)?;
            println!("{removed}");
        }
        Command::Help => println!("{USAGE}"),
    }
    Ok(())
}

fn described(scope: &Scope, key: &IdempotencyKey) -> String {
    format!(
        "key {:?} of tenant {:?} on endpoint {:?}",
        key.as_str(),
        scope.tenant().as_str(),
        scope.endpoint()
    )
}

/// One `name: value` line per field.
fn shown(record: &KeyRecord) -> String {
    let state = match record.state {
        KeyState::InProgress => "in_progress".to_owned(),
        KeyState::Completed => "completed".to_owned(),
        KeyState::Failed => "failed".to_owned(),
        // `KeyState` may grow; show what a newer state is called.
        other => format!("{other:?}"),
    };
    let or_none = |value: Option<String>| value.unwrap_or_else(|| "-".to_owned());
    format!(
        "tenant: {}\nendpoint: {}\nstate: {state}\nresponse_status: {}\nresource_id: {}\n\
         attempt_token: {}\nfingerprint: {}\ncreated_at: {}\ncompleted_at: {}\nexpires_at: {}\n\
         trace_id: {}\n",
        record.tenant_id,
        record.endpoint,
        or_none(record.response_status.map(|s| s.as_u16().to_string())),
        or_none(record.resource_id.as_ref().map(|r| r.to_string())),
        record.attempt_token,
        record.fingerprint,
        time(record.created_at),
        or_none(record.completed_at.map(time)),
        time(record.expires_at),
        or_none(record.trace_id.map(|t| t.to_string())),
    )
}

/// RFC 3339, in UTC.
fn time(at: SystemTime) -> String {
    OffsetDateTime::from(at)
        .format(&Rfc3339)
        .unwrap_or_else(|_| format!("{at:?}"))
}
