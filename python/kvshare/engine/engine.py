"""The serving engine: owns the model, the tokenizer and the cache, runs model steps on its own
thread with continuous batching, and streams events back to request handles.

The server talks only to this class. Everything mutable (sequences, the scheduler, the pool's
block tables) is touched only on the engine thread; other threads hand it work through an inbox
and read `snapshot()`.

One request's fault stays that request's: whatever goes wrong for one sequence (its admission,
its sampling, its share of a forward step, its tier restore or save) fails or falls back for it
alone and the step goes on for the others (`kvshare.engine.faults`). The engine thread never
dies, and every request ends: a waiting request that is not admitted within `queue_timeout_s`
ends with a 503.
"""

from __future__ import annotations

import functools
import itertools
import logging
import threading
import time
from collections import Counter, OrderedDict, deque
from dataclasses import dataclass, replace
from pathlib import Path
from typing import TYPE_CHECKING

import numpy as np

from kvshare.backend import set_cpu_threads
from kvshare.engine.api import (FinishEvent, FinishReason, GenerationRequest, ModelInfo,
                               RenderedChat, RequestRejected, Timings, TokenEvent, TokenLogprob,
                               check_request)
from kvshare.engine.cache import build_cache
from kvshare.engine.context_shift import plan_shift, shift_tokens
from kvshare.engine.deferred_emit import EmitQueue, PendingEmit
from kvshare.engine.deferred_emit import wanted as emit_overlap_wanted
from kvshare.engine.faults import SequenceFault, injected, maybe_inject
from kvshare.engine.grammar_masks import MaskJob, compute_mask
from kvshare.engine.handle import RequestHandle
from kvshare.engine.output import TextAssembler
from kvshare.engine.reasoning_budget import BudgetState, utf8_is_complete
from kvshare.engine.device_sampling import DeviceSampling, Pick
from kvshare.engine.device_sampling import wanted as device_sampling_wanted
from kvshare.engine.sampling import Sampler, top_logprobs
from kvshare.engine.scheduler import Planned, Scheduler
from kvshare.engine.sequence import Sequence, SeqState
from kvshare.engine.step_ahead import Ahead, holds
from kvshare.engine.step_ahead import wanted as step_ahead_wanted

if TYPE_CHECKING:
    from kvshare._core import Grammar, Matcher, _PoolStats
    from kvshare.constrain import TokenVocab
    from kvshare.model.base import Model
    from kvshare.model.chat_template import ChatTemplate
    from kvshare.model.tokenizer import Tokenizer

log = logging.getLogger("kvshare.engine")

# Seconds a client is told to wait (Retry-After) after its request timed out in the queue.
QUEUE_RETRY_AFTER_S = 5.0


def max_token_chars(tokenizer) -> int | None:
    """The longest token text of the vocabulary in characters (GPT-2 byte-level texts have
    one character per byte): a prompt of C characters has at least C / this many tokens."""
    n = tokenizer.vocab_size
    return max(1, max((len(tokenizer.token_text(i)) for i in range(n)), default=1))


def new_matcher(req: GenerationRequest) -> Matcher | None:
    """A fresh matcher of the request's grammar (each choice has its own), or None."""
    if req.grammar is None:
        return None
    return req.grammar.matcher()


# a launched-ahead row's token: the device feeds the real one (engine/step_ahead.py)
_PLACEHOLDER = np.zeros(1, dtype=np.int32)


