"""The `kvshare` command: `serve` (load a model, start the engine, serve the HTTP APIs),
`pull`, `models`, and `route` (kvshare.router.cli).

Every flag can also come from an environment variable `KVSHARE_<FLAG>` (dashes as
underscores, e.g. `KVSHARE_PORT=9000`, `KVSHARE_API_KEY=...`, `KVSHARE_NO_SLOT_ATTACH=1`);
a flag on the command line wins over the environment.

llama-server command lines start kvshare unchanged (docs/llama-server.md): its short and long
flag names for what kvshare has (`-m`, `-c`, `-np`, `-t`, `-n`, `-a`, `--jinja`, ...), its
`LLAMA_ARG_*` environment variables as fallbacks (after `KVSHARE_*`), and flags without a
subcommand (`kvshare -m FILE ...`) mean `kvshare serve`. A flag kvshare does not implement is
refused with one line naming it (exit 2), never ignored.

Modules: `options` (the flag table), `flag_types` (value parsers), `llama_names`
(llama-server's spellings, refused flags), `llama_meanings` (what its spellings mean: `-c`
over `-np` slots, `-v`), `parser` (argparse, environment fallbacks, checks),
`preflight` (checks before the model load), `chat_template_flags`, `config` (flags to
EngineConfig / ServerSettings fields), `model_load` (the model to an Engine), `commands`
(`serve`, `pull`, `models`), `console` (what the command prints).
"""

from __future__ import annotations

from typing import Sequence

from .chat_template_flags import chat_template_override
from .config import engine_config_kwargs, llama_settings_kwargs
from .parser import build_parser, parse_args, unsupported_flags

__all__ = ["build_parser", "chat_template_override", "engine_config_kwargs",
           "llama_settings_kwargs", "main", "parse_args", "unsupported_flags"]


def main(argv: Sequence[str] | None = None) -> int:
    args = parse_args(argv)
    if args.command == "route":
        from kvshare.router.cli import route

        return route(args)
    from . import commands

    run = {"serve": commands.serve, "pull": commands.pull, "models": commands.models}
    return run[args.command](args) if args.command in run else 2
