//! [`OperationId`]: the public name of a long-running operation.

use std::{fmt, str::FromStr};

/// The id of a long-running operation, as its status resource names it.
///
/// 122 random bits (a UUID version 4): not guessable, and unrelated to the
/// idempotency key, so it can be shown in URLs and logs without leaking the
/// key. Every attempt keeps it (a takeover, a recovery, the retry after an
/// attempt that failed), so downstream keys derived from it stay the same;
/// only a new operation under the key (after its record expired) gets a
/// new one.
///
/// ```
/// use tower_idempotency::lease::OperationId;
///
/// let id = OperationId::random();
/// let parsed: OperationId = id.to_string().parse().unwrap();
/// assert_eq!(parsed, id);
/// assert!("not-an-id".parse::<OperationId>().is_err());
/// ```
#[derive(Clone, Copy, PartialEq, Eq, Hash)]
pub struct OperationId(uuid::Uuid);

impl OperationId {
    /// A new random id.
    pub fn random() -> Self {
        OperationId(uuid::Uuid::new_v4())
    }

    /// The id's 16 bytes.
    pub fn as_bytes(&self) -> &[u8; 16] {
        self.0.as_bytes()
    }

    /// An id from its 16 bytes.
    pub fn from_bytes(bytes: [u8; 16]) -> Self {
        OperationId(uuid::Uuid::from_bytes(bytes))
    }
}

impl fmt::Display for OperationId {
    /// The hyphenated lower-case form, `8-4-4-4-12` hex digits.
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        fmt::Display::fmt(&self.0.hyphenated(), f)
    }
}

impl fmt::Debug for OperationId {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "OperationId({self})")
    }
}

impl FromStr for OperationId {
    type Err = OperationIdError;

    /// Only the hyphenated form (36 characters, either case) is accepted.
    fn from_str(s: &str) -> Result<Self, Self::Err> {
        if s.len() != 36 {
            return Err(OperationIdError(()));
        }
        uuid::Uuid::try_parse(s)
            .map(OperationId)
            .map_err(|_| OperationIdError(()))
    }
}

/// The error for text that is not an [`OperationId`].
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct OperationIdError(());

impl fmt::Display for OperationIdError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str("not an operation id (a hyphenated UUID)")
    }
}

impl std::error::Error for OperationIdError {}
