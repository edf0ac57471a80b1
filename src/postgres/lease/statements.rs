//! The lease protocol's statements (their text in `protocol::lease`, shared with
//! the sqlx store) with the parameter types tokio-postgres sends them with.

use tokio_postgres::types::Type;

use crate::{
    postgres::statements::Sql,
    protocol::lease::{
        ACQUIRE, FAIL, FINISH, HEARTBEAT, HOLD, LOOKUP, OPERATION, RECOVER, RELEASE,
    },
};

// The parameters of each, in order: the key's columns (tenant, endpoint,
// key) first, then the token and the rest as each statement names them.
const T: Type = Type::TEXT;

/// The parameters of the two statements that end an operation with its
/// answer (FINISH, FAIL): the key and the token, the response (status,
/// headers, body) and its retention, then `last` (the resource id, the
/// attempts).
const fn answer_then(last: Type) -> [Type; 9] {
    [
        T,
        T,
        T,
        Type::INT8,
        Type::INT2,
        Type::BYTEA,
        Type::BYTEA,
        Type::FLOAT8,
        last,
    ]
}
static FINISH_TYPES: [Type; 9] = answer_then(T);
static FAIL_TYPES: [Type; 9] = answer_then(Type::INT4);

pub(crate) const LOOKUP_SQL: Sql<'static> = Sql::new(LOOKUP, &[T, T, T]);
pub(crate) const ACQUIRE_SQL: Sql<'static> = Sql::new(
    ACQUIRE,
    &[
        T,
        T,
        T,
        Type::BYTEA,
        Type::FLOAT8,
        Type::FLOAT8,
        T,
        T,
        T,
        Type::BYTEA,
        Type::BYTEA,
    ],
);
pub(crate) const HEARTBEAT_SQL: Sql<'static> = Sql::new(
    HEARTBEAT,
    &[T, T, T, Type::INT8, Type::FLOAT8, Type::FLOAT8],
);
pub(crate) const HOLD_SQL: Sql<'static> = Sql::new(HOLD, &[T, T, T, Type::INT8]);
pub(crate) const FINISH_SQL: Sql<'static> = Sql::new(FINISH, &FINISH_TYPES);
pub(crate) const RELEASE_SQL: Sql<'static> = Sql::new(RELEASE, &[T, T, T, Type::INT8]);
pub(crate) const FAIL_SQL: Sql<'static> = Sql::new(FAIL, &FAIL_TYPES);
pub(crate) const OPERATION_SQL: Sql<'static> = Sql::new(OPERATION, &[T, T]);
pub(crate) const RECOVER_SQL: Sql<'static> = Sql::new(
    RECOVER,
    &[T, Type::FLOAT8, Type::FLOAT8, Type::FLOAT8, Type::FLOAT8],
);