def one_token_mask(token: int, n: int) -> np.ndarray:
    """A grammar-layout mask (uint32 words, bit t of word t // 32) allowing only `token`."""
    mask = np.zeros(-(-n // 32), dtype=np.uint32)
    mask[token // 32] = np.uint32(1 << (token % 32))
    return mask


@dataclass
class EngineConfig:
    parallel: int = 4
    ctx_size: int = 8192  # longest sequence (prompt + generation) in tokens
    block_size: int = 16
    kv_blocks: int | None = None  # pool size in blocks; overrides kv_mem_mib
    kv_mem_mib: int | None = None  # pool size in MiB of KV (default: parallel * ctx_size tokens, capped)
    slot_attach: bool = True
    # per-step token budget for prefill: 512 as llama.cpp's ubatch (bench/model_bench.py: 1.5x the
    # prefill tokens/s of 256 on Gemma 3 270M; a decode step beside a full chunk waits longer)
    prefill_chunk: int = 512
    device: str = "cpu"
    threads: int | None = None
    kv_dtype: str | None = None  # "f32" / "f16" / ...; None: the model's default for its backend
    cache_ram_mib: float = 8192  # RAM tier budget; 0 turns it off
    cache_ram_pin_mib: float | None = None  # of which prefix entries may pin (None: half)
    # a finished sequence's blocks are copied to the RAM tier (False: llama-server's
    # --no-cache-idle-slots; only prefix entries reach RAM: engine/cache/tiers.py)
    cache_idle_slots: bool = True
    cache_dir: str | None = None  # disk tier directory; None turns it off
    cache_disk_max_mib: int = 10240
    cache_ttl_s: float = 259200.0
    cache_min_tokens: int = 256
    cache_redis: str | None = None  # shared tier: redis:// (or rediss://, unix://) URL; None: off
    cache_redis_timeout_s: float = 0.5  # per Redis command; a slower one is a miss
    checkpoint_min_step: int = 1024  # hybrids: a checkpoint every this many prompt tokens
    checkpoint_min_gain: int = 64  # hybrids: a divergence checkpoint saves at least this many
    swa_full: bool = False  # sliding-window layers keep every position, as full layers do
    ctx_checkpoints: int = 8  # hybrids: at most this many checkpoints per sequence
    checkpoint_mem_mib: int = 1024  # hybrids: budget of unique checkpoint bytes
    queue_timeout_s: float = 600.0  # a request waiting longer to be admitted ends with a 503
    max_n: int = 8  # most choices (OpenAI `n`) one request may ask for
    # llama-server --context-shift: a full context drops part of its past instead of ending the
    # reply (engine/context_shift.py); off for models with recurrent state
    context_shift: bool = False
    # each token's text and events are emitted while the device runs the next step
    # (engine/deferred_emit.py); None: on where the model runs on a GPU (KVSHARE_EMIT_OVERLAP)
    emit_overlap: bool | None = None
    # a steady decode's next step is launched before this step's tokens reach the host
    # (engine/step_ahead.py); None: on where the engine samples on the device
    # (KVSHARE_ASYNC_SCHEDULING)
    async_scheduling: bool | None = None


class Engine:
    def __init__(self, model: Model, tokenizer: Tokenizer, chat_template: ChatTemplate | None,
                 fingerprint: bytes, config: EngineConfig, model_name: str = "model"):
        self.model = model
        self.tokenizer = tokenizer
        self.chat_template = chat_template
        self.config = config
        self.model_name = model_name
        self.ctx_size = config.ctx_size
        if not getattr(model.backend, "is_gpu", False):
            set_cpu_threads(config.threads)
        # grammar masks beside the forward pass only where it leaves the CPU free (see
        # engine/grammar_masks.py)
        self._overlap_masks = bool(getattr(model.backend, "is_gpu", False))
        # on a GPU the step's rows are sampled there (KVSHARE_DEVICE_SAMPLING=0: on the host)
        self.device_sampling = DeviceSampling(model) if device_sampling_wanted(model) else None
        # a token's EMIT half runs after the next step's launch (engine/deferred_emit.py)
        self.emit_overlap = emit_overlap_wanted(model, config.emit_overlap)
        self._emits = EmitQueue()
        # the next decode step launched before this one's tokens are back (engine/step_ahead.py)
        self.async_scheduling = step_ahead_wanted(self.device_sampling is not None,
                                                  config.async_scheduling)
        self._ahead: Ahead | None = None
        self.cache = build_cache(model, config, fingerprint)
        # the cache's parts, by name (tests, /cache, the forward pass)
        self.kv, self.pool, self.tiers = self.cache.kv, self.cache.pool, self.cache.tiers
        self.kv_dtype = self.cache.keys.kv_dtype
        self.n_blocks = int(self.pool.stats()["total"])
        self.windows = self.cache.group("sliding_window")
        recurrent = self.cache.group("recurrent")
        self.checkpoints = recurrent.checkpoints if recurrent is not None else None
        self.hybrid = self.cache.stateful
        # A shift recomputes the kept tokens' KV at their new positions; a recurrent state
        # would have to be recomputed from the first token, so hybrids end at the context
        # limit instead (as llama-server, whose recurrent caches cannot shift).
        self.context_shift = config.context_shift and not self.hybrid
        if config.context_shift and self.hybrid:
            log.warning("context shift is not supported for models with recurrent state: "
                        "it is off, a reply ends when its context is full")
        self.scheduler = Scheduler(self.cache, config.parallel, config.prefill_chunk)
        self.stop_ids = set(getattr(tokenizer, "stop_ids", ()) or ())
        eos = getattr(tokenizer, "eos_id", None)
        if eos is not None:
            self.stop_ids.add(eos)
        self._ids = itertools.count(1)
        self._inbox: deque = deque()
        self._fetching: set[str] = set()  # submitted sequences whose fetch-ahead is running
        self._cancels: deque[str] = deque()
        self._wake = threading.Event()
        self._stopping = False
        self._warming = False  # `warming_up`
        self._thread: threading.Thread | None = None
        self._handles: dict[str, RequestHandle] = {}
        self._open_choices: dict[str, int] = {}  # request id -> choices not finished yet
        self._seqs: dict[str, Sequence] = {}  # Sequence.key -> sequence
        self._assemblers: dict[int, TextAssembler] = {}
        # llama-server's /metrics figures come from these too (server/metrics.py)
        self.counters = {"prompt_tokens_total": 0, "prompt_tokens_cached_total": 0,
                         "generated_tokens_total": 0, "steps": 0, "preemptions": 0,
                         "prompt_seconds_total": 0.0, "generation_seconds_total": 0.0,
                         "busy_slots_total": 0, "seq_tokens_max": 0, "context_shifts": 0,
                         "steps_ahead": 0}
        self.peak_tokens_used = 0
        self.peak_kv_bytes = 0  # KV bytes in blocks sequences hold (both groups), at most
        self._step_started: float | None = None  # perf_counter while a step runs
        self._grammar_lock = threading.Lock()
        self._grammar_vocab: TokenVocab | None = None  # built on first use
        self._grammars: OrderedDict = OrderedDict()  # (kind, source) -> compiled grammar
        self.failures: Counter[str] = Counter()  # requests ended by an error, by cause
        self.recovered: Counter[str] = Counter()  # faults absorbed without failing a request
        # Hybrids checkpoint at the first user message; the RAM tier pins the prefix up to it.
        self.wants_user_boundary = self.hybrid or self.tiers.ram is not None

    # ---- construction ------------------------------------------------------------------
    @classmethod
    def from_model_path(cls, path: str | None, config: EngineConfig) -> "Engine":
        from kvshare.model.chat_template import ChatTemplate
        from kvshare.model.loader import default_model_path, load_model
        from kvshare.model.tokenizer import Tokenizer

        path = str(path) if path else str(default_model_path())
        model = load_model(path, device=config.device)
        tokenizer = Tokenizer.from_gguf(path)
        template = ChatTemplate.from_gguf(path, tokenizer)
        fingerprint = bytes.fromhex(model.fingerprint)
        return cls(model, tokenizer, template, fingerprint, config, model_name=Path(path).stem)

    # ---- lifecycle ---------------------------------------------------------------------
    def start(self) -> None:
        if self._thread is None:
            # a GPU model prepares its steps first (kernels compiled, CUDA graphs captured:
            # up to a minute on a fresh machine); a CPU model has nothing to prepare
            self._warming = bool(getattr(self.model.backend, "is_gpu", False))
            self._thread = threading.Thread(target=self._run, name="kvshare-engine", daemon=True)
            self._thread.start()

    def warming_up(self) -> bool:
        """True from `start` until the model's start-up work is done (`_warm_up`): requests
        queue meanwhile, so /health says the model is loading."""
        return self._warming

    def shutdown(self, timeout: float = 10.0) -> None:
        """Let in-flight requests finish for up to `timeout` seconds, then cancel the rest."""
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline and (self._handles or self._inbox):
            time.sleep(0.02)
        for rid in list(self._handles):
            self.cancel(rid)
        self._stopping = True
        self._wake.set()
        if self._thread is not None:
            self._thread.join(timeout=5.0)
            self._thread = None
        self.tiers.close()  # drains the disk writer's queue

    # ---- what the server reads (engine.api.EngineClient) -------------------------------
    @functools.cached_property
    def info(self) -> ModelInfo:
        tok, model = self.tokenizer, self.model
        try:
            fingerprint = model.fingerprint
        except ValueError:  # a model built in memory has no file
            fingerprint = ""
        template = self.chat_template
        return ModelInfo(
            name=self.model_name, ctx_size=self.ctx_size, vocab_size=self.vocab_size,
            fingerprint=fingerprint, path=str(model.path) if model.path else "",
            block_size=self.config.block_size, max_n=self.config.max_n,
            parallel=self.config.parallel,
            chat_template=template.source if template is not None else "",
            template_caps=template.caps.as_dict() if template is not None else {},
            template_polyfills=template.polyfills if template is not None else (),
            bos_token=tok.bos_token or "", eos_token=tok.eos_token or "",
            bos_id=tok.bos_id if tok.add_bos else None, fim_ids=dict(tok.fim_ids),
            max_token_chars=max_token_chars(tok), context_shift=self.context_shift)

    # ---- text -------------------------------------------------------------------------
    def tokenize(self, text: str, add_special: bool = True, parse_special: bool = True) -> list[int]:
        return list(self.tokenizer.encode(text, add_special=add_special, parse_special=parse_special))

    def detokenize(self, ids: list[int]) -> str:
        return self.tokenizer.decode(list(ids))

    @property
    def vocab_size(self) -> int:
        return int(self.model.config.vocab_size)

    def _generated_text(self, ids: list[int]) -> str:
        # Control tokens (<start_of_turn>, ...) are not part of a reply's text, as in llama-server.
        return self.tokenizer.decode(list(ids), skip_special=True)

    def compile_grammar(self, kind: str, source: str) -> Grammar:
        """A compiled grammar (kvshare.constrain) for constrained decoding: "json_schema",
        "json_object", "lark", "regex" or "gbnf". Raises `kvshare.constrain.GrammarError`.
        The token trie over the vocabulary is built once, on first use; compiled grammars are
        cached by source (an agent's every turn with the same tools reuses one)."""
        from kvshare import constrain

        key = (kind, source)
        with self._grammar_lock:
            hit = self._grammars.get(key)
            if hit is not None:
                self._grammars.move_to_end(key)
                return hit
            if self._grammar_vocab is None:
                # every end-of-generation token may end a complete output (the main one first)
                main = getattr(self.tokenizer, "eos_id", None)
                eos = ([main] if main is not None else []) + sorted(self.stop_ids - {main})
                self._grammar_vocab = constrain.TokenVocab.from_tokenizer(
                    self.tokenizer, self.vocab_size, eos or [0])
            vocab = self._grammar_vocab
        grammar = constrain.compile_grammar(vocab, kind, source)
        with self._grammar_lock:
            self._grammars[key] = grammar
            while len(self._grammars) > 64:
                self._grammars.popitem(last=False)
        return grammar

    def _special_text(self, ids: list[int]) -> str:
        return self.tokenizer.decode(list(ids), skip_special=False)

    def token_piece(self, token_id: int) -> str:
        return self.tokenizer.token_to_piece(int(token_id))

    def token_bytes(self, token_id: int) -> bytes:
        return self.tokenizer.token_to_bytes(int(token_id))

    @property
    def _template(self) -> ChatTemplate:
        """The model's chat template, which the chat methods need (an engine built without one
        serves token prompts only)."""
        if self.chat_template is None:
            raise RuntimeError("the model has no chat template")
        return self.chat_template

    def render_chat(self, messages: list[dict], tools: list[dict] | None = None, *,
                    add_generation_prompt: bool = True, template_kwargs: dict | None = None,
                    continue_final: bool = False) -> str:
        """The chat rendered by the model's template, not tokenized (/apply-template, and the
        server's length check of a huge chat before it is tokenized)."""
        return self._template.render(messages, tools=tools,
                                     add_generation_prompt=add_generation_prompt,
                                     continue_final=continue_final, **(template_kwargs or {}))

    def apply_chat_template(self, messages: list[dict], tools: list[dict] | None = None,
                            add_generation_prompt: bool = True, **kwargs) -> tuple[str, int | None]:
        if not self.wants_user_boundary:  # locating the boundary costs a re-render
            return self._template.render(messages, tools=tools, add_generation_prompt=add_generation_prompt,
                                         **kwargs), None
        chat = self._template.apply(self.tokenizer, messages, tools=tools,
                                    add_generation_prompt=add_generation_prompt, **kwargs)
        return chat.text, chat.first_user_token

    def chat_prompt(self, messages: list[dict], tools: list[dict] | None = None, *,
                    add_generation_prompt: bool = True, template_kwargs: dict | None = None,
                    cache_after: int | None = None, continue_final: bool = False):
        """A chat request as final token ids, rendered and tokenized once (the server's
        `engine.api.EngineClient.chat_prompt`): the first-user boundary when the cache uses it
        (hybrid checkpoints, the RAM tier's pinned prefix entry), and the token position of a
        cache breakpoint at the end of messages[cache_after] (-1: the first-user boundary).
        `continue_final`: the prompt continues the last message (an assistant prefill)."""
        chat = self._template.apply(
            self.tokenizer, messages, tools=tools, add_generation_prompt=add_generation_prompt,
            boundary=self.wants_user_boundary, cache_after=cache_after,
            continue_final=continue_final, **(template_kwargs or {}))
        return RenderedChat(list(chat.ids), chat.first_user_token, chat.cache_point)

    # ---- requests ---------------------------------------------------------------------
    def submit(self, req: GenerationRequest) -> RequestHandle:
        check_request(req, self.info)
        n = len(req.prompt_tokens)
        if -(-(n + 1) // self.config.block_size) > self.n_blocks:
            raise RequestRejected(f"the prompt has {n} tokens; the KV pool holds "
                                  f"{self.n_blocks * self.config.block_size} (context)",
                                  "context_length_exceeded")
        rid = req.request_id or f"req-{next(self._ids)}"
        req.request_id = rid
        handle = RequestHandle(rid, functools.partial(self.cancel, rid), n=req.n)
        seq = Sequence(seq_id=next(self._ids), request=req, sampler=Sampler(req.sampling, req.prompt_tokens))
        seq.tokens = list(req.prompt_tokens)
        seq.n_prompt = n
        seq.matcher = new_matcher(req)
        seq.budget = self._new_budget(req)
        self._handles[rid] = handle
        self._open_choices[rid] = req.n
        self._seqs[seq.key] = seq
        # What its admission would read from Redis is fetched first, on a fetch thread: the
        # engine thread never waits on the network (engine/cache/prefetch.py).
        self._fetching.add(seq.key)
        if not self.cache.fetch_ahead(seq, functools.partial(self._fetched, seq)):
            self._fetched(seq)
        return handle

    def _fetched(self, seq: Sequence) -> None:
        """Queue a submitted sequence for the scheduler (any thread)."""
        self._inbox.append(seq)
        self._fetching.discard(seq.key)
        self._wake.set()

    def cancel(self, request_id: str) -> None:
        """Stop a request; its handle gets FinishEvent(reason="cancelled"). Any thread."""
        self._cancels.append(request_id)
        self._wake.set()

    # ---- the engine thread ------------------------------------------------------------
    def _run(self) -> None:
        try:
            self._warm_up()
        finally:
            self._warming = False
        while not self._stopping:
            try:
                self._drain_inbox()
                self._expire_queued()
                if not self.scheduler.has_work():
                    self._emit_deferred()
                    self._wake.wait(0.05)
                    self._wake.clear()
                    continue
                self._step_started = time.perf_counter()
                self.step()
            except Exception as exc:  # noqa: BLE001 - the engine thread must never die
                # Faults are handled per sequence inside the step; one that escapes is a bug
                # that cannot be pinned on a sequence: fail what is running, keep serving.
                running = list(self.scheduler.running)
                log.exception("engine step failed outside per-sequence handling; failing %s",
                              [s.request.request_id for s in running])
                for seq in running:
                    self._fail(seq, exc)
            finally:
                self._step_started = None
        self._emit_deferred()

    def _warm_up(self) -> None:
        """The model's start-up work on this engine's cache (on the engine thread, which runs
        every later step: a captured graph holds that thread's library handles); requests
        queue meanwhile. A failure costs speed only: steps are prepared as they come."""
        t0 = time.perf_counter()
        try:
            n = self.model.warm_up(self.kv, self.config.parallel, self.config.prefill_chunk)
        except Exception:  # noqa: BLE001 - serving goes on, eagerly where it must
            log.exception("preparing the model's steps at start failed")
            return
        if n:
            log.info("captured %d step graphs in %.2f s", n, time.perf_counter() - t0)

    def stalled_for(self) -> float:
        """Seconds the current step has been running (0 between steps): /health reports an
        engine stuck in one step (a hung device or file read) instead of answering ok."""
        started = self._step_started
        return 0.0 if started is None else time.perf_counter() - started

    def _drain_inbox(self) -> None:
        while self._inbox:
            seq = self._inbox.popleft()
            if seq.state == SeqState.FINISHED:  # cancelled while its fetch-ahead ran
                self.cache.drop_fetch(seq)
                continue
            self.scheduler.add(seq)
        while self._cancels:
            rid = self._cancels.popleft()
            for seq in self._choices_of(rid):
                if seq.state != SeqState.FINISHED:
                    self._finish(seq, "cancelled")

    def _choices_of(self, rid: str) -> list[Sequence]:
        """The live sequences of one request (its choices)."""
        return [s for s in self._seqs.values() if s.request.request_id == rid]

    def _expire_queued(self) -> None:
        timeout = self.config.queue_timeout_s
        if timeout is None or timeout <= 0 or not self.scheduler.waiting:
            return
        now = time.perf_counter()
        for seq in self.scheduler.expired(now, timeout):
            self._fail(seq, SequenceFault(
                f"the server is busy: the request waited {now - seq.queued_since:.0f} s "
                f"without being admitted (queue timeout {timeout:g} s)",
                status=503, cause="queue_timeout", retry_after_s=QUEUE_RETRY_AFTER_S))

    def run_until_idle(self) -> None:
        """Run steps on the calling thread until nothing is left (tests, benchmarks)."""
        while True:
            self._drain_inbox()
            self._expire_queued()
            if not self.scheduler.has_work():
                self._emit_deferred()
                if self._fetching:  # a fetch-ahead is still running: its sequence comes next
                    self._wake.wait(0.01)
                    self._wake.clear()
                    continue
                self.tiers.flush()  # callers look at the tiers next
                return
            self.step()

    def step(self) -> None:
        """One model step: schedule (admission and blocks), forward, post-process (the cache
        records what was computed; sample, emit). A sequence whose part of this fails is
        failed alone; the others go on. A step launched ahead by the previous one
        (engine/step_ahead.py) is post-processed instead."""
        ahead, self._ahead = self._ahead, None
        if ahead is not None and ahead.ended():
            ahead = None  # every row ended since the launch (cancelled): schedule instead
        if ahead is not None:
            # the device runs this step now: the previous step's text and events meanwhile
            self._emit_deferred()
            self.counters["steps"] += 1
            self.counters["steps_ahead"] += 1
            self.counters["busy_slots_total"] += len(self.scheduler.running)
            self._postprocess(ahead.plan, ahead.logits, {})
            return
        sched = self.scheduler.schedule()
        self._end_unscheduled(sched)
        plan = sched.planned
        if not plan:
            self._emit_deferred()
            return
        done = self._forward(plan)
        if done is not None:
            self._postprocess(plan, *done)

    def _end_unscheduled(self, sched) -> None:
        """Sequences the scheduler could not plan: failed ones, and those that do not fit."""
        self.counters["preemptions"] = self.scheduler.n_preemptions
        for seq, exc in sched.failed:
            self._fail(seq, exc)
        for seq in sched.out_of_room:
            if seq.n_generated:  # a reply that outgrew the pool ends as if it hit the context
                self._finish(seq, "length")
            else:
                self._fail(seq, SequenceFault("the request does not fit in the KV pool",
                                              status=503, cause="kv_pool_full"))

    def _forward(self, plan: list[Planned]):
        """Run the model over the planned chunks (grammar masks computed beside it). Returns
        (logits per chunk, masks by sequence id), or None when the step failed."""
        from kvshare.model.batch import SeqChunk

        now = time.perf_counter()
        chunks = []
        for item in plan:
            if item.seq.prefill_started is None:
                item.seq.prefill_started = now
            chunks.append(SeqChunk(
                tokens=np.asarray(item.seq.tokens[item.start:item.end], dtype=np.int32),
                start_pos=item.start,
                block_table=np.asarray(item.seq.block_table, dtype=np.int32),
                logits="last" if item.wants_logits else "none",
                state_slot=item.seq.state_slot,
                win_block_table=(np.asarray(item.seq.win_table, dtype=np.int32)
                                 if self.windows is not None else None),
            ))
        constrained = [i.seq for i in plan if i.wants_logits and i.seq.matcher is not None]
        masks = MaskJob(constrained, overlap=self._overlap_masks) if constrained else None
        try:
            logits = self.model.forward(chunks, self.kv)
            for item in plan:
                maybe_inject(item.seq.request, "forward")
        except Exception as exc:  # noqa: BLE001 - pinned on its sequence below
            if masks is not None:
                masks.wait()
            self._emit_deferred()
            self._forward_failed(plan, exc)
            return None
        # the device runs this step now: the previous step's text and events meanwhile
        self._emit_deferred()
        self.counters["steps"] += 1
        self.counters["busy_slots_total"] += len(self.scheduler.running)
        return logits, (masks.wait() if masks is not None else {})

    def _postprocess(self, plan: list[Planned], logits, allowed: dict) -> None:
        """Each planned sequence: the cache records its chunk (scheduler.commit), then its
        logits, if it asked for them, are sampled (on the device: `self.device_sampling`).
        A sequence that a stop string in its deferred text finished after this step was
        planned (engine/deferred_emit.py) is skipped: its blocks are released already, and so
        is a void row of a step launched ahead (engine/step_ahead.py). Where it applies, the
        next step is launched once this step's sampling is, before its tokens are back."""
        rows = [(i, out) for i, out in zip(plan, logits)
                if i.seq.state != SeqState.FINISHED and not i.void]
        sampled = [(i.seq, out, allowed.get(i.seq.seq_id)) for i, out in rows if i.wants_logits]
        pending = (self.device_sampling.launch(sampled)
                   if self.device_sampling is not None and sampled else None)
        ahead = self._launch_ahead(rows, pending) if pending is not None else None
        picks_list = pending.wait() if pending is not None else []
        picks = iter(picks_list)
        for item, out in rows:
            item.seq.suspect = False
            try:
                pick = next(picks, None) if item.wants_logits else None
                self.scheduler.commit(item)
                if item.wants_logits:
                    row = pick.row if pick is not None else np.asarray(out)[-1]
                    if injected(item.seq.request, "logits_nan"):
                        row = np.full_like(row, np.nan)
                    self._on_logits(item.seq, row, allowed.get(item.seq.seq_id), pick)
            except Exception as exc:  # noqa: BLE001 - this sequence's fault alone
                self._fail(item.seq, exc)
        if ahead is not None:
            # every row of the launched step is one of this step's rows (all sampled here)
            for nxt, pick in zip(ahead.plan, picks_list):
                nxt.void = not holds(nxt, pick)
            if not ahead.ended():
                self._ahead = ahead
        stats = self.pool.stats()
        self.peak_tokens_used = max(self.peak_tokens_used, stats["tokens_held"])
        self.peak_kv_bytes = max(self.peak_kv_bytes, self.cache.kv_bytes_held(stats))
        self.counters["seq_tokens_max"] = max(self.counters["seq_tokens_max"],
                                              max(len(i.seq.tokens) for i in plan))

    def _launch_ahead(self, rows: list, pending) -> Ahead | None:
        """The next step launched now, fed this step's tokens on the device, where it
        applies (engine/step_ahead.py); None: the next step is scheduled as usual."""
        from kvshare.model.batch import SeqChunk

        if (not self.async_scheduling or not pending.on_device or self._inbox or self._cancels
                or self.scheduler.waiting or self.windows is not None or self.cache.stateful
                or len(rows) != len(self.scheduler.running)
                or not self.model.fed_steps_apply()):
            return None
        running = {id(s) for s in self.scheduler.running}
        for item, _ in rows:
            seq = item.seq
            if (id(seq) not in running or seq.state != SeqState.DECODE or seq.suspect
                    or item.end - item.start != 1 or not item.wants_logits
                    or seq.request.fault is not None
                    or (self.context_shift and item.end + 2 >= self.ctx_size)):
                return None
        bs = self.config.block_size
        for item, _ in rows:
            # a row whose next position starts a block gets it now; without room the next
            # step is scheduled (which may preempt). A block taken here is one the sequence
            # would take at its next scheduled step anyway.
            if item.end // bs >= len(item.seq.block_table):
                try:
                    if not self.cache.allocate(item.seq, item.end + 1):
                        return None
                except Exception:  # noqa: BLE001 - the scheduled step meets it again
                    return None
        chunks = [SeqChunk(tokens=_PLACEHOLDER, start_pos=item.end,
                           block_table=np.asarray(item.seq.block_table, dtype=np.int32),
                           logits="last", state_slot=item.seq.state_slot)
                  for item, _ in rows]
        if pending.may_hand_back:
            # a row the kernel hands back is sampled on the host from this step's logits,
            # which the launch is about to overwrite (a graph's logits buffer)
            pending.keep_logits()
        try:
            logits = self.model.forward_fed(chunks, self.kv, pending.tokens)
        except Exception:  # noqa: BLE001 - the next step is scheduled as usual instead
            log.exception("launching a decode step ahead failed; scheduling it instead")
            return None
        if logits is None:
            return None
        return Ahead([Planned(item.seq, item.end, item.end + 1) for item, _ in rows], logits)

    def _forward_failed(self, plan: list[Planned], exc: Exception) -> None:
        """A forward step raised. Alone, its sequence fails. In a batch the culprit is not
        known: every member becomes a suspect and runs alone until a step of its own succeeds
        (the scheduler plans one suspect per step), so only the culprit fails. Their KV
        positions are simply computed again; a hybrid's recurrent state may have advanced
        part way, so hybrids are preempted and resume from their checkpoints."""
        if len(plan) == 1:
            self._fail(plan[0].seq, exc)
            return
        log.warning("a forward step of %d sequences failed (%s: %s); running each alone to "
                    "find the one that fails", len(plan), type(exc).__name__, exc)
        self.recovered["forward_batch_split"] += 1
        for item in plan:
            item.seq.suspect = True
            if self.cache.stateful and item.seq in self.scheduler.running:
                self.scheduler.preempt(item.seq)

    def _fail(self, seq: Sequence, exc: BaseException) -> None:
        """End one sequence with an error naming the cause; never raises."""
        self._emit_deferred()  # its own and earlier tokens' events come before its end
        if seq.state == SeqState.FINISHED:
            return
        fault = exc if isinstance(exc, SequenceFault) else None
        status = fault.status if fault else 500
        cause = fault.cause if fault else "internal"
        msg = str(exc) if fault else f"{type(exc).__name__}: {exc}"
        retry_after_s = fault.retry_after_s if fault else None
        if status >= 500 and cause != "queue_timeout":
            log.error("sequence %d (request %s) failed: %s", seq.seq_id,
                      seq.request.request_id, msg, exc_info=exc)
        self.failures[cause] += 1
        try:
            self._finish(seq, "error", error=msg, status=status, cause=cause,
                         retry_after_s=retry_after_s)
        except Exception:  # noqa: BLE001
            log.exception("finishing failed sequence %s", seq.request.request_id)

    def _on_logits(self, seq: Sequence, row: np.ndarray | None, allowed=None,
                   pick: Pick | None = None) -> None:
        """The logits after the sequence's last token: sample, emit, maybe finish. `allowed`:
        its grammar mask computed during the forward pass (or the exception that raised);
        `pick`: the device sampler's outcome for the row (`row` None when it decided)."""
        if seq.state == SeqState.PREFILL:
            seq.state = SeqState.DECODE
        if seq.cancelled or seq.state == SeqState.FINISHED:
            return
        if seq.choice == 0 and seq.request.n > 1 and seq.first_token_at is None:
            assert row is not None  # a forking row is sampled on the host
            self._fork(seq, row)
        self._sample_and_emit(seq, row, allowed, pick)

    def _fork(self, parent: Sequence, row: np.ndarray) -> None:
        """OpenAI `n`: the prompt is computed once. The other choices start here, each with its
        own sampler (seed + choice) and grammar matcher, drawing its first token from these same
        logits; then each waits at the head of the queue and, admitted, attaches to the
        prompt's blocks (full blocks shared, the partial last one copied: engine/cache), so a
        choice computes only what it generates. Hybrids resume from the checkpoint the parent
        saved at the prompt's end."""
        req = parent.request
        for i in range(1, req.n):
            params = req.sampling
            if params.seed is not None:
                params = replace(params, seed=params.seed + i)
            child = Sequence(seq_id=next(self._ids), request=req,
                             sampler=Sampler(params, req.prompt_tokens), choice=i,
                             arrival=parent.arrival)
            child.tokens = list(req.prompt_tokens)
            child.n_prompt = parent.n_prompt
            child.prefill_started = parent.prefill_started
            self._seqs[child.key] = child
            try:
                child.matcher = new_matcher(req)
                child.budget = self._new_budget(req)
                self._sample_and_emit(child, row, None)
            except Exception as exc:  # noqa: BLE001 - this choice's fault alone
                self._fail(child, exc)
                continue
            if child.state != SeqState.FINISHED:
                self.scheduler.add_front(child)

    def _new_budget(self, req: GenerationRequest) -> BudgetState | None:
        if req.reasoning_budget is None:
            return None
        return req.reasoning_budget.state(
            lambda t: utf8_is_complete(self.token_bytes(t)))

    def _sample_and_emit(self, seq: Sequence, row: np.ndarray | None, allowed=None,
                         pick: Pick | None = None) -> None:
        """One token: DECIDE what the next step needs (the token, the budget, the grammar, stop
        token ids, the end or the token kept), then EMIT its text and event, now or, with
        `emit_overlap`, queued to run while the device computes the next step
        (engine/deferred_emit.py)."""
        req = seq.request
        token = self._sample(seq, row, allowed, pick)
        if token in self.stop_ids and not req.ignore_eos or token in req.stop_token_ids:
            self._finish(seq, "stop")
            return
        grammar_done = False
        if seq.matcher is not None:
            try:
                seq.matcher.consume(token)
            except ValueError as exc:
                raise SequenceFault(f"constrained decoding failed: {exc}", status=500,
                                    cause="grammar") from exc
            grammar_done = seq.matcher.stopped
        logprobs = self._logprob_values(seq, row, token, pick) if req.logprobs else None
        # Only a token after which the sequence simply goes on is deferred: an end or a context
        # shift must not happen before its text is checked for a stop string.
        if (self.emit_overlap and not grammar_done and seq.n_generated < req.max_tokens
                and len(seq.tokens) + 1 < self.ctx_size):
            seq.tokens.append(token)
            self._emits.put(PendingEmit(seq, token, logprobs))
            return
        self._emit_deferred()  # the earlier rows' events come first
        hit_stop = self._emit(seq, token, logprobs)
        self._end_or_continue(seq, token, hit_stop, grammar_done)

    def _sample(self, seq: Sequence, row: np.ndarray | None, allowed, pick: Pick | None) -> int:
        """The sequence's next token (the device's pick, or sampled here), recorded as
        generated."""
        if pick is not None and pick.token is not None:  # decided on the device
            token = pick.record(seq.sampler)
        else:
            assert row is not None
            mask = None
            forced = seq.budget.forced_token() if seq.budget is not None else None
            if forced is not None:  # the reasoning budget is spent: every other logit is -inf
                mask = one_token_mask(forced, row.size)
            elif seq.matcher is not None:
                mask = allowed if allowed is not None else compute_mask(seq.matcher)
                if isinstance(mask, Exception):
                    raise SequenceFault(f"constrained decoding failed: {mask}", status=500,
                                        cause="grammar")
            token = seq.sampler.sample(row, mask, u=pick.u if pick is not None else None)
        if seq.budget is not None:
            seq.budget.accept(token)
        if seq.first_token_at is None:
            seq.first_token_at = time.perf_counter()
        seq.generated.append(token)
        self.counters["generated_tokens_total"] += 1
        return token

    def _logprob_values(self, seq: Sequence, row: np.ndarray | None, token: int,
                        pick: Pick | None) -> tuple[float, list[tuple[int, float]]]:
        """(the token's logprob, the top ones) as the request asked. Computed at DECIDE: the
        next step may reuse the logits buffer and moves the sampler on."""
        req = seq.request
        if pick is not None and pick.logprobs is not None:
            return pick.logprobs
        assert row is not None
        return (seq.sampler.post_sampling_logprobs(token, req.top_logprobs)
                if req.post_sampling_probs else top_logprobs(row, token, req.top_logprobs))

    def _emit(self, seq: Sequence, token: int,
              logprobs: tuple[float, list[tuple[int, float]]] | None) -> bool:
        """A token's EMIT half: its text (held back while it may start a stop string) and its
        event on the handle. True: the text completed a stop string."""
        req = seq.request
        asm = self._assemblers.get(seq.seq_id)
        if asm is None:
            decode = self._special_text if req.special_text else self._generated_text
            stream = self.tokenizer.incremental_decoder(skip_special=not req.special_text)
            asm = self._assemblers[seq.seq_id] = TextAssembler(decode, req.stop, stream=stream)
        text, hit_stop = asm.push(token)
        if logprobs is None:
            event = TokenEvent(token_id=token, text=text, index=seq.choice)
        else:
            lp, top = logprobs
            event = TokenEvent(
                token_id=token, text=text,
                logprob=TokenLogprob(token, self.token_piece(token), lp),
                top_logprobs=tuple(TokenLogprob(t, self.token_piece(t), v) for t, v in top),
                index=seq.choice,
            )
        handle = self._handles.get(req.request_id)
        if handle is not None:
            handle.put(event)
        return hit_stop

    def _emit_deferred(self) -> bool:
        """Run the queued EMIT halves (engine/deferred_emit.py); True when any ran."""
        return self._emits.run(self._emit_queued)

    def _emit_queued(self, item: PendingEmit) -> None:
        seq = item.seq
        if seq.state == SeqState.FINISHED:  # its request failed or was cancelled meanwhile
            return
        try:
            if self._emit(seq, item.token, item.logprobs):
                # A stop string ends the reply before this token, which was appended for the
                # step now running: take it back, so the sequence ends as it does without
                # overlap (the cache saves and releases tokens[:n_computed] either way).
                assert seq.tokens[-1] == item.token
                seq.tokens.pop()
                self._finish(seq, "stop", flush=False)
        except Exception as exc:  # noqa: BLE001 - this sequence's fault alone
            self._fail(seq, exc)

    def _end_or_continue(self, seq: Sequence, token: int, hit_stop: bool,
                         grammar_done: bool) -> None:
        """After a token was emitted: finish the sequence (a stop string, a complete grammar,
        max_tokens, a full context that does not shift) or keep the token for the next step."""
        if hit_stop:
            self._finish(seq, "stop", flush=False)
            return
        seq.tokens.append(token)
        if grammar_done:  # the grammar is complete: only EOS could follow
            self._finish(seq, "stop")
        elif (seq.n_generated >= seq.request.max_tokens
              or len(seq.tokens) >= self.ctx_size and not self._shift_context(seq)):
            self._finish(seq, "length")  # a full context shifts (when on) rather than ends

    def _shift_context(self, seq: Sequence) -> bool:
        """The sequence's context is full (its last token not computed yet): with context shift
        on, discard part of its past (engine/context_shift.py) and compute the tokens after the
        kept prefix again at their new positions; the kept prefix's full blocks are found in
        the pool and shared as they are. False: no shift (off, or nothing can be discarded)."""
        if not self.context_shift:
            return False
        req = seq.request
        add_bos = bool(getattr(self.tokenizer, "add_bos", False))
        shift = plan_shift(len(seq.tokens) - 1, seq.n_prompt, self.ctx_size, req.n_keep,
                           req.n_discard, add_bos=add_bos)
        if shift.n_discard == 0:
            return False
        # a choice forked from its parent's logits is not admitted yet: only its tokens change
        admitted = seq in self.scheduler.running
        if admitted:
            self.cache.release(seq)
        shift_tokens(seq, shift, self.cache.keys)
        if admitted:
            self.cache.admit(seq)
            seq.state = SeqState.PREFILL
        self.counters["context_shifts"] += 1
        log.debug("%s: context shift, n_keep %d, n_discard %d, %d tokens to recompute",
                  seq.key, shift.n_keep, shift.n_discard, len(seq.tokens) - seq.n_computed)
        return True

    def _finish(self, seq: Sequence, reason: FinishReason, error: str | None = None, flush: bool = True,
                status: int = 500, cause: str | None = None,
                retry_after_s: float | None = None) -> None:
        # the events of tokens still queued come first; the sequence's own may have hit a
        # stop string and finished it
        if self._emit_deferred() and seq.state == SeqState.FINISHED:
            return
        req = seq.request
        rid = req.request_id
        left = self._open_choices.get(rid, 1) - 1
        if left <= 0 or reason in ("error", "cancelled"):
            handle = self._handles.pop(rid, None)
            self._open_choices.pop(rid, None)
        else:
            handle = self._handles.get(rid)
            self._open_choices[rid] = left
        asm = self._assemblers.pop(seq.seq_id, None)
        stop_string = asm.stop_hit if asm is not None and reason == "stop" else None
        if flush and asm is not None and handle is not None and reason in ("stop", "length"):
            tail = asm.flush()
            if tail:
                handle.put(TokenEvent(token_id=-1, text=tail, index=seq.choice))
        seq.finished_at = time.perf_counter()
        seq.cancelled = reason == "cancelled"
        self._seqs.pop(seq.key, None)
        prompt_end = seq.first_token_at or seq.finished_at
        start = seq.prefill_started or seq.arrival
        timings = Timings(
            prompt_n=seq.n_prompt - seq.n_cached,
            cache_n=seq.n_cached,
            prompt_ms=1e3 * (prompt_end - start),
            predicted_n=seq.n_generated,
            predicted_ms=1e3 * (seq.finished_at - seq.first_token_at) if seq.first_token_at else 0.0,
            restore_ms=1e3 * seq.restore_s,
        )
        self.counters["prompt_tokens_total"] += seq.n_prompt
        self.counters["prompt_tokens_cached_total"] += seq.n_cached
        if seq.choice == 0:  # n > 1: the prompt is computed once, for the first choice
            self.counters["prompt_seconds_total"] += timings.prompt_ms / 1e3
        self.counters["generation_seconds_total"] += timings.predicted_ms / 1e3
        ttft = (seq.first_token_at - seq.arrival) if seq.first_token_at else 0.0
        if seq.restore_s:
            log.debug("%s: restored from tiers in %.1f ms (prompt %.1f ms)", req.request_id,
                      1e3 * seq.restore_s, timings.prompt_ms)
        # The client gets its finish before the tier save runs: the save (device reads, RAM
        # copies, queueing the disk write) is no part of this response's latency.
        if handle is not None:
            handle.put(FinishEvent(reason=reason, prompt_tokens=seq.n_prompt,
                                    completion_tokens=seq.n_generated, timings=timings,
                                    n_discarded=seq.n_discarded,
                                    time_to_first_token_s=ttft, error=error,
                                    error_status=status, error_cause=cause,
                                    retry_after_s=retry_after_s, index=seq.choice,
                                    stop_string=stop_string))
        if reason in ("error", "cancelled"):  # the request ends: its other choices stop too
            for other in self._choices_of(rid):
                if other is not seq and other.state != SeqState.FINISHED:
                    self._finish(other, "cancelled")
        try:  # the cache saves to the tiers what later sessions resume from, then releases
            # A shifted token list is no conversation a later request sends again: no save.
            self.scheduler.finish(seq, save=reason != "error" and not seq.n_discarded)
        except Exception:  # noqa: BLE001 - the request is answered; its blocks may leak
            log.exception("releasing %s failed", req.request_id)

    # ---- introspection ----------------------------------------------------------------
    def kv_bytes_held(self, pool_stats: _PoolStats | None = None) -> int:
        """Bytes of the KV blocks that sequences hold now (referenced, not merely cached);
        `pool_stats`: the main pool's `stats()` when the caller has them."""
        return self.cache.kv_bytes_held(pool_stats)

    def snapshot(self) -> dict:
        stats = dict(self.pool.stats())
        slots = []
        for seq in list(self.scheduler.running) + list(self.scheduler.waiting):
            table = list(seq.block_table)
            slots.append({
                "id": seq.seq_id, "request_id": seq.request.request_id, "state": seq.state.value,
                "n_prompt": seq.n_prompt, "n_cached": seq.n_cached, "n_computed": seq.n_computed,
                "n_generated": seq.n_generated, "blocks": len(table),
                "restore_ms": 1e3 * seq.restore_s,
                "shared_blocks": self.cache.shared_blocks(seq),
            })
        pool = {
            "total": stats["total"], "used": stats["used"], "free": stats["free"],
            "cached": stats["cached"], "shared": stats["shared"], "tokens_used": stats["tokens_held"],
            "block_size": self.config.block_size, "peak_tokens_used": self.peak_tokens_used,
            "kv_bytes_held": self.kv_bytes_held(), "peak_kv_bytes_held": self.peak_kv_bytes,
            "block_bytes": self.kv.block_nbytes,
            "window": self.windows.stats() if self.windows is not None else None,
        }
        faults = {"queued": len(self.scheduler.waiting), "failed": dict(self.failures),
                  "recovered": dict(self.recovered + self.cache.counters)}
        return {"slots": slots, "sequences": len(slots), "pool": pool,
                "counters": dict(self.counters), "faults": faults,
                "tiers": self.tiers.snapshot(),
                "checkpoints": self.checkpoints.snapshot() if self.checkpoints else None}
