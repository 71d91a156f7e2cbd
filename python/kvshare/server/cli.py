"""`kvshare serve`: load a model, start the engine, serve the OpenAI-compatible API.

Every flag can also come from an environment variable `KVSHARE_<FLAG>` (dashes as
underscores, e.g. `KVSHARE_PORT=9000`, `KVSHARE_API_KEY=...`, `KVSHARE_NO_SLOT_ATTACH=1`);
a flag on the command line wins over the environment.

llama-server command lines start kvshare unchanged (docs/llama-server.md): its short and long
flag names for what kvshare has (`-m`, `-c`, `-np`, `-t`, `-n`, `-a`, `--jinja`, ...), its
`LLAMA_ARG_*` environment variables as fallbacks (after `KVSHARE_*`), and flags without a
subcommand (`kvshare -m FILE ...`) mean `kvshare serve`. A flag kvshare does not implement is
refused with one line naming it (exit 2), never ignored.
"""

from __future__ import annotations

import argparse
import contextlib
import gc
import logging
import os
import sys
from typing import Any, Callable, Sequence

from kvshare.argtypes import (non_negative_float, non_negative_int, port, positive_float,
                              positive_int)

ENV_PREFIX = "KVSHARE_"
_TRUE = {"1", "true", "yes", "on", "enabled"}
_FALSE = {"0", "false", "no", "off", "disabled", ""}


def _env_name(flag: str) -> str:
    return ENV_PREFIX + flag.lstrip("-").replace("-", "_").upper()


def _cache_scope(s: str) -> str:
    v = s.strip().lower()
    if v not in ("global", "key", "salt"):
        raise ValueError(s)
    return v


_cache_scope.__name__ = "cache scope (global, key or salt)"


def _redis_url(s: str) -> str:
    from urllib.parse import urlsplit

    u = urlsplit(s)
    if u.scheme not in ("redis", "rediss", "unix", "valkey", "valkeys") or not (u.netloc or u.path):
        raise ValueError(s)
    # redis-py speaks the same protocol to Valkey; it knows only the redis schemes
    return s.replace("valkey", "redis", 1) if u.scheme.startswith("valkey") else s


_redis_url.__name__ = "Redis URL (redis://host:port/db, rediss://..., unix:///path)"


KV_DTYPES = ("f32", "f16", "q8_0")


def _kv_dtype(s: str) -> str:
    v = s.strip().lower()
    if v not in KV_DTYPES:
        raise ValueError(s)
    return v


_kv_dtype.__name__ = "KV dtype (f32, f16 or q8_0)"


def _ctx_size(s: str) -> int:
    v = int(s)
    if v < 0:
        raise ValueError(s)
    return v


_ctx_size.__name__ = "context size (0: the model's trained context)"


def _threads(s: str) -> int | None:
    v = int(s)
    return v if v > 0 else None  # llama-server: <= 0 means one per core


_threads.__name__ = "thread count"


def _n_predict(s: str) -> int:
    v = int(s)
    if v == 0 or v < -2:
        raise ValueError(s)
    return -1 if v < 0 else v


_n_predict.__name__ = "token count (-1: until the context is full)"

REASONING_FORMATS = ("none", "auto", "deepseek", "deepseek-legacy")


def _reasoning_format(s: str) -> str:
    v = s.strip().lower()
    if v not in REASONING_FORMATS:
        raise ValueError(s)
    return v


_reasoning_format.__name__ = "reasoning format (none, auto, deepseek or deepseek-legacy)"

# `type` of an OPTIONS entry that is a `--flag` / `--no-flag` pair (a boolean, default on).
TOGGLE = "toggle"

