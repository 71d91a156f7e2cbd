"""Type stubs for kvshare._core (the PyO3 binding of crates/kvshare-core)."""

__version__: str

class KvshareError(Exception): ...
class OutOfBlocks(KvshareError): ...
class InvalidArgument(KvshareError): ...
class CorruptEntry(KvshareError): ...
class FingerprintMismatch(KvshareError): ...
class PathEscape(KvshareError): ...
class OverBudget(KvshareError): ...
class CacheIoError(KvshareError): ...

# --- hashing, block pool, checkpoints, RAM tier ---
# Keys are 32-byte `bytes` (blake3 chain keys). Token ids: a sequence of ints or a NumPy integer
# array (read in place). Payloads: `bytes` or a C-contiguous NumPy array (read in place), or any
# other buffer object (copied once). Misuse raises InvalidArgument; see docs/cache.md.

from collections.abc import Iterable, Sequence
from typing import Any, Literal, TypedDict

import numpy as np
import numpy.typing as npt

_Tokens = Sequence[int] | npt.NDArray[np.integer[Any]]
_Keys = Iterable[bytes]
_Payload = bytes | bytearray | memoryview | npt.NDArray[Any]
_WritableBuffer = bytearray | npt.NDArray[Any]

def root_key(
    fingerprint: bytes, kv_dtype: str, block_size: int, cache_salt: bytes | None = None
) -> bytes: ...
def chain_key(parent: bytes, tokens: _Tokens, extra: bytes | None = None) -> bytes: ...
def hash_blocks(
    root: bytes, tokens: _Tokens, block_size: int, extra: bytes | None = None
) -> list[bytes]: ...
def prefix_key(
    root: bytes, tokens: _Tokens, block_size: int, extra: bytes | None = None
) -> bytes: ...

class _PoolStats(TypedDict):
    total: int
    used: int
    free: int
    cached: int
    shared: int
    tokens_held: int

class BlockPool:
    def __init__(self, n_blocks: int, block_size: int) -> None: ...
    @property
    def n_blocks(self) -> int: ...
    @property
    def block_size(self) -> int: ...
    def available(self) -> int: ...
    def allocate(self, parent: bytes) -> int: ...
    def acquire(self, ids: Sequence[int]) -> None: ...
    def release(self, ids: Sequence[int]) -> None: ...
    def append_tokens(self, id: int, tokens: _Tokens) -> None: ...
    def register(self, id: int, key: bytes) -> int: ...
    def lookup(self, key: bytes) -> int | None: ...
    def match_prefix(self, keys: _Keys) -> tuple[list[int], int]: ...
    def acquire_prefix(self, keys: _Keys) -> tuple[list[int], int]: ...
    def extend_match(self, parent: bytes, next_tokens: _Tokens) -> tuple[int, int] | None: ...
    def cow(self, src: int, n_tokens: int) -> int: ...
    def evict_all_cached(self) -> int: ...
    def stats(self) -> _PoolStats: ...
    def ref_count(self, id: int) -> int: ...
    def tokens(self, id: int) -> list[int]: ...
    def key(self, id: int) -> bytes | None: ...
    def parent(self, id: int) -> bytes: ...
    def state(self, id: int) -> Literal["free", "used", "cached"]: ...
    def lru_order(self) -> list[int]: ...
    def check_invariants(self) -> None: ...

class CheckpointAccount:
    def __init__(self) -> None: ...
    @staticmethod
    def default() -> CheckpointAccount: ...
    @property
    def live_count(self) -> int: ...
    @property
    def live_bytes(self) -> int: ...

class _AccountStats(TypedDict):
    count: int
    bytes: int

def checkpoint_account_stats() -> _AccountStats: ...

