//! Checks over every statement the crate sends with parameters.

use super::sql::Sql;

/// Every statement the store sends with parameters, by name (for the check
/// that each declares the types its text casts to).
pub(super) fn all_statements() -> Vec<(&'static str, Sql<'static>)> {
    use super::{admin, at_commit, claim, complete, lease as lp, migration_session};
    vec![
        ("claim LOOKUP", claim::LOOKUP),
        ("CLAIM", claim::CLAIM),
        ("CLAIM_INSERT", claim::CLAIM_INSERT),
        ("CLAIM_READ", claim::CLAIM_READ),
        ("TAKE_OVER", claim::TAKE_OVER),
        ("COMPLETE", complete::COMPLETE),
        ("CLAIM_AT_COMMIT", at_commit::CLAIM_AT_COMMIT),
        ("FREE", claim::FREE),
        ("FENCED_CHECK", complete::FENCED_CHECK),
        ("INSPECT_KEY", admin::INSPECT_KEY),
        ("REMOVE_KEY", admin::REMOVE_KEY),
        ("migration RECORD", migration_session::RECORD),
        ("lease LOOKUP", lp::LOOKUP),
        ("ACQUIRE", lp::ACQUIRE),
        ("HEARTBEAT", lp::HEARTBEAT),
        ("HOLD", lp::HOLD),
        ("FINISH", lp::FINISH),
        ("RELEASE", lp::RELEASE),
        ("FAIL", lp::FAIL),
        ("OPERATION", lp::OPERATION),
        ("RECOVERY_TENANTS", lp::RECOVERY_TENANTS),
        ("RECOVER", lp::RECOVER),
        ("EXPIRED_TENANTS", super::retention::EXPIRED_TENANTS),
        ("DELETE_BATCH", super::retention::DELETE_BATCH),
        ("DUE_TENANTS", super::outbox::DUE_TENANTS),
        ("CLAIM_EVENTS", super::outbox::CLAIM_EVENTS),
        ("MARK_DELIVERED", super::outbox::MARK_DELIVERED),
        ("MARK_FAILED", super::outbox::MARK_FAILED),
        ("MARK_PARKED", super::outbox::MARK_PARKED),
        ("ENQUEUE", super::outbox::ENQUEUE),
        ("INBOX_INSERT", super::outbox::INBOX_INSERT),
    ]
}

/// Statements across tenants by design, none of which locks a row: the
/// reads that find which tenants have work for the recovery worker,
/// cleanup and the relay (each then locks rows one tenant at a time), the
/// relay's marks (each row named by its key; a batch spans tenants), the
/// gauges, and the migration record (a table of the coordinator's).
pub(super) const ACROSS_TENANTS: &[&str] = &[
    "migration RECORD",
    "RECOVERY_TENANTS",
    "EXPIRED_TENANTS",
    "DUE_TENANTS",
    "MARK_DELIVERED",
    "MARK_FAILED",
    "MARK_PARKED",
    "CLEANUP_BACKLOG",
    "OLDEST_IN_PROGRESS",
    "LEASES",
    "OUTBOX_BACKLOG",
];

/// The statements sent without parameters: the gauges, each across
/// tenants.
pub(super) const UNPARAMETERISED: &[(&str, Sql<'static>)] = &[
    ("CLEANUP_BACKLOG", super::retention::CLEANUP_BACKLOG),
    ("OLDEST_IN_PROGRESS", super::retention::OLDEST_IN_PROGRESS),
    ("LEASES", super::retention::LEASES),
    ("OUTBOX_BACKLOG", super::outbox::OUTBOX_BACKLOG),
];

/// Every statement a request sends names one tenant: it compares
/// `tenant_id` with a parameter, or inserts a row whose `tenant_id` is
/// one. On a table distributed by tenant each is routed to one shard.
#[test]
fn every_statement_of_a_request_names_one_tenant() {
    for (name, sql) in all_statements() {
        // Settings of the transaction: no table.
        if ACROSS_TENANTS.contains(&name) {
            continue;
        }
        let text = sql.text();
        let compares = text.contains("tenant_id = $");
        let inserts = text.contains("INSERT INTO") && text.contains("(tenant_id,");
        assert!(
            compares || inserts,
            "{name} does not name its tenant: {text}"
        );
    }
}

/// The types read from a statement's text are those it casts each
/// parameter to, everywhere it casts it, and it has no parameter beyond
/// them: the unnamed path binds with these types.
#[test]
fn the_types_read_from_the_text_are_its_casts() {
    for (name, sql) in all_statements() {
        let text = sql.text();
        for (i, ty) in sql.types().iter().enumerate() {
            let param = format!("${}", i + 1);
            for (at, _) in text.match_indices(&param) {
                let rest = &text[at + param.len()..];
                if rest.starts_with(|c: char| c.is_ascii_digit()) || !rest.starts_with("::") {
                    continue;
                }
                assert!(
                    rest[2..].starts_with(ty.spelling()),
                    "{name}: {param} is read as {ty:?}, but cast otherwise at {at}"
                );
            }
        }
        let highest = (1..=20)
            .rev()
            .find(|n| text.contains(&format!("${n}")))
            .unwrap_or(0);
        assert_eq!(highest, sql.types().len(), "{name}: parameters read");
    }
}

/// What the reading gives for one statement, spelled out.
#[test]
fn the_claim_takes_the_key_the_fingerprint_and_the_retention() {
    use super::sql::Ty;
    assert_eq!(
        super::claim::CLAIM.types(),
        [Ty::Text, Ty::Text, Ty::Text, Ty::Bytea, Ty::Float8]
    );
    assert_eq!(
        super::lease::FAIL.types()[8..],
        [Ty::Int4],
        "FAIL's last parameter, the attempts"
    );
    assert!(super::migration_session::APPLIED.types().is_empty());
}