# flag, type (None: boolean switch), default, help
OPTIONS: list[tuple[str, Callable[[str], Any] | None, Any, str]] = [
    ("--model", str, None,
     "a catalog model name (fetched on first use; `kvshare models` lists them) or a GGUF "
     "file (default: smollm2-135m-instruct)"),
    ("--model-store", str, None,
     "directory of fetched models (older name: --model-cache) (default: $XDG_CACHE_HOME/kvshare/models or "
     "~/.cache/kvshare/models)"),
    ("--host", str, "127.0.0.1", "address to listen on"),
    ("--port", port, 8080, "port to listen on (0: any free port)"),
    ("--parallel", positive_int, 4, "sequences decoded together"),
    ("--ctx-size", _ctx_size, None,
     "context size per sequence in tokens, each from the shared KV pool (llama-server splits "
     "-c across its -np slots; 0: the model's trained context) (default: 8192)"),
    ("--n-predict", _n_predict, None,
     "max_tokens of a request that gives none (-1: until the context is full; a request's "
     "own limit wins)"),
    ("--kv-mem", positive_int, None, "KV pool size in MiB"),
    ("--kv-blocks", positive_int, None, "KV pool size in blocks (instead of --kv-mem)"),
    ("--block-size", positive_int, None, "tokens per KV block (default: 16)"),
    ("--kv-dtype", _kv_dtype, None,
     "element type of the KV cache: f16 (the default, as llama.cpp), f32 (twice the memory) "
     "or q8_0 (ggml's Q8_0 blocks as llama.cpp's -ctk/-ctv q8_0: 34 bytes per 32 values, "
     "0.53x f16; CPU only, head_dim a multiple of 32)"),
    ("--prefill-chunk", positive_int, None, "prompt tokens computed per step (default: 512)"),
    ("--queue-timeout", non_negative_float, None,
     "seconds a request may wait to be admitted before it gets 503 with Retry-After "
     "(default 600; 0: no limit)"),
    ("--no-slot-attach", None, False, "turn cross-session prefix sharing off"),
    ("--swa-full", None, False,
     "sliding-window layers keep K/V of every position, as full-attention layers do (default: "
     "only each sequence's window, in a pool of their own; docs/architecture.md)"),
    ("--alias", str, None,
     "name(s) /v1/models lists for the loaded model (repeatable or comma-separated); any "
     "requested model name is served by the loaded model and echoed back"),
    ("--chat-template", str, None,
     "chat template: a built-in name (chatml, gemma) or an inline Jinja template (default: "
     "the model file's)"),
    ("--chat-template-file", str, None, "chat template: a Jinja template file"),
    ("--jinja", None, False,
     "accepted: kvshare always renders chat templates with Jinja (--no-jinja is refused)"),
    ("--reasoning-format", _reasoning_format, "auto",
     "reasoning_format of a request that gives none: none (thoughts stay in content), auto or "
     "deepseek (thoughts in reasoning_content), deepseek-legacy"),
    ("--tool-parser", str, None,
     "tool-call format: hermes, qwen35, lfm2 or llama3 (default: detected from the chat "
     "template)"),
    ("--max-n", positive_int, None, "most choices (n) one request may ask for (default 8)"),
    ("--cache-ram", non_negative_int, None, "RAM tier budget in MiB (default 8192; 0: off)"),
    ("--cache-ram-pin", non_negative_int, None,
     "of the RAM tier, MiB that prefix entries (up to the first user message) may pin "
     "(default: half of --cache-ram)"),
    ("--cache-dir", str, None, "directory of the crash-safe disk tier (default: off)"),
    ("--cache-disk-max", positive_int, None, "disk tier budget in MiB (default 10240)"),
    ("--cache-ttl", non_negative_float, None,
     "seconds a disk entry lives unused, and a stored Responses API response lives "
     "(default 259200 = 3 days; 0: no limit)"),
    ("--cache-min-tokens", non_negative_int, None,
     "shortest prompt written to disk or Redis (default 256)"),
    ("--cache-redis", _redis_url, None,
     "shared tier on Redis or Valkey, e.g. redis://127.0.0.1:6379/0: replicas pointing at one "
     "server share computed prefixes (default: off; docs/replicas.md)"),
    ("--cache-redis-timeout", positive_float, None,
     "seconds one Redis command may take before it counts as a miss (default 0.5)"),
    ("--checkpoint-min-step", positive_int, None,
     "hybrid models: a state checkpoint every N prompt tokens (default 1024)"),
    ("--checkpoint-min-gain", positive_int, None,
     "hybrid models: a checkpoint where a prompt splits from a cached one (before the first "
     "user message) when it saves at least N tokens of recomputation (default 64)"),
    ("--ctx-checkpoints", non_negative_int, None,
     "hybrid models: at most N checkpoints per sequence (default 8)"),
    ("--api-key", str, None,
     "require 'Authorization: Bearer <key>' (all but /health); several keys: comma-separated "
     "or the flag repeated, each key its own tenant"),
    ("--api-key-file", str, None,
     "file of API keys, one 'KEY [TENANT-NAME]' per line (# comments); keys sharing a name "
     "are one tenant"),
    ("--cache-scope", _cache_scope, None,
     "who may share cached prefixes: global (everyone without a cache_salt), key (per tenant; "
     "the default with API keys) or salt (only requests with the same cache_salt); "
     "see docs/security.md"),
    ("--public-prefix", str, None,
     "a prefix every tenant may share (repeatable; env: paths joined by ':'): a .json file "
     "{\"messages\": [...], \"tools\": [...]} rendered by the chat template, or a text file "
     "of prompt text"),
    ("--device", str, "cpu", "cpu or cuda"),
    ("--threads", _threads, None, "CPU threads for the model runtime (<= 0: one per core)"),
    ("--root-path", str, "", "mount prefix behind a reverse proxy, e.g. /kvshare"),
    ("--cors-origins", str, None,
     "origins browsers may call the API from, besides the loopback ones (comma-separated or "
     "repeated; *: any origin) (default: loopback origins only)"),
    ("--cors-methods", str, "GET, POST, DELETE, OPTIONS", "methods a CORS preflight allows"),
    ("--cors-headers", str, None,
     "request headers a CORS preflight allows (default: those the browser asks for)"),
    ("--cors-credentials", TOGGLE, True,
     "CORS responses to allowed origins say Access-Control-Allow-Credentials: true "
     "(--no-cors-credentials: they do not)"),
    ("--slots", TOGGLE, True, "serve GET /slots (--no-slots: 501, as llama-server)"),
    ("--slot-save-path", str, None,
     "directory of the files POST /slots/{id}?action=save|restore writes and reads (default: "
     "off)"),
    ("--metrics", None, False, "accepted: kvshare always serves /metrics"),
    ("--cont-batching", None, False, "accepted: kvshare always batches continuously"),
    ("--no-webui", None, False, "accepted: kvshare has no web UI"),
    ("--max-body-mib", positive_int, 16, "largest request body in MiB (larger: 413)"),
    ("--body-timeout", positive_float, 30.0,
     "seconds a client gets to send a request's headers, and the longest gap while it sends "
     "a body (the whole body: 10x this); then 408 and the connection closed. Also the "
     "keep-alive idle time"),
    ("--max-connections", positive_int, 1024,
     "requests in progress at once (/health, /metrics not counted); more get 503 with "
     "Retry-After"),
    ("--graceful-timeout", non_negative_float, 10.0, "seconds in-flight requests get at shutdown"),
    ("--log-level", str, "info", "debug, info, warning or error"),
]


