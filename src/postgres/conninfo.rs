//! libpq's TLS parameters in a connection string.
//!
//! tokio-postgres understands `sslmode=disable|prefer|require` and nothing
//! about certificates; managed PostgreSQL documents its URLs with libpq's
//! full vocabulary (`sslmode=verify-full&sslrootcert=…`). [`split`] takes
//! those parameters out of either form of connection string (a
//! `postgres://` URL or `key=value` pairs) and leaves the rest, unchanged,
//! for tokio-postgres to parse.

use std::path::PathBuf;

/// libpq's `sslmode`, less `allow` (which tokio-postgres cannot do: it
/// would try without TLS first).
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord)]
pub(crate) enum SslMode {
    /// No TLS.
    Disable,
    /// TLS when the server offers it, plain otherwise (libpq's default).
    Prefer,
    /// TLS or no connection; the certificate is not checked, unless a root
    /// certificate is given (then as `VerifyCa`, as libpq does).
    Require,
    /// TLS with a certificate signed by a trusted root, any host name.
    VerifyCa,
    /// TLS with a certificate signed by a trusted root, for the host named.
    VerifyFull,
}

impl SslMode {
    fn parse(value: &str) -> Result<SslMode, String> {
        Ok(match value {
            "disable" => SslMode::Disable,
            "prefer" => SslMode::Prefer,
            "require" => SslMode::Require,
            "verify-ca" => SslMode::VerifyCa,
            "verify-full" => SslMode::VerifyFull,
            "allow" => {
                return Err("sslmode=allow is not supported (it tries without TLS first): \
                            use prefer or disable"
                    .into())
            }
            other => {
                return Err(format!(
                    "invalid sslmode {other:?}: expected disable, prefer, require, verify-ca or verify-full"
                ))
            }
        })
    }
}

/// Where trusted root certificates come from (`sslrootcert`).
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) enum RootCert {
    /// A PEM file of one or more CA certificates.
    File(PathBuf),
    /// `sslrootcert=system`: the platform's trusted roots.
    System,
}

/// The TLS parameters of one connection string.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub(crate) struct TlsParams {
    /// `sslmode`; `None` when not given (libpq's default, `prefer`, or
    /// `verify-full` with `sslrootcert=system`).
    pub(crate) mode: Option<SslMode>,
    pub(crate) root: Option<RootCert>,
    /// `sslcert` and `sslkey`: a client certificate chain and its key (PEM).
    pub(crate) client: Option<(PathBuf, PathBuf)>,
}

impl TlsParams {
    /// The mode in force, checked against the other parameters as libpq
    /// checks them.
    pub(crate) fn effective_mode(&self) -> Result<SslMode, String> {
        let system = self.root == Some(RootCert::System);
        match self.mode {
            None if system => Ok(SslMode::VerifyFull),
            None => Ok(SslMode::Prefer),
            // libpq refuses to trust the whole platform store for any
            // certificate that merely chains to it, whatever its name.
            Some(mode) if system && mode != SslMode::VerifyFull => Err(format!(
                "sslrootcert=system needs sslmode=verify-full (weak sslmode {} refused)",
                mode.name()
            )),
            Some(mode @ (SslMode::VerifyCa | SslMode::VerifyFull)) if self.root.is_none() => {
                Err(format!(
                    "sslmode={} needs sslrootcert: a CA certificate file, or system for the platform's roots",
                    mode.name()
                ))
            }
            Some(mode) => Ok(mode),
        }
    }
}

impl SslMode {
    pub(crate) fn name(self) -> &'static str {
        match self {
            SslMode::Disable => "disable",
            SslMode::Prefer => "prefer",
            SslMode::Require => "require",
            SslMode::VerifyCa => "verify-ca",
            SslMode::VerifyFull => "verify-full",
        }
    }
}

