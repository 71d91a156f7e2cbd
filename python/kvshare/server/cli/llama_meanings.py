"""What llama-server's flags mean beyond a name, applied to the parsed `kvshare serve`
arguments (docs/llama-server.md):

- `-c N` (or `LLAMA_ARG_CTX_SIZE`) given with `-np`/`--parallel` is the context of all slots
  together, as llama-server's: each sequence gets N / np tokens (`ctx_is_total`). kvshare's
  own `--ctx-size` (and `KVSHARE_CTX_SIZE`) stays per sequence, and so does `-c` with
  `--kv-unified` (llama-server's unified KV lets each sequence use all of it) or without a
  slot count (llama-server's automatic slot count turns the unified KV on).
- `-v/--verbose` is debug logging.
- The sampling flags (`--temp`, `--seed`, ...) are checked against the ranges the engine
  accepts (config.sampling_defaults).
- `args.device_given` records whether `--device` was set: without it `-ngl` picks the device
  (preflight.choose_device).
"""

from __future__ import annotations

import argparse
from typing import Sequence

from .config import sampling_defaults

# where a total context (llama-server's spelling) comes from
CTX_TOTAL_SOURCES = ("-c", "LLAMA_ARG_CTX_SIZE")


def _source(args_written: Sequence[str], flags: tuple[str, ...], environ: dict[str, str],
            env_vars: tuple[str, ...]) -> str | None:
    """The spelling a value came from: the last of `flags` on the command line, else the
    first of `env_vars` set (the order the parser reads them in), else None (the default)."""
    for name in reversed(args_written):
        if name in flags:
            return name
    return next((v for v in env_vars if v in environ), None)


def apply_llama_meanings(args: argparse.Namespace, written: Sequence[str],
                         environ: dict[str, str]) -> str | None:
    """Sets `args.ctx_is_total`, `args.device_given` and the log level of `-v`; returns what
    is wrong with the combination, or None."""
    if args.verbose:
        args.log_level = "debug"
    ctx_from = _source(written, ("-c", "--ctx-size"), environ,
                       ("KVSHARE_CTX_SIZE", "LLAMA_ARG_CTX_SIZE"))
    slots_from = _source(written, ("-np", "--parallel"), environ,
                         ("KVSHARE_PARALLEL", "LLAMA_ARG_N_PARALLEL"))
    args.ctx_is_total = bool(ctx_from in CTX_TOTAL_SOURCES and slots_from is not None
                             and not args.kv_unified and args.ctx_size)
    if args.ctx_is_total and args.ctx_size < args.parallel:
        return (f"{ctx_from} {args.ctx_size} is the context of all {args.parallel} slots "
                "together (as llama-server's): under one token each")
    args.device_given = _source(written, ("--device",), environ, ("KVSHARE_DEVICE",)) is not None
    try:
        sampling_defaults(args)
    except ValueError as e:
        return str(e)
    return None
