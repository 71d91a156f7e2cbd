"""llama-server's model preset file (`--models-preset FILE.ini`, tools/server/README.md "Model
presets", common/preset.cpp): a section per model, `[*]` for settings every model gets, each
key a flag without its dashes (`ctx-size`, `c`), a `no-` flag (`no-jinja = true`), or an
environment variable (`LLAMA_ARG_CTX_SIZE`, `KVSHARE_CTX_SIZE`). A section names a model of
`--models-dir` or the model store (its settings), or a new model with a `model` or `hf-repo`
key. `load-on-startup`, `stop-timeout` and `dedup-cache-models` are preset-only keys.

Keys become `kvshare serve` flags here; a key kvshare refuses or does not know is an error
naming it, as llama-server's. Keys the router controls (host, port, API keys, the router's
own flags) are dropped, as llama-server drops them (server-models.cpp unset_reserved_args);
`alias` and `tags` become the model's routing names and tags."""

from __future__ import annotations

import argparse
from dataclasses import dataclass, field
from pathlib import Path

from kvshare.server.cli.llama_names import LLAMA_NAMES, REFUSED
from kvshare.server.cli.options import OPTIONS, env_name
from kvshare.server.cli.parser import TRUE_WORDS, build_parser, serve_parser

GLOBAL_SECTION = "*"
DEFAULT_SECTION = "default"  # keys before any section (llama.cpp's COMMON_PRESET_DEFAULT_NAME)
PRESET_ONLY = ("load-on-startup", "stop-timeout", "dedup-cache-models")
# set by the router for each child, or the router's own: never a child's flag
ROUTER_FLAGS = frozenset({"--host", "--port", "--api-key", "--api-key-file", "--root-path",
                          "--models-dir", "--models-preset", "--models-max",
                          "--models-autoload"})
DEFAULT_STOP_TIMEOUT = 10.0  # seconds, as llama-server's stop-timeout


class PresetError(ValueError):
    """A preset file that cannot be used (one line, for the user)."""


@dataclass
class Preset:
    name: str
    args: list[str] = field(default_factory=list)  # `kvshare serve` flags, in file order
    model: str | None = None  # its `model` key: a GGUF path or a kvshare model name
    aliases: list[str] = field(default_factory=list)
    tags: list[str] = field(default_factory=list)
    load_on_startup: bool = False
    stop_timeout: float | None = None
    text: str = ""  # the section as llama-server shows it in /models (`status.preset`)

    def names_a_model(self) -> bool:
        return self.model is not None or "--hf-repo" in self.args


def _read_ini(path: Path) -> list[tuple[str, list[tuple[str, str]]]]:
    """Sections in file order: (name, [(key, value)]); keys before a section header belong
    to DEFAULT_SECTION. `;` and `#` start comment lines; values may be quoted."""
    try:
        lines = path.read_text(encoding="utf-8").splitlines()
    except OSError as e:
        raise PresetError(f"cannot read --models-preset {path}: {e.strerror or e}") from None
    except UnicodeDecodeError:
        raise PresetError(f"--models-preset {path} is not UTF-8 text") from None
    sections: list[tuple[str, list[tuple[str, str]]]] = [(DEFAULT_SECTION, [])]
    for n, raw in enumerate(lines, 1):
        line = raw.strip()
        if not line or line[0] in ";#":
            continue
        if line.startswith("["):
            if not line.endswith("]") or len(line) < 3:
                raise PresetError(f"--models-preset {path} line {n}: bad section header {line!r}")
            sections.append((line[1:-1].strip(), []))
            continue
        key, eq, value = line.partition("=")
        if not eq or not key.strip():
            raise PresetError(f"--models-preset {path} line {n}: expected 'key = value'")
        value = value.strip()
        if len(value) >= 2 and value[0] == value[-1] and value[0] in "\"'":
            value = value[1:-1]
        sections[-1][1].append((key.strip(), value))
    return sections


class _Flags:
    """Which `kvshare serve` flag a preset key names, and how it takes a value."""

    def __init__(self) -> None:
        serve = serve_parser(build_parser({}))
        self.actions: dict[str, argparse.Action] = {}
        for a in serve._actions:  # noqa: SLF001 - argparse has no public list of them
            for s in a.option_strings:
                self.actions[s] = a
        self.by_env: dict[str, str] = {}
        for flag, *_ in OPTIONS:
            self.by_env[env_name(flag)] = flag
            llama_env = LLAMA_NAMES.get(flag, ((), None))[1]
            if llama_env is not None:
                self.by_env[llama_env] = flag

    def option(self, key: str) -> str | None:
        """The option string `key` names (`c` -> `-c`, `LLAMA_ARG_CTX_SIZE` ->
        `--ctx-size`), or None."""
        if key in self.by_env:
            return self.by_env[key]
        for s in ("--" + key, "-" + key):
            if s in self.actions:
                return s
        return None


_FLAGS: _Flags | None = None


def _flags() -> _Flags:
    global _FLAGS
    if _FLAGS is None:
        _FLAGS = _Flags()
    return _FLAGS


def _truthy(value: str) -> bool:
    return value.strip().lower() in TRUE_WORDS


def _apply(preset: Preset, key: str, value: str, where: str) -> None:
    if key in PRESET_ONLY:
        if key == "load-on-startup":
            preset.load_on_startup = _truthy(value)
        elif key == "stop-timeout":
            try:
                preset.stop_timeout = float(value)
            except ValueError:
                raise PresetError(f"{where}: stop-timeout {value!r} is not a number") from None
        return  # dedup-cache-models: kvshare lists each stored model once already
    flags = _flags()
    opt = flags.option(key)
    if opt is None:
        refused = next((s for s in ("--" + key, "-" + key) if s in REFUSED), None)
        if refused is not None:
            raise PresetError(f"{where}: option '{key}' is not supported: {REFUSED[refused]}")
        raise PresetError(f"option '{key}' not recognized in preset '{preset.name}'")
    action = flags.actions[opt]
    canon = action.option_strings[0]
    if canon in ROUTER_FLAGS:
        return
    if canon == "--model":
        preset.model = value
    elif canon == "--alias":
        preset.aliases += [a.strip() for a in value.split(",") if a.strip()]
    elif canon == "--tags":
        preset.tags += [t.strip() for t in value.split(",") if t.strip()]
    elif action.nargs == 0:
        on = _truthy(value)
        negative = "--no-" + canon[2:]
        if negative in action.option_strings:
            # a --flag / --no-flag pair: the key's own polarity, then the value's
            preset.args.append(negative if on == (opt == negative) else canon)
        elif on:
            preset.args.append(canon)
    else:
        preset.args += [canon, value]


def read_presets(path: str | Path) -> tuple[Preset | None, list[Preset]]:
    """(the `[*]` section, the model sections in file order) of a preset file."""
    path = Path(path)
    glob: Preset | None = None
    out: dict[str, Preset] = {}
    for name, items in _read_ini(path):
        items = [(k, v) for k, v in items if k != "version"]  # the format's, reserved
        if name == DEFAULT_SECTION and not items:
            continue
        p = Preset(name)
        where = f"--models-preset {path} [{name}]"
        for key, value in items:
            _apply(p, key, value, where)
        p.text = f"[{name}]\n" + "".join(f"{k} = {v}\n" for k, v in items)
        if name == GLOBAL_SECTION:
            glob = p
        else:
            out[name] = p  # a repeated section: the last wins, as llama.cpp's map
    return glob, list(out.values())