class Checkpoint:
    def __init__(
        self,
        position: int,
        key: bytes,
        anchor: bytes,
        tail: _Tokens,
        data: _Payload,
        layout: str = "",
        account: CheckpointAccount | None = None,
    ) -> None: ...
    @staticmethod
    def at(
        root: bytes,
        tokens: _Tokens,
        block_size: int,
        data: _Payload,
        layout: str = "",
        extra: bytes | None = None,
        account: CheckpointAccount | None = None,
    ) -> Checkpoint: ...
    @property
    def position(self) -> int: ...
    @property
    def key(self) -> bytes: ...
    @property
    def anchor(self) -> bytes: ...
    @property
    def anchor_position(self) -> int: ...
    @property
    def tail(self) -> list[int]: ...
    @property
    def data(self) -> bytes: ...
    @property
    def layout(self) -> str: ...
    @property
    def nbytes(self) -> int: ...
    @property
    def __array_interface__(self) -> dict[str, Any]: ...
    def read_into(self, out: _WritableBuffer) -> None: ...
    def same(self, other: Checkpoint) -> bool: ...

class CheckpointStore:
    def __init__(self, account: CheckpointAccount | None = None) -> None: ...
    def insert(self, ckpt: Checkpoint) -> Checkpoint: ...
    def get(self, key: bytes) -> Checkpoint | None: ...
    def remove(self, key: bytes) -> Checkpoint | None: ...
    def __contains__(self, key: bytes) -> bool: ...
    def __len__(self) -> int: ...
    def keys(self) -> list[bytes]: ...
    def deepest(
        self, root: bytes, block_keys: _Keys, tokens: _Tokens, max_position: int | None = None
    ) -> Checkpoint | None: ...
    @property
    def unique_bytes(self) -> int: ...
    @property
    def account(self) -> CheckpointAccount: ...
    def check_invariants(self) -> None: ...

class _RamStats(TypedDict):
    entries: int
    blocks: int
    checkpoints: int
    bytes: int
    budget: int
    hits: int
    misses: int
    evictions: int
    pinned: int  # pinned entries (prefix entries)
    pinned_bytes: int  # <= pin_budget <= budget
    pin_budget: int
    demotions: int  # pins moved back to the normal LRU class to keep the pin budget
    pinned_evictions: int  # evictions that took a pinned entry (also in `evictions`)

class RamTier:
    """Blocks and checkpoints in host memory under a byte budget, LRU. Pinned entries (prefix
    entries) are evicted only when no unpinned entry is left, and their bytes are bounded by
    `pin_budget` (default budget // 2): pinning past it demotes the least recent pins."""

    def __init__(self, budget_bytes: int, account: CheckpointAccount | None = None,
                 pin_budget_bytes: int | None = None) -> None: ...
    def put_block(self, key: bytes, data: _Payload) -> bool: ...
    def get_block(self, key: bytes) -> bytes | None: ...
    def get_block_into(self, key: bytes, out: _WritableBuffer) -> bool: ...
    def contains_block(self, key: bytes) -> bool: ...
    def remove_block(self, key: bytes) -> bool: ...
    def match_prefix(self, keys: _Keys) -> int: ...
    def touch_blocks(self, keys: _Keys) -> int: ...
    def pin_blocks(self, keys: _Keys) -> int: ...
    def pin_checkpoint(self, key: bytes) -> bool: ...
    def unpin(self, key: bytes, checkpoint: bool = False) -> bool: ...
    def is_pinned(self, key: bytes, checkpoint: bool = False) -> bool: ...
    def put_checkpoint(self, ckpt: Checkpoint) -> bool: ...
    def get_checkpoint(self, key: bytes) -> Checkpoint | None: ...
    def contains_checkpoint(self, key: bytes) -> bool: ...
    def remove_checkpoint(self, key: bytes) -> Checkpoint | None: ...
    def deepest_checkpoint(
        self, root: bytes, block_keys: _Keys, tokens: _Tokens, max_position: int | None = None
    ) -> Checkpoint | None: ...
    @property
    def held_bytes(self) -> int: ...
    @property
    def budget(self) -> int: ...
    @property
    def pinned_bytes(self) -> int: ...
    @property
    def pin_budget(self) -> int: ...
    def set_budget(self, budget_bytes: int) -> None: ...
    def set_pin_budget(self, pin_budget_bytes: int) -> None: ...
    def clear(self) -> None: ...
    def __len__(self) -> int: ...
    def stats(self) -> _RamStats: ...
    def lru_order(self) -> list[tuple[Literal["block", "checkpoint"], bytes]]: ...
    def check_invariants(self) -> None: ...

