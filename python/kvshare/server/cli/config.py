"""What the parsed `kvshare serve` flags configure: the engine's `EngineConfig` fields and
the HTTP server's `ServerSettings` fields, as keyword arguments (a flag left unset leaves the
field's own default)."""

from __future__ import annotations

import argparse
import os
from typing import Any


# llama-server's sampling flags (their argparse names) -> SamplingParams fields
SAMPLING_FLAGS = {"temp": "temperature", "top_k": "top_k", "top_p": "top_p", "min_p": "min_p",
                  "seed": "seed", "repeat_penalty": "repetition_penalty",
                  "repeat_last_n": "penalty_last_n", "presence_penalty": "presence_penalty",
                  "frequency_penalty": "frequency_penalty"}


def sampling_defaults(args: argparse.Namespace) -> dict[str, float | int]:
    """ServerSettings.sampling_defaults: the sampling flags given, by SamplingParams name.
    ValueError (one line naming the flag) for a value the engine would refuse."""
    from kvshare.apis.sampling_fields import check_server_defaults

    out: dict[str, float | int] = {}
    for dest, param in SAMPLING_FLAGS.items():
        v = getattr(args, dest, None)
        if v is None:
            continue
        try:
            check_server_defaults({param: v})
        except ValueError as e:
            raise ValueError(f"cannot use --{dest.replace('_', '-')} {v}: {e}") from None
        out[param] = v
    return out


# llama.cpp rounds the context of all sequences, and each sequence's share, up to a multiple
# of this (src/llama-context.cpp: GGML_PAD(n_ctx, 256), GGML_PAD(n_ctx / n_seq_max, 256))
CTX_PAD = 256


def _pad(n: int) -> int:
    return -(-n // CTX_PAD) * CTX_PAD


def ctx_per_sequence(args: argparse.Namespace, n_ctx_train: int | None = None) -> int | None:
    """Each sequence's context as llama-server computes its slots' `n_ctx` from `-c`, `-np`,
    `--kv-unified` and `--kv-unified-per-slot` (llama_context's n_ctx_seq, then
    server_context::n_ctx_slot):

    - `-c` unset with `--kv-unified-per-slot N`: the pool is np x N (tools/server/server.cpp);
    - `-c 0`: the model's trained context `n_ctx_train`;
    - the total rounded up to a multiple of 256; with the unified KV each sequence may use all
      of it, else each gets the total / np, rounded up to a multiple of 256;
    - at most `--kv-unified-per-slot` and at most `n_ctx_train`.

    None: kvshare's default (8192), or `-c 0` before the model (and so `n_ctx_train`) is known.
    """
    per_slot = getattr(args, "kv_unified_per_slot", None) or 0
    total = args.ctx_size
    if total is None:
        if not per_slot:
            return None
        total = args.parallel * per_slot
    if total == 0:
        if not n_ctx_train:
            return None
        total = n_ctx_train
    total = _pad(total)
    seq = total if args.kv_unified else _pad(total // args.parallel)
    if per_slot:
        seq = min(seq, per_slot)
    if n_ctx_train:
        seq = min(seq, n_ctx_train)
    return int(seq)


def prefill_chunk(args: argparse.Namespace) -> int | None:
    """Prompt tokens per step: the smallest of --prefill-chunk and llama-server's -b / -ub
    (its physical batch bounds what one forward call computes); None: the engine's."""
    given = [v for v in (args.prefill_chunk, getattr(args, "batch_size", None),
                         getattr(args, "ubatch_size", None)) if v is not None]
    return min(given) if given else None


def engine_config_kwargs(args: argparse.Namespace) -> dict[str, Any]:
    """EngineConfig fields of the engine's flags."""
    kw: dict[str, Any] = {"parallel": args.parallel, "slot_attach": not args.no_slot_attach,
                          "device": args.device}
    for name, value in (("ctx_size", ctx_per_sequence(args)), ("kv_blocks", args.kv_blocks),
                        ("kv_mem_mib", args.kv_mem), ("block_size", args.block_size),
                        ("prefill_chunk", prefill_chunk(args)), ("threads", args.threads),
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
    if getattr(args, "context_shift", False):
        kw["context_shift"] = True
    if not getattr(args, "cache_idle_slots", True):
        kw["cache_idle_slots"] = False
    return kw


def ui_config(args: argparse.Namespace) -> Any:
    """llama-server's `--ui-config JSON` / `--ui-config-file PATH` (the last given wins, as
    both set one field there): the web UI's default settings, parsed as JSON (any value, as
    llama-server's json::parse; empty: none), served as /props' `ui_settings`. ValueError:
    one line naming the flag."""
    import json

    text, flag = getattr(args, "ui_config", None), "--ui-config"
    path = getattr(args, "ui_config_file", None)
    if path is not None and (text is None or getattr(args, "ui_config_file_last", True)):
        flag = f"--ui-config-file {path}"
        try:
            with open(path, encoding="utf-8") as f:
                text = f.read()
        except OSError as e:
            raise ValueError(f"cannot use {flag}: {e.strerror or e}") from None
        except UnicodeDecodeError as e:
            raise ValueError(f"cannot use {flag}: not UTF-8 text ({e.reason})") from None
    if not text:
        return None
    try:
        return json.loads(text)
    except json.JSONDecodeError as e:
        raise ValueError(f"cannot use {flag}: not valid JSON ({e})") from None


def llama_settings_kwargs(args: argparse.Namespace) -> dict[str, Any]:
    """The ServerSettings fields of llama-server's flags (-n, sampling defaults,
    --reasoning-format, CORS, --slots, --slot-save-path, --no-webui)."""
    from kvshare.server.cors import parse_origins

    n = getattr(args, "n_predict", None)
    return {
        "default_max_tokens": n if n is not None and n > 0 else None,
        "n_keep": getattr(args, "keep", 0),
        "sampling_defaults": sampling_defaults(args),
        "reasoning_format": args.reasoning_format,
        "reasoning_budget": args.reasoning_budget,
        "reasoning_budget_message": args.reasoning_budget_message or "",
        "cors_origins": parse_origins(args.cors_origins),
        "cors_methods": args.cors_methods,
        "cors_headers": args.cors_headers,
        "cors_credentials": args.cors_credentials,
        "slots_endpoint": args.slots,
        "webui": not args.no_webui,
        "slot_save_path": (os.path.abspath(args.slot_save_path)
                           if args.slot_save_path is not None else None),
    }
