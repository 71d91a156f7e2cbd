"""`kvshare route`: the command line of the prefix-aware reverse proxy (router/app.py).

Flags follow `kvshare serve`'s conventions: each can also come from `KVSHARE_<FLAG>` (the
command line wins), errors are one line with exit status 2. `--backend` also reads
`KVSHARE_BACKENDS` (comma-separated), the name a deployment sets for the whole list.
"""

from __future__ import annotations

import argparse
import logging
import sys
from typing import Any
from urllib.parse import urlsplit

# the same number checks (and error wording) as `kvshare serve`'s flags
from kvshare.argtypes import port, positive_float, positive_int

DEFAULT_MAX_BODY = 32 * 1024 * 1024
LOG_LEVELS = ("DEBUG", "INFO", "WARNING", "ERROR", "CRITICAL")


def _factor(s: str) -> float:
    v = float(s)
    if not 1.0 <= v < float("inf"):  # PrefixPolicy refuses factors below 1
        raise ValueError(s)
    return v


_factor.__name__ = "number >= 1"


class _FromEnv(list):
    """A repeatable flag's values taken from the environment (the first flag replaces them)."""


class _Append(argparse.Action):
    """A repeatable, comma-separable flag: the first one on the command line replaces the
    environment's list, later ones extend it (as `kvshare serve`'s repeatable flags do)."""

    def __call__(self, parser, namespace, values, option_string=None):
        cur = getattr(namespace, self.dest)
        cur = [] if isinstance(cur, _FromEnv) else list(cur)
        setattr(namespace, self.dest, [*cur, *_split(values)])


def _split(value: str) -> list[str]:
    return [v.strip() for v in value.split(",") if v.strip()]


def add_route_parser(sub: Any, environ: dict[str, str]) -> argparse.ArgumentParser:
    """Add the `route` subcommand to `sub` (the `kvshare` parser's subparsers).

    A value from the environment is left a string here: argparse converts a string default
    with the flag's type only when `route` is the command, so a bad KVSHARE_HEALTH_INTERVAL
    cannot break `kvshare serve`."""
    p = sub.add_parser(
        "route", help="a prefix-aware reverse proxy in front of kvshare replicas",
        allow_abbrev=False,
        description="Send each request to the replica that already holds its shared prefix "
                    "(system prompt and tools), by consistent hashing with bounded load; "
                    "fall back to the least-loaded healthy replica (docs/router.md).",
        epilog="Every flag can also be set with KVSHARE_<FLAG>, e.g. KVSHARE_PORT=8080; "
               "--backend also with KVSHARE_BACKENDS=URL,URL.")
    backends = _split(environ.get("KVSHARE_BACKENDS", environ.get("KVSHARE_BACKEND", "")))
    keys = _split(environ.get("KVSHARE_API_KEY", ""))
    p.add_argument("--backend", action=_Append, default=_FromEnv(backends), metavar="URL",
                   help="a replica's base URL, e.g. http://10.0.0.5:8080 (repeatable or "
                        "comma-separated; at least one) [env KVSHARE_BACKENDS]")
    p.add_argument("--host", default=environ.get("KVSHARE_HOST", "127.0.0.1"),
                   help="address to listen on [env KVSHARE_HOST]")
    p.add_argument("--port", type=port, default=environ.get("KVSHARE_PORT", 8080),
                   help="port to listen on (0: any free port) [env KVSHARE_PORT]")
    p.add_argument("--api-key", action=_Append, default=_FromEnv(keys), metavar="KEY",
                   help="require 'Authorization: Bearer KEY' or 'x-api-key: KEY' (all but "
                        "/health); repeatable or comma-separated. The headers still go to the "
                        "backends unchanged [env KVSHARE_API_KEY]")
    p.add_argument("--api-key-file", default=environ.get("KVSHARE_API_KEY_FILE"), metavar="FILE",
                   help="the keys of a `kvshare serve --api-key-file` (one per line, an optional "
                        "tenant name after it): the router accepts the replicas' keys "
                        "[env KVSHARE_API_KEY_FILE]")
    p.add_argument("--health-interval", type=positive_float,
                   default=environ.get("KVSHARE_HEALTH_INTERVAL", 2.0),
                   help="seconds between health checks (GET /health) of each backend "
                        "[env KVSHARE_HEALTH_INTERVAL]")
    p.add_argument("--load-factor", type=_factor,
                   default=environ.get("KVSHARE_LOAD_FACTOR", 1.0),
                   help="a backend takes a new prefix while it holds fewer than this x the "
                        "mean number of active prefixes (>= 1) [env KVSHARE_LOAD_FACTOR]")
    p.add_argument("--overload-factor", type=_factor,
                   default=environ.get("KVSHARE_OVERLOAD_FACTOR", 1.5),
                   help="a backend with more than this x the mean requests in flight (and at "
                        "least --spill-min) is overloaded: its prefixes' requests spill to the "
                        "least-loaded one (>= 1) [env KVSHARE_OVERLOAD_FACTOR]")
    p.add_argument("--spill-min", type=positive_int,
                   default=environ.get("KVSHARE_SPILL_MIN", 32),
                   help="a backend with fewer requests in flight is never overloaded "
                        "[env KVSHARE_SPILL_MIN]")
    p.add_argument("--timeout", type=positive_float,
                   default=environ.get("KVSHARE_TIMEOUT", 600.0),
                   help="seconds a backend may stay silent (read timeout), and the most it "
                        "may take to send its response headers (then 504) [env KVSHARE_TIMEOUT]")
    p.add_argument("--body-timeout", type=positive_float,
                   default=environ.get("KVSHARE_BODY_TIMEOUT", 30.0),
                   help="seconds a client gets to send a request's headers, and the longest "
                        "gap while it sends a body (the whole body: 10x this); then 408 and the "
                        "connection closed (as kvshare serve) [env KVSHARE_BODY_TIMEOUT]")
    p.add_argument("--max-connections", type=positive_int,
                   default=environ.get("KVSHARE_MAX_CONNECTIONS", 1024),
                   help="requests in progress at once (/health, /metrics not counted); more "
                        "get 503 with Retry-After [env KVSHARE_MAX_CONNECTIONS]")
    p.add_argument("--max-body", type=positive_int,
                   default=environ.get("KVSHARE_MAX_BODY", DEFAULT_MAX_BODY),
                   help="largest request body in bytes (larger: 413) [env KVSHARE_MAX_BODY]")
    p.add_argument("--root-path", default=environ.get("KVSHARE_ROOT_PATH", ""),
                   help="mount prefix behind another proxy, e.g. /kvshare; stripped before "
                        "routing, not passed to the backends [env KVSHARE_ROOT_PATH]")
    p.add_argument("--log-level", default=environ.get("KVSHARE_LOG_LEVEL", "info"),
                   help="debug, info, warning or error [env KVSHARE_LOG_LEVEL]")
    return p


