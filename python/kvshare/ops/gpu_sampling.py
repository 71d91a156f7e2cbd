"""Sampling on the device (kernels/sampling.cu): all logits rows of a step in one launch, one
CTA per row, following `kvshare.engine.sampling.Sampler.sample`'s chain; only the chosen
tokens, the logprobs a row asked for and a status per row come back to the host.

`RowSpec` is one row's request: its device logits row, the sequence's sampling parameters,
the grammar mask (packed uint32, bit t of word t // 32), the penalty inputs (the host's
history), the uniform u in [0, 1) of the draw (from the sequence's own RNG, so the random
stream is the CPU path's) and how many top logprobs it wants. `sample_rows` returns one
`RowResult` per row: `status` STATUS_OK (token and logprobs valid), STATUS_HOST (the kernel did
not take the row: sample it on the host), or an error status whose `SamplingError` message is
`ERROR_MESSAGES[status]` (the host path's, for that row alone).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Sequence

import numpy as np

from kvshare.backend import cupy_module
from kvshare.ops import gpu_runtime as rt

SAMPLE_THREADS = 512  # sampling.cu: SMP_THREADS (one CTA per row)
MAX_TOP_K = 1024  # SMP_MAX_K: a larger top_k is sampled on the host
MAX_TOP_LOGPROBS = 20  # SMP_MAX_TOP
IP_COUNT, FP_COUNT, DP_COUNT = 8, 4, 2  # ints / floats / doubles per row (sampling.cu)
EDIT_BIAS, EDIT_REPEAT, EDIT_SUB = 1, 2, 4

STATUS_OK, STATUS_HOST = 0, 1
ERROR_MESSAGES = {
    2: "the model produced non-finite logits",
    3: "the penalties (repeat/frequency/presence) made the scores non-finite",
    4: "the grammar allows no token here",
    5: "the sampling probabilities are not finite",
}

ENTRY_POINTS: tuple[str, ...] = ("sample_rows",)
rt.declare_entry_points("sampling", ENTRY_POINTS)


@dataclass
class RowSpec:
    """One row to sample. `history`: the ids the repetition penalty looks at (the window of
    `penalty_last_n`); `generated`: token -> count for the frequency/presence penalties."""

    logits: Any  # device float32 [vocab] (a contiguous row)
    greedy: bool
    temperature: float = 1.0
    top_k: int = 0
    top_p: float = 1.0
    min_p: float = 0.0
    repetition_penalty: float = 1.0
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repeat_ids: Sequence[int] = ()
    generated: dict[int, int] | None = None
    logit_bias: Sequence[tuple[int, float]] = ()
    mask: np.ndarray | None = None
    u: float = 0.0
    n_top: int = -1  # top logprobs wanted (0..20); -1: no logprobs


@dataclass
class RowResult:
    status: int
    token: int = -1
    logprob: float = 0.0
    top: list[tuple[int, float]] | None = None


def takes(spec: RowSpec, vocab: int) -> bool:
    """Whether the kernel can take this row at all (else sample it on the host): top_k up to
    MAX_TOP_K, at most MAX_TOP_LOGPROBS logprobs, logit_bias without a repeated token."""
    if 0 < spec.top_k < vocab and spec.top_k > MAX_TOP_K:
        return False
    if spec.n_top > MAX_TOP_LOGPROBS:
        return False
    ids = [t for t, _ in spec.logit_bias]
    return len(ids) == len(set(ids))


def _edits(spec: RowSpec, vocab: int) -> tuple[list[int], list[int], list[float], list[float]]:
    """The row's sparse score edits, one entry per token: (ids, flags, bias, sub). The values
    are computed as the host's NumPy code computes them (float32)."""
    if (not spec.logit_bias and spec.repetition_penalty == 1.0
            and spec.presence_penalty == 0.0 and spec.frequency_penalty == 0.0):
        return [], [], [], []  # the common row: nothing to edit
    flags: dict[int, int] = {}
    bias: dict[int, float] = {}
    sub: dict[int, float] = {}
    for tok, b in spec.logit_bias:
        if tok < vocab:  # the host skips ids past the row
            flags[tok] = flags.get(tok, 0) | EDIT_BIAS
            bias[tok] = float(np.float32(b))
    if spec.repetition_penalty != 1.0:
        for tok in set(spec.repeat_ids):
            flags[tok] = flags.get(tok, 0) | EDIT_REPEAT
    if (spec.presence_penalty != 0.0 or spec.frequency_penalty != 0.0) and spec.generated:
        ids = np.fromiter(spec.generated.keys(), dtype=np.int64)
        counts = np.fromiter(spec.generated.values(), dtype=np.float32)
        vals = counts * spec.frequency_penalty + spec.presence_penalty  # float32, as the host
        for tok, v in zip(ids.tolist(), vals.tolist()):
            flags[tok] = flags.get(tok, 0) | EDIT_SUB
            sub[tok] = v
    ids = sorted(flags)
    return (ids, [flags[t] for t in ids], [bias.get(t, 0.0) for t in ids],
            [sub.get(t, 0.0) for t in ids])


