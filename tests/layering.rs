//! The direction of the crate's imports, checked on its source text (no
//! database, no build of anything but this file).
//!
//! The driver-neutral layers (`src/protocol`, the PostgreSQL protocol both
//! drivers speak; `src/store`, the store traits; `src/server`, the
//! middleware) never name a driver: no path that resolves to
//! `crate::postgres` or `crate::sqlx` (`use crate::{postgres::…}`,
//! `super::super::sqlx::…`, `$crate::postgres::…` in a macro all count),
//! and no `feature = "postgres"`, `feature = "sqlx"` or
//! `feature = "tls-rustls"` (PgStore's TLS) in a `cfg`. The drivers
//! (`src/postgres`, `src/sqlx`) never name `crate::server`: what both need
//! of the middleware's defaults lives in `src/store`.
//!
//! What is read:
//!
//! - Comments are not code: `//`, `///`, `//!` and `/* … */` are skipped,
//!   so a rustdoc intra-doc link such as ``[`PgStore`](crate::postgres::PgStore)``
//!   is documentation, not an import, and is allowed.
//! - Files whose name ends in `tests.rs` (`src/protocol/tests.rs`,
//!   `src/protocol/citus_tests.rs`, `src/protocol/migrations/tests.rs`, …)
//!   are exempt: they are test modules that run the protocol against
//!   PostgreSQL through a driver. Test modules written inline in any other
//!   file (`#[cfg(test)] mod tests { … }`) are not exempt.
//!
//! A failure lists every offending file and line.

use std::{
    fmt::Write as _,
    fs,
    path::{Path, PathBuf},
};

/// Driver-neutral layers: they name no driver.
const NEUTRAL: &[&str] = &["src/protocol", "src/store", "src/server"];

/// The drivers' modules, as paths from the crate root.
const DRIVER_MODULES: &[&str] = &["postgres", "sqlx"];

/// Features that exist for one driver.
const DRIVER_FEATURES: &[&str] = &["postgres", "sqlx", "tls-rustls"];

/// The drivers: they never name the middleware.
const DRIVERS: &[&str] = &["src/postgres", "src/sqlx"];

#[test]
fn neutral_layers_name_no_driver_and_drivers_name_no_server() {
    let root = Path::new(env!("CARGO_MANIFEST_DIR"));
    let mut files = Vec::new();
    rust_files(&root.join("src"), &mut files);
    files.sort();

    let mut offences = Vec::new();
    for file in &files {
        let relative = file
            .strip_prefix(root)
            .expect("under the manifest directory")
            .to_str()
            .expect("UTF-8 path")
            .replace('\\', "/");
        if exempt(&relative) {
            continue;
        }
        let neutral = NEUTRAL.iter().any(|dir| under(&relative, dir));
        let driver = DRIVERS.iter().any(|dir| under(&relative, dir));
        if !neutral && !driver {
            continue;
        }
        let source = fs::read_to_string(file).expect("readable source");
        let tokens = tokens(&source);
        let module = module_path(&relative);
        for (path, line) in paths(&tokens) {
            let Some(resolved) = resolve(&module, &path) else {
                continue;
            };
            let named =
                |top: &str| resolved.len() > 1 && resolved[0] == "crate" && resolved[1] == top;
            let wrong = if neutral {
                DRIVER_MODULES.iter().copied().find(|m| named(m))
            } else {
                named("server").then_some("server")
            };
            if let Some(top) = wrong {
                offences.push((
                    relative.clone(),
                    line,
                    format!(
                        "names `crate::{top}` (as `{}`): {}",
                        path.join("::"),
                        source_line(&source, line)
                    ),
                ));
            }
        }
        if neutral {
            for (feature, line) in features(&tokens) {
                if !DRIVER_FEATURES.contains(&feature.as_str()) {
                    continue;
                }
                offences.push((
                    relative.clone(),
                    line,
                    format!(
                        "mentions the driver feature `{feature}`: {}",
                        source_line(&source, line)
                    ),
                ));
            }
        }
    }

    for dir in NEUTRAL.iter().chain(DRIVERS) {
        assert!(
            files.iter().any(|f| f.starts_with(root.join(dir))),
            "no source file under {dir}: the layering test no longer looks where the code is"
        );
    }

    if !offences.is_empty() {
        offences.sort();
        offences.dedup();
        let mut message = format!("{} line(s) against the layering:\n", offences.len());
        for (file, line, what) in &offences {
            writeln!(message, "  {file}:{line}: {what}").unwrap();
        }
        panic!("{message}");
    }
}

