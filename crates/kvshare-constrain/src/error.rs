//! The one error type of constrained decoding.

/// Everything that can go wrong building a vocabulary, compiling a grammar or matching tokens.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum ConstrainError {
    /// The token strings, flags, EOS ids or vocabulary size are inconsistent.
    #[error("invalid vocabulary: {0}")]
    Vocab(String),
    /// A grammar kind this crate does not know (or cannot compile, such as GBNF).
    #[error("{0}")]
    UnsupportedKind(String),
    /// The grammar source does not compile (syntax error, unsupported schema keyword, unknown
    /// special token, ...); the message is llguidance's.
    #[error("{0}")]
    Compile(String),
    /// The grammar does not allow this token here; the matcher is unchanged.
    #[error("token {token} ({text}) is not allowed here{why}")]
    Rejected {
        token: u32,
        text: String,
        why: &'static str,
    },
    /// A mask buffer of the wrong length.
    #[error("mask buffer has {got} words, expected {expected}")]
    MaskSize { got: usize, expected: usize },
    /// The matcher failed while computing a mask or consuming a token (no token of the
    /// vocabulary can continue the grammar, parser limits exceeded, ...). It stays failed.
    #[error("constraint failed: {0}")]
    Matcher(String),
}

pub type Result<T> = std::result::Result<T, ConstrainError>;

/// llguidance's message without the marker it appends to non-verbose errors.
pub(crate) fn llg_message(e: &impl std::fmt::Display) -> String {
    let s = e.to_string();
    s.strip_suffix("\n<non-verbose/>").unwrap_or(&s).to_string()
}
