#!/usr/bin/env python3
"""Print the `kvshare serve` flag tables of docs/configuration.md (markdown), read from the
argparse parser itself (kvshare.server.cli.parser.build_parser), grouped by topic.

    python scripts/gen_flag_docs.py                              # print the tables
    python scripts/gen_flag_docs.py --write docs/configuration.md  # replace them in the doc

`--write` replaces the text between the `<!-- flags:begin -->` and `<!-- flags:end -->` lines.
tests/test_docs_flags.py fails when a serve flag (or its env var) is missing from the doc, or
the doc's tables name a flag the parser does not have.

Defaults: the parser's default where it has one; for flags whose parser default is None
(the engine or server picks it) the value the code uses, from DEFAULTS below (each checked
against the code it names) or from the flag's help text "(default ...)".
"""

from __future__ import annotations

import argparse
import re
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "python"))

BEGIN, END = "<!-- flags:begin -->", "<!-- flags:end -->"

GROUPS: list[tuple[str, tuple[str, ...]]] = [
    ("Model and device", ("--model", "--hf-repo", "--hf-file", "--hf-token", "--model-store",
                          "--offline", "--device", "--n-gpu-layers", "--cuda-graphs",
                          "--threads")),
    ("Network and auth", ("--host", "--port", "--root-path", "--api-key", "--api-key-file",
                          "--cors-origins", "--cors-methods", "--cors-headers",
                          "--cors-credentials")),
    ("Prefix cache: sharing, tiers, checkpoints, scope",
     ("--no-slot-attach", "--cache-ram", "--cache-ram-pin", "--cache-idle-slots", "--cache-dir",
      "--cache-disk-max",
      "--cache-ttl", "--cache-min-tokens", "--cache-redis", "--cache-redis-timeout",
      "--checkpoint-min-step", "--checkpoint-min-gain", "--ctx-checkpoints", "--cache-scope",
      "--public-prefix")),
    ("Engine: batch, context, KV pool",
     ("--parallel", "--ctx-size", "--kv-unified-per-slot", "--kv-unified", "--n-predict", "--kv-mem", "--kv-blocks",
      "--block-size", "--kv-dtype", "--swa-full", "--prefill-chunk", "--batch-size",
      "--ubatch-size")),
    ("Sampling defaults (of requests that leave the field out)",
     ("--temp", "--top-k", "--top-p", "--min-p", "--seed", "--repeat-penalty",
      "--repeat-last-n", "--presence-penalty", "--frequency-penalty")),
    ("Limits", ("--max-n", "--max-parallel-tool-calls", "--max-body-mib", "--body-timeout", "--max-connections",
                "--queue-timeout", "--graceful-timeout")),
    ("API behaviour and logging", ("--alias", "--tags", "--chat-template", "--chat-template-file",
                                   "--reasoning", "--reasoning-budget",
                                   "--reasoning-budget-message",
                                   "--reasoning-format", "--tool-parser", "--slots",
                                   "--slot-save-path", "--no-webui", "--ui-config",
                                   "--ui-config-file", "--sleep-idle-seconds", "--log-level",
                                   "--verbose")),
    ("Router mode (several models)", ("--models-dir", "--models-preset", "--models-max",
                                      "--models-autoload")),
    ("Server tools and MCP (llama-server's; off by default)",
     ("--tools", "--tools-runtime", "--mcp-servers-config", "--mcp-servers-json",
      "--ui-mcp-proxy", "--agent")),
    # accepted for llama-server command lines; kvshare already behaves that way
    ("llama-server compatibility (accepted, no effect)",
     ("--jinja", "--flash-attn", "--backend-sampling", "--metrics", "--cont-batching")),
]