# Flags that may be given several times: the values are joined with this separator (a value
# from the environment is replaced, not extended, by the flags on the command line).
REPEATABLE = {"--api-key": ",", "--public-prefix": os.pathsep, "--alias": ",",
              "--cors-origins": ","}

# llama-server's names for kvshare's flags (tools/server/README.md, common/arg.cpp): flag ->
# (other flag names, llama-server's environment variable, read after KVSHARE_<FLAG>).
LLAMA_NAMES: dict[str, tuple[tuple[str, ...], str | None]] = {
    "--model": (("-m",), "LLAMA_ARG_MODEL"),
    "--host": ((), "LLAMA_ARG_HOST"),
    "--port": ((), "LLAMA_ARG_PORT"),
    "--parallel": (("-np",), "LLAMA_ARG_N_PARALLEL"),
    "--ctx-size": (("-c",), "LLAMA_ARG_CTX_SIZE"),
    "--n-predict": (("-n", "--predict"), "LLAMA_ARG_N_PREDICT"),
    "--threads": (("-t",), "LLAMA_ARG_THREADS"),
    "--alias": (("-a",), "LLAMA_ARG_ALIAS"),
    "--api-key": ((), "LLAMA_API_KEY"),
    "--api-key-file": ((), "LLAMA_ARG_API_KEY_FILE"),
    "--cache-ram": (("-cram",), "LLAMA_ARG_CACHE_RAM"),
    "--swa-full": ((), "LLAMA_ARG_SWA_FULL"),
    "--ctx-checkpoints": (("-ctxcp", "--swa-checkpoints"), "LLAMA_ARG_CTX_CHECKPOINTS"),
    "--checkpoint-min-step": (("-cms",), "LLAMA_ARG_CHECKPOINT_MIN_SPACING_NT"),
    "--body-timeout": (("-to", "--timeout"), "LLAMA_ARG_TIMEOUT"),
    "--chat-template": ((), "LLAMA_ARG_CHAT_TEMPLATE"),
    "--chat-template-file": ((), "LLAMA_ARG_CHAT_TEMPLATE_FILE"),
    "--jinja": ((), "LLAMA_ARG_JINJA"),
    "--reasoning-format": ((), "LLAMA_ARG_THINK"),
    "--cors-origins": ((), "LLAMA_ARG_CORS_ORIGINS"),
    "--cors-methods": ((), "LLAMA_ARG_CORS_METHODS"),
    "--cors-headers": ((), "LLAMA_ARG_CORS_HEADERS"),
    "--cors-credentials": ((), "LLAMA_ARG_CORS_CREDENTIALS"),
    "--slots": ((), "LLAMA_ARG_ENDPOINT_SLOTS"),
    "--metrics": ((), "LLAMA_ARG_ENDPOINT_METRICS"),
    "--cont-batching": (("-cb",), "LLAMA_ARG_CONT_BATCHING"),
    "--no-webui": (("--no-ui",), None),
    "--slot-save-path": ((), None),
}

# llama-server flags kvshare refuses, with the reason (or what to use instead) in the one-line
# error. Any other unknown flag is refused too, just without a reason.
REFUSED = {
    "--no-jinja": "kvshare renders chat templates with Jinja only",
    "--no-cont-batching": "kvshare always batches continuously",
    "-nocb": "kvshare always batches continuously",
    "-ngl": "kvshare runs every layer on --device (cpu or cuda)",
    "--n-gpu-layers": "kvshare runs every layer on --device (cpu or cuda)",
    "--gpu-layers": "kvshare runs every layer on --device (cpu or cuda)",
    "-dev": "use --device cpu or cuda",
    "-ctk": "use --kv-dtype", "--cache-type-k": "use --kv-dtype",
    "-ctv": "use --kv-dtype", "--cache-type-v": "use --kv-dtype",
    "-b": "use --prefill-chunk", "--batch-size": "use --prefill-chunk",
    "-ub": "use --prefill-chunk", "--ubatch-size": "use --prefill-chunk",
    "-v": "use --log-level debug", "--verbose": "use --log-level debug",
    "-hf": "use --model with a catalog name or a GGUF file",
    "--hf-repo": "use --model with a catalog name or a GGUF file",
}


class _FromEnv(str):
    """A repeatable flag's value taken from the environment (the first flag replaces it)."""


