//! How the store sends its own statements: prepared once per connection and
//! cached (the default), or, behind a transaction pooler, as unnamed
//! statements with their parameter types given, which nothing outside one
//! round trip has to remember ([`PgStoreBuilder::transaction_pooling`]).
//!
//! Every statement of the crate is a [`Sql`]: its text and the types of its
//! parameters. The cached path prepares the text (the types come back from
//! the server, as before); the unnamed path sends Parse, Bind, Describe,
//! Execute and Sync in one message (tokio-postgres `query_typed`), so a
//! pooler that hands the server connection to another client after each
//! transaction, or even after each statement outside one, never splits a
//! statement from its preparation.
//!
//! [`PgStoreBuilder::transaction_pooling`]: super::PgStoreBuilder::transaction_pooling

use tokio_postgres::{
    types::{IsNull, ToSql, Type},
    Row, Statement,
};

use super::conn::Conn;

pub(crate) use crate::protocol::sql::Sql;
use crate::protocol::sql::{Param, Ty, MAX_PARAMS};

/// The driver's type for a declared parameter type.
pub(crate) fn pg_type(ty: Ty) -> Type {
    match ty {
        Ty::Text => Type::TEXT,
        Ty::Bytea => Type::BYTEA,
        Ty::Int2 => Type::INT2,
        Ty::Int4 => Type::INT4,
        Ty::Int8 => Type::INT8,
        Ty::Float8 => Type::FLOAT8,
        Ty::Jsonb => Type::JSONB,
        Ty::TextArray => Type::TEXT_ARRAY,
        Ty::Float8Array => Type::FLOAT8_ARRAY,
    }
}

/// A protocol value binds as the value it holds.
impl ToSql for Param<'_> {
    fn to_sql(
        &self,
        ty: &Type,
        out: &mut bytes::BytesMut,
    ) -> Result<IsNull, Box<dyn std::error::Error + Sync + Send>> {
        let value: &(dyn ToSql + Sync) = match self {
            Param::Text(v) => v,
            Param::OptText(v) => v,
            Param::Bytea(v) => v,
            Param::Int2(v) => v,
            Param::Int4(v) => v,
            Param::Int8(v) => v,
            Param::Float8(v) => v,
        };
        // The value checks itself against the declared type.
        value.to_sql_checked(ty, out)
    }

    // The statement's text fixes each parameter's type; `to_sql` checks it.
    fn accepts(_: &Type) -> bool {
        true
    }

    tokio_postgres::types::to_sql_checked!();
}

/// Protocol values as the driver's parameter list.
pub(crate) fn dyn_params<'p>(params: &'p [Param<'_>]) -> DynParams<'p> {
    DynParams::default().and(params)
}

/// The driver's parameter list, held on the stack: a statement of the crate
/// takes at most [`MAX_PARAMS`] parameters (its text is checked when it is
/// built), the session reset's arguments included, so a statement binds
/// without allocating a list of references.
pub(crate) struct DynParams<'p> {
    refs: [&'p (dyn ToSql + Sync); MAX_PARAMS],
    len: usize,
}

/// What fills the unused places; never bound.
static UNUSED: Param<'static> = Param::OptText(None);

impl Default for DynParams<'_> {
    fn default() -> Self {
        DynParams {
            refs: [&UNUSED; MAX_PARAMS],
            len: 0,
        }
    }
}

impl<'p> DynParams<'p> {
    /// These and `params` after them. Past [`MAX_PARAMS`] the rest is left
    /// out, and PostgreSQL refuses the statement for its missing parameters
    /// (no statement of the crate has that many).
    pub(crate) fn and(mut self, params: &'p [Param<'_>]) -> Self {
        for param in params {
            let Some(slot) = self.refs.get_mut(self.len) else {
                debug_assert!(false, "more than MAX_PARAMS parameters");
                break;
            };
            *slot = param;
            self.len += 1;
        }
        self
    }
}

impl<'p> std::ops::Deref for DynParams<'p> {
    type Target = [&'p (dyn ToSql + Sync)];

    fn deref(&self) -> &Self::Target {
        &self.refs[..self.len]
    }
}

crate::protocol::sql::columns!(Row);

/// A statement ready to run on one connection: prepared and cached on it,
/// or to be sent unnamed.
pub(crate) enum Prepared<'a> {
    Cached(Statement),
    Unnamed(Sql<'a>),
}

impl Conn {
    /// Prepares `sql` (cached per connection) unless the store sends
    /// unnamed statements, which need no round trip here. Prepare before
    /// pipelining: a statement prepared inside a pipeline would send its
    /// Parse, wait for the answer, and let the next statement of the
    /// pipeline (a `COMMIT`) overtake its Bind.
    pub(crate) async fn prepare_sql<'a>(
        &self,
        sql: Sql<'a>,
    ) -> Result<Prepared<'a>, tokio_postgres::Error> {
        if self.unnamed() {
            Ok(Prepared::Unnamed(sql))
        } else {
            self.prepare_cached(sql.text()).await.map(Prepared::Cached)
        }
    }
}

