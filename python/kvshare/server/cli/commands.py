"""The `kvshare` subcommands that run here: `serve` (load the model, start the engine, serve
HTTP), `pull` (fetch a catalog model) and `models` (list the catalog). Each takes the parsed
arguments and returns the exit status."""

from __future__ import annotations

import argparse
import gc
import logging
import sys
from typing import TYPE_CHECKING, Any

from kvshare.server.server_tools.config import ToolsConfig, tools_config

from .chat_template_flags import TemplateError, chat_template_override
from .config import llama_settings_kwargs, ui_config
from .console import fail, mib, say
from .model_load import ModelReload, StartupError, open_model
from .preflight import choose_device, flag_problem, hub_flags_problem

if TYPE_CHECKING:
    from kvshare.server.settings import ServerSettings


def _server_settings(args: argparse.Namespace, tenancy_kw: dict[str, Any], ui: Any,
                     tools: ToolsConfig) -> ServerSettings:
    from kvshare.server.settings import ServerSettings

    aliases = [a.strip() for a in (args.alias or "").split(",") if a.strip()]
    tags = [t.strip() for t in (args.tags or "").split(",") if t.strip()]
    return ServerSettings(root_path=args.root_path, aliases=aliases, tags=tags,
                          tool_parser=args.tool_parser,
                          max_parallel_tool_calls=args.max_parallel_tool_calls,
                          max_body_bytes=args.max_body_mib * 1024 * 1024,
                          body_timeout=args.body_timeout,
                          max_connections=args.max_connections,
                          ui_settings={} if ui is None else ui,
                          tools=tools,
                          **({} if args.cache_ttl is None
                             else {"response_ttl_s": args.cache_ttl}),
                          **llama_settings_kwargs(args), **tenancy_kw)


def serve(args: argparse.Namespace) -> int:
    from kvshare.model_router.cli import is_router_mode, serve_models

    if is_router_mode(args):  # llama-server's router: several models, a child server each
        return serve_models(args)
    logging.basicConfig(level=args.log_level.upper(), stream=sys.stderr,
                        format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    note = choose_device(args)
    if note:
        say(note)
    problem = flag_problem(args)
    if problem:
        return fail(problem, 2)
    try:
        template_override = chat_template_override(args)
    except TemplateError as e:
        return fail(str(e), 2)
    try:
        ui_settings = ui_config(args)
        tools = tools_config(args)  # --tools names, MCP config: checked before the model load
    except ValueError as e:
        return fail(str(e), 2)

    from kvshare.server.tenancy import TenancyError, settings_from_args

    try:  # API keys, cache scope, public prefix files: before the slow model load
        tenancy_kw = settings_from_args(args)
    except TenancyError as e:
        return fail(str(e), 2)

    from kvshare.server.app import create_app
    from kvshare.server.launcher import bind_socket, raise_fd_limit, run, socket_url

    try:
        sock = bind_socket(args.host, args.port)
    except OSError as e:
        return fail(f"cannot listen on {args.host}:{args.port}: {e.strerror or e}", 2)
    try:
        engine = open_model(args, template_override)
    except StartupError as e:
        sock.close()
        return fail(e.message, e.code)

    url = socket_url(sock, args.root_path)
    settings = _server_settings(args, tenancy_kw, ui_settings, tools)
    raise_fd_limit(args.max_connections + 256)  # a descriptor per connection, and files

    model_name, ctx_size = engine.model_name, engine.ctx_size

    def ready() -> None:
        print(f"kvshare: serving {model_name} at {url} "
              f"(parallel {args.parallel}, ctx {ctx_size}, "
              f"slot attach {'off' if args.no_slot_attach else 'on'}, "
              f"cache scope {settings.cache_scope})", flush=True)

    if args.sleep_idle_seconds > 0:  # llama-server's idle sleep (server/idle_sleep.py)
        from kvshare.server.idle_sleep import SleepingEngine

        engine = SleepingEngine(engine, ModelReload(args, str(engine.model.path), model_name,
                                                    template_override),
                                args.sleep_idle_seconds, args.graceful_timeout)
    try:
        app = create_app(engine, settings, on_startup=ready)
    except TenancyError as e:  # a public prefix the template or tokenizer rejects
        sock.close()
        return fail(str(e), 2)
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
    """`kvshare pull NAME`: the catalog model or hub reference (`hf:OWNER/NAME[:QUANT]`) in
    the model store (fetched if needed, or when a catalog file fails its sha256 check); prints
    its path on stdout."""
    from kvshare.model import catalog
    from kvshare.model.store import FetchError, ModelNotFound

    hub_flags_problem(args)
    try:
        path = catalog.ensure(args.name, args.model_store, verify=True)
    except ModelNotFound as e:
        return fail(str(e), 2)
    except FetchError as e:
        return fail(f"cannot fetch {args.name}: {e}", 1)
    except KeyboardInterrupt:
        return fail("interrupted", 130)
    print(path, flush=True)
    return 0


def models(args: argparse.Namespace) -> int:
    """`kvshare models`: the catalog and the hub models in the model store, one a line."""
    from kvshare.model import catalog, hub
    from kvshare.model.store import store_root

    rows = [("NAME", "SIZE", "STATUS", "FOR")]
    for m in catalog.MODELS.values():
        note = " (default)" if m.name == catalog.DEFAULT_MODEL else ""
        rows.append((m.name, mib(m.size), catalog.status(m.name, args.model_store),
                     m.summary + note))
    for h in catalog.HUB_MODELS.values():
        rows.append((h.name, "~" + mib(h.size), catalog.status(h.name, args.model_store),
                     f"{h.summary} [{h.ref}]"))
    named = {h.ref.lower() for h in catalog.HUB_MODELS.values()}
    for ref, size in hub.stored_models(args.model_store):
        if ref.lower() not in named:
            rows.append((ref, mib(size), "downloaded", "a Hugging Face model"))
    widths = [max(len(r[i]) for r in rows) for i in range(3)]
    for r in rows:
        print("  ".join(c.ljust(w) for c, w in zip(r[:3], widths)) + "  " + r[3])
    print(f"model store: {store_root(args.model_store)}")
    print("use one: kvshare serve --model NAME (or hf:OWNER/NAME[:QUANT], or a GGUF file "
          "path); fetch ahead: kvshare pull NAME")
    return 0
