//! [`Token`]: what the classification needs of a token, and which names an
//! identifier may spell once PostgreSQL has folded its case.

use std::borrow::Cow;

/// What the classification needs of a token.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(super) enum Token<'a> {
    /// A keyword or unquoted identifier, as written.
    Word(&'a str),
    /// A quoted identifier, unescaped; `unicode` for `U&"…"`.
    Quoted { name: String, unicode: bool },
    /// A string constant of any kind, with its value where that is certain
    /// without knowing more than the text: a `$tag$…$tag$` body, a `'…'`
    /// (`E'…'`, `N'…'`) without backslashes and not continued on another
    /// line, `''` read as `'`. Its value matters where it is code (the body
    /// of a `DO` block or a function) or a setting's name or value.
    Literal(Option<Cow<'a, str>>),
    /// Punctuation, an operator character, a digit, the `$` of `$1`.
    Other(u8),
}

impl Token<'_> {
    pub(super) fn is(&self, keyword: &str) -> bool {
        matches!(self, Token::Word(word) if word.eq_ignore_ascii_case(keyword))
    }

    /// The identifier this token spells, and whether PostgreSQL folds its case.
    pub(super) fn identifier(&self) -> Option<(&str, bool)> {
        match self {
            Token::Word(word) => Some((word, true)),
            Token::Quoted { name, .. } => Some((name, false)),
            _ => None,
        }
    }

    /// Whether this identifier may name `name` (lower-case ASCII).
    pub(super) fn names(&self, name: &str) -> bool {
        self.identifier()
            .is_some_and(|(ident, folded)| same_name(ident, folded, name))
    }

    /// `pg_temp`, or a backend's own `pg_temp_<n>`.
    pub(super) fn names_temp_schema(&self) -> bool {
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
