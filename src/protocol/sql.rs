//! A statement as the protocol writes it, for either driver to send: its
//! text and the declared type of each parameter ([`Sql`]), the values bound
//! to it ([`Param`]), and the columns of a row it returns read by type
//! ([`Columns`]). A driver adds only how it sends the statement and how it
//! reads one column.

// A sqlx-only build reads fewer types than the tokio-postgres store's.
#![cfg_attr(not(feature = "postgres"), allow(dead_code))]

use std::time::{Duration, SystemTime};

use crate::store::{StoreError, StoreErrorKind};

/// The type a statement's text casts a parameter to (`$1::text`), so that
/// binding can never fail on the client after an earlier pipelined statement
/// was already sent.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Ty {
    Text,
    Bytea,
    Int2,
    Int4,
    Int8,
    Float8,
    Jsonb,
    TextArray,
    Float8Array,
}

impl Ty {
    /// The type's name in PostgreSQL's catalog (`pg_type.typname`).
    #[cfg(test)]
    pub(crate) const fn name(self) -> &'static str {
        match self {
            Ty::Text => "text",
            Ty::Bytea => "bytea",
            Ty::Int2 => "int2",
            Ty::Int4 => "int4",
            Ty::Int8 => "int8",
            Ty::Float8 => "float8",
            Ty::Jsonb => "jsonb",
            Ty::TextArray => "_text",
            Ty::Float8Array => "_float8",
        }
    }
}

/// A statement of the crate: its text and the types of its parameters, in
/// order (the text casts each parameter to the same type).
#[derive(Debug, Clone, Copy)]
pub(crate) struct Sql<'a> {
    text: &'a str,
    types: &'a [Ty],
}

impl<'a> Sql<'a> {
    pub(crate) const fn new(text: &'a str, types: &'a [Ty]) -> Self {
        Sql { text, types }
    }

    pub(crate) fn text(&self) -> &'a str {
        self.text
    }

    pub(crate) fn types(&self) -> &'a [Ty] {
        self.types
    }
}

/// A value bound to a parameter of a [`Sql`], as the protocol hands it to a
/// driver. The statement's text fixes its type.
#[derive(Debug, Clone, Copy)]
pub(crate) enum Param<'a> {
    Text(&'a str),
    OptText(Option<&'a str>),
    Bytea(&'a [u8]),
    Int2(i16),
    Int4(i32),
    Int8(i64),
    Float8(f64),
}

impl<'a> From<&'a str> for Param<'a> {
    fn from(text: &'a str) -> Self {
        Param::Text(text)
    }
}

impl<'a> From<Option<&'a str>> for Param<'a> {
    fn from(text: Option<&'a str>) -> Self {
        Param::OptText(text)
    }
}

impl<'a> From<&'a [u8]> for Param<'a> {
    fn from(bytes: &'a [u8]) -> Self {
        Param::Bytea(bytes)
    }
}

impl From<i16> for Param<'_> {
    fn from(n: i16) -> Self {
        Param::Int2(n)
    }
}

impl From<i32> for Param<'_> {
    fn from(n: i32) -> Self {
        Param::Int4(n)
    }
}

impl From<i64> for Param<'_> {
    fn from(n: i64) -> Self {
        Param::Int8(n)
    }
}

impl From<f64> for Param<'_> {
    fn from(n: f64) -> Self {
        Param::Float8(n)
    }
}

/// A duration as the statements take it: seconds, as `float8`.
impl From<Duration> for Param<'_> {
    fn from(d: Duration) -> Self {
        Param::Float8(d.as_secs_f64())
    }
}

/// The parameters of a statement, each converted to a [`Param`].
macro_rules! params {
    ($($value:expr),* $(,)?) => {
        [$($crate::protocol::sql::Param::from($value)),*]
    };
}
pub(crate) use params;

/// A row a statement returned, read column by column as the protocol's
/// decoders need. A driver implements each with its own typed read
/// ([`columns!`]); a value that does not decode is
/// [`StoreErrorKind::Corrupt`].
pub(crate) trait Columns {
    fn bool(&self, i: usize) -> Result<bool, StoreError>;
    fn opt_bool(&self, i: usize) -> Result<Option<bool>, StoreError>;
    fn int2(&self, i: usize) -> Result<i16, StoreError>;
    fn opt_int2(&self, i: usize) -> Result<Option<i16>, StoreError>;
    fn int4(&self, i: usize) -> Result<i32, StoreError>;
    fn int8(&self, i: usize) -> Result<i64, StoreError>;
    fn opt_int8(&self, i: usize) -> Result<Option<i64>, StoreError>;
    fn text(&self, i: usize) -> Result<&str, StoreError>;
    fn opt_text(&self, i: usize) -> Result<Option<&str>, StoreError>;
    fn bytea(&self, i: usize) -> Result<&[u8], StoreError>;
    fn opt_bytea(&self, i: usize) -> Result<Option<&[u8]>, StoreError>;

    /// A timestamp the statement returned as whole microseconds since the
    /// Unix epoch (`int8`): exact, and readable by every driver.
    fn micros(&self, i: usize) -> Result<SystemTime, StoreError> {
        let micros = self.int8(i)?;
        let since = Duration::from_micros(micros.unsigned_abs());
        if micros >= 0 {
            SystemTime::UNIX_EPOCH.checked_add(since)
        } else {
            SystemTime::UNIX_EPOCH.checked_sub(since)
        }
        .ok_or_else(|| corrupt(&format!("timestamp in column {i}")))
    }

    /// [`micros`](Self::micros) of a column that may be NULL.
    fn opt_micros(&self, i: usize) -> Result<Option<SystemTime>, StoreError> {
        match self.opt_int8(i)? {
            None => Ok(None),
            Some(_) => self.micros(i).map(Some),
        }
    }
}

/// [`Columns`] for the row type `$row`, whose `try_get(usize)` reads a
/// column (in scope where this is invoked), mapping its error with `$err`.
macro_rules! columns {
    ($row:ty) => {
        impl $crate::protocol::sql::Columns for $row {
            $crate::protocol::sql::columns!(@get
                bool: bool, opt_bool: Option<bool>, int2: i16, opt_int2: Option<i16>,
                int4: i32, int8: i64, opt_int8: Option<i64>, text: &str,
                opt_text: Option<&str>, bytea: &[u8], opt_bytea: Option<&[u8]>
            );
        }
    };
    (@get $($name:ident: $t:ty),*) => {
        $(
            fn $name(&self, i: usize) -> Result<$t, $crate::store::StoreError> {
                self.try_get(i)
                    .map_err(|e| $crate::protocol::sql::column_error(i, &e))
            }
        )*
    };
}
pub(crate) use columns;

/// A column that did not decode.
pub(crate) fn column_error(i: usize, e: &dyn std::fmt::Display) -> StoreError {
    corrupt(&format!("column {i} ({e})"))
}

/// [`StoreErrorKind::Corrupt`]: a stored value that does not decode.
pub(crate) fn corrupt(what: &str) -> StoreError {
    StoreError::new(
        StoreErrorKind::Corrupt,
        format!("stored record has an invalid {what}"),
    )
}