/// What the hosts of `config` make of `mode`, as libpq has it, adjusting
/// `config` where it must:
///
/// - Unix sockets only: a local socket carries no TLS and libpq ignores
///   `sslmode` there, so `prefer` and `require` connect without it (no
///   server answers a TLS request on a socket); `verify-ca` and
///   `verify-full`, which promise a certificate, are refused rather than
///   quietly dropped.
/// - `hostaddr` without `host`: below `verify-full` no name is needed, so
///   the address is the name TLS is given (the certificate's name is not
///   checked); `verify-full` needs a host name to check, as libpq says.
pub(crate) fn settle_hosts(
    config: &mut tokio_postgres::Config,
    mode: SslMode,
) -> Result<SslMode, String> {
    use tokio_postgres::config::Host;
    let hosts = config.get_hosts();
    let unix_only = !hosts.is_empty()
        && config.get_hostaddrs().is_empty()
        && hosts.iter().all(|h| !matches!(h, Host::Tcp(_)));
    if unix_only {
        return match mode {
            SslMode::Disable | SslMode::Prefer | SslMode::Require => Ok(SslMode::Disable),
            SslMode::VerifyCa | SslMode::VerifyFull => Err(format!(
                "sslmode={} cannot be met over a Unix socket, which carries no TLS: \
                 connect over TCP (host=NAME) or use sslmode=require",
                mode.name()
            )),
        };
    }
    if hosts.is_empty() && !config.get_hostaddrs().is_empty() && mode != SslMode::Disable {
        if mode == SslMode::VerifyFull {
            return Err(
                "sslmode=verify-full needs host, the name the certificate must carry; \
                 hostaddr alone gives none (add host=NAME beside hostaddr)"
                    .into(),
            );
        }
        let names: Vec<String> = config
            .get_hostaddrs()
            .iter()
            .map(ToString::to_string)
            .collect();
        for name in names {
            config.host(&name);
        }
    }
    Ok(mode)
}

/// Splits libpq's TLS parameters (`sslmode`, `sslrootcert`, `sslcert`,
/// `sslkey`) off `conninfo`: returns the rest, in the same form, and the
/// parameters. The last occurrence of a parameter wins, as in libpq.
pub(crate) fn split(conninfo: &str) -> Result<(String, TlsParams), String> {
    let mut params = TlsParams::default();
    let mut cert = None;
    let mut key = None;
    let mut take = |name: &str, value: String| -> Result<bool, String> {
        match name {
            "sslmode" => params.mode = Some(SslMode::parse(&value)?),
            "sslrootcert" => {
                params.root = Some(match value.as_str() {
                    "system" => RootCert::System,
                    _ => RootCert::File(value.into()),
                })
            }
            "sslcert" => cert = Some(PathBuf::from(value)),
            "sslkey" => key = Some(PathBuf::from(value)),
            _ => return Ok(false),
        }
        Ok(true)
    };
    let rest = if conninfo.starts_with("postgres://") || conninfo.starts_with("postgresql://") {
        split_url(conninfo, &mut take)?
    } else {
        split_pairs(conninfo, &mut take)?
    };
    params.client = match (cert, key) {
        (Some(cert), Some(key)) => Some((cert, key)),
        (None, None) => None,
        (Some(_), None) => return Err("sslcert is given without sslkey".into()),
        (None, Some(_)) => return Err("sslkey is given without sslcert".into()),
    };
    Ok((rest, params))
}

type Take<'a> = dyn FnMut(&str, String) -> Result<bool, String> + 'a;

fn split_url(url: &str, take: &mut Take<'_>) -> Result<String, String> {
    let Some((base, query)) = url.split_once('?') else {
        return Ok(url.to_owned());
    };
    let mut kept = Vec::new();
    for pair in query.split('&').filter(|p| !p.is_empty()) {
        let (name, value) = pair.split_once('=').unwrap_or((pair, ""));
        if !take(&percent_decode(name)?, percent_decode(value)?)? {
            kept.push(pair);
        }
    }
    Ok(match kept.is_empty() {
        true => base.to_owned(),
        false => format!("{base}?{}", kept.join("&")),
    })
}

fn percent_decode(s: &str) -> Result<String, String> {
    let bytes = s.as_bytes();
    let mut out = Vec::with_capacity(bytes.len());
    let mut i = 0;
    while i < bytes.len() {
        if bytes[i] == b'%' {
            let hex = s
                .get(i + 1..i + 3)
                .and_then(|h| u8::from_str_radix(h, 16).ok())
                .ok_or_else(|| {
                    format!("invalid percent-encoding in the connection URL at {s:?}")
                })?;
            out.push(hex);
            i += 3;
        } else {
            out.push(bytes[i]);
            i += 1;
        }
    }
    String::from_utf8(out).map_err(|_| "a connection URL parameter is not UTF-8".to_owned())
}

