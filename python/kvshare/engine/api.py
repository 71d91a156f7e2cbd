"""The engine's public surface: what the server submits and what it gets back.

The server talks only to the engine (never to the model or the core); these plain data classes
are the whole contract between them. The engine runs model steps on its own thread; a
`RequestHandle` is consumed from asyncio and is safe to cancel from any thread.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING, AsyncIterator, Literal, Mapping, Protocol, runtime_checkable

if TYPE_CHECKING:
    from kvshare._core import Grammar
    from kvshare.engine.reasoning_budget import ReasoningBudget

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

    def __init__(self, message: str, code: str = "invalid_request",
                 details: dict | None = None):
        super().__init__(message)
        self.code = code
        self.details = details  # llama-server's extra error fields (n_prompt_tokens, n_ctx)


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
    # Logprobs from the distribution after the sampler chain, the one the token was drawn from
    # (llama-server's `post_sampling_probs`), instead of the model's raw distribution.
    post_sampling_probs: bool = False
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
    grammar: Grammar | None = None
    # llama-server's reasoning budget: the end of a thinking block is forced after this many
    # tokens inside it (engine/reasoning_budget.py). None: no budget.
    reasoning_budget: ReasoningBudget | None = None
    # llama-server's `n_keep` / `n_discard`: with context shift on (EngineConfig.context_shift)
    # a full context keeps the first n_keep prompt tokens (-1: all, plus BOS) and discards
    # n_discard after them (0: half of the rest).
    n_keep: int = 0
    n_discard: int = 0
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
    # Tokens context shifts discarded (llama-server's `truncated`; engine/context_shift.py).
    n_discarded: int = 0


# --------------------------------------------------------------------------- the server's view

@dataclass(frozen=True)
class ModelInfo:
    """What the HTTP APIs read about the loaded model (`EngineClient.info`): names, sizes and
    the tokenizer's special tokens. Plain values, so a fake engine can give the same."""

    name: str  # the model's name as responses echo it by default (the file's stem)
    ctx_size: int  # longest sequence (prompt + completion) in tokens
    vocab_size: int
    fingerprint: str = ""  # content hash of the weights ("": unknown, e.g. a fake)
    path: str = ""  # the model file ("": none)
    block_size: int = 16  # KV block size in tokens (cache breakpoints are block-aligned)
    max_n: int = 8  # most choices (OpenAI `n`) one request may ask for
    parallel: int = 4  # sequences decoded at once (llama-server's slots)
    chat_template: str = ""  # the template's source ("": the model has none)
    # what the template renders itself ({"supports_tools": ..., ...}, model.template_caps) and
    # what kvshare renders for it ("tools", "tool_calls", ...; model.tool_polyfill)
    template_caps: Mapping[str, bool] = field(default_factory=dict)
    template_polyfills: tuple[str, ...] = ()
    bos_token: str = ""
    eos_token: str = ""
    # The BOS id a text prompt gets (None: this model's tokenizer adds none)
    bos_id: int | None = None
    # Fill-in-the-middle token ids by role ("pre", "suf", "mid", "rep", "sep", "pad")
    fim_ids: Mapping[str, int | None] = field(default_factory=dict)
    # The longest token text in characters (prompt bounds); None: unknown, no bound
    max_token_chars: int | None = None
    # A full context shifts (engine/context_shift.py) instead of ending the reply: a request's
    # max_tokens is then not capped at the room its prompt leaves.
    context_shift: bool = False


class EngineHandle(Protocol):
    """One submitted request (`engine.handle.RequestHandle`): iterate it for TokenEvents and
    one FinishEvent per choice; `cancel` from any thread."""

    request_id: str

    def __aiter__(self) -> AsyncIterator[TokenEvent | FinishEvent]: ...

    def cancel(self) -> None: ...


@runtime_checkable
class EngineClient(Protocol):
    """Everything the HTTP server uses of the engine (`kvshare.engine.Engine` implements it;
    tests use a fake that does too). The server never reaches past it to the model, the
    tokenizer or the template."""

    info: ModelInfo

    def tokenize(self, text: str, add_special: bool, parse_special: bool) -> list[int]: ...

    def detokenize(self, ids: list[int]) -> str: ...

    def token_piece(self, token_id: int) -> str:
        """The token's text as the vocabulary spells it (special tokens included)."""
        ...

    def token_bytes(self, token_id: int) -> bytes:
        """The bytes the token decodes to (a piece of a multi-byte character for byte tokens)."""
        ...

    def chat_prompt(self, messages: list[dict], tools: list[dict] | None, *,
                    add_generation_prompt: bool, template_kwargs: dict,
                    cache_after: int | None, continue_final: bool) -> RenderedChat:
        """The chat rendered by the model's template and tokenized once."""
        ...

    def render_chat(self, messages: list[dict], tools: list[dict] | None, *,
                    add_generation_prompt: bool, template_kwargs: dict,
                    continue_final: bool) -> str:
        """The chat rendered by the model's template, not tokenized."""
        ...

    def compile_grammar(self, kind: str, source: str) -> Grammar:
        """A compiled grammar for `GenerationRequest.grammar`; raises
        `kvshare.constrain.GrammarError` (a 400) on a bad one."""
        ...

    def submit(self, req: GenerationRequest) -> EngineHandle:
        """Queue a request; raises `RequestRejected` for one the engine cannot take (the only
        check of what the engine accepts: empty or too long prompts, token ids, `n`)."""
        ...

    def snapshot(self) -> dict:
        """The pool, tiers, counters and live sequences (`/cache`, `/slots`, `/metrics`)."""
        ...

    def stalled_for(self) -> float:
        """Seconds the engine step now running has taken (0.0 when idle)."""
        ...

    def warming_up(self) -> bool:
        """True while the engine prepares its steps after start (a GPU model's kernels and
        CUDA graphs); requests queue meanwhile."""
        ...

    def start(self) -> None: ...

    def shutdown(self, timeout: float = 10.0) -> None: ...


def check_request(req: GenerationRequest, info: ModelInfo) -> None:
    """What every engine accepts, checked the same way by the real engine and the fakes:
    a non-empty prompt that leaves room for a token, ids in the vocabulary, 1 <= n <= max_n,
    max_tokens >= 1. Raises `RequestRejected` with the message the client gets."""
    n = len(req.prompt_tokens)
    if n == 0:
        raise RequestRejected("the prompt is empty")
    if n >= info.ctx_size:
        raise RequestRejected(
            f"This model's maximum context length is {info.ctx_size} tokens, but the prompt "
            f"has {n} tokens (at least one token must be left for the completion)",
            "context_length_exceeded", {"n_prompt_tokens": n, "n_ctx": info.ctx_size})
    if req.max_tokens < 1:
        raise RequestRejected("max_tokens must be at least 1")
    if not 1 <= req.n <= info.max_n:
        raise RequestRejected(f"n must be between 1 and {info.max_n}, got {req.n}")
    vocab = info.vocab_size
    # min and max: a long prompt scanned in C (a generator over 6K ids was ~0.2 ms a request)
    if min(req.prompt_tokens) < 0 or max(req.prompt_tokens) >= vocab:
        raise RequestRejected(f"prompt token ids must be in [0, {vocab})", "invalid_token_id")