class _Repeat(argparse.Action):
    def __call__(self, parser, namespace, values, option_string=None):
        cur = getattr(namespace, self.dest)
        sep = REPEATABLE[self.option_strings[0]]
        setattr(namespace, self.dest, values if cur is None or isinstance(cur, _FromEnv)
                else f"{cur}{sep}{values}")


class _EnvError(Exception):
    pass


class _Toggle(argparse.Action):
    """`--flag` sets True, `--no-flag` False."""

    def __init__(self, option_strings, dest, default=None, help=None):
        super().__init__(option_strings, dest, nargs=0, default=default, help=help)

    def __call__(self, parser, namespace, values, option_string=None):
        setattr(namespace, self.dest, not option_string.startswith("--no-"))


class _Parser(argparse.ArgumentParser):
    """Errors are one line on stderr (`kvshare: error: ...`), exit status 2. Remembers what
    argparse keeps only in private fields: each option string and whether it takes a value
    (`takes_value`), and the subcommands (`subcommands`, the `add_subparsers` action)."""

    def __init__(self, *args, **kwargs):
        self.takes_value: dict[str, bool] = {}  # before argparse adds -h/--help
        self.subcommands: argparse.Action | None = None
        super().__init__(*args, **kwargs)

    def add_argument(self, *args, **kwargs) -> argparse.Action:
        action = super().add_argument(*args, **kwargs)
        self.takes_value.update({s: action.nargs != 0 for s in action.option_strings})
        return action

    def add_subparsers(self, **kwargs):
        self.subcommands = super().add_subparsers(**kwargs)
        return self.subcommands

    def error(self, message):
        self.exit(2, f"kvshare: error: {message}\n")


def _env_default(flag: str, typ: Callable[[str], Any] | str | None, default: Any,
                 environ: dict[str, str]) -> Any:
    name = _env_name(flag)
    raw = environ.get(name)
    if raw is None:  # llama-server's variable, if it has one
        llama = LLAMA_NAMES.get(flag, ((), None))[1]
        if llama is not None and llama in environ:
            name, raw = llama, environ[llama]
    if raw is None:
        return default
    if typ is None or typ == TOGGLE:
        low = raw.strip().lower()
        if low in _TRUE:
            return True
        if low in _FALSE:
            return False
        raise _EnvError(f"{name}={raw!r} is not a boolean (use 1/0, true/false)")
    try:
        return typ(raw)
    except ValueError:
        raise _EnvError(f"{name}={raw!r} is not a valid {getattr(typ, '__name__', 'value')}"
                        ) from None


# Older spellings still accepted (not shown in --help).
OLD_NAMES: dict[str, tuple[str, ...]] = {"--model-store": ("--model-cache",)}

# `kvshare pull` and `kvshare models` take these of OPTIONS.
CATALOG_OPTIONS = ("--model-store",)


def _add_options(parser: argparse.ArgumentParser, sub: argparse.ArgumentParser,
                 options: list[tuple[str, Callable[[str], Any] | str | None, Any, str]],
                 environ: dict[str, str]) -> None:
    for flag, typ, default, help_ in options:
        try:
            d = _env_default(flag, typ, default, environ)
        except _EnvError as e:
            parser.error(str(e))
        aliases, llama_env = LLAMA_NAMES.get(flag, ((), None))
        also = [*aliases] + ([f"env {llama_env}"] if llama_env else [])
        h = help_ + (f" (llama-server: {', '.join(also)})" if also else "")
        h = f"{h} [env {_env_name(flag)}]"
        names = [flag, *aliases, *OLD_NAMES.get(flag, ())]
        if typ == TOGGLE:
            sub.add_argument(*names, "--no-" + flag[2:], action=_Toggle, default=d, help=h,
                             dest=flag[2:].replace("-", "_"))
        elif typ is None:
            sub.add_argument(*names, action="store_true", default=d, help=h)
        elif flag in REPEATABLE:
            sub.add_argument(*names, type=typ, action=_Repeat, help=h,
                             default=_FromEnv(d) if d is not None else None)
        else:
            sub.add_argument(*names, type=typ, default=d, help=h)


def build_parser(environ: dict[str, str] | None = None) -> _Parser:
    environ = dict(os.environ if environ is None else environ)
    parser = _Parser(
        prog="kvshare", description="OpenAI-compatible LLM server that shares prompt prefixes",
        epilog="Flags without a command mean `kvshare serve` (a llama-server command line "
               "works as is).")
    sub = parser.add_subparsers(dest="command", required=True)
    epilog = "Every flag can also be set with KVSHARE_<FLAG>, e.g. KVSHARE_PORT=9000."
    serve = sub.add_parser(
        "serve", help="serve a model over HTTP", allow_abbrev=False,
        epilog=epilog + " llama-server's flag names and LLAMA_ARG_* variables work too "
                        "(docs/llama-server.md).")
    _add_options(parser, serve, OPTIONS, environ)
    catalog_opts = [o for o in OPTIONS if o[0] in CATALOG_OPTIONS]
    pull = sub.add_parser(
        "pull", help="fetch a catalog model into the model cache and print its path",
        epilog=epilog)
    pull.add_argument("name", help="catalog model name (`kvshare models` lists them)")
    _add_options(parser, pull, catalog_opts, environ)
    models = sub.add_parser(
        "models", help="list the catalog models: name, size, cached or not, what it is for",
        epilog=epilog)
    _add_options(parser, models, catalog_opts, environ)
    from kvshare.router.cli import add_route_parser

    add_route_parser(sub, environ)
    return parser


