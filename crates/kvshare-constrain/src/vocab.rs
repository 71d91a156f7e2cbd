//! A model's vocabulary as llguidance sees it: the token trie and the parser factory built on
//! it. Built once per model; cheap to clone (shared).

use crate::error::{ConstrainError, Result};
use llguidance::ParserFactory;
use std::sync::Arc;
use toktrie::{ApproximateTokEnv, TokEnv, TokRxInfo, TokTrie, TokenId};

/// The token byte strings of one model, with its end-of-sequence token(s).
///
/// Control tokens (`special`) and the EOS tokens are stored behind toktrie's marker byte 0xFF,
/// so no text can spell them (0xFF never occurs in UTF-8) and a Lark grammar names them as
/// `<|im_end|>` or `<[106]>`. Every other token, including user-defined ones such as Qwen's `<tool_call>`, is
/// plain bytes: the grammar literal `"<tool_call>"` can be produced by that single token as well
/// as by `<`, `tool`, ... Token ids from `tokens.len()` up to `vocab_size` (padding rows of the
/// embedding) and tokens with empty text are never allowed.
#[derive(Clone)]
pub struct Vocab {
    inner: Arc<Inner>,
}

struct Inner {
    factory: ParserFactory,
    eos: Vec<TokenId>,
    vocab_size: usize,
}

impl Vocab {
    /// `tokens[i]` is the text of token `i` (as bytes; byte-fallback tokens are their one
    /// byte), `special[i]` marks control tokens, `eos` the tokens that end a sequence (the
    /// first is the main one; all are allowed when the grammar can end), `vocab_size` the
    /// length of a logits row (>= `tokens.len()`).
    ///
    /// Tokenization: llguidance only tokenizes when it forces tokens (fast-forward) or reads a
    /// prompt, which [`crate::Matcher`] never does; it is given toktrie's greedy longest-match
    /// tokenizer, declared non-canonical so that llguidance never forces a token on its account.
    pub fn new(
        tokens: Vec<Vec<u8>>,
        special: Vec<bool>,
        eos: &[u32],
        vocab_size: usize,
    ) -> Result<Self> {
        let bad = |m: String| Err(ConstrainError::Vocab(m));
        if special.len() != tokens.len() {
            return bad(format!(
                "{} tokens but {} special flags",
                tokens.len(),
                special.len()
            ));
        }
        if vocab_size < tokens.len() || vocab_size >= u32::MAX as usize {
            return bad(format!(
                "vocab_size {vocab_size} must be at least the {} tokens",
                tokens.len()
            ));
        }
        if eos.is_empty() {
            return bad("no EOS token".into());
        }
        if let Some(&e) = eos.iter().find(|&&e| e as usize >= vocab_size) {
            return bad(format!(
                "EOS token {e} is not below vocab_size {vocab_size}"
            ));
        }
        let mut words = tokens;
        for (i, (word, &is_special)) in words.iter_mut().zip(&special).enumerate() {
            // an EOS token ends generation wherever it is sampled, so it is never text even
            // when its type says user-defined (Gemma's `</s>`)
            if (is_special || eos.contains(&(i as u32))) && !word.is_empty() {
                word.insert(0, TokTrie::SPECIAL_TOKEN_MARKER);
            }
        }
        words.resize(vocab_size, Vec::new());
        let info = TokRxInfo::new(vocab_size as u32, eos[0]);
        let trie = TokTrie::from(&info, &words).with_eos_tokens(eos);
        let env: TokEnv = Arc::new(ApproximateTokEnv::new(trie));
        let mut factory =
            ParserFactory::new_simple(&env).map_err(|e| ConstrainError::Vocab(e.to_string()))?;
        factory.quiet();
        // errors name the grammar rule and bytes, not the whole parser state and grammar
        factory.limits_mut().verbose_errors = false;
        Ok(Vocab {
            inner: Arc::new(Inner {
                factory,
                eos: eos.to_vec(),
                vocab_size,
            }),
        })
    }

    /// The length of a logits row (bits of a mask).
    pub fn vocab_size(&self) -> usize {
        self.inner.vocab_size
    }

    /// `u32` words of one mask: `ceil(vocab_size / 32)`.
    pub fn mask_words(&self) -> usize {
        self.inner.vocab_size.div_ceil(32)
    }

    /// The end-of-sequence tokens (the first is the main one).
    pub fn eos(&self) -> &[TokenId] {
        &self.inner.eos
    }

    pub(crate) fn factory(&self) -> &ParserFactory {
        &self.inner.factory
    }

    pub(crate) fn trie(&self) -> &TokTrie {
        self.inner.factory.tok_env().tok_trie()
    }

    /// A readable rendering of a token for error messages.
    pub fn token_text(&self, token: TokenId) -> String {
        if (token as usize) < self.inner.vocab_size {
            self.trie().token_dbg(token)
        } else {
            "out of range".into()
        }
    }
}

impl std::fmt::Debug for Vocab {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Vocab")
            .field("vocab_size", &self.inner.vocab_size)
            .field("eos", &self.inner.eos)
            .finish()
    }
}
