"""Turning one position's logits into the next token: penalties, greedy or sampled decoding
(temperature, top-k, top-p, min-p, per-request seed) and logprobs.

Follows llama.cpp's sampler chain order: logit bias -> grammar mask -> penalties -> top-k ->
top-p -> min-p -> temperature -> draw. The grammar mask (constrained decoding) comes before
every filter, so temperature, top-k and top-p only ever choose among tokens the grammar allows.
Logprobs are reported from the model's raw distribution (OpenAI semantics) by default; a
request may ask for the distribution the token was drawn from instead, after the whole chain
(llama-server's `post_sampling_probs`): `Sampler.post_sampling_logprobs`.
"""

from __future__ import annotations

from collections import Counter

import numpy as np

from kvshare._core import mask_logits, masked_argmax
from kvshare.engine.api import SamplingParams
from kvshare.engine.faults import SamplingError


class Sampler:
    """Per-sequence sampling state (its RNG and the token history penalties look at)."""

    def __init__(self, params: SamplingParams, prompt_tokens: list[int]):
        self.params = params
        self.rng = np.random.default_rng(params.seed)
        self.history: list[int] = list(prompt_tokens)
        self.generated: Counter[int] = Counter()
        # the last draw's distribution after the chain: candidate ids and their probabilities,
        # most likely first (kept by reference: the draw computed them anyway)
        self.last_ids: np.ndarray = np.zeros(0, dtype=np.int64)
        self.last_probs: np.ndarray = np.zeros(0, dtype=np.float32)

    def _apply_penalties(self, logits: np.ndarray) -> np.ndarray:
        p = self.params
        needs_repeat = p.repetition_penalty != 1.0 and p.penalty_last_n != 0
        needs_freq = p.presence_penalty != 0.0 or p.frequency_penalty != 0.0
        if not (needs_repeat or needs_freq):
            return logits
        logits = logits.copy()
        if needs_repeat:
            window = self.history if p.penalty_last_n < 0 else self.history[-p.penalty_last_n :]
            ids = np.fromiter(set(window), dtype=np.int64)
            if ids.size:
                vals = logits[ids]
                logits[ids] = np.where(vals > 0, vals / p.repetition_penalty, vals * p.repetition_penalty)
        if needs_freq and self.generated:
            ids = np.fromiter(self.generated.keys(), dtype=np.int64)
            counts = np.fromiter(self.generated.values(), dtype=np.float32)
            logits[ids] -= counts * p.frequency_penalty + p.presence_penalty
        return logits

    def uniform(self) -> float:
        """The draw's uniform in [0, 1): what `rng.choice(p=...)` takes from the RNG for a
        sampled token, taken when the draw happens elsewhere (on the device, or `sample`'s `u`),
        so the sequence's random stream stays the one `sample` alone would use."""
        return float(self.rng.random())

    def record(self, token: int, greedy: bool) -> None:
        """A token picked elsewhere (on the device) with this sampler's parameters: the history
        the penalties look at, as `sample` records it. The draw's distribution is not known
        here (the device keeps it): `last_ids` holds only a greedy pick."""
        self.history.append(token)
        self.generated[token] += 1
        if greedy:
            self.last_ids, self.last_probs = np.array([token]), np.ones(1, dtype=np.float32)
        else:
            self.last_ids = np.zeros(0, dtype=np.int64)
            self.last_probs = np.zeros(0, dtype=np.float32)

    def sample(self, logits: np.ndarray, mask: np.ndarray | None = None,
               u: float | None = None) -> int:
        """Pick the next token from a [vocab] float32 row and record it in the history.
        `mask` (uint32 words, bit t of word t // 32 = token t allowed: kvshare.constrain's
        layout): the grammar's mask; only those tokens can be drawn. It is applied in one pass
        in Rust (argmax over the allowed bits, or -inf written over the rest), not unpacked
        into a [vocab] boolean array. Raises `SamplingError` (this sequence's fault alone) on
        non-finite scores. `u`: the draw's uniform when `uniform()` already took it (the device
        handed the row back); None draws it here."""
        p = self.params
        logits = np.asarray(logits, dtype=np.float32)
        if not np.isfinite(logits).all():
            raise SamplingError("the model produced non-finite logits")
        if p.logit_bias:
            logits = logits.copy()
            for tok, bias in p.logit_bias:
                if tok < logits.size:
                    logits[tok] += bias
        scores = self._apply_penalties(logits)
        if not np.isfinite(scores).all():
            raise SamplingError("the penalties (repeat/frequency/presence) made the scores "
                                "non-finite")
        if mask is not None:
            mask = np.ascontiguousarray(mask, dtype=np.uint32)
        if p.greedy:
            if mask is None:
                token = int(np.argmax(scores))
            else:
                best = masked_argmax(np.ascontiguousarray(scores), mask)
                if best is None:
                    raise SamplingError("the grammar allows no token here")
                token = int(best)
            # greedy is temperature 0 at the chain's end: all the mass on one token
            self.last_ids, self.last_probs = np.array([token]), np.ones(1, dtype=np.float32)
        else:
            if mask is not None:
                scores = np.array(scores, dtype=np.float32, copy=True)  # the caller's row
                if mask_logits(scores, mask) == 0:
                    raise SamplingError("the grammar allows no token here")
            token = self._draw(scores, u)
        self.history.append(token)
        self.generated[token] += 1
        return token

    def _draw(self, scores: np.ndarray, u: float | None = None) -> int:
        p = self.params
        k = p.top_k if 0 < p.top_k < scores.size else min(scores.size, 1024)
        # Candidates: the top-k (or the top 1024, which holds all the mass that top-p/min-p
        # keep in practice) sorted by score, so the full 262K vocabulary is never sorted.
        cand = np.argpartition(scores, -k)[-k:]
        cand = cand[np.argsort(scores[cand])[::-1]]
        if p.top_k <= 0 and k < scores.size:
            # Without an explicit top-k the tail still matters when temperature is high:
            # fall back to the full distribution if the candidates miss real mass.
            full = _softmax(scores / max(p.temperature, 1e-6))
            if full[cand].sum() < 0.999:
                cand = np.argsort(scores)[::-1]
        probs = _softmax(scores[cand])
        keep = len(cand)
        if p.top_p < 1.0:
            keep = min(keep, int(np.searchsorted(np.cumsum(probs), p.top_p) + 1))
        if p.min_p > 0.0:
            keep = min(keep, max(1, int(np.sum(probs >= p.min_p * probs[0]))))
        cand = cand[:keep]
        final = _softmax(scores[cand] / max(p.temperature, 1e-6))
        if not np.isfinite(final).all() or final.sum() <= 0:
            raise SamplingError("the sampling probabilities are not finite")
        self.last_ids, self.last_probs = cand, final
        if u is None:
            return int(cand[self.rng.choice(len(cand), p=final)])
        return int(cand[choice_at(final, u)])

    def post_sampling_logprobs(self, chosen: int, n: int
                               ) -> tuple[float, list[tuple[int, float]]]:
        """As `top_logprobs`, from the last draw's distribution after the chain (penalties,
        grammar, top-k, top-p, min-p, temperature): tokens the chain removed have no entry
        (llama-server leaves out zero probabilities), so fewer than n may come back."""
        ids, probs = self.last_ids, self.last_probs
        keep = probs > 0
        ids, probs = ids[keep], probs[keep]
        hit = np.flatnonzero(ids == chosen)
        chosen_lp = float(np.log(probs[hit[0]])) if hit.size else float("-inf")
        top = [(int(t), float(np.log(q))) for t, q in zip(ids[:n], probs[:n])]
        return chosen_lp, top


def choice_at(p: np.ndarray, u: float) -> int:
    """The index numpy's `Generator.choice(len(p), p=p)` picks when its uniform draw is `u`:
    the float64 cumulative sum, normalised by its last value, searched on the right."""
    cdf = np.asarray(p, dtype=np.float64).cumsum()
    cdf /= cdf[-1]
    return int(cdf.searchsorted(u, side="right"))


def _softmax(x: np.ndarray) -> np.ndarray:
    e = np.exp(x - np.max(x))
    return e / e.sum()


def log_softmax(logits: np.ndarray) -> np.ndarray:
    x = np.asarray(logits, dtype=np.float32)
    m = np.max(x)
    return x - (m + np.log(np.sum(np.exp(x - m))))


def top_logprobs(logits: np.ndarray, chosen: int, n: int) -> tuple[float, list[tuple[int, float]]]:
    """The chosen token's logprob and the n most likely (token, logprob) pairs."""
    lp = log_softmax(logits)
    top: list[tuple[int, float]] = []
    if n > 0:
        ids = np.argpartition(lp, -n)[-n:]
        ids = ids[np.argsort(lp[ids])[::-1]]
        top = [(int(i), float(lp[i])) for i in ids]
    return float(lp[chosen]), top