/// Test modules that run against PostgreSQL through a driver.
fn exempt(relative: &str) -> bool {
    relative.ends_with("tests.rs")
}

fn under(relative: &str, dir: &str) -> bool {
    relative
        .strip_prefix(dir)
        .is_some_and(|rest| rest.starts_with('/'))
}

fn rust_files(dir: &Path, out: &mut Vec<PathBuf>) {
    for entry in fs::read_dir(dir).expect("readable directory") {
        let path = entry.expect("directory entry").path();
        if path.is_dir() {
            rust_files(&path, out);
        } else if path.extension().is_some_and(|e| e == "rs") {
            out.push(path);
        }
    }
}

/// The module a file under `src/` is: `src/a/mod.rs` and `src/a.rs` are
/// `crate::a`, `src/lib.rs` is `crate`.
fn module_path(relative: &str) -> Vec<String> {
    let inner = relative
        .strip_prefix("src/")
        .expect("a file under src/")
        .strip_suffix(".rs")
        .expect("a .rs file");
    let mut module = vec!["crate".to_owned()];
    let parts: Vec<&str> = inner.split('/').collect();
    for (i, part) in parts.iter().enumerate() {
        let last = i + 1 == parts.len();
        if last && (*part == "mod" || (i == 0 && (*part == "lib" || *part == "main"))) {
            continue;
        }
        module.push((*part).to_owned());
    }
    module
}

fn source_line(source: &str, line: usize) -> &str {
    source.lines().nth(line - 1).unwrap_or("").trim()
}

#[derive(Debug, Clone, PartialEq)]
enum Token {
    Ident(String),
    /// `::`
    PathSep,
    Punct(char),
    /// A string literal's contents (escapes left as written).
    Str(String),
    /// A character or number literal, a lifetime's quote.
    Other,
}

/// The code of `source`, comments left out, as tokens with their line.
fn tokens(source: &str) -> Vec<(Token, usize)> {
    let chars: Vec<char> = source.chars().collect();
    let mut out = Vec::new();
    let mut line = 1;
    let mut i = 0;
    let at = |i: usize| chars.get(i).copied().unwrap_or('\0');
    while i < chars.len() {
        let c = chars[i];
        match c {
            '\n' => {
                line += 1;
                i += 1;
            }
            c if c.is_whitespace() => i += 1,
            '/' if at(i + 1) == '/' => {
                while i < chars.len() && chars[i] != '\n' {
                    i += 1;
                }
            }
            '/' if at(i + 1) == '*' => {
                let mut depth = 0;
                while i < chars.len() {
                    if chars[i] == '/' && at(i + 1) == '*' {
                        depth += 1;
                        i += 2;
                    } else if chars[i] == '*' && at(i + 1) == '/' {
                        depth -= 1;
                        i += 2;
                        if depth == 0 {
                            break;
                        }
                    } else {
                        if chars[i] == '\n' {
                            line += 1;
                        }
                        i += 1;
                    }
                }
            }
            '"' => {
                let start = line;
                let (text, next, lines) = quoted(&chars, i + 1);
                out.push((Token::Str(text), start));
                line += lines;
                i = next;
            }
            '\'' => {
                // A character literal ('a', '\n', '\''), or a lifetime's
                // or label's quote ('a, 'static).
                if at(i + 1) == '\\' {
                    i += 2;
                    while i < chars.len() && chars[i] != '\'' {
                        i += 1;
                    }
                    i += 1;
                } else if at(i + 2) == '\'' {
                    i += 3;
                } else {
                    i += 1;
                }
                out.push((Token::Other, line));
            }
            c if c.is_alphabetic() || c == '_' => {
                // Raw and byte strings: r"…", r#"…"#, b"…", br#"…"#, c"…".
                let mut j = i;
                while j < chars.len() && (chars[j].is_alphanumeric() || chars[j] == '_') {
                    j += 1;
                }
                let word: String = chars[i..j].iter().collect();
                let raw = matches!(word.as_str(), "r" | "br" | "cr");
                if raw && (at(j) == '"' || at(j) == '#') {
                    let mut hashes = 0;
                    let mut k = j;
                    while at(k) == '#' {
                        hashes += 1;
                        k += 1;
                    }
                    if at(k) == '"' {
                        let start = line;
                        k += 1;
                        let body_start = k;
                        loop {
                            if k >= chars.len() {
                                break;
                            }
                            if chars[k] == '"' && (1..=hashes).all(|h| at(k + h) == '#') {
                                break;
                            }
                            if chars[k] == '\n' {
                                line += 1;
                            }
                            k += 1;
                        }
                        let text: String = chars[body_start..k.min(chars.len())].iter().collect();
                        out.push((Token::Str(text), start));
                        i = k + 1 + hashes;
                        continue;
                    }
                }
                if matches!(word.as_str(), "b" | "c") && at(j) == '"' {
                    let start = line;
                    let (text, next, lines) = quoted(&chars, j + 1);
                    out.push((Token::Str(text), start));
                    line += lines;
                    i = next;
                    continue;
                }
                out.push((Token::Ident(word), line));
                i = j;
            }
            c if c.is_ascii_digit() => {
                while i < chars.len() && (chars[i].is_alphanumeric() || chars[i] == '_') {
                    i += 1;
                }
                out.push((Token::Other, line));
            }
            ':' if at(i + 1) == ':' => {
                out.push((Token::PathSep, line));
                i += 2;
            }
            c => {
                out.push((Token::Punct(c), line));
                i += 1;
            }
        }
    }
    out
}

