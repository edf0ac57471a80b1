//! Settings from the environment (see CONTRACT in the README).

use std::{collections::HashMap, net::SocketAddr, time::Duration};

use tower_idempotency::scope::TenantId;

pub(crate) struct Settings {
    pub(crate) database_url: Option<String>,
    /// `DATABASE_POOL_MODE`: whether the store's statements must survive a
    /// pooler in transaction pooling mode (`transaction`, the default with
    /// `DATABASE_URL`) or may use cached prepared statements and `LISTEN`
    /// (`direct`, the default for the private cluster).
    pub(crate) transaction_pooling: bool,
    pub(crate) addr: SocketAddr,
    pub(crate) tokens: HashMap<String, TenantId>,
    /// `IDEMPOTENCY_RETENTION`, used exactly as given.
    pub(crate) retention: Duration,
    /// `IDEMPOTENCY_HANDLER_TIMEOUT`: how long the work of `POST /orders`
    /// may run before it is rolled back and answered `503`.
    pub(crate) handler_timeout: Duration,
    pub(crate) wait: Duration,
    /// The lease of a long-running fulfilment: how long an owner that stops
    /// heart-beating keeps its claim before a retry or the recovery worker
    /// takes the operation over.
    pub(crate) lease: Duration,
    /// How long the fake warehouse takes to ship.
    pub(crate) fulfilment_delay: Duration,
    /// Attempts a fulfilment gets (first run, takeovers, recovery) before
    /// it ends `failed`.
    pub(crate) max_attempts: u32,
    /// `IDEMPOTENCY_MODE`: how `POST /orders` is made idempotent.
    pub(crate) mode: Mode,
    /// `PAYMENT_PROVIDER_URL`: a payment provider outside this server and
    /// its database (`POST {url}/charges`); unset, the in-process fake.
    pub(crate) payment_provider: Option<http::Uri>,
}

/// How `POST /orders` is made idempotent (`IDEMPOTENCY_MODE`). The answers
/// are the same in both; what differs is who may run the handler and what
/// a create costs (the guide `docs/modes.md`).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum Mode {
    /// `claim-first` (the default): the key is claimed before the
    /// handler runs, and one owner runs it.
    ClaimFirst,
    /// `one-commit`: the key's record is inserted with the commit; of
    /// duplicates that reach several instances at once, one commit wins and
    /// every other rolls back and answers the winner's response.
    OneCommit,
}

impl Mode {
    /// The value `IDEMPOTENCY_MODE` takes for this mode.
    pub(crate) fn name(self) -> &'static str {
        match self {
            Mode::ClaimFirst => "claim-first",
            Mode::OneCommit => "one-commit",
        }
    }

    fn parse(text: &str) -> Result<Mode, String> {
        match text.trim() {
            "claim-first" => Ok(Mode::ClaimFirst),
            "one-commit" => Ok(Mode::OneCommit),
            other => Err(format!(
                "IDEMPOTENCY_MODE={other:?} is neither claim-first nor one-commit"
            )),
        }
    }
}

