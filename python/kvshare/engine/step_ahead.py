"""The next decode step launched before this step's sampled tokens reach the host.

On a GPU a decode step ends with the host waiting: the sampled tokens come back, each row's
DECIDE half runs (engine/deferred_emit.py), the scheduler plans the next step and the host
issues it, while the device idles. In a steady decode (every running sequence decoding, no
request waiting) the next step is known before its tokens are: every row computes one more
position, fed the token its row just drew. So the engine launches step N+1 right after step
N's sampling, its input tokens copied on the device from the sampler's output
(`DecoderModel.forward_fed`, a CUDA graph), and only then waits for step N's tokens; the
host's DECIDE, EMIT and the next launch overlap the device's step N+1, as vLLM's async
scheduling and SGLang's overlap scheduler do.

A row of the launched step holds only if its sequence is, once step N's DECIDE has run,
exactly what the launch assumed: still running, its chunk committed up to the fed position,
one token longer, and that token the one the device drew (`holds`). A row that does not is
void: a sequence that ended (a stop token, max_tokens, a stop string, a cancellation) is
skipped as `deferred_emit` skips it; a row the host sampled after all (the kernel handed it
back) or whose token differs is skipped and computed again by the next scheduled step (its
KV position is simply written again). The launched step always covers every running
sequence, so a void row stops the pipelining until a scheduled step has recomputed it.

Where it applies (`Engine._launch_ahead` checks it): the model takes fed decode steps (a
model with CUDA graphs), every row of step N is a decode row sampled on the device, no
request waits for admission or cancellation, no sliding-window cache group, no recurrent
state (hybrids), no row about to shift its context, no injected fault. A hybrid's launched
step would advance every row's recurrent state in place: a void row whose sequence goes on
would then be computed twice on its state (a KV position is simply written again; a state
is not), and the state the cache snapshots at step N's commit (checkpoints) would already
hold step N+1's token. A row whose next position starts a KV block gets the
block at the launch; where the pool has no room the next step is scheduled instead (the
scheduler may preempt). Grammar rows and penalties take the step: their masks and penalty
inputs are computed when the launched step is sampled, after step N's DECIDE.

On by default where the engine samples on the device; `EngineConfig.async_scheduling` or
`KVSHARE_ASYNC_SCHEDULING` ("0"/"1") says so explicitly.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from kvshare.engine.device_sampling import Pick
    from kvshare.engine.scheduler import Planned

ENV = "KVSHARE_ASYNC_SCHEDULING"


def wanted(device_sampling: bool, configured: bool | None) -> bool:
    """Launch steps ahead: as configured, else as the environment says, else where the
    engine samples on the device (the tokens a launch is fed never exist otherwise)."""
    if not device_sampling:
        return False
    if configured is not None:
        return configured
    env = os.environ.get(ENV, "").strip()
    if env in ("0", "1"):
        return env == "1"
    return True


@dataclass
class Ahead:
    """A launched step: one decode row per sequence of the step before it, in its order,
    and the step's logits (`model.forward_fed`'s)."""

    plan: list[Planned]
    logits: list[Any]

    def ended(self) -> bool:
        """Whether no row is left to post-process: each is void or its sequence ended."""
        from kvshare.engine.sequence import SeqState  # noqa: PLC0415

        return all(i.void or i.seq.state == SeqState.FINISHED for i in self.plan)


def holds(item: Planned, pick: Pick | None) -> bool:
    """Whether a launched row is what its sequence needs now that the step before it has
    been post-processed (see the module doc)."""
    from kvshare.engine.sequence import SeqState  # noqa: PLC0415

    seq = item.seq
    return (seq.state == SeqState.DECODE and pick is not None and pick.error is None
            and pick.token is not None and seq.n_computed == item.start
            and len(seq.tokens) == item.end and seq.tokens[item.start] == pick.token)