def _is_number(s: str) -> bool:
    try:
        float(s)
    except ValueError:
        return False
    return True


def unsupported_flags(sub: _Parser, argv: Sequence[str]) -> list[str]:
    """The flags in `argv` that `sub` does not have, exactly as written (no abbreviations, no
    value glued to a short flag: llama-server has neither, and `-ngl` must not read as
    `-n gl`). The tokens after a known flag that takes a value are its value."""
    takes_value = sub.takes_value
    out: list[str] = []
    it = iter(argv)
    for tok in it:
        if tok == "--":
            break
        if not tok.startswith("-") or tok == "-" or _is_number(tok):
            continue
        name, eq, _ = tok.partition("=") if tok.startswith("--") else (tok, "", "")
        if name in takes_value:
            if takes_value[name] and not eq:
                next(it, None)
        elif name not in out:
            out.append(name)
    return out


def _unsupported_message(flags: list[str]) -> str:
    named = ", ".join(f"{f} ({REFUSED[f]})" if f in REFUSED else f for f in flags)
    return (f"unsupported flag(s): {named}; `kvshare serve --help` lists kvshare's flags, "
            "docs/llama-server.md maps llama-server's")


def _serve_parser(parser: _Parser) -> _Parser:
    return parser.subcommands.choices["serve"]


def parse_args(argv: Sequence[str] | None = None,
               environ: dict[str, str] | None = None) -> argparse.Namespace:
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv and argv[0].startswith("-") and argv[0] not in ("-h", "--help"):
        argv = ["serve", *argv]  # a llama-server command line: flags, no command
    parser = build_parser(environ)
    if argv and argv[0] == "serve":
        unknown = unsupported_flags(_serve_parser(parser), argv[1:])
        if unknown:
            parser.error(_unsupported_message(unknown))
    args = parser.parse_args(argv)
    if args.command != "serve":
        return args
    if not args.jinja and "LLAMA_ARG_JINJA" in (os.environ if environ is None else environ):
        low = (os.environ if environ is None else environ)["LLAMA_ARG_JINJA"].strip().lower()
        if low in _FALSE:
            parser.error(f"LLAMA_ARG_JINJA={low!r}: kvshare renders chat templates with Jinja "
                         "only")
    if args.chat_template is not None and args.chat_template_file is not None:
        parser.error("use either --chat-template or --chat-template-file, not both")
    if args.kv_mem is not None and args.kv_blocks is not None:
        parser.error("use either --kv-mem or --kv-blocks, not both")
    if args.device not in ("cpu", "cuda"):
        parser.error(f"--device must be cpu or cuda, not {args.device!r}")
    if args.log_level.upper() not in ("DEBUG", "INFO", "WARNING", "ERROR", "CRITICAL"):
        parser.error(f"unknown --log-level {args.log_level!r}")
    if args.tool_parser is not None:
        from kvshare.toolcalls import FORMATS

        if args.tool_parser not in FORMATS:
            parser.error(f"unknown --tool-parser {args.tool_parser!r} (one of "
                         f"{', '.join(FORMATS)})")
    if args.root_path and not args.root_path.startswith("/"):
        parser.error("--root-path must start with '/'")
    return args


def engine_config_kwargs(args: argparse.Namespace) -> dict[str, Any]:
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
    from .cors import parse_origins

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


def _model_errors() -> tuple[type[BaseException], ...]:
    # ValueError, KeyError: metadata a model needs that the file lacks or has wrong
    errors: list[type[BaseException]] = [OSError, ValueError, KeyError]
    try:
        from kvshare.model.gguf_file import GGUFError

        errors.append(GGUFError)
    except ImportError:
        pass
    try:
        from kvshare.model.loader import UnsupportedModelError

        errors.append(UnsupportedModelError)
    except ImportError:
        pass
    return tuple(errors)


def _fail(msg: str, code: int) -> int:
    print(f"kvshare: error: {msg}", file=sys.stderr, flush=True)
    return code


def _cache_dir_problem(path: str) -> str | None:
    """Why `--cache-dir path` cannot be used (created if missing, must be a writable
    directory), or None. The disk store's own lock is checked when it opens."""
    import tempfile

    try:
        os.makedirs(path, exist_ok=True)
    except FileExistsError:
        return "it exists and is not a directory"
    except OSError as e:
        return f"cannot create it: {e.strerror or e}"
    if not os.path.isdir(path):
        return "it is not a directory"
    try:
        with tempfile.NamedTemporaryFile(dir=path, prefix=".kvshare-probe-"):
            pass
    except OSError as e:
        return f"it is not writable: {e.strerror or e}"
    return None


def _say(msg: str) -> None:
    """A startup line (stdout, like the "serving" line: stderr holds only errors, so a
    startup error stays the one line there)."""
    print(f"kvshare: {msg}", flush=True)