# --- disk store ---
import os
from collections.abc import Sequence
from pathlib import Path
from types import TracebackType

from typing_extensions import Buffer

_Checkpoint = tuple[int, bytes, str, Buffer]  # (position, key, layout, data)
_CheckpointInfo = tuple[int, bytes, str, int]  # (position, key, layout, n_bytes)

class DiskStore:
    """Crash-safe on-disk store of KV blocks and checkpoints with a background writer.

    Keys are 32-byte block/checkpoint keys. Entries of another model fingerprint are never
    returned. One store per directory (a second raises CacheIoError)."""

    def __init__(
        self,
        path: str | os.PathLike[str],
        model_fingerprint: bytes,
        budget_bytes: int,
        ttl_seconds: float | None,
        min_tokens: int,
        queue_depth: int = 16,
    ) -> None: ...
    @property
    def path(self) -> Path: ...
    def submit(
        self,
        block_keys: Sequence[bytes],
        payload: Buffer,
        block_bytes: int | Sequence[int],
        tokens: int,
        checkpoints: Sequence[_Checkpoint] | None = None,
        payload_from: int = 0,
    ) -> bool:
        """Queues an entry; False if the queue is full (the write is dropped and counted).
        `payload` holds blocks `block_keys[payload_from:]` back to back; earlier blocks must
        already be stored (see `stored_prefix`)."""
    def write(
        self,
        block_keys: Sequence[bytes],
        payload: Buffer,
        block_bytes: int | Sequence[int],
        tokens: int,
        checkpoints: Sequence[_Checkpoint] | None = None,
        payload_from: int = 0,
    ) -> bytes | None:
        """Writes now; the entry key, or None if nothing was written."""
    def flush(self) -> None: ...
    def close(self) -> None: ...
    def __enter__(self) -> DiskStore: ...
    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> bool: ...
    def lookup(self, keys: Sequence[bytes]) -> tuple[int, int, _CheckpointInfo | None]:
        """(n_blocks, n_bytes, deepest checkpoint on a matched key); evicts first."""
    def stored_prefix(self, keys: Sequence[bytes]) -> int: ...
    def read_blocks(self, keys: Sequence[bytes], out: Buffer) -> int:
        """Fills writable contiguous `out` with the stored prefix's blocks (whole blocks that
        fit); returns the count. Raises CorruptEntry (entry removed, `out` zeroed)."""
    def lookup_checkpoint(
        self, candidates: Sequence[tuple[int, bytes]], max_position: int
    ) -> _CheckpointInfo | None: ...
    def read_checkpoint(self, key: bytes) -> tuple[int, str, bytes] | None:
        """(position, layout, data), verified; None if not stored."""
    def evict(self) -> int: ...
    def stats(self) -> dict[str, int]: ...
    def entries(self) -> list[dict[str, object]]: ...

# --- shared (remote) tier values (kvshare_core::remote) ---

def remote_value(kind: Literal["block", "checkpoint"], fingerprint: bytes, key: bytes,
                 payload: Buffer, position: int = 0, layout: str = "") -> bytes:
    """One checksummed value of the shared tier: `payload` stored under `key` for the model
    `fingerprint` (32 bytes each)."""
def remote_value_into(value: Buffer, kind: Literal["block", "checkpoint"], fingerprint: bytes,
                      key: bytes, out: Buffer) -> tuple[int, str]:
    """Checks `value` and copies its payload into writable `out` (exactly its length);
    `(position, layout)`. CorruptEntry for any damage, FingerprintMismatch for another model."""
def remote_value_open(value: Buffer, kind: Literal["block", "checkpoint"], fingerprint: bytes,
                      key: bytes) -> tuple[int, str, bytes]:
    """Checks `value`; `(position, layout, payload)`. Errors as `remote_value_into`."""

# --- compute kernels (crates/kvshare-kernels) ---

