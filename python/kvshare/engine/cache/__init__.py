"""The engine's KV cache: block pools (bookkeeping, the Rust core), the model's paged KV arrays
(payload), one manager per layer group, and the RAM / disk / Redis tiers behind the pools.

- manager.py: `KVCacheManager`, the face the scheduler calls (admit / allocate / commit /
  release / finish);
- base.py: `LayerGroupManager`, the interface each layer kind implements;
- full_attention.py, sliding_window.py, recurrent.py: one manager per kind;
- keys.py: chain keys; checkpoints.py: recurrent-state checkpoints;
- tiers.py, remote_tier.py: what outlives a session (RAM, disk, Redis).

`build_cache` sizes the pools from the engine's settings and puts the parts together.
"""

from __future__ import annotations

from pathlib import Path

from kvshare import _core
from kvshare.engine.cache.base import CacheContext, LayerGroupManager
from kvshare.engine.cache.checkpoints import CheckpointManager
from kvshare.engine.cache.full_attention import FullAttentionManager
from kvshare.engine.cache.keys import BlockKeys
from kvshare.engine.cache.manager import KVCacheManager
from kvshare.engine.cache.recurrent import RecurrentStateManager
from kvshare.engine.cache.remote_tier import RemoteTier
from kvshare.engine.cache.sliding_window import SlidingWindowManager
from kvshare.engine.cache.tiers import TierManager

__all__ = ["KVCacheManager", "LayerGroupManager", "build_cache"]


def build_cache(model, config, fingerprint: bytes) -> KVCacheManager:
    """The cache for `model` under `config` (engine.EngineConfig). The layer kinds the model
    declares (`Model.layer_kinds`) decide the groups: recurrent layers (hybrids): full
    attention + recurrent; sliding-window layers, unless `swa_full`: full attention + sliding
    window; else full attention alone. (Hybrids with sliding-window layers keep them in the
    main pool.)"""
    kinds = model.layer_kinds()
    hybrid = kinds.recurrent > 0
    window = kinds.window if kinds.sliding_window and not hybrid and not config.swa_full else 0
    n_win_blocks = win_pool_blocks(model, config, window) if window else None
    n_blocks = pool_blocks(model, config, window, n_win_blocks)
    kv = model.new_cache(n_blocks, config.block_size, kv_dtype=config.kv_dtype,
                         n_state_slots=config.parallel if hybrid else 0,
                         n_win_blocks=n_win_blocks)
    kv.prefault()  # host pool: map its pages in the background, not on first use
    dtype = kv.kv_dtype_name  # part of every cache key (a block means its bytes in it)
    pool = _core.BlockPool(n_blocks, config.block_size)
    tiers = make_tiers(config, fingerprint, dtype, pool, kv)
    ctx = CacheContext(kv, BlockKeys(fingerprint, dtype, config.block_size,
                                     public_prefixes=not hybrid),
                       tiers, config.slot_attach)
    full = FullAttentionManager(pool, ctx)
    other: LayerGroupManager | None = None
    if hybrid:
        other = RecurrentStateManager(CheckpointManager(
            kv, config.block_size, config.parallel, config.checkpoint_min_step,
            config.ctx_checkpoints, int(config.checkpoint_mem_mib) * 2**20,
            config.checkpoint_min_gain), full, ctx)
    elif n_win_blocks is not None:  # set exactly when there is a window group
        other = SlidingWindowManager(_core.BlockPool(n_win_blocks, config.block_size), window,
                                     full, ctx)
    return KVCacheManager(full, ctx, other)


def pool_blocks(model, config, window: int, n_win_blocks: int | None) -> int:
    """Blocks of the main pool (every attention layer, or the full-attention ones when
    sliding-window layers have their own pool: that pool's bytes come off `--kv-mem`)."""
    if config.kv_blocks:
        return int(config.kv_blocks)
    group = 0 if window else None
    per_block = max(1, model.kv_bytes_per_token(config.kv_dtype, group) * config.block_size)
    if config.kv_mem_mib:
        budget = int(config.kv_mem_mib) * 2**20
        if n_win_blocks is not None:  # given exactly when there is a window group
            budget = max(per_block * 4, budget - n_win_blocks * win_block_bytes(model, config))
        return max(4, budget // per_block)
    want = config.parallel * -(-config.ctx_size // config.block_size)
    cap = 1536 * 2**20 // per_block  # default: at most 1.5 GiB of KV
    return max(4, min(want, cap))


def win_block_bytes(model, config) -> int:
    return model.kv_bytes_per_token(config.kv_dtype, 1) * config.block_size


def win_pool_blocks(model, config, window: int) -> int:
    """The window pool: every running sequence's window and the chunk it computes
    (ceil((W + chunk) / bs) + 1 blocks), twice over: as much again for kept windows (shared
    prefixes' windows stay findable while they fit), plus the null block. Under `--kv-mem` at
    most half of it."""
    bs = config.block_size
    per_seq = -(-(window + config.prefill_chunk) // bs) + 1
    n = 2 * config.parallel * per_seq + 1
    if config.kv_mem_mib and not config.kv_blocks:
        n = min(n, int(config.kv_mem_mib) * 2**20 // 2 // win_block_bytes(model, config))
    return max(n, per_seq + 2)


def make_tiers(config, fingerprint: bytes, kv_dtype: str, pool, kv) -> TierManager:
    # What a stored block means: the model, and the kv dtype and block size of its bytes (the
    # disk and Redis tiers bind their entries to it).
    bound_fp = _core.root_key(fingerprint, kv_dtype, config.block_size, None)
    ram = None
    if config.cache_ram_mib > 0:
        budget = int(config.cache_ram_mib * 2**20)
        pin = None if config.cache_ram_pin_mib is None else int(config.cache_ram_pin_mib * 2**20)
        ram = _core.RamTier(budget, None, pin)
    disk = None
    if config.cache_dir:
        Path(config.cache_dir).mkdir(parents=True, exist_ok=True)
        disk = _core.DiskStore(config.cache_dir, bound_fp, int(config.cache_disk_max_mib) * 2**20,
                               config.cache_ttl_s if config.cache_ttl_s > 0 else None,
                               int(config.cache_min_tokens))
    remote = None
    if config.cache_redis:
        remote = RemoteTier(config.cache_redis, bound_fp,
                            config.cache_ttl_s if config.cache_ttl_s > 0 else None,
                            timeout_s=config.cache_redis_timeout_s)
    tiers = TierManager(pool, kv, config.block_size, ram, disk, remote,
                        int(config.cache_min_tokens))
    tiers.finished_to_ram = config.cache_idle_slots
    return tiers
