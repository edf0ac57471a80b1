//! The user-defined types a handler's statements may meet, loaded into a
//! connection's type cache behind a transaction pooler: the query that
//! lists them ([`USER_TYPES`]), the statement whose description makes a
//! driver look them up ([`describe_types`]), and [`DEALLOCATE_ALL`], which
//! drops what the lookups prepared.

/// A statement whose columns are `NULL` cast to each of `types` (names as
/// [`USER_TYPES`] returns them): describing it makes a driver look each
/// type up and cache it.
pub(crate) fn describe_types(types: &[String]) -> String {
    let columns: Vec<String> = types.iter().map(|name| format!("NULL::{name}")).collect();
    format!("SELECT {}", columns.join(", "))
}

/// Drops the session's prepared statements (a driver's own type lookups
/// among them), on this server connection only.
pub(crate) const DEALLOCATE_ALL: &str = "DEALLOCATE ALL";

/// The user-defined types a handler's statements may meet (enums, domains,
/// ranges, base types such as `citext`, standalone composites, and arrays
/// of these), as `regtype` text: quoted and qualified as needed. Table row
/// types are left out. Behind a transaction pooler `PgStore` loads them into
/// each new connection's type cache (see `postgres/types.rs`), and
/// `sqlx::load_types` a connection's that it is given.
pub(crate) const USER_TYPES: &str = "SELECT t.oid::regtype::text FROM pg_type t \
     JOIN pg_namespace n ON n.oid = t.typnamespace \
     LEFT JOIN pg_class c ON c.oid = t.typrelid \
     LEFT JOIN pg_type e ON e.oid = t.typelem AND t.typcategory = 'A' \
     LEFT JOIN pg_class ec ON ec.oid = e.typrelid \
     WHERE n.nspname NOT IN ('pg_catalog', 'information_schema') \
       AND n.nspname !~ '^pg_(toast|temp)' AND t.typisdefined \
       AND (c.oid IS NULL OR c.relkind = 'c') AND (ec.oid IS NULL OR ec.relkind = 'c') \
     ORDER BY t.oid";