/// A string's contents from `start` (after the opening quote) to its
/// closing quote: the text, the index after the quote, and the newlines in it.
fn quoted(chars: &[char], start: usize) -> (String, usize, usize) {
    let mut i = start;
    let mut lines = 0;
    while i < chars.len() && chars[i] != '"' {
        if chars[i] == '\\' {
            i += 1;
        }
        if chars.get(i) == Some(&'\n') {
            lines += 1;
        }
        i += 1;
    }
    let text = chars[start..i.min(chars.len())].iter().collect();
    (text, i + 1, lines)
}

/// Every path that starts at `crate`, `$crate`, `super` or `self`, use
/// groups expanded (`use crate::{a::b, c::{d, e}}` is `crate::a::b`,
/// `crate::c::d` and `crate::c::e`), each with the line of its last
/// segment.
fn paths(tokens: &[(Token, usize)]) -> Vec<(Vec<String>, usize)> {
    let mut out = Vec::new();
    for i in 0..tokens.len() {
        let Token::Ident(word) = &tokens[i].0 else {
            continue;
        };
        if !matches!(word.as_str(), "crate" | "super" | "self") {
            continue;
        }
        if i > 0 && tokens[i - 1].0 == Token::PathSep {
            continue;
        }
        tree(tokens, i, Vec::new(), &mut out);
    }
    out
}

/// Reads the use tree (or plain path) at `i` under `prefix`; returns the
/// index after it.
fn tree(
    tokens: &[(Token, usize)],
    mut i: usize,
    mut prefix: Vec<String>,
    out: &mut Vec<(Vec<String>, usize)>,
) -> usize {
    loop {
        match tokens.get(i) {
            Some((Token::Ident(word), line)) => {
                prefix.push(word.clone());
                if tokens.get(i + 1).map(|t| &t.0) == Some(&Token::PathSep) {
                    i += 2;
                    continue;
                }
                out.push((prefix, *line));
                return i + 1;
            }
            Some((Token::Punct('{'), _)) => {
                i += 1;
                loop {
                    match tokens.get(i) {
                        None => return i,
                        Some((Token::Punct('}'), _)) => return i + 1,
                        Some((Token::Punct(','), _)) => i += 1,
                        Some((Token::Ident(word), _)) if word == "as" => i += 2,
                        Some((Token::Ident(_) | Token::Punct('{'), _)) => {
                            i = tree(tokens, i, prefix.clone(), out);
                        }
                        Some(_) => i += 1,
                    }
                }
            }
            Some((_, line)) => {
                // `*`, `<` of a turbofish, …: the path so far.
                if prefix.len() > 1 {
                    out.push((prefix, *line));
                }
                return i;
            }
            None => return i,
        }
    }
}