def qmatmul_t(
    x: npt.NDArray[np.float32],
    qs: npt.NDArray[np.int8],
    scale: npt.NDArray[np.float32],
    mins: npt.NDArray[np.float32] | None,
    out: npt.NDArray[np.float32],
    group: int,
    threads: int = 1,
) -> None:
    """`out[m, n] = sum_k x[m, k] * (qs[n, k] * scale[n, k // group] - mins[n, k // group])`.

    x f32 `[M, K]`, qs int8 `[N, K]`, scale/mins f32 `[N, K // group]` (group 16 or 32), out
    f32 `[M, N]` (written; must not overlap an input); all C-contiguous, read in place. Runs on
    up to `threads` threads with the GIL released. Raises InvalidArgument on wrong dtypes,
    shapes or overlap, TypeError for non-arrays."""

def paged_attention(
    q: npt.NDArray[np.float32],
    k_cache: npt.NDArray[np.float32] | npt.NDArray[np.float16] | npt.NDArray[np.uint8],
    v_cache: npt.NDArray[np.float32] | npt.NDArray[np.float16] | npt.NDArray[np.uint8],
    block_tables: npt.NDArray[np.int32],
    q_starts: npt.NDArray[np.int64],
    start_positions: npt.NDArray[np.int64],
    scale: float,
    window: int,
    out: npt.NDArray[np.float32],
    max_rows: int,
    threads: int = 1,
    invariant: bool = False,
    sinks: npt.NDArray[np.float32] | None = None,
) -> None:
    """Attention of the query rows of every sequence with at most `max_rows` rows over the
    paged cache, into `out`; rows of longer sequences are not written.

    q/out f32 `[N, n_head, hd]`; k_cache/v_cache f32 or f16 (both the same)
    `[n_blocks, block_size, n_kv, hd]`, or uint8 q8_0 rows `[..., hd / 32 * 34]`;
    block_tables int32 `[n_seq, width]` (-1 padded); q_starts int64 `[n_seq + 1]`;
    start_positions int64 `[n_seq]`. Masks, head grouping and `sinks` (f32 `[n_head]`
    attention-sink logits) as `kvshare.ops.attention.paged_attention`; `invariant`: every row
    through the tiles, the same bits in any call. All C-contiguous, read in place, GIL
    released.
    Raises InvalidArgument on wrong dtypes, shapes or overlap, IndexError when a block table
    does not cover a query's keys."""

# --- constrained decoding (crates/kvshare-constrain) ---
# Masks: `mask_words = ceil(vocab_size / 32)` uint32 words, bit `t % 32` of word `t // 32` set =
# token t allowed. EOS is allowed when the output is complete, and alone once it is stopped.

class GrammarError(ValueError):
    """A grammar that does not compile, or a token it does not allow."""

class ConstraintVocab:
    """One model's token strings (build once per model). `special[i]` marks control tokens:
    text never spells them, Lark names them `<|im_end|>` / `<[id]>`. `eos`: the end token, or
    several (the first is the main one); they are special too, whatever `special` says. `vocab_size` >= len(tokens): the logits row length.
    Raises InvalidArgument on inconsistent arguments."""

    def __init__(
        self, tokens: list[bytes], special: list[bool], eos: int | Sequence[int], vocab_size: int
    ) -> None: ...
    @property
    def vocab_size(self) -> int: ...
    @property
    def mask_words(self) -> int: ...
    @property
    def eos(self) -> list[int]: ...

class Grammar:
    """A compiled constraint; `kind` is "json_schema", "json_object" (source ignored), "lark"
    or "regex". Raises GrammarError with llguidance's message (syntax errors, schema keywords
    it cannot enforce, unknown formats, overlapping oneOf, GBNF). GIL released while
    compiling."""

    def __init__(self, vocab: ConstraintVocab, kind: str, source: str) -> None: ...
    def matcher(self) -> Matcher: ...
    @property
    def kind(self) -> str: ...
    @property
    def warnings(self) -> list[str]: ...

class Matcher:
    """One sequence's position in a grammar (thread-safe; one per sequence)."""

    def fill_mask(self, out: npt.NDArray[np.uint32]) -> None:
        """Writes the mask into `out` (writable 1-D, `mask_words` long), GIL released. Raises
        GrammarError if the matcher fails (`out` then allows only EOS)."""
    def consume(self, token: int) -> None:
        """Raises GrammarError (matcher unchanged) for a token the grammar does not allow."""
    @property
    def accepting(self) -> bool: ...
    @property
    def stopped(self) -> bool: ...
    @property
    def error(self) -> str | None: ...
    @property
    def mask_words(self) -> int: ...

