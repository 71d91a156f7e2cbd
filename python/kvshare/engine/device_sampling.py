"""Sampling a step's logits on the GPU: the engine's side of `kvshare.ops.gpu_sampling`.

When the model runs on a GPU and `KVSHARE_DEVICE_SAMPLING` is not "0", the engine sets
`model.logits_on_device` (the forward pass then returns device rows) and hands every row of a
step to `DeviceSampling.pick`, which samples them in one launch with each sequence's own
`Sampler` parameters, history and RNG; only token ids and the logprobs a request asked for
come back. A row the device does not take gets its logits copied to the host and goes through
`Sampler.sample` as before: the n > 1 fork (the children draw from the parent's row), the
reasoning budget's forced token, fault injection, `post_sampling_probs` logprobs, a grammar
mask that failed, and the rows the kernel hands back (`gpu_sampling.STATUS_HOST`); a sampled
row keeps the uniform it took from the sequence's RNG (`Pick.u`), so its random stream is the
CPU path's either way.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Any

import numpy as np

from kvshare.engine.faults import SamplingError, injected
from kvshare.engine.grammar_masks import compute_mask
from kvshare.engine.sampling import Sampler

ENV = "KVSHARE_DEVICE_SAMPLING"


def wanted(model: Any) -> bool:
    """Sample on the device: the model runs on a GPU and the environment does not say "0"."""
    return bool(getattr(model.backend, "is_gpu", False)) and os.environ.get(ENV, "1") != "0"


@dataclass
class Pick:
    """One row's outcome. `token` is None: sample `row` (host logits) on the host, with the
    uniform `u` when the device already took it from the RNG. Otherwise the device picked
    `token` (or `error` says why the row failed); `logprobs` (chosen, top) when asked for."""

    token: int | None = None
    row: np.ndarray | None = None
    u: float | None = None
    error: str | None = None
    logprobs: tuple[float, list[tuple[int, float]]] | None = None

    def record(self, sampler: Sampler) -> int:
        """The device's token, recorded in the sequence's history; raises its error."""
        if self.error is not None:
            raise SamplingError(self.error)
        assert self.token is not None
        sampler.record(self.token, sampler.params.greedy)
        return self.token


def _host_only(seq: Any, allowed: Any) -> bool:
    """Rows that take the host path (see the module doc)."""
    req = seq.request
    return (injected(req, "logits_nan")
            or (seq.choice == 0 and req.n > 1 and seq.first_token_at is None)
            or (seq.budget is not None and seq.budget.forced_token() is not None)
            or isinstance(allowed, Exception)
            or bool(req.logprobs and req.post_sampling_probs))


def row_spec(sampler: Sampler, row: Any, mask: np.ndarray | None, n_top: int) -> Any:
    """The device request for one row with `sampler`'s parameters and history; a sampled row
    takes its draw's uniform from the sampler's RNG here."""
    from kvshare.ops.gpu_sampling import RowSpec  # noqa: PLC0415 - CuPy-side module

    p = sampler.params
    repeat: list[int] = []
    if p.repetition_penalty != 1.0 and p.penalty_last_n != 0:
        repeat = sampler.history if p.penalty_last_n < 0 else sampler.history[-p.penalty_last_n:]
    return RowSpec(
        logits=row, greedy=p.greedy, temperature=p.temperature, top_k=p.top_k, top_p=p.top_p,
        min_p=p.min_p, repetition_penalty=p.repetition_penalty,
        presence_penalty=p.presence_penalty, frequency_penalty=p.frequency_penalty,
        repeat_ids=repeat, logit_bias=p.logit_bias,
        # the counts only where a penalty reads them (a copy of a long reply's counts per row
        # per step otherwise)
        generated=(dict(sampler.generated)
                   if p.presence_penalty != 0.0 or p.frequency_penalty != 0.0 else None),
        mask=mask, u=0.0 if p.greedy else sampler.uniform(), n_top=n_top)


class PendingPicks:
    """A step's rows with their device sampling launched (`DeviceSampling.launch`).
    `on_device`: every row went to the kernel, so `tokens` (device int32, one per row, in
    order) holds what each row drew unless the kernel hands it back or fails it. `wait()`
    gives the `Pick`s; `keep_logits()` first copies the rows' logits on the device, for the
    rows the host samples after all, when the logits buffer will be overwritten before
    `wait()` (the next step launched ahead)."""

    def __init__(self, owner: "DeviceSampling", items: list, picks: list[Pick], at: list[int],
                 pending: Any):
        self._owner, self._items, self._picks, self._at = owner, items, picks, at
        self._pending = pending
        self._kept: list[Any] | None = None
        self.on_device = pending is not None and len(at) == len(picks)
        self.tokens = pending.tokens if pending is not None else None
        # whether the kernel may hand a row back to the host (sampled rows; top logprobs)
        self.may_hand_back = pending is not None and any(
            not sp.greedy or sp.n_top > 0 for sp in pending.specs)

    def keep_logits(self) -> None:
        from kvshare.backend import cupy_module  # noqa: PLC0415

        rows = cupy_module().concatenate([out[-1:] for _, out, _ in self._items])
        self._kept = [rows[k : k + 1] for k in range(len(self._items))]

    def wait(self) -> list[Pick]:
        from kvshare.ops import gpu_sampling as gs  # noqa: PLC0415 - CuPy-side module

        picks, owner = self._picks, self._owner
        results = self._pending.results() if self._pending is not None else []
        for i, res in zip(self._at, results):
            pk = picks[i]
            if res.status == gs.STATUS_OK:
                pk.token = res.token
                if res.top is not None:
                    pk.logprobs = (res.logprob, res.top)
            elif res.status in gs.ERROR_MESSAGES:
                pk.token, pk.error = -1, gs.ERROR_MESSAGES[res.status]
        for k, (pk, (_, out, _)) in enumerate(zip(picks, self._items)):
            if pk.token is None and pk.row is None:
                pk.row = owner.host_row(out if self._kept is None else self._kept[k])
        owner.rows_host += sum(pk.token is None for pk in picks)
        owner.rows_device += sum(pk.token is not None for pk in picks)
        return picks


class DeviceSampling:
    """The engine's device sampler for one model (sets `model.logits_on_device`)."""

    def __init__(self, model: Any):
        model.logits_on_device = True
        self.backend = model.backend
        self.rows_device = 0  # rows sampled on the device / handed to the host (counters)
        self.rows_host = 0

    def host_row(self, out: Any) -> np.ndarray:
        return np.asarray(self.backend.to_host(out[-1:]))[-1]

    def launch(self, items: list[tuple[Any, Any, Any]]) -> PendingPicks:
        """(sequence, its chunk's logits, its precomputed grammar mask or None) of each row
        of a step: the device rows' sampling launched (`PendingPicks.wait` for the `Pick`s,
        one per row, in order). The host-only rows' logits are copied now."""
        from kvshare.ops import gpu_sampling as gs  # noqa: PLC0415 - CuPy-side module

        picks: list[Pick] = []
        specs, at = [], []
        for seq, out, allowed in items:
            if _host_only(seq, allowed):
                picks.append(Pick(row=self.host_row(out)))
                continue
            mask = None
            if seq.matcher is not None:
                mask = allowed if allowed is not None else compute_mask(seq.matcher)
            req = seq.request
            n_top = min(req.top_logprobs, gs.MAX_TOP_LOGPROBS + 1) if req.logprobs else -1
            spec = row_spec(seq.sampler, out[-1], mask, n_top)
            picks.append(Pick(u=None if spec.greedy else spec.u))
            if gs.takes(spec, int(out.shape[-1])):
                specs.append(spec)
                at.append(len(picks) - 1)
        return PendingPicks(self, items, picks, at, gs.launch_rows(specs) if specs else None)

    def pick(self, items: list[tuple[Any, Any, Any]]) -> list[Pick]:
        """`launch`, then wait: one `Pick` per row, in order."""
        return self.launch(items).wait()
