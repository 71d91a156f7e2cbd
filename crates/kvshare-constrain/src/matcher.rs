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
    let parts = threads.clamp(1, matchers.len().max(1));
    fill_masks_with(matchers, out, parts, &|parts, work| {
        std::thread::scope(|s| {
            for _ in 1..parts {
                s.spawn(work);
            }
            work();
        })
    })
}

/// As [`fill_masks_parallel`], with the threads supplied by the caller: `run(parts, work)` must
/// call `work` on up to `parts` threads (the calling one included) and return when all calls
/// have returned. kvshare runs it on its kernel pool, whose workers are idle (spinning) right
/// after a forward step, so the masks start without spawning or waking a thread.
pub fn fill_masks_with(
    matchers: &mut [&mut Matcher],
    out: &mut [u32],
    parts: usize,
    run: &dyn Fn(usize, &(dyn Fn() + Sync)),
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
    run(parts.clamp(1, n), &work);
    results
}

/// The highest-scoring token the mask allows (the first on ties, as `argmax` picks), or `None`
/// when it allows none of `scores` (`scores.len()` may be shorter than the mask's bits).
/// One pass over the row, skipping 32 forbidden tokens per zero word: greedy constrained
/// decoding without unpacking a [vocab] boolean array.
pub fn masked_argmax(scores: &[f32], mask: &[u32]) -> Option<usize> {
    let mut best: Option<(usize, f32)> = None;
    for (w, &bits) in mask.iter().enumerate() {
        let base = w * 32;
        if bits == 0 || base >= scores.len() {
            if base >= scores.len() {
                break;
            }
            continue;
        }
        let mut b = bits;
        while b != 0 {
            let t = base + b.trailing_zeros() as usize;
            b &= b - 1;
            if t >= scores.len() {
                break;
            }
            let v = scores[t];
            // NaN never wins (the sampler rejects non-finite rows before this)
            if best.is_none_or(|(_, bv)| v > bv) {
                best = Some((t, v));
            }
        }
    }
    best.map(|(t, _)| t)
}

/// Set every score the mask does not allow to -inf, in place; returns how many are allowed.
pub fn mask_scores(scores: &mut [f32], mask: &[u32]) -> usize {
    let mut allowed = 0;
    for (w, chunk) in scores.chunks_mut(32).enumerate() {
        let bits = mask.get(w).copied().unwrap_or(0);
        if bits == u32::MAX && chunk.len() == 32 {
            allowed += 32;
            continue;
        }
        for (i, v) in chunk.iter_mut().enumerate() {
            if bits >> i & 1 == 0 {
                *v = f32::NEG_INFINITY;
            } else {
                allowed += 1;
            }
        }
    }
    allowed
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn masked_argmax_picks_the_best_allowed_token() {
        let scores: Vec<f32> = (0..70).map(|i| (i % 7) as f32).collect();
        let mut mask = vec![0u32; 3];
        assert_eq!(masked_argmax(&scores, &mask), None);
        for t in [3usize, 40, 66] {
            mask[t / 32] |= 1 << (t % 32);
        }
        // scores: 3 -> 3, 40 -> 5, 66 -> 3
        assert_eq!(masked_argmax(&scores, &mask), Some(40));
        // bits beyond the row are ignored
        mask[2] |= 1 << 31;
        assert_eq!(masked_argmax(&scores, &mask), Some(40));
        assert_eq!(masked_argmax(&scores[..40], &mask), Some(3));
    }

    #[test]
    fn mask_scores_forbids_the_rest() {
        let mut scores = vec![1.0f32; 70];
        let mut mask = vec![0u32; 3];
        mask[0] = u32::MAX;
        mask[2] = 0b101;
        assert_eq!(mask_scores(&mut scores, &mask), 34);
        assert!(scores[..32].iter().all(|&v| v == 1.0));
        assert!(scores[32..64].iter().all(|&v| v == f32::NEG_INFINITY));
        assert_eq!(scores[64], 1.0);
        assert_eq!(scores[65], f32::NEG_INFINITY);
        assert_eq!(scores[66], 1.0);
    }
}
