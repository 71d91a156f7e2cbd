//! One typed error enum for the whole crate; the binding maps each variant to a Python
//! exception class (`KvshareError` and its subclasses).

use thiserror::Error;

#[derive(Debug, Error)]
pub enum CoreError {
    /// No free or evictable block is left in the pool.
    #[error("out of KV blocks: {0}")]
    OutOfBlocks(String),
    /// A caller passed something that breaks an API contract (bad block id, double free, ...).
    #[error("invalid argument: {0}")]
    InvalidArgument(String),
    /// A disk entry failed its checksum or could not be decoded; it has been removed.
    #[error("corrupt cache entry: {0}")]
    CorruptEntry(String),
    /// An entry was written by another model (fingerprint mismatch).
    #[error("model fingerprint mismatch: {0}")]
    FingerprintMismatch(String),
    /// A path would leave the cache directory.
    #[error("path escapes the cache directory: {0}")]
    PathEscape(String),
    /// Something does not fit a byte budget at all (larger than the whole budget).
    #[error("over budget: {0}")]
    OverBudget(String),
    #[error("I/O error: {0}")]
    Io(#[from] std::io::Error),
}

pub type Result<T> = std::result::Result<T, CoreError>;
