//! [`HarnessError`]: why a temporary cluster or test database could not
//! be provided.

use std::error::Error as _;
use std::{fmt, io};

use super::INSTALL;

/// Why a temporary cluster or test database could not be provided.
#[derive(Debug)]
#[non_exhaustive]
pub enum HarnessError {
    /// No usable `initdb`/`postgres` pair was found.
    BinariesNotFound {
        /// The places that were looked at.
        searched: String,
    },
    /// Running as root, which `initdb` refuses, with no `postgres` user to switch to.
    PostgresUserMissing,
    /// A filesystem or process operation failed.
    Io {
        /// What was being done.
        context: String,
        /// The underlying error.
        source: io::Error,
    },
    /// `initdb` exited unsuccessfully.
    Initdb {
        /// Its output.
        stderr: String,
    },
    /// The server process exited before accepting connections.
    ServerExited {
        /// The exit status.
        status: String,
        /// The end of the server log.
        log_tail: String,
    },
    /// The server did not accept connections within 30 seconds.
    StartTimeout {
        /// The end of the server log.
        log_tail: String,
    },
    /// `DATABASE_URL` could not be parsed.
    InvalidDatabaseUrl(tokio_postgres::Error),
    /// The cluster shared by the test process failed to start; holds the original message.
    SharedCluster(String),
    /// Talking to the server failed.
    Database(tokio_postgres::Error),
    /// A Citus cluster was asked for, and the server binaries found have
    /// no Citus beside them.
    CitusNotInstalled {
        /// The library directory looked in for `citus.so`.
        libdir: String,
    },
}

impl fmt::Display for HarnessError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        // tokio_postgres::Error's Display omits its cause, which holds the useful part.
        let pg = |f: &mut fmt::Formatter<'_>, e: &tokio_postgres::Error| match e.source() {
            Some(cause) => write!(f, "{e}: {cause}"),
            None => write!(f, "{e}"),
        };
        match self {
            Self::BinariesNotFound { searched } => write!(
                f,
                "PostgreSQL server binaries (initdb, postgres) not found; {INSTALL} or set \
                 PG_BIN_DIR, or set DATABASE_URL to use an existing server (searched: {searched})"
            ),
            Self::PostgresUserMissing => write!(
                f,
                "running as root, which initdb refuses, and /etc/passwd has no `postgres` user \
                 to run it as; {INSTALL}, which creates that user, or run as a non-root user"
            ),
            Self::Io { context, source } => write!(f, "{context}: {source}"),
            Self::Initdb { stderr } => write!(f, "initdb failed:\n{stderr}"),
            Self::ServerExited { status, log_tail } => {
                write!(
                    f,
                    "postgres exited during startup ({status}); log tail:\n{log_tail}"
                )
            }
            Self::StartTimeout { log_tail } => {
                write!(
                    f,
                    "postgres did not become ready in time; log tail:\n{log_tail}"
                )
            }
            Self::InvalidDatabaseUrl(e) => {
                f.write_str("DATABASE_URL is not a valid connection string: ")?;
                pg(f, e)
            }
            Self::SharedCluster(msg) => write!(f, "the shared test cluster failed to start: {msg}"),
            Self::Database(e) => pg(f, e),
            Self::CitusNotInstalled { libdir } => write!(
                f,
                "Citus is not installed ({libdir}/citus.so not found): build and install \
                 Citus 13 from source against this PostgreSQL (Citus has no Debian package; \
                 .ci/run shows how)"
            ),
        }
    }
}

impl std::error::Error for HarnessError {
    fn source(&self) -> Option<&(dyn std::error::Error + 'static)> {
        match self {
            Self::Io { source, .. } => Some(source),
            Self::InvalidDatabaseUrl(e) | Self::Database(e) => Some(e),
            _ => None,
        }
    }
}

pub(super) fn io_err(context: impl Into<String>) -> impl FnOnce(io::Error) -> HarnessError {
    let context = context.into();
    move |source| HarnessError::Io { context, source }
}