def _mib(n: float) -> str:
    return f"{n / 2**20:,.0f} MiB" if n >= 2**20 else f"{n / 2**10:,.0f} KiB"


def _count(n: int) -> str:
    for unit, div in (("B", 1e9), ("M", 1e6), ("K", 1e3)):
        if n >= div:
            return f"{n / div:.{0 if n >= 100 * div else 1}f}{unit}"
    return str(n)


def _describe_file(path: str, label: str) -> None:
    """Check that kvshare can run the file (architecture, block formats; a truncated file
    fails here too) and print what is being loaded, before the slow part."""
    import math

    from kvshare.model.gguf_file import GGUFFile
    from kvshare.model.loader import block_formats, check_supported

    gf = GGUFFile(path)
    try:
        check_supported(gf)
        formats = ", ".join(f"{k} x{v}" for k, v in block_formats(gf).items())
        params = sum(math.prod(t.shape) for t in gf.tensors.values())
        arch = gf.architecture
    finally:
        with contextlib.suppress(BufferError):
            gf.close()
    _say(f"loading {label}: {path} ({arch}, {_count(params)} parameters, "
         f"{_mib(os.path.getsize(path))}, block formats {formats})")


# `--chat-template NAME`: kvshare's built-in templates (kvshare.model.chat_template), under
# llama.cpp's names for them.
BUILTIN_TEMPLATES = {"chatml": "CHATML_TEMPLATE", "gemma": "GEMMA3_TEMPLATE",
                     "gemma3": "GEMMA3_TEMPLATE"}


class _TemplateError(Exception):
    pass


def chat_template_override(args: argparse.Namespace) -> tuple[str, str] | None:
    """(Jinja source, name) of `--chat-template` / `--chat-template-file`, checked to compile;
    None: the model file's template. `_TemplateError` (one line) when unusable."""
    from kvshare.model import chat_template as ct

    file = getattr(args, "chat_template_file", None)
    value = getattr(args, "chat_template", None)
    if file is not None:
        try:
            with open(file, encoding="utf-8") as f:
                source = f.read()
        except (OSError, UnicodeDecodeError) as e:
            raise _TemplateError(f"cannot read --chat-template-file {file}: "
                                 f"{getattr(e, 'strerror', None) or e}") from e
        flag, name = f"--chat-template-file {file}", f"from {os.path.basename(file)}"
    elif value is not None:
        key = value.strip().lower()
        flag = "--chat-template"
        if key in BUILTIN_TEMPLATES:
            source, name = getattr(ct, BUILTIN_TEMPLATES[key]), "gemma3" if "gemma" in key else key
        elif "{{" in value or "{%" in value:
            source, name = value, "inline"
        else:
            raise _TemplateError(
                f"--chat-template {value!r} is neither a template kvshare has built in "
                f"({', '.join(BUILTIN_TEMPLATES)}) nor a Jinja template")
    else:
        return None
    try:
        ct.ChatTemplate(source)
    except ct.ChatTemplateError as e:
        msg = str(e).splitlines()[0] if str(e) else "empty chat template"
        raise _TemplateError(f"cannot use {flag}: {msg}") from e
    return source, name


def _trained_context(model) -> int | None:
    n = getattr(getattr(model, "config", None), "context_length", None)
    return int(n) if isinstance(n, int) and n > 0 else None


def _load_engine(args: argparse.Namespace, path: str, label: str,
                 template_override: tuple[str, str] | None = None):
    import dataclasses
    from pathlib import Path

    from tqdm import tqdm

    from kvshare.engine.engine import Engine, EngineConfig
    from kvshare.model.chat_template import ChatTemplate
    from kvshare.model.loader import load_model, weight_bytes
    from kvshare.model.tokenizer import Tokenizer

    config = EngineConfig(**engine_config_kwargs(args))
    _describe_file(path, label)
    tty = sys.stderr.isatty()
    model = load_model(path, device=args.device, progress=True if tty else None)
    if getattr(args, "ctx_size", None) == 0:  # llama-server's -c 0: the trained context
        n_ctx = _trained_context(model)
        if n_ctx is not None:
            config = dataclasses.replace(config, ctx_size=n_ctx)
    with tqdm(total=2, desc="loading tokenizer", unit="step", leave=False, file=sys.stderr,
              disable=not tty) as bar:
        tokenizer = Tokenizer.from_gguf(path)
        bar.update()
        if template_override is None:
            template = ChatTemplate.from_gguf(path, tokenizer)
        else:  # --chat-template / --chat-template-file, with the model's BOS/EOS handling
            source, tname = template_override
            template = ChatTemplate(source, bos_token=tokenizer.bos_token,
                                    eos_token=tokenizer.eos_token, add_bos=tokenizer.add_bos,
                                    add_eos=tokenizer.add_eos,
                                    name=tname if tname in BUILTIN_TEMPLATES else "custom")
        bar.update()
    md = getattr(model, "metadata", {}) or {}
    tname = getattr(template, "name", "?")
    if template_override is not None:
        what = f"{template_override[1]} (from --chat-template" + (
            "-file)" if getattr(args, "chat_template_file", None) else ")")
    elif tname == "gguf":
        what = "from the file"
    else:
        what = f"{tname} (built in: the file has none)"
    _say(f"tokenizer {md.get('tokenizer.ggml.model', '?')} "
         f"({len(md.get('tokenizer.ggml.tokens') or ())} tokens), chat template {what}")
    try:
        engine = Engine(model, tokenizer, template, bytes.fromhex(model.fingerprint), config,
                        model_name=label if label else Path(path).stem)
    except (ValueError, TypeError) as e:  # e.g. a --kv-dtype the KV pool does not support
        raise _KvDtypeError(str(e).splitlines()[0] if str(e) else type(e).__name__) from e
    w = weight_bytes(model)
    kv = _kv_pool_bytes(engine)
    ram = int(config.cache_ram_mib * 2**20)
    kv_name = engine.kv_dtype
    _say(f"memory: weights {_mib(w)} + KV pool {_mib(kv)} ({kv_name}, "
         f"{engine.n_blocks} blocks of {config.block_size} tokens) + RAM tier "
         + (f"up to {_mib(ram)}" if ram else "off")
         + f" = {_mib(w + kv + ram)} at most")
    huge = model.huge_page_fraction
    if huge:
        _say(f"weights mapped in 2 MiB pages: {huge:.0%} of the file")
    remote = engine.tiers.remote
    if remote is not None:
        ok = remote.ping()
        _say(f"shared tier: Redis at {remote.display_url} "
             + ("(reachable)" if ok else "(not reachable now: local tiers only until it "
                                         "answers; requests are not affected)"))
    return engine