/// `key = value` pairs, values bare or single-quoted with backslash
/// escapes, as libpq reads them. Pairs that are not taken are copied as
/// they were written.
fn split_pairs(conninfo: &str, take: &mut Take<'_>) -> Result<String, String> {
    let s = conninfo.as_bytes();
    let mut kept = Vec::new();
    let mut i = 0;
    let skip_space = |mut i: usize| {
        while i < s.len() && s[i].is_ascii_whitespace() {
            i += 1;
        }
        i
    };
    loop {
        i = skip_space(i);
        if i == s.len() {
            break;
        }
        let start = i;
        while i < s.len() && s[i] != b'=' && !s[i].is_ascii_whitespace() {
            i += 1;
        }
        let name = &conninfo[start..i];
        i = skip_space(i);
        if s.get(i) != Some(&b'=') {
            return Err(format!(
                "missing \"=\" after {name:?} in the connection string"
            ));
        }
        i = skip_space(i + 1);
        let mut value = Vec::new();
        if s.get(i) == Some(&b'\'') {
            i += 1;
            loop {
                match s.get(i) {
                    None => {
                        return Err("unterminated quoted string in the connection string".into())
                    }
                    Some(b'\'') => break i += 1,
                    Some(b'\\') if i + 1 < s.len() => {
                        value.push(s[i + 1]);
                        i += 2;
                    }
                    Some(&c) => {
                        value.push(c);
                        i += 1;
                    }
                }
            }
        } else {
            while i < s.len() && !s[i].is_ascii_whitespace() {
                if s[i] == b'\\' && i + 1 < s.len() {
                    i += 1;
                }
                value.push(s[i]);
                i += 1;
            }
        }
        let value = String::from_utf8(value)
            .map_err(|_| "a connection string value is not UTF-8".to_owned())?;
        if !take(name, value)? {
            kept.push(&conninfo[start..i]);
        }
    }
    Ok(kept.join(" "))
}

#[cfg(test)]
mod tests {
    use super::*;

    fn tls(conninfo: &str) -> (String, TlsParams) {
        split(conninfo).unwrap()
    }

    #[test]
    fn takes_tls_parameters_out_of_a_url() {
        let (rest, params) = tls(
            "postgres://app:p%40ss@db.example.com:5432/app?sslmode=verify-full&sslrootcert=%2Fetc%2Fca.pem&application_name=x",
        );
        assert_eq!(
            rest,
            "postgres://app:p%40ss@db.example.com:5432/app?application_name=x"
        );
        assert_eq!(params.mode, Some(SslMode::VerifyFull));
        assert_eq!(params.root, Some(RootCert::File("/etc/ca.pem".into())));
        assert_eq!(params.effective_mode(), Ok(SslMode::VerifyFull));
        let (rest, _) = tls("postgresql://h/db?sslmode=require");
        assert_eq!(rest, "postgresql://h/db");
    }

    #[test]
    fn takes_tls_parameters_out_of_key_value_pairs() {
        let (rest, params) = tls(
            "host=db port=5432 sslmode = verify-ca sslrootcert='/a dir/ca.pem' user=app sslcert=c.pem sslkey='k\\'s.pem'",
        );
        assert_eq!(rest, "host=db port=5432 user=app");
        assert_eq!(params.mode, Some(SslMode::VerifyCa));
        assert_eq!(params.root, Some(RootCert::File("/a dir/ca.pem".into())));
        assert_eq!(params.client, Some(("c.pem".into(), "k's.pem".into())));
        let (rest, params) = tls("host='/tmp/a b' dbname=x");
        assert_eq!(rest, "host='/tmp/a b' dbname=x");
        assert_eq!(params, TlsParams::default());
    }

    #[test]
    fn checks_the_parameters_as_libpq_does() {
        let mode = |s: &str| tls(s).1.effective_mode();
        assert_eq!(mode("host=h"), Ok(SslMode::Prefer));
        assert_eq!(mode("host=h sslrootcert=system"), Ok(SslMode::VerifyFull));
        assert!(mode("host=h sslrootcert=system sslmode=require")
            .unwrap_err()
            .contains("verify-full"));
        assert!(mode("host=h sslmode=verify-full")
            .unwrap_err()
            .contains("needs sslrootcert"));
        assert_eq!(
            mode("host=h sslmode=require sslrootcert=ca.pem"),
            Ok(SslMode::Require)
        );
        for bad in [
            "host=h sslmode=allow",
            "host=h sslmode=on",
            "host=h sslcert=c.pem",
            "host=h sslkey=k.pem",
            "host=h sslmode",
            "host=h sslrootcert='open",
            "postgres://h/d?sslmode=%zz",
        ] {
            assert!(split(bad).is_err(), "{bad} was accepted");
        }
    }
}