def check_backend(url: str) -> str:
    """`url` normalised (no trailing slash); ValueError with the reason when unusable."""
    parts = urlsplit(url)
    if parts.scheme not in ("http", "https") or not parts.netloc:
        raise ValueError(f"--backend {url!r} is not an http(s) URL (e.g. http://host:8080)")
    if parts.query or parts.fragment:
        raise ValueError(f"--backend {url!r} has a query or fragment")
    try:
        parts.port  # noqa: B018 - a bad port raises here
    except ValueError:
        raise ValueError(f"--backend {url!r} has an invalid port") from None
    return url.rstrip("/")


def _fail(msg: str, code: int) -> int:
    print(f"kvshare: error: {msg}", file=sys.stderr, flush=True)
    return code


def settings_from_args(args: argparse.Namespace) -> Any:
    """The router's settings from parsed flags; ValueError (one line) on a bad one."""
    from .app import RouterSettings

    if not args.backend:
        raise ValueError("give at least one --backend URL (or KVSHARE_BACKENDS)")
    backends = list(dict.fromkeys(check_backend(b) for b in args.backend))
    if args.root_path and not args.root_path.startswith("/"):
        raise ValueError("--root-path must start with '/'")
    if args.log_level.upper() not in LOG_LEVELS:
        raise ValueError(f"unknown --log-level {args.log_level!r}")
    keys = list(args.api_key or ())
    if args.api_key_file:
        from kvshare.server.tenancy import TenancyError, read_key_file

        try:
            keys += [k.key for k in read_key_file(args.api_key_file)]
        except TenancyError as e:
            raise ValueError(str(e)) from None
    return RouterSettings(backends=backends, api_keys=tuple(keys),
                          health_interval=args.health_interval, load_factor=args.load_factor,
                          overload_factor=args.overload_factor, spill_min=args.spill_min,
                          timeout=args.timeout, body_timeout=args.body_timeout,
                          max_connections=args.max_connections,
                          max_body=args.max_body, root_path=args.root_path.rstrip("/"))


def route(args: argparse.Namespace) -> int:
    try:
        settings = settings_from_args(args)
    except ValueError as e:
        return _fail(str(e), 2)
    logging.basicConfig(level=args.log_level.upper(), stream=sys.stderr,
                        format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    from kvshare.server.launcher import bind_socket, raise_fd_limit, run, socket_url

    from .app import create_app

    try:
        sock = bind_socket(args.host, args.port)
    except OSError as e:
        return _fail(f"cannot listen on {args.host}:{args.port}: {e.strerror or e}", 2)
    url = socket_url(sock, settings.root_path)

    def ready() -> None:
        print(f"kvshare: routing at {url} to {len(settings.backends)} backend(s): "
              f"{', '.join(settings.backends)}", flush=True)

    app = create_app(settings, on_startup=ready)
    raise_fd_limit(settings.max_connections * 2 + 256)  # a client and a backend connection each
    # no graceful drain of long streams beyond Hypercorn's: the replicas own the generations
    run(app, sock, root_path=settings.root_path, graceful_timeout=10.0,
        log_level=args.log_level, header_timeout=settings.body_timeout)
    print("kvshare: stopped", flush=True)
    return 0

