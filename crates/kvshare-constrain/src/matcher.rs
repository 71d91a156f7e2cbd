//! One sequence's position in a grammar: which tokens may come next, and consuming the one
//! that was sampled.

use crate::error::{llg_message, ConstrainError, Result};
use crate::vocab::Vocab;
use std::sync::Mutex;
use toktrie::{SimpleVob, TokenId};

/// The state of one sequence under a [`crate::Grammar`].
///
/// EOS: allowed whenever the grammar is accepting (the output so far is complete), and the only
/// token allowed once the grammar is stopped (nothing can extend the output). Consuming EOS
/// ends the matcher: afterwards its mask is EOS only and every other token is rejected.
pub struct Matcher {
    vocab: Vocab,
    inner: llguidance::Matcher,
    /// EOS has been consumed.
    ended: bool,
}

impl Matcher {
    pub(crate) fn new(vocab: Vocab, inner: llguidance::Matcher) -> Self {
        Matcher {
            vocab,
            inner,
            ended: false,
        }
    }

    /// Write the mask of allowed next tokens into `out` (`vocab.mask_words()` words). On an
    /// error `out` holds the EOS-only mask, so a caller that ignores the error ends the
    /// sequence rather than sampling from nothing.
    pub fn fill_mask(&mut self, out: &mut [u32]) -> Result<()> {
        let expected = self.vocab.mask_words();
        if out.len() != expected {
            return Err(ConstrainError::MaskSize {
                got: out.len(),
                expected,
            });
        }
        if let Some(e) = self.error() {
            self.eos_mask(out);
            return Err(ConstrainError::Matcher(e));
        }
        if self.is_stopped() {
            self.eos_mask(out);
            return Ok(());
        }
        match self.inner.compute_mask() {
            Ok(vob) => {
                copy_mask(&vob, out, self.vocab.vocab_size());
                Ok(())
            }
            Err(e) => {
                self.eos_mask(out);
                Err(ConstrainError::Matcher(llg_message(&e)))
            }
        }
    }

    fn eos_mask(&self, out: &mut [u32]) {
        out.fill(0);
        for &t in self.vocab.eos() {
            out[t as usize / 32] |= 1 << (t % 32);
        }
    }

    /// Advance by `token`. A token the grammar does not allow here is an error and leaves the
    /// matcher as it was.
    pub fn consume(&mut self, token: TokenId) -> Result<()> {
        let vocab = self.vocab.clone();
        let reject = |why| {
            Err(ConstrainError::Rejected {
                token,
                text: vocab.token_text(token),
                why,
            })
        };
        if token as usize >= self.vocab.vocab_size() {
            return reject(": beyond the vocabulary");
        }
        if self.ended {
            return reject(": the sequence already ended with EOS");
        }
        if let Some(e) = self.error() {
            return Err(ConstrainError::Matcher(e));
        }
        let is_eos = self.vocab.eos().contains(&token);
        if is_eos && self.is_accepting() {
            self.ended = true;
            return Ok(());
        }
        if self.inner.is_stopped() {
            return reject(": the grammar is complete, only EOS may follow");
        }
        if is_eos {
            // EOS as grammar content (a Lark grammar may name it as a special token).
            // llguidance's validation only knows EOS as the end, and a failed consume leaves
            // its matcher failed: try it on a copy (sharing the lexer) and keep that on success.
            let mut attempt = self.inner.clone();
            if attempt.consume_token(token).is_ok() && attempt.get_error().is_none() {
                self.inner = attempt;
                return Ok(());
            }
            return reject(": the output is not complete yet");
        }
        match self.inner.try_consume_tokens(&[token]) {
            Ok(1) => Ok(()),
            Ok(_) => reject(""),
            Err(e) => Err(ConstrainError::Matcher(llg_message(&e))),
        }
    }

    /// The output so far is a complete match: EOS is allowed.
    pub fn is_accepting(&mut self) -> bool {
        self.is_stopped() || (self.error().is_none() && self.inner.is_accepting().unwrap_or(false))
    }

    /// Nothing can extend the output: only EOS may follow (also true after EOS was consumed).
    pub fn is_stopped(&self) -> bool {
        self.ended || (self.inner.is_stopped() && self.error().is_none())
    }

    /// Why the matcher failed, if it did (its mask is then EOS only).
    pub fn error(&self) -> Option<String> {
        if let Some(e) = self.inner.get_error() {
            return Some(llg_message(&e));
        }
        let reason = self.inner.stop_reason();
        (!reason.is_ok()).then(|| format!("stopped: {reason}"))
    }

    pub fn vocab(&self) -> &Vocab {
        &self.vocab
    }
}

/// Copy the first `vocab_size` bits of `vob` into `out`, clearing the bits beyond.
fn copy_mask(vob: &SimpleVob, out: &mut [u32], vocab_size: usize) {
    let src = vob.as_slice();
    let n = src.len().min(out.len());
    out[..n].copy_from_slice(&src[..n]);
    out[n..].fill(0);
    if !vocab_size.is_multiple_of(32) {
        if let Some(last) = out.last_mut() {
            *last &= (1u32 << (vocab_size % 32)) - 1;
        }
    }
}

/// Fill row `i` of `out` (`matchers.len()` rows of `mask_words` words, back to back) with
/// `matchers[i]`'s mask, using up to `threads` threads (this one included), each taking the
/// next matcher when it is done with one (mask times vary by 100x). Returns each matcher's
/// result; a failed row holds the EOS-only mask (see [`Matcher::fill_mask`]).
pub fn fill_masks_parallel(
    matchers: &mut [&mut Matcher],
    out: &mut [u32],
    threads: usize,
) -> Vec<Result<()>> {
    let n = matchers.len();
    if n == 0 {
        return Vec::new();
    }
    let words = matchers[0].vocab.mask_words();
    if out.len() != n * words || matchers.iter().any(|m| m.vocab.mask_words() != words) {
        let err = ConstrainError::MaskSize {
            got: out.len(),
            expected: n * words,
        };
        return vec![Err(err); n];
    }
    let mut results: Vec<Result<()>> = vec![Ok(()); n];
    let jobs = Mutex::new(
        matchers
            .iter_mut()
            .zip(out.chunks_mut(words))
            .zip(results.iter_mut()),
    );
    let work = || loop {
        let job = jobs.lock().unwrap_or_else(|p| p.into_inner()).next();
        let Some(((m, row), res)) = job else { break };
        *res = m.fill_mask(row);
    };
    std::thread::scope(|s| {
        for _ in 1..threads.clamp(1, n) {
            s.spawn(work);
        }
        work();
    });
    results
}
