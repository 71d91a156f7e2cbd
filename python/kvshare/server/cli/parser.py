"""The `kvshare` argument parser: the subcommands, each `kvshare serve` flag from
options.OPTIONS with its environment fallbacks, llama-server's names for them, and the checks
that turn a bad command line into one error line (exit status 2).

A flag's value comes from the command line, else `KVSHARE_<FLAG>`, else llama-server's
`LLAMA_ARG_*` variable, else the table's default. A llama-server command line is flags without
a subcommand, or nothing at all: it means `kvshare serve`. A flag `serve` does not
have is refused before argparse sees it (argparse would take `-ngl` for `-n gl`).
"""

from __future__ import annotations

import argparse
import os
import sys
from typing import Any, NoReturn, Sequence

from .llama_meanings import apply_llama_meanings
from .llama_names import LLAMA_NAMES, REFUSED
from .options import (CATALOG_OPTIONS, OLD_NAMES, OPTIONS, REPEATABLE, TOGGLE, FlagType, Option,
                      env_name)

TRUE_WORDS = {"1", "true", "yes", "on", "enabled"}
FALSE_WORDS = {"0", "false", "no", "off", "disabled", ""}
LOG_LEVELS = ("DEBUG", "INFO", "WARNING", "ERROR", "CRITICAL")


class Parser(argparse.ArgumentParser):
    """Errors are one line on stderr (`kvshare: error: ...`), exit status 2. Remembers what
    argparse keeps only in private fields: each option string and whether it takes a value
    (`takes_value`), and the `serve` subcommand's parser (`serve`)."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        self.takes_value: dict[str, bool] = {}  # before argparse adds -h/--help
        self.serve: Parser | None = None
        super().__init__(*args, **kwargs)

    def add_argument(self, *args: Any, **kwargs: Any) -> argparse.Action:
        action = super().add_argument(*args, **kwargs)
        self.takes_value.update({s: action.nargs != 0 for s in action.option_strings})
        return action

    def error(self, message: str) -> NoReturn:
        self.exit(2, f"kvshare: error: {message}\n")


class _FromEnv(str):
    """A repeatable flag's value taken from the environment (the first flag replaces it)."""


class _Repeat(argparse.Action):
    """A flag of REPEATABLE: each occurrence joins its value to the earlier ones."""

    def __call__(self, parser: argparse.ArgumentParser, namespace: argparse.Namespace,
                 values: Any, option_string: str | None = None) -> None:
        cur = getattr(namespace, self.dest)
        sep = REPEATABLE[self.option_strings[0]]
        setattr(namespace, self.dest, values if cur is None or isinstance(cur, _FromEnv)
                else f"{cur}{sep}{values}")


class _Toggle(argparse.Action):
    """`--flag` sets True, `--no-flag` False."""

    def __init__(self, option_strings: Sequence[str], dest: str, default: Any = None,
                 help: str | None = None) -> None:
        super().__init__(option_strings, dest, nargs=0, default=default, help=help)

    def __call__(self, parser: argparse.ArgumentParser, namespace: argparse.Namespace,
                 values: Any, option_string: str | None = None) -> None:
        # llama-server's short off forms start with one dash (-no-ag)
        setattr(namespace, self.dest, not (option_string or "").lstrip("-").startswith("no-"))


class _EnvError(Exception):
    pass


def _env_value(flag: str, environ: dict[str, str]) -> tuple[str, str] | None:
    """(variable, raw value) of the flag's environment fallback: `KVSHARE_<FLAG>`, else
    llama-server's variable; None when neither is set."""
    name = env_name(flag)
    if name in environ:
        return name, environ[name]
    llama = LLAMA_NAMES.get(flag, ((), None))[1]
    if llama is not None and llama in environ:
        return llama, environ[llama]
    return None


def _env_default(flag: str, typ: FlagType, default: Any, environ: dict[str, str]) -> Any:
    found = _env_value(flag, environ)
    if found is None:
        return default
    name, raw = found
    if typ is None or isinstance(typ, str):  # a switch or a TOGGLE
        low = raw.strip().lower()
        if low in TRUE_WORDS:
            return True
        if low in FALSE_WORDS:
            return False
        raise _EnvError(f"{name}={raw!r} is not a boolean (use 1/0, true/false)")
    try:
        return typ(raw)
    except ValueError:
        raise _EnvError(f"{name}={raw!r} is not a valid {getattr(typ, '__name__', 'value')}"
                        ) from None


def _help_text(flag: str, help_: str) -> str:
    """The flag's help with its llama-server names and its environment variables."""
    aliases, llama_env = LLAMA_NAMES.get(flag, ((), None))
    also = [*aliases] + ([f"env {llama_env}"] if llama_env else [])
    h = help_ + (f" (llama-server: {', '.join(also)})" if also else "")
    return f"{h} [env {env_name(flag)}]"


def _add_options(parser: argparse.ArgumentParser, sub: argparse.ArgumentParser,
                 options: Sequence[Option], environ: dict[str, str]) -> None:
    for flag, typ, default, help_ in options:
        try:
            d = _env_default(flag, typ, default, environ)
        except _EnvError as e:
            parser.error(str(e))
        h = _help_text(flag, help_)
        names = [flag, *LLAMA_NAMES.get(flag, ((), None))[0], *OLD_NAMES.get(flag, ())]
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


