//! Just enough SQL lexing to find each statement's leading keywords, so that
//! [`PgTx`](super::PgTx) can refuse statements that would end the layer's
//! transaction or change the pooled session for later requests.
//!
//! Quotes (`'…'`, `E'…'`, `"…"`, `$tag$…$tag$`) and comments (`--`, nested
//! `/* */`) are skipped, so a `;` or a keyword inside them counts for nothing.

/// Why a statement is refused.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(super) enum Refusal {
    /// BEGIN, COMMIT, ROLLBACK (but not ROLLBACK TO), END, ABORT, START, PREPARE TRANSACTION.
    TransactionControl,
    /// A session-level SET/RESET, which would outlive the transaction on the pooled connection.
    SessionState,
}

/// The first refused statement in `sql`, if any.
pub(super) fn refusal(sql: &str) -> Option<Refusal> {
    statements(sql)
        .into_iter()
        .find_map(|words| classify(&words))
}

fn classify(words: &[String]) -> Option<Refusal> {
    let word = |i: usize| words.get(i).map(String::as_str);
    match word(0)? {
        "BEGIN" | "START" | "COMMIT" | "END" | "ABORT" => Some(Refusal::TransactionControl),
        "ROLLBACK" if word(1) != Some("TO") => Some(Refusal::TransactionControl),
        "PREPARE" if word(1) == Some("TRANSACTION") => Some(Refusal::TransactionControl),
        "SET" if !matches!(word(1), Some("LOCAL" | "TRANSACTION" | "CONSTRAINTS")) => {
            Some(Refusal::SessionState)
        }
        "RESET" => Some(Refusal::SessionState),
        _ => None,
    }
}

/// The first two upper-cased keywords of every statement.
fn statements(sql: &str) -> Vec<Vec<String>> {
    let bytes = sql.as_bytes();
    let mut statements = Vec::new();
    let mut words: Vec<String> = Vec::new();
    let mut i = 0;
    while i < bytes.len() {
        let b = bytes[i];
        match b {
            b';' => {
                if !words.is_empty() {
                    statements.push(std::mem::take(&mut words));
                }
                i += 1;
            }
            b'-' if bytes.get(i + 1) == Some(&b'-') => {
                i = bytes[i..]
                    .iter()
                    .position(|&c| c == b'\n')
                    .map_or(bytes.len(), |n| i + n + 1);
            }
            b'/' if bytes.get(i + 1) == Some(&b'*') => i = skip_block_comment(bytes, i),
            b'\'' => i = skip_quoted(bytes, i, b'\'', false),
            b'"' => i = skip_quoted(bytes, i, b'"', false),
            b'$' => i = skip_dollar_quoted(bytes, i),
            c if c.is_ascii_alphabetic() || c == b'_' => {
                let start = i;
                while i < bytes.len()
                    && (bytes[i].is_ascii_alphanumeric() || bytes[i] == b'_' || bytes[i] == b'$')
                {
                    i += 1;
                }
                // E'…' strings take backslash escapes.
                if i - start == 1 && matches!(c, b'e' | b'E') && bytes.get(i) == Some(&b'\'') {
                    i = skip_quoted(bytes, i, b'\'', true);
                } else if words.len() < 2 {
                    words.push(sql[start..i].to_ascii_uppercase());
                }
            }
            _ => {
                // Anything else (a parenthesis, a number, an operator) ends the
                // leading keywords of this statement.
                if !b.is_ascii_whitespace() && b != b'(' && words.len() < 2 {
                    words.resize(2, String::new());
                }
                i += 1;
            }
        }
    }
    if !words.is_empty() {
        statements.push(words);
    }
    statements
}

fn skip_block_comment(bytes: &[u8], mut i: usize) -> usize {
    let mut depth = 0;
    while i < bytes.len() {
        if bytes[i] == b'/' && bytes.get(i + 1) == Some(&b'*') {
            depth += 1;
            i += 2;
        } else if bytes[i] == b'*' && bytes.get(i + 1) == Some(&b'/') {
            depth -= 1;
            i += 2;
            if depth == 0 {
                return i;
            }
        } else {
            i += 1;
        }
    }
    i
}

/// Skips a quoted run starting at `i`; a doubled quote is an escaped quote.
fn skip_quoted(bytes: &[u8], mut i: usize, quote: u8, backslash_escapes: bool) -> usize {
    i += 1;
    while i < bytes.len() {
        match bytes[i] {
            b'\\' if backslash_escapes => i += 2,
            c if c == quote && bytes.get(i + 1) == Some(&quote) => i += 2,
            c if c == quote => return i + 1,
            _ => i += 1,
        }
    }
    i
}

/// `$tag$ … $tag$`; a `$` that does not open a tag (`$1`) is skipped alone.
fn skip_dollar_quoted(bytes: &[u8], i: usize) -> usize {
    let tag_end = bytes[i + 1..]
        .iter()
        .position(|&c| !(c.is_ascii_alphanumeric() || c == b'_'))
        .map(|n| i + 1 + n);
    match tag_end {
        Some(end) if bytes[end] == b'$' && !bytes.get(i + 1).is_some_and(u8::is_ascii_digit) => {
            let tag = &bytes[i..=end];
            let body = end + 1;
            bytes[body..]
                .windows(tag.len())
                .position(|w| w == tag)
                .map_or(bytes.len(), |n| body + n + tag.len())
        }
        _ => i + 1,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn refuses_statements_that_end_the_transaction() {
        for sql in [
            "COMMIT",
            "  commit;",
            "COMMIT;",
            "end;",
            "/* x */ COMMIT",
            "/* a /* nested */ b */ commit",
            "-- c\nROLLBACK",
            "BEGIN",
            "start transaction",
            "rollback",
            "abort",
            "PREPARE TRANSACTION 'x'",
            "INSERT INTO t VALUES (1); COMMIT",
            "SELECT 'a;b'; END",
        ] {
            assert_eq!(refusal(sql), Some(Refusal::TransactionControl), "{sql:?}");
        }
    }

    #[test]
    fn refuses_session_level_settings() {
        for sql in [
            "SET default_transaction_read_only = on",
            "set search_path to x",
            "RESET ALL",
            "SET SESSION x = 1",
        ] {
            assert_eq!(refusal(sql), Some(Refusal::SessionState), "{sql:?}");
        }
    }

    #[test]
    fn allows_ordinary_statements_savepoints_and_local_settings() {
        for sql in [
            "SAVEPOINT a",
            "ROLLBACK TO SAVEPOINT a",
            "rollback to a",
            "RELEASE a",
            "SET LOCAL lock_timeout = '1s'",
            "SET TRANSACTION ISOLATION LEVEL SERIALIZABLE",
            "SET CONSTRAINTS ALL DEFERRED",
            "INSERT INTO t VALUES (1)",
            "INSERT INTO t VALUES ('done; end of story')",
            "INSERT INTO t VALUES (E'it\\'s; commit')",
            "INSERT INTO t VALUES ($$; COMMIT $$)",
            "INSERT INTO t VALUES ($body$; ROLLBACK $body$)",
            "SELECT $1::text",
            "UPDATE \"commit\" SET x = 1",
            "PREPARE q AS SELECT 1",
            "(SELECT 1)",
            "",
            ";;",
            "-- only a comment",
        ] {
            assert_eq!(refusal(sql), None, "{sql:?}");
        }
    }

    #[test]
    fn never_panics_on_truncated_input() {
        for sql in ["'", "\"", "$", "$a", "$a$", "/*", "E'", "E'\\", "--", "x$"] {
            let _ = refusal(sql);
        }
    }
}
