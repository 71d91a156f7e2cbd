"""`kvshare serve` in llama-server's router mode: no --model and a router flag
(`--models-dir`, `--models-preset`, `--models-max`, `--[no-]models-autoload`).

Each model's child is `kvshare serve` with the router's other flags as written (llama-server
passes its own on the same way: "model instances inherit both command line arguments and
environment variables from the router server"), after the preset's `[*]` and the model's own
settings (so the command line wins over the preset, as llama-server's precedence), then
`--model`, a loopback host, port 0 and the model's name as its alias. Flags the router owns
(host, port, root path, the router flags, --alias) are not passed on; API keys are (the child
checks them too). A preset that gives a flag a bad value, or one kvshare refuses, stops the
router at startup with one error line (exit 2), before any child runs."""

from __future__ import annotations

import argparse
import contextlib
import io
import logging
import os
import sys
from collections.abc import Sequence

from kvshare.server.cli.console import fail
from kvshare.server.cli.parser import build_parser, parse_args, serve_parser

from .listing import ModelEntry, list_models
from .preset import PresetError

ROUTER_FLAGS = frozenset({"--models-dir", "--models-preset", "--models-max",
                          "--models-autoload"})
# not passed on to a child: the router sets them (host, port, alias) or owns them
NOT_PASSED_ON = ROUTER_FLAGS | {"--host", "--port", "--alias", "--root-path", "--model",
                                "--hf-repo", "--hf-file"}
# the router's variables, which would make each child a router too
ROUTER_ENV = ("LLAMA_ARG_MODELS_DIR", "LLAMA_ARG_MODELS_PRESET", "LLAMA_ARG_MODELS_MAX",
              "LLAMA_ARG_MODELS_AUTOLOAD", "KVSHARE_MODELS_DIR", "KVSHARE_MODELS_PRESET",
              "KVSHARE_MODELS_MAX", "KVSHARE_MODELS_AUTOLOAD", "KVSHARE_ROOT_PATH")
DEFAULT_MODELS_MAX = 4  # llama-server's


def is_router_mode(args: argparse.Namespace) -> bool:
    """llama-server runs as a router when no model is given; kvshare does when a router flag
    is given too (a bare command line serves kvshare's default model)."""
    if args.model is not None or args.hf_repo is not None:
        return False
    return (args.models_dir is not None or args.models_preset is not None
            or args.models_max is not None or args.models_autoload is not None)


def passed_on(argv: Sequence[str]) -> list[str]:
    """The router's `kvshare serve` flags a child gets: `argv` less NOT_PASSED_ON (each
    spelling, with its value)."""
    serve = serve_parser(build_parser({}))
    canon = {s: a.option_strings[0] for a in serve._actions  # noqa: SLF001
             for s in a.option_strings}
    out: list[str] = []
    it = iter(argv)
    for tok in it:
        name, eq, _ = tok.partition("=") if tok.startswith("--") else (tok, "", "")
        flag = canon.get(name)
        takes = serve.takes_value.get(name, False) and not eq
        if flag is not None and flag in NOT_PASSED_ON:
            if takes:
                next(it, None)
            continue
        out.append(tok)
        if flag is not None and takes:
            value = next(it, None)
            if value is not None:
                out.append(value)
    return out


def child_env(environ: dict[str, str]) -> dict[str, str]:
    return {k: v for k, v in environ.items() if k not in ROUTER_ENV}


def child_argv(entry: ModelEntry, router_args: Sequence[str]) -> list[str]:
    argv = [sys.executable, "-m", "kvshare.server.cli", "serve", *entry.args, *router_args]
    if entry.model is not None:
        argv += ["--model", entry.model]
    return argv + ["--host", "127.0.0.1", "--port", "0",
                   "--alias", ",".join([entry.name, *entry.aliases])]


def check_child(entry: ModelEntry, argv: Sequence[str], env: dict[str, str]) -> str | None:
    """What is wrong with a child's command line (parsed as the child will), or None."""
    err = io.StringIO()
    try:
        with contextlib.redirect_stderr(err):
            parse_args(list(argv[3:]), env)
    except SystemExit:
        line = err.getvalue().strip().splitlines()[-1:] or ["bad flags"]
        return f"model {entry.name}: {line[0].removeprefix('kvshare: error: ')}"
    return None


def serve_models(args: argparse.Namespace) -> int:
    logging.basicConfig(level=args.log_level.upper(), stream=sys.stderr,
                        format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    logging.getLogger("httpx").setLevel(logging.WARNING)  # a line per proxied request
    from kvshare.server.tenancy import KeyRing, TenancyError, settings_from_args

    try:
        keys = settings_from_args(args)["api_keys"]
    except TenancyError as err:
        return fail(str(err), 2)
    try:
        entries = list_models(args.models_dir, args.models_preset, args.model_store)
    except PresetError as err:
        return fail(str(err), 2)
    env = child_env(dict(os.environ))
    router_args = passed_on(getattr(args, "serve_argv", []))
    argv_of = {e.name: child_argv(e, router_args) for e in entries}
    for entry in entries:
        problem = check_child(entry, argv_of[entry.name], env)
        if problem:
            return fail(problem, 2)
    models_max = DEFAULT_MODELS_MAX if args.models_max is None else args.models_max
    autoload = True if args.models_autoload is None else args.models_autoload
    starting = [e.name for e in entries if e.load_on_startup]
    if models_max and len(starting) > models_max:
        return fail(f"number of models to load on startup ({len(starting)}) exceeds "
                    f"--models-max ({models_max})", 2)

    from kvshare.server.launcher import bind_socket, raise_fd_limit, run, socket_url

    from .app import ModelRouterSettings, create_app
    from .pool import ModelPool

    try:
        sock = bind_socket(args.host, args.port)
    except OSError as err:
        return fail(f"cannot listen on {args.host}:{args.port}: {err.strerror or err}", 2)
    url = socket_url(sock, args.root_path)
    pool = ModelPool(entries, lambda e: argv_of[e.name], env, models_max)
    settings = ModelRouterSettings(models_max=models_max, autoload=autoload,
                                   max_body=args.max_body_mib * 1024 * 1024,
                                   body_timeout=args.body_timeout,
                                   max_connections=args.max_connections)

    def ready() -> None:
        print(f"kvshare: routing {len(entries)} model(s) at {url} (models max "
              f"{models_max or 'unlimited'}, autoload {'on' if autoload else 'off'})",
              flush=True)

    from kvshare.server.cors import CORSPolicy, parse_origins

    cors = CORSPolicy(parse_origins(args.cors_origins), args.cors_methods, args.cors_headers,
                      args.cors_credentials)
    app = create_app(pool, settings, KeyRing(keys) if keys else None, cors, on_startup=ready)
    raise_fd_limit(args.max_connections * 2 + 256)  # a client and a child connection each
    run(app, sock, root_path=args.root_path, graceful_timeout=args.graceful_timeout,
        log_level=args.log_level, header_timeout=args.body_timeout)
    print("kvshare: stopped", flush=True)
    return 0
