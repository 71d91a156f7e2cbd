"""The models a router serves and the names requests give them, as llama-server lists them
(common/preset.cpp, server-models.cpp load_models):

- `--models-dir DIR`: each `NAME.gguf` in DIR is model NAME; each folder NAME of DIR holding a
  GGUF is model NAME (a split model's first part `-00001-of-N`, else its GGUF). Companion files
  (`mmproj*`, the draft prefixes `mtp-`, `dspark-`, `dflash-`) are no model of their own. Unlike
  llama-server, the later parts of a split GGUF lying in DIR itself are not listed as models
  (none loads alone); its first part is, by its file name.
- the model store (llama-server's cache): the catalog models fetched or installed, under their
  catalog names, and other fetched hub models as OWNER/NAME[:QUANT].
- `--models-preset FILE`: a section naming one of those gives it settings; any other section
  is a model of its own (it needs a `model` or `hf-repo` key).
"""

from __future__ import annotations

import logging
import re
from dataclasses import dataclass, field
from pathlib import Path

from .preset import Preset, PresetError, read_presets

log = logging.getLogger("kvshare.model_router")

SOURCE_DIR, SOURCE_PRESET, SOURCE_CACHE = "models_dir", "preset", "cache"
DRAFT_PREFIXES = ("mtp-", "dspark-", "dflash-")
_LATER_PART = re.compile(r"-(\d{5})-of-\d{5}\.gguf$")


@dataclass
class ModelEntry:
    name: str
    source: str
    model: str | None  # the child's --model: a GGUF path or a model store name
    args: list[str] = field(default_factory=list)  # the preset's flags: [*]'s, then its own
    aliases: list[str] = field(default_factory=list)
    tags: list[str] = field(default_factory=list)
    preset_text: str | None = None
    load_on_startup: bool = False
    stop_timeout: float | None = None


def _companion(name: str) -> bool:
    return "mmproj" in name or name.startswith(DRAFT_PREFIXES)


def _folder_model(folder: Path) -> Path | None:
    model = first_part = None
    for f in sorted(folder.iterdir()):
        if not f.name.endswith(".gguf") or not f.is_file() or _companion(f.name):
            continue
        if "-00001-of-" in f.name:
            first_part = f
        elif _LATER_PART.search(f.name) is None:
            model = f
    return first_part or model


def scan_models_dir(directory: str | Path) -> dict[str, Path]:
    """Model name -> its GGUF (a split model's first part) for a `--models-dir`."""
    root = Path(directory)
    if not root.is_dir():
        raise PresetError(f"--models-dir {directory} does not exist or is not a directory")
    out: dict[str, Path] = {}
    for entry in sorted(root.iterdir()):
        if entry.is_dir():
            found = _folder_model(entry)
            if found is not None:
                out[entry.name] = found.resolve()
        elif entry.name.endswith(".gguf") and not _companion(entry.name):
            m = _LATER_PART.search(entry.name)
            if m is not None and m.group(1) != "00001":
                continue
            out[entry.name.replace(".gguf", "")] = entry.resolve()
    return out


def store_models(store: str | None) -> dict[str, str]:
    """Model name -> `--model` value of the models already in the model store."""
    from kvshare.model import catalog, hub  # noqa: PLC0415 - the model package is heavy

    out: dict[str, str] = {}
    try:
        for m in catalog.MODELS.values():
            if catalog.status(m.name, store) != "not downloaded":
                out[m.name] = m.name
        for h in catalog.HUB_MODELS.values():
            if catalog.status(h.name, store) == "downloaded":
                out[h.name] = h.ref
        named = {h.ref.lower() for h in catalog.HUB_MODELS.values()}
        for ref, _size in hub.stored_models(store):
            if ref.lower() not in named:
                out[ref.removeprefix(hub.PREFIX)] = ref
    except OSError as e:  # an unreadable store lists nothing rather than stopping the router
        log.warning("cannot list the model store: %s", e)
    return out


def list_models(models_dir: str | None, preset_file: str | None,
                store: str | None) -> list[ModelEntry]:
    """Every model the router serves, sorted by name. Raises PresetError."""
    entries: dict[str, ModelEntry] = {}
    for name, ref in store_models(store).items():
        entries[name] = ModelEntry(name, SOURCE_CACHE, ref)
    if models_dir is not None:
        for name, path in scan_models_dir(models_dir).items():
            entries[name] = ModelEntry(name, SOURCE_DIR, str(path))
    if preset_file is not None:
        glob, presets = read_presets(preset_file)
        for p in presets:
            _apply_preset(entries, p, preset_file)
        if glob is not None:  # [*] is every model's, from the preset file or not
            for e in entries.values():
                e.args = [*glob.args, *e.args]
                e.tags = list(dict.fromkeys([*glob.tags, *e.tags]))
                if e.stop_timeout is None:
                    e.stop_timeout = glob.stop_timeout
    return sorted(entries.values(), key=lambda e: e.name)


def _apply_preset(entries: dict[str, ModelEntry], p: Preset, preset_file: str) -> None:
    e = entries.get(p.name)
    if e is None:
        if not p.names_a_model():
            raise PresetError(f"--models-preset {preset_file} [{p.name}]: names no model of "
                              "--models-dir or the model store: give it a model or hf-repo key")
        e = entries[p.name] = ModelEntry(p.name, SOURCE_PRESET, None)
    if p.model is not None:
        e.model = p.model
    e.args = list(p.args)
    e.aliases = list(p.aliases)
    e.tags = list(p.tags)
    e.preset_text = p.text
    e.load_on_startup = p.load_on_startup
    e.stop_timeout = p.stop_timeout
