//! The boxed error the crate's bodies, services and client carry: one
//! definition for the whole crate.

pub(crate) type BoxError = Box<dyn std::error::Error + Send + Sync>;
