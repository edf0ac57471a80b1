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

/// libpq's TLS parameters, the names [`split`] takes out.
const TLS_KEYS: [&str; 4] = ["sslmode", "sslrootcert", "sslcert", "sslkey"];

/// Splits libpq's TLS parameters (`sslmode`, `sslrootcert`, `sslcert`,
/// `sslkey`) off `conninfo`: returns the rest, in the same form, and the
/// parameters. The last occurrence of a parameter wins, as in libpq.
///
/// The string is cut where tokio-postgres's own parser cuts it, and every
/// other parameter is copied as it was written, so the rest means to
/// tokio-postgres what `conninfo` meant without the TLS parameters (a
/// property test holds both forms to it).
pub(crate) fn split(conninfo: &str) -> Result<(String, TlsParams), String> {
    let mut params = TlsParams::default();
    let mut cert = None;
    let mut key = None;
    let mut take = |name: &str, value: String| -> Result<(), String> {
        match name {
            "sslmode" => params.mode = Some(SslMode::parse(&value)?),
            "sslrootcert" => {
                params.root = Some(match value.as_str() {
                    "system" => RootCert::System,
                    _ => RootCert::File(value.into()),
                })
            }
            "sslcert" => cert = Some(PathBuf::from(value)),
            _ => key = Some(PathBuf::from(value)),
        }
        Ok(())
    };
    let rest = if let Some(after) = ["postgres://", "postgresql://"]
        .into_iter()
        .find_map(|prefix| conninfo.strip_prefix(prefix))
    {
        split_url(conninfo, conninfo.len() - after.len(), &mut take)?
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

/// Called with each TLS parameter's name and value.
type Take<'a> = dyn FnMut(&str, String) -> Result<(), String> + 'a;

/// A URL's query, cut as tokio-postgres cuts it: the credentials end at the
/// first `@` (which may hide a `?`), the query starts at the next `?`, and
/// each parameter is a name up to the next `=` and a value up to the next
/// `&`. Names and values are percent-decoded (only the TLS parameters'
/// values here: tokio-postgres reads a `host` as bytes).
fn split_url(url: &str, prefix: usize, take: &mut Take<'_>) -> Result<String, String> {
    let after_credentials = url[prefix..].find('@').map_or(prefix, |at| prefix + at + 1);
    let Some(query) = url[after_credentials..].find('?') else {
        return Ok(url.to_owned());
    };
    let (base, query) = url.split_at(after_credentials + query + 1);
    let decode = |s: &str| {
        percent_encoding::percent_decode_str(s)
            .decode_utf8()
            .map(|decoded| decoded.into_owned())
            .map_err(|_| "a connection URL parameter is not UTF-8 once percent-decoded".to_owned())
    };
    let mut kept = Vec::new();
    let mut taken = false;
    let mut rest = query;
    while !rest.is_empty() {
        // A name without `=` is tokio-postgres's error to report: the rest
        // is passed on as it is.
        let Some(eq) = rest.find('=') else {
            kept.push(rest);
            break;
        };
        let end = rest[eq + 1..]
            .find('&')
            .map_or(rest.len(), |amp| eq + 1 + amp);
        let (pair, name, value) = (&rest[..end], &rest[..eq], &rest[eq + 1..end]);
        rest = rest.get(end + 1..).unwrap_or("");
        let name = decode(name)?;
        if TLS_KEYS.contains(&name.as_str()) {
            take(&name, decode(value)?)?;
            taken = true;
        } else {
            kept.push(pair);
        }
    }
    Ok(match (taken, kept.is_empty()) {
        (false, _) => url.to_owned(),
        (true, true) => base[..base.len() - 1].to_owned(),
        (true, false) => format!("{base}{}", kept.join("&")),
    })
}

/// `key = value` pairs, values bare or single-quoted with backslash
/// escapes, cut as tokio-postgres (and libpq) cut them: whitespace is
/// Unicode's, and an empty name ends the string. Pairs that are not taken
/// are copied as they were written.
fn split_pairs(conninfo: &str, take: &mut Take<'_>) -> Result<String, String> {
    let mut chars = conninfo.char_indices().peekable();
    let mut kept = Vec::new();
    let skip_space = |chars: &mut std::iter::Peekable<std::str::CharIndices<'_>>| {
        while chars.next_if(|(_, c)| c.is_whitespace()).is_some() {}
    };
    let at = |chars: &mut std::iter::Peekable<std::str::CharIndices<'_>>| {
        chars.peek().map_or(conninfo.len(), |&(i, _)| i)
    };
    loop {
        skip_space(&mut chars);
        let start = at(&mut chars);
        while chars
            .next_if(|&(_, c)| c != '=' && !c.is_whitespace())
            .is_some()
        {}
        let name = &conninfo[start..at(&mut chars)];
        if name.is_empty() {
            // The end, or what tokio-postgres ignores (a pair with no name).
            if start < conninfo.len() {
                kept.push(&conninfo[start..]);
            }
            break;
        }
        skip_space(&mut chars);
        if chars.next_if(|&(_, c)| c == '=').is_none() {
            return Err(format!(
                "missing \"=\" after {name:?} in the connection string"
            ));
        }
        skip_space(&mut chars);
        let mut value = String::new();
        if chars.next_if(|&(_, c)| c == '\'').is_some() {
            loop {
                match chars.next() {
                    None => {
                        return Err("unterminated quoted string in the connection string".into())
                    }
                    Some((_, '\'')) => break,
                    Some((_, '\\')) => value.extend(chars.next().map(|(_, c)| c)),
                    Some((_, c)) => value.push(c),
                }
            }
        } else {
            while let Some((_, c)) = chars.next_if(|(_, c)| !c.is_whitespace()) {
                match c {
                    '\\' => value.extend(chars.next().map(|(_, c)| c)),
                    c => value.push(c),
                }
            }
            if value.is_empty() {
                return Err(format!(
                    "missing value for {name:?} in the connection string"
                ));
            }
        }
        if TLS_KEYS.contains(&name) {
            take(name, value)?;
        } else {
            kept.push(&conninfo[start..at(&mut chars)]);
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
            "postgres://h/d?sslrootcert=%ff",
            "host=h sslrootcert=",
        ] {
            assert!(split(bad).is_err(), "{bad} was accepted");
        }
    }

    #[test]
    fn cuts_where_tokio_postgres_cuts() {
        // The credentials end at the first `@`: a `?` in a password is no query.
        let url = "postgres://u:p?sslmode=x@h/db?sslmode=require&application_name=a";
        let (rest, params) = tls(url);
        assert_eq!(rest, "postgres://u:p?sslmode=x@h/db?application_name=a");
        assert_eq!(params.mode, Some(SslMode::Require));
        // Unicode whitespace separates pairs, a backslash escapes one, and a
        // trailing backslash escapes nothing.
        let (rest, params) = tls("host=h\u{a0}sslrootcert=ca.pem\\  port=1");
        assert_eq!(rest, "host=h port=1");
        assert_eq!(params.root, Some(RootCert::File("ca.pem ".into())));
        let (_, params) = tls("sslrootcert=ca\\");
        assert_eq!(params.root, Some(RootCert::File("ca".into())));
        // Only the TLS parameters' values are decoded: a host is bytes.
        let url = "postgres://h/db?host=/tmp/%ff&sslmode=disable";
        assert_eq!(tls(url).0, "postgres://h/db?host=/tmp/%ff");
    }

    use proptest::prelude::*;

    /// What tokio-postgres makes of a connection string (its error, as text).
    fn parsed(conninfo: &str) -> Result<tokio_postgres::Config, String> {
        conninfo
            .parse::<tokio_postgres::Config>()
            .map_err(|e| e.to_string())
    }

    /// Text made of the characters either parser treats specially, and a few others.
    fn tricky(max: usize) -> impl Strategy<Value = String> {
        proptest::collection::vec(
            prop_oneof![
                4 => proptest::char::range('a', 'e'),
                1 => proptest::char::range('0', '9'),
                6 => proptest::sample::select(vec![
                    '=', '&', '?', '@', '/', ':', '%', '\'', '\\', ' ', '\t', '\u{a0}', ',', '[', ']', 'é',
                ]),
            ],
            0..max,
        )
        .prop_map(|chars| chars.into_iter().collect())
    }

    /// A parameter name: one tokio-postgres knows, an unknown one, or noise.
    fn name() -> impl Strategy<Value = String> {
        prop_oneof![
            proptest::sample::select(vec![
                "host",
                "hostaddr",
                "port",
                "user",
                "password",
                "dbname",
                "options",
                "application_name",
                "connect_timeout",
                "target_session_attrs",
                "keepalives",
            ])
            .prop_map(str::to_owned),
            "[a-z_]{1,6}",
            tricky(6),
        ]
    }

    /// A value as written: bare, quoted, percent-encoded or noise.
    fn value() -> impl Strategy<Value = String> {
        prop_oneof![
            "[a-z0-9/._-]{0,8}",
            "[a-z0-9/. ]{0,8}".prop_map(|v| format!("'{}'", v.replace(' ', "\\ "))),
            "(%[0-9a-fA-F]{2}|[a-z/]){0,4}",
            tricky(8),
        ]
    }

    /// A connection string of either form with no TLS parameter in it.
    fn conninfo() -> impl Strategy<Value = String> {
        let pairs = || proptest::collection::vec((name(), value()), 0..5);
        prop_oneof![
            // key=value pairs, separated by some whitespace.
            (
                pairs(),
                proptest::sample::select(vec![" ", "  ", "\t", "\u{a0}", " \n "])
            )
                .prop_map(|(pairs, sep)| pairs
                    .iter()
                    .map(|(n, v)| format!("{n}={v}"))
                    .collect::<Vec<_>>()
                    .join(sep)),
            // A URL with a query.
            (
                proptest::sample::select(vec!["postgres://", "postgresql://"]),
                tricky(12),
                pairs(),
            )
                .prop_map(|(scheme, base, pairs)| {
                    let query: Vec<_> = pairs.iter().map(|(n, v)| format!("{n}={v}")).collect();
                    format!("{scheme}{base}?{}", query.join("&"))
                }),
            // Anything at all.
            tricky(24),
            tricky(24).prop_map(|s| format!("postgres://{s}")),
        ]
        .prop_filter("no TLS parameter", |s| !s.contains("ssl"))
    }

    proptest! {
        /// With no TLS parameter, the rest means to tokio-postgres exactly
        /// what the connection string meant (or fails as it fails).
        #[test]
        fn without_tls_parameters_the_rest_parses_as_the_original(conninfo in conninfo()) {
            let original = parsed(&conninfo);
            match split(&conninfo) {
                Ok((rest, params)) => {
                    prop_assert_eq!(&params, &TlsParams::default());
                    match (&original, parsed(&rest)) {
                        (Ok(original), Ok(rest)) => prop_assert_eq!(original, &rest),
                        (Err(_), Err(_)) => {}
                        (original, rest) => prop_assert!(
                            false,
                            "{conninfo:?} parsed {original:?}, its rest {rest:?}"
                        ),
                    }
                }
                Err(e) => prop_assert!(original.is_err(), "{conninfo:?} refused: {e}"),
            }
        }

        /// TLS parameters put between the others come out with their
        /// values, and the rest parses as the string without them.
        #[test]
        fn tls_parameters_come_out_and_leave_the_rest_as_it_was(
            pairs in proptest::collection::vec(("[a-z_]{1,8}", "[a-z0-9/._-]{1,8}"), 0..4),
            url in any::<bool>(),
            mode in proptest::sample::select(vec!["disable", "prefer", "require", "verify-ca", "verify-full"]),
            root in "[a-z0-9/._ -]{1,12}",
            at in any::<proptest::sample::Index>(),
        ) {
            let (mode_pair, root_pair) = match url {
                true => (
                    format!("sslmode={mode}"),
                    format!("sslrootcert={}", root.replace(' ', "%20")),
                ),
                false => (
                    format!("sslmode = {mode}"),
                    format!("sslrootcert='{root}'"),
                ),
            };
            let mut plain: Vec<String> = pairs.iter().map(|(n, v)| format!("{n}={v}")).collect();
            let mut with = plain.clone();
            let i = at.index(with.len() + 1);
            with.insert(i, mode_pair);
            with.insert(i, root_pair);
            let (sep, base) = match url {
                true => ("&", "postgres://u:p%40w@h:5432/db?"),
                false => (" ", ""),
            };
            if url && plain.is_empty() {
                plain.push(String::new());
            }
            let without = format!("{base}{}", plain.join(sep));
            let with = format!("{base}{}", with.join(sep));
            let (rest, params) = split(&with).map_err(TestCaseError::fail)?;
            prop_assert_eq!(params.mode.map(SslMode::name), Some(mode));
            prop_assert_eq!(params.root, Some(RootCert::File(root.into())));
            prop_assert_eq!(parsed(&rest), parsed(&without), "{:?} left {:?}", with, rest);
        }
    }
}