class _KvDtypeError(Exception):
    pass


def _kv_dtype_problem(kv_dtype: str | None, device: str = "cpu") -> str | None:
    """Why the KV pool cannot hold `kv_dtype` on `device` (asked of
    kvshare.model.kv_arrays.kv_dtype_of, which every pool allocation goes through), or None.
    q8_0 is CPU-only (the CUDA attention kernels read f16 or f32)."""
    if kv_dtype is None:
        return None
    from kvshare.model.kv_arrays import kv_dtype_name, kv_dtype_of

    try:
        kv_dtype_of(kv_dtype)
    except (ValueError, TypeError) as e:
        return f"the KV pool does not support it yet ({str(e).splitlines()[0] if str(e) else e})"
    if device != "cpu" and kv_dtype_name(kv_dtype) == "q8_0":
        return (f"q8_0 KV is CPU-only (--device {device}: the GPU attention kernels read f16 "
                "or f32; use --kv-dtype f16)")
    return None


def _kv_pool_bytes(engine) -> int:
    n = int(engine.kv.kv.nbytes) + sum(int(st.nbytes) for st in engine.kv.states)
    if n:
        return n
    try:
        return (engine.model.kv_bytes_per_token(engine.config.kv_dtype)
                * engine.config.block_size * engine.n_blocks)
    except (ValueError, TypeError, AttributeError):
        return 0


class _StartupError(Exception):
    """A startup step failed: `message` is the one line for stderr, `code` the exit status."""

    def __init__(self, message: str, code: int = 2):
        super().__init__(message)
        self.message, self.code = message, code


def _flag_problem(args: argparse.Namespace) -> str | None:
    """What is wrong with the model name, --kv-dtype, --cache-dir or --slot-save-path, found
    before anything slow (a typo is one line), or None."""
    from kvshare.model import catalog

    if not catalog.is_known(args.model):
        return catalog.not_found_message(args.model)
    problem = _kv_dtype_problem(args.kv_dtype, args.device)
    if problem:
        return f"cannot use --kv-dtype {args.kv_dtype}: {problem}"
    if args.cache_dir:
        problem = _cache_dir_problem(args.cache_dir)
        if problem:
            return f"cannot use --cache-dir {args.cache_dir}: {problem}"
    if args.slot_save_path is not None and not os.path.isdir(args.slot_save_path):
        return f"cannot use --slot-save-path {args.slot_save_path}: it is not a directory"
    return None


def _first_line(e: BaseException) -> str:
    return str(e).splitlines()[0] if str(e) else type(e).__name__


def _open_model(args: argparse.Namespace, template_override: tuple[str, str] | None):
    """The engine of the model `--model` names (a catalog name is fetched into the model
    cache on first use); every failure is a `_StartupError` naming the flag to blame."""
    from kvshare._core import CacheIoError, KvshareError
    from kvshare.backend import BackendError
    from kvshare.model import catalog

    shown = args.model or catalog.DEFAULT_MODEL
    try:
        path, name = catalog.resolve(args.model, args.model_store)
    except catalog.CatalogError as e:
        raise _StartupError(f"cannot load model {shown}: {e}") from e
    except KeyboardInterrupt:
        raise _StartupError("interrupted while fetching the model", 130) from None
    try:
        return _load_engine(args, path, name or os.path.splitext(os.path.basename(path))[0],
                            template_override)
    except CacheIoError as e:  # e.g. the cache dir is locked by another running kvshare
        where = f"cannot use --cache-dir {args.cache_dir}" if args.cache_dir else "cache error"
        raise _StartupError(f"{where}: {_first_line(e)}") from e
    except BackendError as e:  # e.g. --device cuda without a usable device
        raise _StartupError(f"cannot use --device {args.device}: {_first_line(e)}") from e
    except _KvDtypeError as e:
        logging.getLogger("kvshare.server").debug("engine construction failed", exc_info=True)
        if args.kv_dtype not in (None, "f32"):
            raise _StartupError(f"cannot use --kv-dtype {args.kv_dtype}: {e}") from e
        raise _StartupError(f"cannot start the engine: {e}") from e
    except (KvshareError, *_model_errors()) as e:
        raise _StartupError(f"cannot load model {shown}: {_first_line(e)}") from e