def build_parser(environ: dict[str, str] | None = None) -> Parser:
    environ = dict(os.environ if environ is None else environ)
    parser = Parser(
        prog="kvshare", description="OpenAI-compatible LLM server that shares prompt prefixes",
        epilog="Flags without a command mean `kvshare serve` (a llama-server command line "
               "works as is).")
    sub = parser.add_subparsers(dest="command", required=True)
    epilog = "Every flag can also be set with KVSHARE_<FLAG>, e.g. KVSHARE_PORT=9000."
    serve = sub.add_parser(
        "serve", help="serve a model over HTTP", allow_abbrev=False,
        epilog=epilog + " llama-server's flag names and LLAMA_ARG_* variables work too "
                        "(docs/llama-server.md).")
    parser.serve = serve
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


def serve_parser(parser: Parser) -> Parser:
    """The `serve` subcommand's parser of a `build_parser` parser."""
    assert parser.serve is not None, "not a build_parser parser"
    return parser.serve


def _is_number(s: str) -> bool:
    try:
        float(s)
    except ValueError:
        return False
    return True


def written_flags(sub: Parser, argv: Sequence[str]) -> list[str]:
    """The flags in `argv` in order, each name exactly as written (`--ctx-size=512` is
    `--ctx-size`); the token after a flag of `sub` that takes a value is its value, not a
    flag. No abbreviations, no value glued to a short flag: llama-server has neither, and
    `-ngl` must not read as `-n gl`."""
    takes_value = sub.takes_value
    out: list[str] = []
    it = iter(argv)
    for tok in it:
        if tok == "--":
            break
        if not tok.startswith("-") or tok == "-" or _is_number(tok):
            continue
        name, eq, _ = tok.partition("=") if tok.startswith("--") else (tok, "", "")
        out.append(name)
        if takes_value.get(name) and not eq:
            next(it, None)
    return out


def llama_spelling(sub: Parser, argv: Sequence[str]) -> list[str]:
    """`argv` with each long flag's underscores as dashes (`--backend_sampling` is
    `--backend-sampling`), as llama-server reads its flags; values are left as they are."""
    out: list[str] = []
    it = iter(argv)
    for tok in it:
        out.append(tok)
        if tok == "--":
            out.extend(it)
            break
        if not tok.startswith("-") or tok == "-" or _is_number(tok):
            continue
        name, eq, value = tok.partition("=") if tok.startswith("--") else (tok, "", "")
        if name.startswith("--"):
            name = "--" + name[2:].replace("_", "-")
            out[-1] = name + eq + value
        if sub.takes_value.get(name) and not eq:
            nxt = next(it, None)
            if nxt is not None:
                out.append(nxt)
    return out


def unsupported_flags(sub: Parser, argv: Sequence[str]) -> list[str]:
    """The flags in `argv` that `sub` does not have, as written, each once."""
    return [f for f in dict.fromkeys(written_flags(sub, argv)) if f not in sub.takes_value]


def _unsupported_message(flags: list[str]) -> str:
    named = ", ".join(f"{f} ({REFUSED[f]})" if f in REFUSED else f for f in flags)
    return (f"unsupported flag(s): {named}; `kvshare serve --help` lists kvshare's flags, "
            "docs/llama-server.md maps llama-server's")


def _serve_args_problem(args: argparse.Namespace) -> str | None:
    """What is wrong with a combination of `kvshare serve`'s flags, or None."""
    if args.chat_template is not None and args.chat_template_file is not None:
        return "use either --chat-template or --chat-template-file, not both"
    if args.kv_mem is not None and args.kv_blocks is not None:
        return "use either --kv-mem or --kv-blocks, not both"
    if args.device not in ("cpu", "cuda"):
        return f"--device must be cpu or cuda, not {args.device!r}"
    if args.log_level.upper() not in LOG_LEVELS:
        return f"unknown --log-level {args.log_level!r}"
    if args.tool_parser is not None:
        from kvshare.toolcalls import FORMATS

        if args.tool_parser not in FORMATS:
            return f"unknown --tool-parser {args.tool_parser!r} (one of {', '.join(FORMATS)})"
    if args.root_path and not args.root_path.startswith("/"):
        return "--root-path must start with '/'"
    return None


def parse_args(argv: Sequence[str] | None = None,
               environ: dict[str, str] | None = None) -> argparse.Namespace:
    argv = list(sys.argv[1:] if argv is None else argv)
    if not argv or (argv[0].startswith("-") and argv[0] not in ("-h", "--help")):
        # a llama-server command line: flags or nothing (its settings in LLAMA_ARG_*), no command
        argv = ["serve", *argv]
    parser = build_parser(environ)
    written: list[str] = []
    if argv and argv[0] == "serve":
        serve = serve_parser(parser)
        argv = ["serve", *llama_spelling(serve, argv[1:])]
        written = written_flags(serve, argv[1:])
        unknown = [f for f in dict.fromkeys(written) if f not in serve.takes_value]
        if unknown:
            parser.error(_unsupported_message(unknown))
    args = parser.parse_args(argv)
    if args.command != "serve":
        return args
    args.serve_argv = argv[1:]  # as written: router mode passes them on to each model's server
    env = dict(os.environ if environ is None else environ)
    problem = _serve_args_problem(args) or apply_llama_meanings(args, written, env)
    if problem:
        parser.error(problem)
    return args