impl Settings {
    pub(crate) fn from_env() -> Result<Self, String> {
        let var = |name: &str| std::env::var(name).ok().filter(|v| !v.trim().is_empty());
        let addr = var("ORDER_SERVER_ADDR").unwrap_or_else(|| "127.0.0.1:3000".into());
        let database_url = var("DATABASE_URL");
        let transaction_pooling = match var("DATABASE_POOL_MODE").as_deref().map(str::trim) {
            None => database_url.is_some(),
            Some("transaction") => true,
            Some("direct") => false,
            Some(other) => {
                return Err(format!(
                    "DATABASE_POOL_MODE={other:?} is neither transaction nor direct"
                ))
            }
        };
        let retention_text = var("IDEMPOTENCY_RETENTION").unwrap_or_else(|| "24h".into());
        let retention = parse_duration("IDEMPOTENCY_RETENTION", &retention_text)?;
        let timeout_text = var("IDEMPOTENCY_HANDLER_TIMEOUT").unwrap_or_else(|| "30s".into());
        let handler_timeout = parse_duration("IDEMPOTENCY_HANDLER_TIMEOUT", &timeout_text)?;
        let mode = Mode::parse(&var("IDEMPOTENCY_MODE").unwrap_or_else(|| "claim-first".into()))?;
        // The claim-first mode counts retention from the claim: a key must
        // outlive its work, or a retry right after a slow commit would find
        // it expired and run the work again. The layer would raise a shorter
        // retention; the server refuses it instead, so that what an operator
        // configured is what is remembered.
        let floor = handler_timeout.saturating_add(Duration::from_secs(5));
        if mode == Mode::ClaimFirst && retention < floor {
            return Err(format!(
                "IDEMPOTENCY_RETENTION={} is shorter than IDEMPOTENCY_HANDLER_TIMEOUT={} + 5s, \
                 so a key could expire while its work runs: set IDEMPOTENCY_RETENTION to at \
                 least {}s, or shorten IDEMPOTENCY_HANDLER_TIMEOUT",
                retention_text.trim(),
                timeout_text.trim(),
                floor.as_secs_f64().ceil(),
            ));
        }
        Ok(Settings {
            database_url,
            transaction_pooling,
            addr: addr
                .parse()
                .map_err(|e| format!("ORDER_SERVER_ADDR={addr:?} is not an address: {e}"))?,
            tokens: parse_tokens(
                &var("ORDER_SERVER_TOKENS")
                    .unwrap_or_else(|| "demo-token-a=tenant-a,demo-token-b=tenant-b".into()),
            )?,
            retention,
            handler_timeout,
            wait: parse_duration(
                "IDEMPOTENCY_WAIT",
                &var("IDEMPOTENCY_WAIT").unwrap_or_else(|| "5s".into()),
            )?,
            lease: parse_duration(
                "IDEMPOTENCY_LEASE",
                &var("IDEMPOTENCY_LEASE").unwrap_or_else(|| "10s".into()),
            )?,
            fulfilment_delay: parse_duration(
                "FULFILMENT_DELAY",
                &var("FULFILMENT_DELAY").unwrap_or_else(|| "2s".into()),
            )?,
            max_attempts: parse_attempts(
                &var("IDEMPOTENCY_MAX_ATTEMPTS").unwrap_or_else(|| "5".into()),
            )?,
            mode,
            payment_provider: var("PAYMENT_PROVIDER_URL")
                .map(|url| match url.trim().parse::<http::Uri>() {
                    Ok(uri) if uri.scheme_str() == Some("http") && uri.authority().is_some() => {
                        Ok(uri)
                    }
                    _ => Err(format!(
                        "PAYMENT_PROVIDER_URL={url:?} is not an http:// URL of a payment provider"
                    )),
                })
                .transpose()?,
        })
    }
}

/// A whole number from 1 to 1000.
fn parse_attempts(text: &str) -> Result<u32, String> {
    match text.trim().parse::<u32>() {
        Ok(n @ 1..=1000) => Ok(n),
        _ => Err(format!(
            "IDEMPOTENCY_MAX_ATTEMPTS={text:?} is not a whole number from 1 to 1000"
        )),
    }
}

/// `token=tenant,token=tenant`.
fn parse_tokens(spec: &str) -> Result<HashMap<String, TenantId>, String> {
    spec.split(',')
        .map(str::trim)
        .filter(|pair| !pair.is_empty())
        .map(|pair| match pair.split_once('=') {
            Some((token, tenant)) if !token.trim().is_empty() && !tenant.trim().is_empty() => {
                Ok((token.trim().to_owned(), TenantId::new(tenant.trim())))
            }
            _ => Err(format!("ORDER_SERVER_TOKENS: {pair:?} is not token=tenant")),
        })
        .collect()
}

/// `500ms`, `90s`, `15m`, `24h`, `7d`.
pub(crate) fn parse_duration(name: &str, text: &str) -> Result<Duration, String> {
    let text = text.trim();
    let split = text
        .find(|c: char| !c.is_ascii_digit())
        .unwrap_or(text.len());
    let (number, unit) = text.split_at(split);
    let bad = || format!("{name}={text:?} is not a duration like 90s, 15m, 24h or 7d");
    let n: u64 = number.parse().map_err(|_| bad())?;
    let seconds = match unit {
        "ms" => return Ok(Duration::from_millis(n)),
        "s" => 1,
        "m" => 60,
        "h" => 3600,
        "d" => 86_400,
        _ => return Err(bad()),
    };
    n.checked_mul(seconds)
        .map(Duration::from_secs)
        .ok_or_else(bad)
}