/// The ways to run a statement, each written once for both paths: the
/// driver's method for a cached statement, its `_typed` twin for an unnamed
/// one. `$prepared` runs a [`Prepared`]; `$sql` prepares a [`Sql`]
/// ([`Conn::prepare_sql`]) and then runs it so.
macro_rules! run_statements {
    ($($(#[$doc:meta])* fn $prepared:ident, $sql:ident -> $out:ty = $cached:ident / $typed:ident;)*) => {
        impl Conn {
            $(
                $(#[$doc])*
                pub(crate) async fn $prepared(
                    &self,
                    statement: &Prepared<'_>,
                    params: &[&(dyn ToSql + Sync)],
                ) -> Result<$out, tokio_postgres::Error> {
                    match statement {
                        Prepared::Cached(statement) => self.$cached(statement, params).await,
                        Prepared::Unnamed(sql) => self.$typed(sql.text(), &typed(*sql, params)).await,
                    }
                }

                #[doc = concat!(
                    "[`prepare_sql`](Self::prepare_sql), then [`", stringify!($prepared),
                    "`](Self::", stringify!($prepared), ")."
                )]
                pub(crate) async fn $sql(
                    &self,
                    sql: Sql<'_>,
                    params: &[&(dyn ToSql + Sync)],
                ) -> Result<$out, tokio_postgres::Error> {
                    let statement = self.prepare_sql(sql).await?;
                    self.$prepared(&statement, params).await
                }
            )*
        }
    };
}

run_statements! {
    /// Runs a prepared statement and returns its rows.
    fn query_prepared, query_sql -> Vec<Row> = query / query_typed;
    /// Runs a prepared statement that returns exactly one row.
    fn query_one_prepared, query_one_sql -> Row = query_one / query_typed_one;
    /// Runs a prepared statement that returns at most one row.
    fn query_opt_prepared, query_opt_sql -> Option<Row> = query_opt / query_typed_opt;
    /// Runs a prepared statement and returns the number of rows it affected.
    fn execute_prepared, execute_sql -> u64 = execute / execute_typed;
}

/// Pairs each parameter with its declared type. A count that does not match
/// is the crate's bug; the server then refuses the statement (the Bind
/// supplies the wrong number of parameters) rather than run it.
fn typed<'p>(
    sql: Sql<'_>,
    params: &[&'p (dyn ToSql + Sync)],
) -> Vec<(&'p (dyn ToSql + Sync), Type)> {
    debug_assert_eq!(
        params.len(),
        sql.types().len(),
        "parameters and declared types of {:?}",
        sql.text()
    );
    params
        .iter()
        .zip(sql.types())
        .map(|(param, ty)| (*param, pg_type(*ty)))
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_parameter_list_holds_a_statement_and_the_reset_in_order() {
        let statement: Vec<Param<'_>> = (0..MAX_PARAMS as i64 - 2).map(Param::Int8).collect();
        let reset = [Param::OptText(Some("35s")), Param::OptText(None)];
        let params = dyn_params(&statement).and(&reset);
        assert_eq!(params.len(), MAX_PARAMS);
        // Each place is the value given for it, bound as the driver binds it.
        let bound = |p: &(dyn ToSql + Sync), ty: &Type| {
            let mut out = bytes::BytesMut::new();
            let null = p.to_sql_checked(ty, &mut out).expect("binds");
            (matches!(null, IsNull::Yes), out.to_vec())
        };
        for (i, param) in params[..MAX_PARAMS - 2].iter().enumerate() {
            assert_eq!(
                bound(*param, &Type::INT8),
                (false, (i as i64).to_be_bytes().to_vec())
            );
        }
        assert_eq!(
            bound(params[MAX_PARAMS - 2], &Type::TEXT),
            (false, b"35s".to_vec())
        );
        assert_eq!(bound(params[MAX_PARAMS - 1], &Type::TEXT), (true, vec![]));
        assert!(dyn_params(&[]).is_empty());
    }
}
