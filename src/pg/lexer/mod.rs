//! Just enough of PostgreSQL's SQL scanner to tell what each statement does,
//! so that [`PgTx`](super::PgTx) (and `SqlxStore`'s guarded connection) can
//! refuse statements that would end the layer's transaction or change the
//! pooled session for later requests.
//!
//! The lexer follows PostgreSQL's (`src/backend/parser/scan.l`) wherever a
//! token's boundary decides what counts as a keyword: strings in all their
//! forms (`'…'`, `E'…'`, `B'…'`, `X'…'`, `N'…'`, `U&'…'`, `$tag$…$tag$`, and
//! a `'…'` continued after a newline), quoted identifiers (`"…"`, `U&"…"`),
//! `--` comments (which end at `\n` or `\r`), nested `/* */` comments and
//! whitespace (`[ \t\n\r\f\v]`). A `;` or a keyword inside a string or a
//! comment counts for nothing. Bytes of non-ASCII characters outside quotes
//! are identifier letters, as in PostgreSQL, so `COMMITé` is not `COMMIT`.
//!
//! It fails closed: text it cannot follow is refused, as transaction control,
//! rather than guessed at, because a misread quote would hide everything after
//! it. That covers unterminated strings, identifiers and comments, NUL bytes,
//! control characters outside strings and comments, and `UESCAPE` after
//! `U&"…"`. PostgreSQL rejects nearly all of these itself, so the refusal
//! costs nothing.
//!
//! Whether a backslash escapes a quote in a plain `'…'` depends on
//! `standard_conforming_strings`: on by default, but a role may have it off
//! and a handler may `SET LOCAL` it. So text with a backslash is read both
//! ways, and what either reading refuses is refused.

/// Why a statement is refused.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Refusal {
    /// BEGIN, START, COMMIT, END, ABORT, ROLLBACK (but not ROLLBACK TO),
    /// PREPARE TRANSACTION, COMMIT/ROLLBACK PREPARED; also text the lexer
    /// cannot follow (see the module docs).
    TransactionControl,
    /// Something that would outlive the transaction on the pooled connection:
    /// a session-level SET/RESET, prepared statements, LISTEN, temporary
    /// objects, WITH HOLD cursors, `set_config` and session advisory locks.
    SessionState,
}

/// The first refused statement in `sql`, if any.
pub(crate) fn refusal(sql: &str) -> Option<Refusal> {
    // The server reads query text only up to a NUL.
    if sql.contains('\0') {
        return Some(Refusal::TransactionControl);
    }
    let standard = match Lexer::new(sql, true).tokens() {
        Ok(tokens) => first_refusal(&tokens),
        Err(_) => return Some(Refusal::TransactionControl),
    };
    if standard.is_some() || !sql.contains('\\') {
        return standard;
    }
    // The reading with standard_conforming_strings off. Text that this
    // reading rejects is rejected whole by a server in that mode, before any
    // of it runs; `'C:\'` is such text, and fine under the default.
    match Lexer::new(sql, false).tokens() {
        Ok(tokens) => first_refusal(&tokens),
        Err(Stop::Rejected) => None,
        Err(Stop::Unfollowed) => Some(Refusal::TransactionControl),
    }
}

/// Functions whose effect outlives the transaction. `set_config(…, true)`
/// would be fine, but a call cannot be told apart from `set_config(…,
/// false)` without evaluating it; `SET LOCAL` can.
const SESSION_FUNCTIONS: [&str; 5] = [
    "set_config",
    "pg_advisory_lock",
    "pg_advisory_lock_shared",
    "pg_try_advisory_lock",
    "pg_try_advisory_lock_shared",
];