class _Packed:
    """Host arrays laid out in one buffer (each part 16-byte aligned), sent with one copy;
    `upload` returns the device views, one per part, in order. An empty part gets one zero
    element, so that every kernel pointer is valid."""

    ALIGN = 16

    def __init__(self, parts: list[tuple[Any, Any]]):
        self.arrays = [np.ascontiguousarray(a if np.size(a) else np.zeros(1), dtype=dt).reshape(-1)
                       for a, dt in parts]
        self.offsets, off = [], 0
        for a in self.arrays:
            self.offsets.append(off)
            off += -(-a.nbytes // self.ALIGN) * self.ALIGN
        self.buf = np.zeros(off, dtype=np.uint8)
        for a, o in zip(self.arrays, self.offsets):
            self.buf[o : o + a.nbytes] = a.view(np.uint8)

    def upload(self, cp: Any) -> list[Any]:
        d = cp.asarray(self.buf)
        return [d[o : o + a.nbytes].view(a.dtype) for a, o in zip(self.arrays, self.offsets)]


def _pack_inputs(specs: Sequence[RowSpec], vocab: int) -> _Packed:
    """The kernel's per-row parameters, grammar masks and score edits, in one buffer. Rows
    are gathered as Python lists and converted once (a step of 32 rows costs the host tens
    of microseconds, not a NumPy scalar store per field)."""
    ip_rows: list[tuple[int, ...]] = []
    fp_rows: list[tuple[float, ...]] = []
    dp_rows: list[tuple[float, float]] = []
    ptrs: list[int] = []
    mask_words: list[np.ndarray] = []
    n_words = 0
    e_ids: list[int] = []
    e_flags: list[int] = []
    e_bias: list[float] = []
    e_sub: list[float] = []
    for s in specs:
        row = s.logits
        if row.shape[-1] != vocab or row.dtype != np.float32 or row.strides[-1] != 4:
            raise ValueError("sample_rows: every row must be a contiguous float32 row of the "
                             "same vocabulary size")
        ptrs.append(row.data.ptr)
        m0 = m1 = 0
        if s.mask is not None:
            m = np.ascontiguousarray(s.mask, dtype=np.uint32)
            m0, m1 = n_words, m.size
            mask_words.append(m)
            n_words += m.size
        ids, flags, bias, sub = _edits(s, vocab)
        ip_rows.append((1 if s.greedy else 0, s.top_k, s.n_top, m0, m1, len(e_ids),
                        len(e_ids) + len(ids), 0))
        e_ids += ids
        e_flags += flags
        e_bias += bias
        e_sub += sub
        # float32 of each value as NumPy rounds it (np.array(..., float32) rounds alike)
        fp_rows.append((max(s.temperature, 1e-6), s.min_p, s.repetition_penalty, 0.0))
        dp_rows.append((s.u, s.top_p))
    ip = np.array(ip_rows, dtype=np.int32).reshape(-1, IP_COUNT)
    fp = np.array(fp_rows, dtype=np.float32).reshape(-1, FP_COUNT)
    dp = np.array(dp_rows, dtype=np.float64).reshape(-1, DP_COUNT)
    masks = np.concatenate(mask_words) if mask_words else np.zeros(1, dtype=np.uint32)
    return _Packed([(np.array(ptrs, dtype=np.uint64), np.uint64), (ip, np.int32),
                    (fp, np.float32), (dp, np.float64), (masks, np.uint32), (e_ids, np.int32),
                    (e_flags, np.int32),
                    (e_bias, np.float32), (e_sub, np.float32)])


class PendingRows:
    """A `launch_rows` launch: the device int32 `tokens` `[n]` of the sampled ids (a row
    whose status is not STATUS_OK holds junk there), and its statuses, tokens and logprobs on
    their way to the host (an asynchronous copy into pinned memory, issued right after the
    kernel). `results()` waits for that copy alone, not for work issued after the launch."""

    def __init__(self, specs: Sequence[RowSpec], tokens: Any, back: np.ndarray, event: Any,
                 want_top: bool):
        self.specs, self.tokens, self._back, self._event = specs, tokens, back, event
        self._want_top = want_top

    def results(self) -> list[RowResult]:
        self._event.synchronize()
        specs, back, n = self.specs, self._back, len(self.specs)
        nt = n * MAX_TOP_LOGPROBS
        st, tok = back[:n], back[n : 2 * n]
        lp_h = back[2 * n : 3 * n].view(np.float32)
        ids_h = back[3 * n : 3 * n + nt].reshape(n, MAX_TOP_LOGPROBS) if self._want_top else None
        tlp_h = (back[3 * n + nt :].view(np.float32).reshape(n, MAX_TOP_LOGPROBS)
                 if self._want_top else None)
        out: list[RowResult] = []
        for r, s in enumerate(specs):
            got = RowResult(int(st[r]), int(tok[r]))
            if got.status == STATUS_OK and s.n_top >= 0:
                got.logprob = float(lp_h[r])
                got.top = ([(int(ids_h[r, j]), float(tlp_h[r, j])) for j in range(s.n_top)]
                           if s.n_top > 0 and ids_h is not None and tlp_h is not None else [])
            out.append(got)
        return out


def launch_rows(specs: Sequence[RowSpec]) -> PendingRows:
    """Launch the sampling of every row of `specs` (rows of one vocabulary size) and start
    copying the tokens, statuses and logprobs (a few bytes per row, nothing else) back.
    `specs` must not be empty."""
    cp = cupy_module()
    n = len(specs)
    vocab = int(specs[0].logits.shape[-1])
    # Every input goes up in one host-to-device copy and every output comes back in one
    # device-to-host copy: each separate copy of a few bytes is a synchronous round trip
    # (~10 us on a GPU), a dozen of them a step's worth of a small model's decode.
    inputs = _pack_inputs(specs, vocab)
    d_ptrs, d_ip, d_fp, d_dp, d_masks, d_ids, d_flags, d_bias, d_sub = inputs.upload(cp)
    scores = rt.empty((n, vocab), np.float32)
    # outputs, one int32 buffer: status [n], token [n], lp [n] (float32 bits), then the top
    # ids [n, MAX_TOP_LOGPROBS] and their logprobs (float32 bits)
    nt = n * MAX_TOP_LOGPROBS
    res = rt.empty((3 * n + 2 * nt,), np.int32)
    status, token = res[:n], res[n : 2 * n]
    lp = res[2 * n : 3 * n].view(np.float32)
    top_ids = res[3 * n : 3 * n + nt].reshape(n, MAX_TOP_LOGPROBS)
    top_lp = res[3 * n + nt :].view(np.float32).reshape(n, MAX_TOP_LOGPROBS)
    rt.kernel("sampling", "sample_rows")(
        (n, 1, 1), (SAMPLE_THREADS, 1, 1),
        (d_ptrs, scores, np.int32(vocab), d_ip, d_fp, d_dp, d_masks, d_ids, d_flags, d_bias,
         d_sub, status, token, lp, top_ids, top_lp))
    want_top = any(s.n_top > 0 for s in specs)
    src = res if want_top else res[: 3 * n]
    back = np.frombuffer(cp.cuda.alloc_pinned_memory(src.nbytes), np.int32, int(src.size))
    cp.asnumpy(src, out=back, blocking=False)
    event = cp.cuda.Event(disable_timing=True)
    event.record()
    return PendingRows(specs, token, back, event, want_top)


def sample_rows(specs: Sequence[RowSpec]) -> list[RowResult]:
    """Sample every row of `specs` in one launch (rows of one vocabulary size): the tokens,
    statuses and logprobs (`launch_rows`, waited for)."""
    if not specs:
        return []
    return launch_rows(specs).results()