def serve(args: argparse.Namespace) -> int:
    logging.basicConfig(level=args.log_level.upper(), stream=sys.stderr,
                        format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    problem = _flag_problem(args)
    if problem:
        return _fail(problem, 2)
    try:
        template_override = chat_template_override(args)
    except _TemplateError as e:
        return _fail(str(e), 2)

    from .tenancy import TenancyError, settings_from_args

    try:  # API keys, cache scope, public prefix files: before the slow model load
        tenancy_kw = settings_from_args(args)
    except TenancyError as e:
        return _fail(str(e), 2)

    from .app import create_app
    from .launcher import bind_socket, raise_fd_limit, run, socket_url
    from .settings import ServerSettings

    try:
        sock = bind_socket(args.host, args.port)
    except OSError as e:
        return _fail(f"cannot listen on {args.host}:{args.port}: {e.strerror or e}", 2)
    try:
        engine = _open_model(args, template_override)
    except _StartupError as e:
        sock.close()
        return _fail(e.message, e.code)

    url = socket_url(sock, args.root_path)
    aliases = [a.strip() for a in (args.alias or "").split(",") if a.strip()]
    settings = ServerSettings(root_path=args.root_path, aliases=aliases,
                              tool_parser=args.tool_parser,
                              max_body_bytes=args.max_body_mib * 1024 * 1024,
                              body_timeout=args.body_timeout,
                              max_connections=args.max_connections,
                              **({} if args.cache_ttl is None
                                 else {"response_ttl_s": args.cache_ttl}),
                              **llama_settings_kwargs(args), **tenancy_kw)
    raise_fd_limit(args.max_connections + 256)  # a descriptor per connection, and files

    def ready() -> None:
        print(f"kvshare: serving {engine.model_name} at {url} "
              f"(parallel {args.parallel}, ctx {engine.ctx_size}, "
              f"slot attach {'off' if args.no_slot_attach else 'on'}, "
              f"cache scope {settings.cache_scope})", flush=True)

    try:
        app = create_app(engine, settings, on_startup=ready)
    except TenancyError as e:  # a public prefix the template or tokenizer rejects
        sock.close()
        return _fail(str(e), 2)
    logging.getLogger("kvshare.server").info("%s", app.state.server.tenancy.describe())
    # what startup built (the model, the tokenizer's tables: ~10^5 objects) lives as long as
    # the server: out of the collector's full passes, each of which otherwise walked it all
    # (42 ms with the 1.9B model loaded, a stall inside some decode step)
    gc.collect()
    gc.freeze()
    run(app, sock, root_path=args.root_path, graceful_timeout=args.graceful_timeout,
        log_level=args.log_level)
    print("kvshare: stopped", flush=True)
    return 0


def pull(args: argparse.Namespace) -> int:
    """`kvshare pull NAME`: the catalog model in the model cache (fetched if needed, or when
    the cached file fails its sha256 check); prints its path on stdout."""
    from kvshare.model import catalog

    try:
        path = catalog.ensure(args.name, args.model_store, verify=True)
    except catalog.UnknownModelError as e:
        return _fail(str(e), 2)
    except catalog.CatalogError as e:
        return _fail(f"cannot fetch {args.name}: {e}", 1)
    except KeyboardInterrupt:
        return _fail("interrupted", 130)
    print(path, flush=True)
    return 0


def models(args: argparse.Namespace) -> int:
    """`kvshare models`: the catalog, one model a line."""
    from kvshare.model import catalog

    rows = [("NAME", "SIZE", "STATUS", "FOR")]
    for m in catalog.MODELS.values():
        note = " (default)" if m.name == catalog.DEFAULT_MODEL else ""
        rows.append((m.name, _mib(m.size), catalog.status(m.name, args.model_store),
                     m.summary + note))
    widths = [max(len(r[i]) for r in rows) for i in range(3)]
    for r in rows:
        print("  ".join(c.ljust(w) for c, w in zip(r[:3], widths)) + "  " + r[3])
    print(f"model store: {args.model_store or catalog.store_dir()}")
    print("use one: kvshare serve --model NAME (or a GGUF file path); fetch ahead: "
          "kvshare pull NAME")
    return 0


def main(argv: Sequence[str] | None = None) -> int:
    args = parse_args(argv)
    if args.command == "serve":
        return serve(args)
    if args.command == "pull":
        return pull(args)
    if args.command == "models":
        return models(args)
    if args.command == "route":
        from kvshare.router.cli import route

        return route(args)
    return 2


if __name__ == "__main__":
    sys.exit(main())
