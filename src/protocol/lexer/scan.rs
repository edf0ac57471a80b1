//! The scanner: [`Lexer`] splits SQL text into [`Token`]s as PostgreSQL's
//! `scan.l` would, or stops ([`Stop`]) where it cannot follow the text.

use std::borrow::Cow;

use super::token::Token;

/// Why the lexer stopped before the end of the text.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(super) enum Stop {
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

pub(super) struct Lexer<'a> {
    sql: &'a str,
    bytes: &'a [u8],
    pos: usize,
    standard_conforming_strings: bool,
    tokens: Vec<Token<'a>>,
}

impl<'a> Lexer<'a> {
    pub(super) fn new(sql: &'a str, standard_conforming_strings: bool) -> Self {
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

    pub(super) fn tokens(mut self) -> Result<Vec<Token<'a>>, Stop> {
        while let Some(byte) = self.peek(0) {
            match byte {
                b' ' | b'\t' | b'\n' | b'\r' | 0x0b | 0x0c => self.pos += 1,
                b'-' if self.peek(1) == Some(b'-') => {
                    self.pos = line_comment_end(self.bytes, self.pos)
                }
                b'/' if self.peek(1) == Some(b'*') => self.block_comment()?,
                b'\'' => {
                    self.pos += 1;
                    self.string(self.plain(), true)?;
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
                self.string(Quote::Escaped, true)
            }
            ([b'b' | b'B' | b'x' | b'X'], Some(b'\''), _) => {
                self.pos += 1;
                self.string(Quote::Bits, false)
            }
            ([b'n' | b'N'], Some(b'\''), _) => {
                self.pos += 1;
                self.string(self.plain(), true)
            }
            ([b'u' | b'U'], Some(b'&'), Some(b'\'')) => {
                // "unsafe use of string constant with Unicode escapes"
                if !self.standard_conforming_strings {
                    return Err(Stop::Rejected);
                }
                // Its value depends on a UESCAPE after it: not kept.
                self.pos += 2;
                self.string(Quote::Standard, false)
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
    /// including its continuations on later lines; its value is kept if
    /// `keep` and the value is certain (see [`Token::Literal`]).
    fn string(&mut self, quote: Quote, keep: bool) -> Result<(), Stop> {
        let start = self.pos;
        let mut continued = false;
        loop {
            match self.peek(0) {
                None => return Err(Stop::Rejected),
                Some(b'\\') if quote == Quote::Escaped => self.pos += 2,
                Some(b'\'') if quote != Quote::Bits && self.peek(1) == Some(b'\'') => self.pos += 2,
                Some(b'\'') => {
                    let end = self.pos;
                    self.pos += 1;
                    match string_continuation(self.bytes, self.pos) {
                        Some(next) => {
                            self.pos = next;
                            continued = true;
                        }
                        None => {
                            let raw = self.sql.get(start..end).filter(|raw| {
                                keep && !continued
                                    && !(quote == Quote::Escaped && raw.contains('\\'))
                            });
                            let value = raw.map(|raw| match raw.contains("''") {
                                true => Cow::Owned(raw.replace("''", "'")),
                                false => Cow::Borrowed(raw),
                            });
                            self.tokens.push(Token::Literal(value));
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
        // Nothing in a dollar-quoted string is an escape.
        let value = self.sql.get(body..body + close).map(Cow::Borrowed);
        self.tokens.push(Token::Literal(value));
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
