//! A statement as the protocol writes it, for either driver to send: its
//! text and the declared type of each parameter ([`Sql`]), the values bound
//! to it ([`Param`]), and the columns of a row it returns read by type
//! ([`Columns`]). A driver adds only how it sends the statement and how it
//! reads one column.

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
    /// Every type, with its spelling in a cast; an array before its element
    /// type, which its spelling begins with.
    const CASTS: [(&'static str, Ty); 9] = [
        ("text[]", Ty::TextArray),
        ("float8[]", Ty::Float8Array),
        ("text", Ty::Text),
        ("bytea", Ty::Bytea),
        ("int2", Ty::Int2),
        ("int4", Ty::Int4),
        ("int8", Ty::Int8),
        ("float8", Ty::Float8),
        ("jsonb", Ty::Jsonb),
    ];
}

#[cfg(test)]
impl Ty {
    /// How a cast spells the type.
    pub(crate) fn spelling(self) -> &'static str {
        Self::CASTS
            .iter()
            .find(|(_, ty)| *ty == self)
            .map(|(name, _)| *name)
            .unwrap_or_default()
    }
}

/// The most parameters a statement of the crate takes.
pub(crate) const MAX_PARAMS: usize = 13;

/// A statement of the crate: its text, and the types of its parameters,
/// read from the text itself, where each parameter is cast where it first
/// appears (`$1::text`). A statement whose parameter is not cast so does
/// not compile (the reading is a `const fn`).
#[derive(Debug, Clone, Copy)]
pub(crate) struct Sql<'a> {
    text: &'a str,
    types: [Ty; MAX_PARAMS],
    count: usize,
}

impl<'a> Sql<'a> {
    pub(crate) const fn new(text: &'a str) -> Self {
        let bytes = text.as_bytes();
        let mut types = [Ty::Text; MAX_PARAMS];
        let mut count = 0;
        while count < MAX_PARAMS {
            match first_use(bytes, count + 1) {
                None => break,
                Some(at) => types[count] = cast_at(bytes, at),
            }
            count += 1;
        }
        assert!(
            first_use(bytes, MAX_PARAMS + 1).is_none(),
            "a statement takes at most MAX_PARAMS parameters"
        );
        Sql { text, types, count }
    }

    pub(crate) const fn text(&self) -> &'a str {
        self.text
    }

    /// The types of its parameters, in order.
    pub(crate) fn types(&self) -> &[Ty] {
        &self.types[..self.count]
    }
}

/// Where `$n` first appears in `sql`, just past its digits.
const fn first_use(sql: &[u8], n: usize) -> Option<usize> {
    let mut i = 0;
    while i < sql.len() {
        if sql[i] == b'$' {
            // The number after the `$`.
            let (mut j, mut value) = (i + 1, 0);
            while j < sql.len() && sql[j].is_ascii_digit() {
                value = value * 10 + (sql[j] - b'0') as usize;
                j += 1;
            }
            if j > i + 1 && value == n {
                return Some(j);
            }
        }
        i += 1;
    }
    None
}

/// The type of the cast that starts at `at` (`::text`).
const fn cast_at(sql: &[u8], at: usize) -> Ty {
    assert!(
        starts_with(sql, at, b"::"),
        "each parameter is cast where it first appears ($1::text)"
    );
    let mut k = 0;
    while k < Ty::CASTS.len() {
        let (name, ty) = Ty::CASTS[k];
        if starts_with(sql, at + 2, name.as_bytes()) {
            return ty;
        }
        k += 1;
    }
    panic!("a parameter is cast to a type the protocol does not bind")
}

const fn starts_with(sql: &[u8], at: usize, pattern: &[u8]) -> bool {
    if at + pattern.len() > sql.len() {
        return false;
    }
    let mut k = 0;
    while k < pattern.len() {
        if sql[at + k] != pattern[k] {
            return false;
        }
        k += 1;
    }
    true
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

/// A duration as the statements take it: seconds, as `float8`.
impl From<Duration> for Param<'_> {
    fn from(d: Duration) -> Self {
        Param::Float8(d.as_secs_f64())
    }
}

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