def fill_masks(
    matchers: Sequence[Matcher],
    out: npt.NDArray[np.uint32],
    threads: int | None = None,
    kernel_pool: bool = False,
) -> list[str | None]:
    """Row i of `out` (writable `[len(matchers), mask_words]`) = matcher i's mask, computed on
    up to `threads` threads (default: one per core) with the GIL released. One entry per
    matcher: None, or the message of a failed matcher (its row then allows only EOS).
    `kernel_pool`: run on the CPU kernels' thread pool instead (between forward steps)."""

def masked_argmax(row: npt.NDArray[np.float32], mask: npt.NDArray[np.uint32]) -> int | None:
    """The index of the highest score among the tokens `mask` allows; None if it allows none
    of the row."""

def mask_logits(row: npt.NDArray[np.float32], mask: npt.NDArray[np.uint32]) -> int:
    """Write -inf over every score `mask` does not allow, in place; the number allowed."""

# --- block-format kernels (crates/kvshare-kernels/src/blocks) ---

def block_matmul_t(
    x: npt.NDArray[np.float32],
    raw: npt.NDArray[np.uint8],
    qtype: int,
    out: npt.NDArray[np.float32],
    threads: int = 1,
) -> None:
    """`out[m, n] = sum_k x[m, k] * w[n, k]`, `w` the rows of `raw` (uint8 `[N, row_bytes]`,
    may be read-only, e.g. a view into the mmapped GGUF) in GGML type `qtype` (F32, F16, BF16,
    Q4_0, Q4_1, Q5_0, Q5_1, Q8_0, Q2_K..Q6_K, IQ4_NL, IQ4_XS, MXFP4). x f32 `[M, K]` with M <= 16,
    out f32 `[M, N]` (written; must not overlap an input). Quantized types quantize x to 8
    bits per 32 values. All C-contiguous, read in place, GIL released. Raises ValueError on
    wrong dtypes, shapes, overlap or an unsupported type."""

def block_dequantize(
    raw: npt.NDArray[np.uint8],
    qtype: int,
    k: int,
    out: npt.NDArray[np.float32],
    threads: int = 1,
) -> None:
    """`out[rows, k]` (f32, written) = the rows of `raw` (uint8 `[rows, row_bytes]`) of GGML
    type `qtype` as f32, exactly as ggml's dequantize_row_* computes them. GIL released.
    Raises ValueError on wrong dtypes, shapes or an unsupported type."""

def block_force_portable(on: bool) -> None:
    """Make the block kernels run their portable code instead of AVX2 (for tests)."""

def block_matmul_t_f32(
    x: npt.NDArray[np.float32],
    raw: npt.NDArray[np.uint8],
    qtype: int,
    out: npt.NDArray[np.float32],
    threads: int = 1,
) -> None:
    """As `block_matmul_t` (same arguments, checks and ValueErrors; M <= 16), but with the f32
    activations themselves for every type (no 8-bit rounding): the weights are formed in
    registers with ggml's dequantization arithmetic, so `out` equals
    `x @ dequantize(raw).T` up to f32 summation order. GIL released."""

def block_gemm_available() -> bool:
    """Whether `block_gemm_f32` runs on this CPU (AVX-512) with the SIMD code switched on
    (`block_force_portable(True)` switches it off)."""

def block_gemm_f32(
    x: npt.NDArray[np.float32],
    raw: npt.NDArray[np.uint8],
    qtype: int,
    out: npt.NDArray[np.float32],
    col0: int = 0,
    threads: int = 1,
) -> None:
    """`out[:, col0:col0 + n] = x @ dequantize(raw).T` for a block-quantized `raw` (uint8
    `[n, row_bytes]`; F32/F16/BF16 are refused) and `x` f32 `[m, k]` of any m (a prefill
    chunk); `out` C-contiguous f32 `[m, ld]`, its other columns untouched. Panels of weight
    rows are dequantized as ggml does and multiplied by an f32 micro-kernel; each output sums
    its k products in order from zero, so a row's result does not depend on m or the threads.
    ValueError on bad shapes, overlap or when AVX-512 is absent. GIL released."""

