"""The engine's public surface: what the server submits and what it gets back.

The server talks only to the engine (never to the model or the core); these plain data classes
are the whole contract between them. The engine runs model steps on its own thread; a
`RequestHandle` is consumed from asyncio and is safe to cancel from any thread.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Literal

FinishReason = Literal["stop", "length", "cancelled", "error"]


@dataclass(frozen=True)
class SamplingParams:
    """OpenAI / llama-server sampling knobs. temperature == 0 means greedy."""

    temperature: float = 1.0
    top_k: int = 0  # 0 = off
    top_p: float = 1.0
    min_p: float = 0.0
    seed: int | None = None
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0  # llama.cpp repeat_penalty; 1.0 = off
    penalty_last_n: int = 64
    # OpenAI logit_bias: (token id, bias) pairs added to the logits before anything else;
    # -100 bans a token, +100 all but forces it.
    logit_bias: tuple[tuple[int, float], ...] = ()

    @property
    def greedy(self) -> bool:
        return self.temperature <= 0.0


class RequestRejected(ValueError):
    """`Engine.submit` refused a request before queueing it; `code` says why
    ("context_length_exceeded", "invalid_request") for the client's error."""

    def __init__(self, message: str, code: str = "invalid_request"):
        super().__init__(message)
        self.code = code


@dataclass(frozen=True)
class RenderedChat:
    """A chat request rendered by the model's template and tokenized once (`Engine.chat_prompt`).

    `first_user_boundary`: token position where the first user message starts (hybrid
    checkpoints and the pinned prefix entry), or None. `cache_point`: token position of the
    request's cache breakpoint (Anthropic `cache_control`, a stored Responses conversation), or
    None; the full KV blocks before it are pinned in the RAM tier and written to disk."""

    tokens: list[int]
    first_user_boundary: int | None = None
    cache_point: int | None = None


@dataclass
class GenerationRequest:
    prompt_tokens: list[int]
    max_tokens: int
    sampling: SamplingParams = field(default_factory=SamplingParams)
    stop: list[str] = field(default_factory=list)  # stop strings (not included in the output)
    stop_token_ids: list[int] = field(default_factory=list)  # in addition to the model's EOS/EOT
    ignore_eos: bool = False
    logprobs: bool = False
    top_logprobs: int = 0
    # Control tokens in the reply are decoded as their text (tool-call formats whose markers
    # are control tokens, e.g. LFM2's <|tool_call_start|>); by default they are dropped.
    special_text: bool = False
    cache_salt: bytes | None = None  # tenant isolation: part of every cache key
    # Leading prompt tokens that are public (an operator-marked prefix, `--public-prefix`):
    # their full blocks are keyed without the salt, so every tenant shares them; the blocks
    # after them are keyed with it. 0: the whole prompt is keyed with the salt.
    public_prefix_tokens: int = 0
    # False: keep this request's blocks out of the RAM and disk tiers (nothing could ever reuse
    # them, e.g. under `--cache-scope salt` without a cache_salt: a one-off random salt).
    cache_store: bool = True
    # False: compute the whole prompt even if a cached prefix exists (llama-server
    # `cache_prompt: false`); what it computes is still shared with later requests.
    reuse_cache: bool = True
    # Token position of the first user message's start in a chat prompt (hybrid checkpoints).
    first_user_boundary: int | None = None
    # Token position of a client's cache breakpoint (RenderedChat.cache_point): the full blocks
    # before it are pinned in the RAM tier as soon as computed, like the prefix entry up to the
    # first user message, and written to disk when the request ends.
    cache_point: int | None = None
    request_id: str = ""
    # Choices sampled from this one prompt (OpenAI `n`): the prompt is computed once and the
    # choices fork from it, sharing its blocks; events carry the choice's `index`.
    n: int = 1
    # A compiled grammar (kvshare.constrain.Grammar) every choice must follow: its own matcher
    # masks the logits before sampling (constrained decoding). None: unconstrained.
    grammar: object | None = None
    # Test hook (kvshare.engine.faults): an injection point that fails this sequence; set by
    # the server only when fault injection is enabled.
    fault: str | None = None


@dataclass(frozen=True)
class TokenLogprob:
    token_id: int
    text: str
    logprob: float


@dataclass(frozen=True)
class TokenEvent:
    """One generated token. `text` is the newly complete text it adds (may be empty while a
    multi-byte character or a possible stop string is pending). A final event with
    `token_id == -1` may carry held-back text released at the end; it is not a token."""

    token_id: int
    text: str
    logprob: TokenLogprob | None = None
    top_logprobs: tuple[TokenLogprob, ...] = ()
    index: int = 0  # the choice (n > 1)


@dataclass(frozen=True)
class Timings:
    """llama-server's `timings` object."""

    prompt_n: int  # prompt tokens computed
    cache_n: int  # prompt tokens reused from the cache
    prompt_ms: float
    predicted_n: int
    predicted_ms: float
    restore_ms: float = 0.0  # of prompt_ms: reading cached state from the RAM/disk tiers

    def as_dict(self) -> dict:
        return {
            "prompt_n": self.prompt_n,
            "cache_n": self.cache_n,
            "prompt_ms": self.prompt_ms,
            "prompt_per_token_ms": self.prompt_ms / self.prompt_n if self.prompt_n else 0.0,
            "prompt_per_second": 1e3 * self.prompt_n / self.prompt_ms if self.prompt_ms > 0 else 0.0,
            "predicted_n": self.predicted_n,
            "predicted_ms": self.predicted_ms,
            "predicted_per_token_ms": self.predicted_ms / self.predicted_n if self.predicted_n else 0.0,
            "predicted_per_second": 1e3 * self.predicted_n / self.predicted_ms if self.predicted_ms > 0 else 0.0,
            "restore_ms": self.restore_ms,
        }


@dataclass(frozen=True)
class FinishEvent:
    reason: FinishReason
    prompt_tokens: int
    completion_tokens: int
    timings: Timings
    time_to_first_token_s: float
    error: str | None = None
    # With reason "error": the HTTP status the request should end with, a short cause
    # ("queue_timeout", "non_finite_logits", "internal", ...) and, for a 503, the seconds a
    # client should wait before retrying.
    error_status: int = 500
    error_cause: str | None = None
    retry_after_s: float | None = None
    index: int = 0  # the choice (n > 1): a request with n choices gets n FinishEvents
    # With reason "stop": the request's stop string that ended this choice (None: EOS/EOT,
    # a stop token, or a grammar that completed).
    stop_string: str | None = None
