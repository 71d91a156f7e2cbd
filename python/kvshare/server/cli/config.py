"""What the parsed `kvshare serve` flags configure: the engine's `EngineConfig` fields and
the HTTP server's `ServerSettings` fields, as keyword arguments (a flag left unset leaves the
field's own default)."""

from __future__ import annotations

import argparse
import os
from typing import Any


def engine_config_kwargs(args: argparse.Namespace) -> dict[str, Any]:
    """EngineConfig fields of the engine's flags."""
    kw: dict[str, Any] = {"parallel": args.parallel, "slot_attach": not args.no_slot_attach,
                          "device": args.device}
    for name, value in (("ctx_size", args.ctx_size or None), ("kv_blocks", args.kv_blocks),
                        ("kv_mem_mib", args.kv_mem), ("block_size", args.block_size),
                        ("prefill_chunk", args.prefill_chunk), ("threads", args.threads),
                        ("kv_dtype", args.kv_dtype),
                        ("queue_timeout_s", args.queue_timeout),
                        ("cache_ram_mib", args.cache_ram), ("cache_ram_pin_mib", args.cache_ram_pin),
                        ("cache_dir", args.cache_dir),
                        ("cache_disk_max_mib", args.cache_disk_max), ("cache_ttl_s", args.cache_ttl),
                        ("cache_min_tokens", args.cache_min_tokens),
                        ("cache_redis", args.cache_redis),
                        ("cache_redis_timeout_s", args.cache_redis_timeout),
                        ("checkpoint_min_step", args.checkpoint_min_step),
                        ("checkpoint_min_gain", args.checkpoint_min_gain),
                        ("max_n", args.max_n),
                        ("ctx_checkpoints", args.ctx_checkpoints)):
        if value is not None:
            kw[name] = value
    if args.swa_full:
        kw["swa_full"] = True
    return kw


def llama_settings_kwargs(args: argparse.Namespace) -> dict[str, Any]:
    """The ServerSettings fields of llama-server's flags (-n, --reasoning-format, CORS,
    --slots, --slot-save-path)."""
    from kvshare.server.cors import parse_origins

    n = getattr(args, "n_predict", None)
    return {
        "default_max_tokens": n if n is not None and n > 0 else None,
        "reasoning_format": args.reasoning_format,
        "cors_origins": parse_origins(args.cors_origins),
        "cors_methods": args.cors_methods,
        "cors_headers": args.cors_headers,
        "cors_credentials": args.cors_credentials,
        "slots_endpoint": args.slots,
        "slot_save_path": (os.path.abspath(args.slot_save_path)
                           if args.slot_save_path is not None else None),
    }