def block_vnni_available() -> bool:
    """Whether `block_matmul_t_vnni` runs on this CPU (AVX512-VNNI) with the SIMD code
    switched on (`block_force_portable(True)` switches it off)."""

def block_vnni_supports(qtype: int) -> bool:
    """Whether `block_matmul_t_vnni` takes weights of GGML type `qtype`."""

def block_matmul_t_vnni(
    x: npt.NDArray[np.float32],
    raws: list[npt.NDArray[np.uint8]],
    qtypes: list[int],
    out: npt.NDArray[np.float32],
    threads: int = 1,
) -> None:
    """`x` (f32 `[M, k]`, any M) quantized to 8 bits per 32 values (scale amax / 127, ties
    to even) times the rows of each part `raws[p]` (type `qtypes[p]`, one the kernel
    supports), in integers; part `p` fills the columns of `out` (`[M, sum of the parts'
    rows]`) after those of the parts before it. A row's result is the same bits whatever M
    is and wherever the row sits in `x`. ValueError for bad shapes, dtypes, overlap or an
    unsupported type. GIL released."""

def block_matmul_t_f32_parts(
    x: npt.NDArray[np.float32],
    raws: list[npt.NDArray[np.uint8]],
    qtypes: list[int],
    out: npt.NDArray[np.float32],
    threads: int = 1,
) -> None:
    """`block_matmul_t_f32` of several weights with the same `k` at once (fused Q/K/V or
    gate/up, whose parts may differ in type): part `p` fills the columns of `out`
    (`[M, sum of the parts' rows]`) after those of the parts before it. One pass over the
    kernel threads for all parts. Same checks and ValueErrors. GIL released."""

# --- mixture-of-experts: grouped expert products (kvshare-kernels `moe`) ---
# `raws[p]`: a whole stacked expert tensor, uint8 `[n_expert * n_p, row_bytes]` of GGML type
# `qtypes[p]`; expert e's matrix is its n_p rows of each part, stacked in part order.
# `activations`: "f32", "q8" or "vnni", as BlockWeight's.

def moe_gate_up(
    x: npt.NDArray[np.float32],
    ids: npt.NDArray[np.int64],
    raws: list[npt.NDArray[np.uint8]],
    qtypes: list[int],
    n_expert: int,
    out: npt.NDArray[np.float32],
    activations: Literal["f32", "q8", "vnni"] = "f32",
    glu: Literal["silu", "gelu_tanh", "swiglu_oai"] | None = "silu",
    threads: int = 1,
    bias: npt.NDArray[np.float32] | None = None,
) -> None:
    """Token rows `x` (`[n_tok, k]`) routed to experts `ids` (`[n_tok, slots]`): row
    `t * slots + j` of `out` is `x[t]` times expert `ids[t, j]`'s rows, plus that expert's row
    of `bias` (`[n_expert, rows]`) when given, with `glu` applied to its gate and up halves (`out` `[n_tok * slots, rows / 2]`; None: `[n_tok * slots, rows]`).
    Tokens grouped by expert, the work split over up to `threads` threads by expert.
    ValueError for bad shapes, dtypes, ids, overlap or an unsupported type. GIL released."""

def moe_down(
    a: npt.NDArray[np.float32],
    ids: npt.NDArray[np.int64],
    weights: npt.NDArray[np.float32],
    raws: list[npt.NDArray[np.uint8]],
    qtypes: list[int],
    n_expert: int,
    out: npt.NDArray[np.float32],
    activations: Literal["f32", "q8", "vnni"] = "f32",
    threads: int = 1,
    bias: npt.NDArray[np.float32] | None = None,
) -> None:
    """Pair rows `a` (`[n_tok * slots, k]`) routed as `ids` with `weights` (both
    `[n_tok, slots]`): `out[t]` (`[n_tok, rows]`) = the sum over slots, in slot order, of
    `weights[t, j] * (a[t * slots + j]` times expert `ids[t, j]`'s rows, plus its row of
    `bias`, `[n_expert, rows]`, when given). Same checks as `moe_gate_up`. GIL released."""