def _defaults() -> dict[str, str]:
    """Defaults the parser leaves as None, as the code computes them."""
    try:
        from kvshare.model.catalog import DEFAULT_MODEL  # noqa: PLC0415
        model = f"`{DEFAULT_MODEL}` (catalog)"
    except ImportError:  # pragma: no cover
        model = "the catalog's default"
    return {
        "--model": model,  # kvshare.model.catalog.DEFAULT_MODEL
        # kvshare.model.store.store_dir
        "--model-store": "`$XDG_CACHE_HOME/kvshare/models`, else `~/.cache/kvshare/models`",
        # Engine._pool_blocks: parallel * ceil(ctx / block) blocks, capped at 1.5 GiB of KV
        "--kv-mem": "`--parallel` x each sequence's context, at most 1.5 GiB",
        "--kv-unified-per-slot": "none (from `--ctx-size`)",
        "--kv-blocks": "(from `--kv-mem`)",
        "--threads": "one per usable core",  # backend.set_cpu_threads(None)
        "--cache-scope": "`key` with API keys, else `global`",  # tenancy.default_scope
        "--alias": "the catalog name, or the file name without `.gguf`",
        "--api-key": "none (no auth)",
        "--api-key-file": "none",
        "--public-prefix": "none",
        "--root-path": "none (served at `/`)",
        "--tool-parser": "from the chat template",
        # Model._default_kv_dtype: float16 on a GPU backend, float32 otherwise
        "--kv-dtype": "`f16`",
        # ServerSettings.default_max_tokens None: the request's max_tokens, else the context
        "--n-predict": "`-1` (until the context is full)",
        "--chat-template": "the model file's (built-in chatml or gemma3 when it has none)",
        "--chat-template-file": "none",
        "--cors-origins": "loopback origins only",  # cors.is_loopback_origin
        "--cors-headers": "the headers the preflight asks for",
        "--slots": "on (`--no-slots`: off)",
        "--cuda-graphs": "on (`--no-cuda-graphs`: off)",
        "--cors-credentials": "on (`--no-cors-credentials`: off)",
        "--slot-save-path": "none (save/restore off)",
        "--jinja": "on (`--no-jinja` changes nothing)",
        "--n-gpu-layers": "none (`--device`)",
        "--batch-size": "none (`--prefill-chunk`)",
        "--ubatch-size": "none (`--prefill-chunk`)",
        # apis/sampling_fields.py: each API's dialect defaults, else SamplingParams' off values
        **{f: "the API's own" for f in ("--temp", "--top-k", "--top-p", "--min-p",
                                         "--repeat-penalty", "--repeat-last-n",
                                         "--presence-penalty", "--frequency-penalty")},
        "--seed": "random (`-1`)",
        "--metrics": "on (always)",
        "--cont-batching": "on (always)",
        "--no-webui": "off (the page is served)",
        "--reasoning-budget-message": "none",
        "--ui-mcp-proxy": "off (403)",
        "--agent": "off",
    }


def _help_default(help_: str) -> str | None:
    m = re.search(r"\(default:? ([^)]*)\)", help_)
    if not m:
        return None
    v = m.group(1).split(";")[0].strip()
    return f"`{v}`" if re.fullmatch(r"[\d.]+", v) else v


def serve_parser() -> argparse.ArgumentParser:
    from kvshare.server.cli.parser import build_parser, serve_parser  # noqa: PLC0415

    return serve_parser(build_parser(environ={}))


def serve_flags() -> list[tuple[str, str, str, str]]:
    """(flag, env var, default, help) of every `kvshare serve` option, parser order."""
    from kvshare.server.cli.options import env_name  # noqa: PLC0415

    notes = _defaults()
    rows = []
    for a in serve_parser()._actions:  # noqa: SLF001 - argparse has no public list of them
        if not a.option_strings or a.dest == "help":
            continue
        flag = a.option_strings[0]
        help_ = re.sub(r"\s*\[env [A-Z_]+\]$", "", a.help or "")
        if flag in notes:
            default = notes[flag]
        elif isinstance(a, argparse._StoreTrueAction):  # noqa: SLF001 - store_true's class
            default = "off"
        elif a.default not in (None, ""):
            default = f"`{a.default}`"
        else:
            default = _help_default(help_) or "none"
        rows.append((flag, env_name(flag), default, help_))
    return rows


def _cell(s: str) -> str:
    return s.replace("|", "\\|").replace("\n", " ")


def tables() -> str:
    rows = {r[0]: r for r in serve_flags()}
    out: list[str] = []
    placed: set[str] = set()
    groups = list(GROUPS)
    other = tuple(f for f in rows if not any(f in g for _, g in GROUPS))
    if other:  # a new flag nobody grouped yet: still listed
        groups.append(("Other", other))
    for title, flags in groups:
        present = [f for f in flags if f in rows]
        if not present:
            continue
        out += [f"### {title}", "", "| flag | env var | default | meaning |",
                "| --- | --- | --- | --- |"]
        for f in present:
            flag, env, default, help_ = rows[f]
            out.append(f"| `{flag}` | `{env}` | {_cell(default)} | {_cell(help_)} |")
            placed.add(f)
        out.append("")
    return "\n".join(out).rstrip() + "\n"


def replace_tables(doc: str, new: str) -> str:
    start, end = doc.find(BEGIN), doc.find(END)
    if start < 0 or end < start:
        raise SystemExit(f"no {BEGIN} ... {END} section in the document")
    return doc[: start + len(BEGIN)] + "\n\n" + new + "\n" + doc[end:]


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--write", metavar="DOC", help="replace the tables in DOC in place")
    args = ap.parse_args(argv)
    new = tables()
    if args.write:
        p = Path(args.write)
        p.write_text(replace_tables(p.read_text(), new))
        print(f"wrote the flag tables into {p}")
    else:
        sys.stdout.write(new)
    return 0


if __name__ == "__main__":
    sys.exit(main())
