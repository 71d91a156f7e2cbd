"""What llama-server's flags mean beyond a name, applied to the parsed `kvshare serve`
arguments (docs/llama-server.md):

- `-c/--ctx-size N` is llama-server's context of all slots together: with a slot count
  (`-np`, `--parallel` or its variables) and without `--kv-unified`, each sequence gets
  N / np tokens (config.ctx_per_sequence, which also rounds as llama.cpp does). Without a
  slot count, or with a negative one (`-np -1`), llama-server picks 4 slots and turns its
  unified KV on (tools/server/server.cpp), so `args.kv_unified` is set: each sequence may use
  all N, as with `--kv-unified`.
  `--kv-unified-per-slot N` is each sequence's context itself.
- `-v/--verbose` is debug logging.
- The sampling flags (`--temp`, `--seed`, ...) are checked against the ranges the engine
  accepts (config.sampling_defaults).
- `-ag/--agent` is `--tools all` and `--ui-mcp-proxy` (`-no-ag` both off), a later `--tools`
  or proxy flag winning (server_tools.config.apply_agent).
- `args.device_given` records whether `--device` was set: without it `-ngl` picks the device
  (preflight.choose_device).
- `--ui-config` and `--ui-config-file` set one value: `args.ui_config_file_last` says whether
  the file was the last given (config.ui_config).
"""

from __future__ import annotations

import argparse
from typing import Sequence

from kvshare.server.server_tools.config import apply_agent

from .config import sampling_defaults
from .flag_types import AUTO_SLOTS

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
    """Sets `args.kv_unified` where llama-server turns it on, `args.device_given` and the log
    level of `-v`; returns what is wrong with the combination, or None."""
    if args.verbose:
        args.log_level = "debug"
    slots_from = _source(written, ("-np", "--parallel"), environ,
                         ("KVSHARE_PARALLEL", "LLAMA_ARG_N_PARALLEL"))
    if args.parallel < 0:  # llama-server's -np -1: auto
        args.parallel = AUTO_SLOTS
        args.kv_unified = True
    elif slots_from is None:  # no slot count: llama-server's default, auto
        args.kv_unified = True
    args.device_given = _source(written, ("--device",), environ, ("KVSHARE_DEVICE",)) is not None
    apply_agent(args, written, environ)  # -ag: --tools all and --ui-mcp-proxy
    # --ui-config and --ui-config-file set one value in llama-server: the last written wins
    ui_from = _source(written, ("--ui-config", "--webui-config", "--ui-config-file",
                                "--webui-config-file"), environ,
                      ("KVSHARE_UI_CONFIG_FILE", "LLAMA_ARG_UI_CONFIG_FILE"))
    args.ui_config_file_last = ui_from is None or "FILE" in ui_from.upper()
    try:
        sampling_defaults(args)
    except ValueError as e:
        return str(e)
    return None
