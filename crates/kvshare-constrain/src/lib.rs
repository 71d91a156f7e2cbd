//! Constrained decoding: which tokens may come next so that the output matches a JSON schema,
//! a Lark grammar or a regex. A thin shell over llguidance (grammars, lexer, Earley parser) and
//! toktrie (the token trie the masks are computed over).
//!
//! - [`Vocab`]: built once per model from the token byte strings.
//! - [`Grammar`]: one compiled constraint; makes any number of [`Matcher`]s.
//! - [`Matcher`]: one sequence's state: token mask, consume, accepting / stopped.
//! - [`fill_masks_parallel`] / [`fill_masks_with`]: several matchers' masks on threads.
//! - [`masked_argmax`] / [`mask_scores`]: a mask applied to a logits row.
//!
//! A mask is a bitmask of `ceil(vocab_size / 32)` little-endian `u32` words: bit `t % 32` of
//! word `t / 32` set means token `t` is allowed.

mod error;
mod grammar;
mod matcher;
mod vocab;

pub use error::{ConstrainError, Result};
pub use grammar::{Grammar, GrammarKind};
pub use matcher::{fill_masks_parallel, fill_masks_with, mask_scores, masked_argmax, Matcher};
pub use vocab::Vocab;