/// `path` from the crate root, as seen from `module`; `None` for a path
/// that leaves the crate (too many `super`s).
fn resolve(module: &[String], path: &[String]) -> Option<Vec<String>> {
    let mut resolved: Vec<String>;
    let mut rest = path;
    match path.first().map(String::as_str) {
        Some("crate") => {
            resolved = vec!["crate".to_owned()];
            rest = &path[1..];
        }
        Some("self") => {
            resolved = module.to_vec();
            rest = &path[1..];
        }
        Some("super") => {
            resolved = module.to_vec();
            while rest.first().map(String::as_str) == Some("super") {
                if resolved.len() <= 1 {
                    return None;
                }
                resolved.pop();
                rest = &rest[1..];
            }
        }
        _ => return None,
    }
    resolved.extend(rest.iter().cloned());
    Some(resolved)
}

/// Every `feature = "…"` in the code (in `cfg`, `cfg_attr`, `cfg!`), with
/// its line.
fn features(tokens: &[(Token, usize)]) -> Vec<(String, usize)> {
    tokens
        .windows(3)
        .filter_map(|w| match (&w[0].0, &w[1].0, &w[2].0) {
            (Token::Ident(word), Token::Punct('='), Token::Str(name)) if word == "feature" => {
                Some((name.clone(), w[2].1))
            }
            _ => None,
        })
        .collect()
}

/// The reader itself, on text written to catch each way of naming a module.
mod reader {
    use super::*;

    fn named(module: &str, source: &str) -> Vec<String> {
        let module = module_path(module);
        paths(&tokens(source))
            .into_iter()
            .filter_map(|(path, line)| {
                resolve(&module, &path).map(|r| format!("{}@{line}", r.join("::")))
            })
            .collect()
    }

    #[test]
    fn groups_relative_paths_and_macros_are_resolved() {
        let found = named(
            "src/protocol/admin.rs",
            "use crate::{\n    key::Key,\n    postgres::{KeyRecord, KeyState as S},\n};\n\
             use super::super::sqlx::X;\n\
             fn f() { $crate::postgres::PgStore::builder::<u8>(); self::g(); }\n",
        );
        for expected in [
            "crate::key::Key@2",
            "crate::postgres::KeyRecord@3",
            "crate::postgres::KeyState@3",
            "crate::sqlx::X@5",
            "crate::postgres::PgStore::builder@6",
            "crate::protocol::admin::g@6",
        ] {
            assert!(
                found.contains(&expected.to_owned()),
                "{expected} in {found:?}"
            );
        }
    }

    #[test]
    fn comments_and_strings_are_not_code() {
        let source = "//! [`PgStore`](crate::postgres::PgStore)\n\
             /// see crate::sqlx\n/* crate::server::X\n crate::postgres */\n\
             const A: &str = \"crate::postgres // not a comment\"; // feature = \"sqlx\"\n\
             const B: &str = r#\"crate::sqlx \"# ; const C: char = '\"';\n\
             #[cfg(feature = \"postgres\")] fn g<'a>(_: &'a str) { crate::server::h() }\n";
        assert_eq!(
            named("src/postgres/pool.rs", source),
            ["crate::server::h@7"]
        );
        assert_eq!(
            features(&tokens(source)),
            [("postgres".to_owned(), 7)],
            "the feature in the comment is not read"
        );
    }

    #[test]
    fn modules_of_files() {
        assert_eq!(module_path("src/lib.rs"), ["crate"]);
        assert_eq!(module_path("src/protocol/mod.rs"), ["crate", "protocol"]);
        assert_eq!(
            module_path("src/protocol/migrations/tests.rs"),
            ["crate", "protocol", "migrations", "tests"]
        );
        assert_eq!(
            resolve(
                &module_path("src/server/layer/tests.rs"),
                &[
                    "super".into(),
                    "super".into(),
                    "super".into(),
                    "postgres".into()
                ]
            ),
            Some(vec!["crate".to_owned(), "postgres".to_owned()])
        );
    }
}