fn first_refusal(tokens: &[Token<'_>]) -> Option<Refusal> {
    tokens
        .split(|token| matches!(token, Token::Other(b';')))
        .find_map(statement_refusal)
}

fn statement_refusal(statement: &[Token<'_>]) -> Option<Refusal> {
    let parens = statement
        .iter()
        .take_while(|token| matches!(token, Token::Other(b'(')))
        .count();
    leading_refusal(&statement[parens..]).or_else(|| inner_refusal(statement))
}

/// Refusals decided by the keywords a statement starts with.
fn leading_refusal(statement: &[Token<'_>]) -> Option<Refusal> {
    use Refusal::{SessionState, TransactionControl};
    let is = |i: usize, keyword: &str| statement.get(i).is_some_and(|t| t.is(keyword));
    let Some(Token::Word(first)) = statement.first() else {
        return None;
    };
    match first.to_ascii_uppercase().as_str() {
        "BEGIN" | "START" | "COMMIT" | "END" | "ABORT" => Some(TransactionControl),
        "ROLLBACK" => {
            let to = if is(1, "WORK") || is(1, "TRANSACTION") {
                2
            } else {
                1
            };
            (!is(to, "TO")).then_some(TransactionControl)
        }
        "PREPARE" if is(1, "TRANSACTION") => Some(TransactionControl),
        // SET LOCAL ends with the transaction; but another client encoding
        // would change how the server reads the next text this lexer reads.
        "SET" if is(1, "LOCAL") => {
            let encoding =
                is(2, "NAMES") || statement.get(2).is_some_and(|t| t.names("client_encoding"));
            encoding.then_some(SessionState)
        }
        "SET" if is(1, "TRANSACTION") || is(1, "CONSTRAINTS") => None,
        "SET" | "RESET" | "PREPARE" | "EXECUTE" | "DEALLOCATE" | "LISTEN" | "UNLISTEN"
        | "DISCARD" | "LOAD" => Some(SessionState),
        _ => None,
    }
}

/// Refusals wherever the words appear in a statement (`EXPLAIN ANALYZE
/// CREATE TEMP TABLE …` creates the table too).
fn inner_refusal(statement: &[Token<'_>]) -> Option<Refusal> {
    let declares = statement.iter().any(|t| t.is("DECLARE"));
    let outlives = statement.iter().enumerate().any(|(i, token)| {
        let before = i.checked_sub(1).and_then(|p| statement.get(p));
        let after = &statement[i + 1..];
        SESSION_FUNCTIONS.iter().any(|f| token.names(f))
            // `pg_temp.t` creates, or finds, an object in the session's temporary schema.
            || (token.names_temp_schema() && matches!(after.first(), Some(Token::Other(b'.'))))
            || (token.is("CREATE") && creates_temporary(after))
            // SELECT … INTO TEMP t; `INSERT INTO temp` is a table named temp.
            || (token.is("INTO")
                && !before.is_some_and(|t| t.is("INSERT") || t.is("MERGE"))
                && temporary(after))
            || (declares && token.is("WITH") && after.first().is_some_and(|t| t.is("HOLD")))
    });
    outlives.then_some(Refusal::SessionState)
}

/// `[OR REPLACE] [LOCAL | GLOBAL] TEMP[ORARY]` after CREATE.
fn creates_temporary(after_create: &[Token<'_>]) -> bool {
    match after_create {
        [or, replace, rest @ ..] if or.is("OR") && replace.is("REPLACE") => temporary(rest),
        _ => temporary(after_create),
    }
}

/// `[LOCAL | GLOBAL] TEMP[ORARY]`.
fn temporary(words: &[Token<'_>]) -> bool {
    let words = match words {
        [scope, rest @ ..] if scope.is("LOCAL") || scope.is("GLOBAL") => rest,
        _ => words,
    };
    words
        .first()
        .is_some_and(|t| t.is("TEMP") || t.is("TEMPORARY"))
}

/// What the classification needs of a token; strings keep no content, since
/// nothing in them is ever run as a statement.
#[derive(Debug, Clone, PartialEq, Eq)]
enum Token<'a> {
    /// A keyword or unquoted identifier, as written.
    Word(&'a str),
    /// A quoted identifier, unescaped; `unicode` for `U&"…"`.
    Quoted { name: String, unicode: bool },
    /// A string constant of any kind.
    Literal,
    /// Punctuation, an operator character, a digit, the `$` of `$1`.
    Other(u8),
}

impl Token<'_> {
    fn is(&self, keyword: &str) -> bool {
        matches!(self, Token::Word(word) if word.eq_ignore_ascii_case(keyword))
    }

    /// The identifier this token spells, and whether PostgreSQL folds its case.
    fn identifier(&self) -> Option<(&str, bool)> {
        match self {
            Token::Word(word) => Some((word, true)),
            Token::Quoted { name, .. } => Some((name, false)),
            _ => None,
        }
    }

    /// Whether this identifier may name `name` (lower-case ASCII).
    fn names(&self, name: &str) -> bool {
        self.identifier()
            .is_some_and(|(ident, folded)| same_name(ident, folded, name))
    }

    /// `pg_temp`, or a backend's own `pg_temp_<n>`.
    fn names_temp_schema(&self) -> bool {
        self.identifier().is_some_and(|(ident, folded)| {
            let base = ident.trim_end_matches(|c: char| c.is_ascii_digit());
            same_name(ident, folded, "pg_temp")
                || (base.len() < ident.len() && same_name(base, folded, "pg_temp_"))
        })
    }
}

/// Quoted identifiers keep their case, so comparing them case-insensitively
/// only errs towards refusing.
fn same_name(ident: &str, folded: bool, name: &str) -> bool {
    if folded {
        folds_to(ident, name)
    } else {
        ident.eq_ignore_ascii_case(name)
    }
}

/// Whether PostgreSQL may fold the unquoted identifier `word` into `name`.
/// It lower-cases ASCII, and in a single-byte server encoding also applies
/// the locale's `tolower` to other letters, which in a Turkish locale makes
/// `İ` an `i`; so a non-ASCII character may stand for any letter.
fn folds_to(word: &str, name: &str) -> bool {
    word.chars().count() == name.len()
        && word
            .chars()
            .zip(name.chars())
            .all(|(w, n)| !w.is_ascii() || w.eq_ignore_ascii_case(&n))
}

/// Why the lexer stopped before the end of the text.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Stop {
    /// PostgreSQL rejects the whole text as well, so none of it would run.
    Rejected,
    /// A construct this lexer does not follow, which PostgreSQL may accept.
    Unfollowed,
}

/// How a single-quoted string treats backslashes and doubled quotes.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Quote {
    /// `'…'` with standard_conforming_strings on, `U&'…'`: `''` is a quote.
    Standard,
    /// `E'…'`, and `'…'` with standard_conforming_strings off: `\` escapes
    /// the next byte as well.
    Escaped,
    /// `B'…'`, `X'…'`: the first quote ends them.
    Bits,
}

struct Lexer<'a> {
    sql: &'a str,
    bytes: &'a [u8],
    pos: usize,
    standard_conforming_strings: bool,
    tokens: Vec<Token<'a>>,
}

impl<'a> Lexer<'a> {
    fn new(sql: &'a str, standard_conforming_strings: bool) -> Self {
        Lexer {
            sql,
            bytes: sql.as_bytes(),
            pos: 0,
            standard_conforming_strings,
            tokens: Vec::new(),
        }
    }

    fn peek(&self, ahead: usize) -> Option<u8> {
        self.bytes.get(self.pos + ahead).copied()
    }

    fn tokens(mut self) -> Result<Vec<Token<'a>>, Stop> {
        while let Some(byte) = self.peek(0) {
            match byte {
                b' ' | b'\t' | b'\n' | b'\r' | 0x0b | 0x0c => self.pos += 1,
                b'-' if self.peek(1) == Some(b'-') => {
                    self.pos = line_comment_end(self.bytes, self.pos)
                }
                b'/' if self.peek(1) == Some(b'*') => self.block_comment()?,
                b'\'' => {
                    self.pos += 1;
                    self.string(self.plain())?;
                }
                b'"' => {
                    self.pos += 1;
                    let name = self.quoted_identifier()?;
                    self.tokens.push(Token::Quoted {
                        name,
                        unicode: false,
                    });
                }
                b'$' => self.dollar()?,
                b'0'..=b'9' => self.other(byte),
                _ if is_ident_start(byte) => self.word()?,
                0x21..=0x7e => self.other(byte),
                // Control characters: PostgreSQL has no token for them.
                _ => return Err(Stop::Rejected),
            }
        }
        Ok(self.tokens)
    }

    fn other(&mut self, byte: u8) {
        self.tokens.push(Token::Other(byte));
        self.pos += 1;
    }

    fn plain(&self) -> Quote {
        if self.standard_conforming_strings {
            Quote::Standard
        } else {
            Quote::Escaped
        }
    }

    /// A keyword or identifier; or, when it is a single letter right before a
    /// quote, the prefix of a string or identifier (`E'`, `B'`, `X'`, `N'`,
    /// `U&'`, `U&"`), as in scan.l where the longer match wins.
    fn word(&mut self) -> Result<(), Stop> {
        let start = self.pos;
        while self.peek(0).is_some_and(is_ident_cont) {
            self.pos += 1;
        }
        // Words start and end next to ASCII bytes, at character boundaries.
        let word = self.sql.get(start..self.pos).ok_or(Stop::Unfollowed)?;
        match (word.as_bytes(), self.peek(0), self.peek(1)) {
            ([b'e' | b'E'], Some(b'\''), _) => {
                self.pos += 1;
                self.string(Quote::Escaped)
            }
            ([b'b' | b'B' | b'x' | b'X'], Some(b'\''), _) => {
                self.pos += 1;
                self.string(Quote::Bits)
            }
            ([b'n' | b'N'], Some(b'\''), _) => {
                self.pos += 1;
                self.string(self.plain())
            }
            ([b'u' | b'U'], Some(b'&'), Some(b'\'')) => {
                // "unsafe use of string constant with Unicode escapes"
                if !self.standard_conforming_strings {
                    return Err(Stop::Rejected);
                }
                self.pos += 2;
                self.string(Quote::Standard)
            }
            ([b'u' | b'U'], Some(b'&'), Some(b'"')) => {
                self.pos += 2;
                let name = unescape_unicode(&self.quoted_identifier()?)?;
                self.tokens.push(Token::Quoted {
                    name,
                    unicode: true,
                });
                Ok(())
            }
            _ => {
                // UESCAPE picks another escape character for the U&"…" before
                // it, which would change the name it spells.
                let unicode_before = matches!(
                    self.tokens.last(),
                    Some(Token::Quoted { unicode: true, .. })
                );
                if unicode_before && word.eq_ignore_ascii_case("UESCAPE") {
                    return Err(Stop::Unfollowed);
                }
                self.tokens.push(Token::Word(word));
                Ok(())
            }
        }
    }

    /// The rest of a single-quoted string whose opening quote is consumed,
    /// including its continuations on later lines.
    fn string(&mut self, quote: Quote) -> Result<(), Stop> {
        loop {
            match self.peek(0) {
                None => return Err(Stop::Rejected),
                Some(b'\\') if quote == Quote::Escaped => self.pos += 2,
                Some(b'\'') if quote != Quote::Bits && self.peek(1) == Some(b'\'') => self.pos += 2,
                Some(b'\'') => {
                    self.pos += 1;
                    match string_continuation(self.bytes, self.pos) {
                        Some(next) => self.pos = next,
                        None => {
                            self.tokens.push(Token::Literal);
                            return Ok(());
                        }
                    }
                }
                Some(_) => self.pos += 1,
            }
        }
    }

    /// The rest of a double-quoted identifier whose opening quote is
    /// consumed, with `""` unescaped.
    fn quoted_identifier(&mut self) -> Result<String, Stop> {
        let mut name = Vec::new();
        loop {
            match self.peek(0) {
                None => return Err(Stop::Rejected),
                Some(b'"') if self.peek(1) == Some(b'"') => {
                    name.push(b'"');
                    self.pos += 2;
                }
                Some(b'"') => {
                    self.pos += 1;
                    break;
                }
                Some(byte) => {
                    name.push(byte);
                    self.pos += 1;
                }
            }
        }
        // "zero-length delimited identifier"
        if name.is_empty() {
            return Err(Stop::Rejected);
        }
        Ok(String::from_utf8_lossy(&name).into_owned())
    }

    /// `$tag$ … $tag$`, or a lone `$`: that of a parameter (`$1`), or one
    /// before a name with no closing `$`, which PostgreSQL then reads on its own.
    fn dollar(&mut self) -> Result<(), Stop> {
        let start = self.pos;
        let mut end = start + 1;
        if self.bytes.get(end).is_some_and(|&b| is_ident_start(b)) {
            while self
                .bytes
                .get(end)
                .is_some_and(|&b| is_ident_cont(b) && b != b'$')
            {
                end += 1;
            }
        }
        if self.bytes.get(end) != Some(&b'$') {
            self.other(b'$');
            return Ok(());
        }
        let tag = &self.bytes[start..=end];
        let body = end + 1;
        let close = self.bytes[body..]
            .windows(tag.len())
            .position(|window| window == tag)
            .ok_or(Stop::Rejected)?;
        self.pos = body + close + tag.len();
        self.tokens.push(Token::Literal);
        Ok(())
    }

    fn block_comment(&mut self) -> Result<(), Stop> {
        let mut depth = 0_usize;
        loop {
            match (self.peek(0), self.peek(1)) {
                (None, _) => return Err(Stop::Rejected),
                (Some(b'/'), Some(b'*')) => {
                    depth += 1;
                    self.pos += 2;
                }
                (Some(b'*'), Some(b'/')) => {
                    self.pos += 2;
                    depth = depth.saturating_sub(1);
                    if depth == 0 {
                        return Ok(());
                    }
                }
                (Some(_), _) => self.pos += 1,
            }
        }
    }
}

/// ident_start in scan.l: bytes of non-ASCII characters are letters.
fn is_ident_start(byte: u8) -> bool {
    byte.is_ascii_alphabetic() || byte == b'_' || byte >= 0x80
}

fn is_ident_cont(byte: u8) -> bool {
    is_ident_start(byte) || byte.is_ascii_digit() || byte == b'$'
}

/// Where a `--` comment at `start` ends: at `\n` or `\r`, as in scan.l.
fn line_comment_end(bytes: &[u8], start: usize) -> usize {
    bytes
        .get(start..)
        .and_then(|rest| rest.iter().position(|&b| b == b'\n' || b == b'\r'))
        .map_or(bytes.len(), |n| start + n)
}

/// Where a string goes on after the quote that seemed to end it at `after`:
/// SQL joins string constants separated only by whitespace (and `--`
/// comments) that includes a newline, and the joined part is read the same
/// way, so an `E'…'` continues with backslash escapes.
fn string_continuation(bytes: &[u8], after: usize) -> Option<usize> {
    let mut pos = after;
    let mut newline = false;
    loop {
        match *bytes.get(pos)? {
            b' ' | b'\t' | 0x0b | 0x0c => pos += 1,
            b'\n' | b'\r' => {
                newline = true;
                pos += 1;
            }
            b'-' if bytes.get(pos + 1) == Some(&b'-') => pos = line_comment_end(bytes, pos),
            b'\'' if newline => return Some(pos + 1),
            _ => return None,
        }
    }
}

/// The name a `U&"…"` identifier spells with the default escape, `\`:
/// `\\`, `\XXXX` and `\+XXXXXX`. PostgreSQL rejects any other escape.
fn unescape_unicode(raw: &str) -> Result<String, Stop> {
    let mut name = String::with_capacity(raw.len());
    let mut chars = raw.chars();
    while let Some(c) = chars.next() {
        if c != '\\' {
            name.push(c);
            continue;
        }
        let digits = match chars.clone().next() {
            Some('\\') => {
                chars.next();
                name.push('\\');
                continue;
            }
            Some('+') => {
                chars.next();
                6
            }
            _ => 4,
        };
        let hex: String = chars.by_ref().take(digits).collect();
        if hex.len() != digits || !hex.chars().all(|c| c.is_ascii_hexdigit()) {
            return Err(Stop::Rejected);
        }
        let code = u32::from_str_radix(&hex, 16).map_err(|_| Stop::Rejected)?;
        // Surrogates and the like never spell an ASCII name.
        name.push(char::from_u32(code).unwrap_or(char::REPLACEMENT_CHARACTER));
    }
    Ok(name)
}

#[cfg(test)]
mod tests;
