"""Startup's slow part: the model `--model` names resolved (a catalog name fetched into the
model store on first use), checked, loaded with its tokenizer and chat template into an
`Engine`, and described in a few stdout lines (file, tokenizer, memory). Every failure is a
`StartupError` naming the flag to blame."""

from __future__ import annotations

import argparse
import contextlib
import logging
import os
import sys
from typing import Any

from .chat_template_flags import describe_template, model_chat_template
from .config import ctx_per_sequence, engine_config_kwargs
from .console import count, first_line, mib, say


class StartupError(Exception):
    """A startup step failed: `message` is the one line for stderr, `code` the exit status."""

    def __init__(self, message: str, code: int = 2):
        super().__init__(message)
        self.message, self.code = message, code


class KvDtypeError(Exception):
    """The engine refused its KV pool's element type."""


def model_errors() -> tuple[type[BaseException], ...]:
    """What loading a bad model file raises."""
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


def describe_file(path: str, label: str) -> None:
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
    say(f"loading {label}: {path} ({arch}, {count(params)} parameters, "
        f"{mib(os.path.getsize(path))}, block formats {formats})")


def trained_context(model: Any) -> int | None:
    n = getattr(getattr(model, "config", None), "context_length", None)
    return int(n) if isinstance(n, int) and n > 0 else None


def kv_pool_bytes(engine: Any) -> int:
    n = int(engine.kv.kv.nbytes) + sum(int(st.nbytes) for st in engine.kv.states)
    if n:
        return n
    try:
        return (engine.model.kv_bytes_per_token(engine.config.kv_dtype)
                * engine.config.block_size * engine.n_blocks)
    except (ValueError, TypeError, AttributeError):
        return 0


def _load_tokenizer_and_template(args: argparse.Namespace, model: Any, path: str,
                                 template_override: tuple[str, str] | None) -> tuple[Any, Any]:
    from tqdm import tqdm

    from kvshare.model.tokenizer import Tokenizer

    with tqdm(total=2, desc="loading tokenizer", unit="step", leave=False, file=sys.stderr,
              disable=not sys.stderr.isatty()) as bar:
        tokenizer = Tokenizer.from_gguf(path)
        bar.update()
        template = model_chat_template(path, tokenizer, template_override)
        bar.update()
    md = getattr(model, "metadata", {}) or {}
    say(f"tokenizer {md.get('tokenizer.ggml.model', '?')} "
        f"({len(md.get('tokenizer.ggml.tokens') or ())} tokens), chat template "
        f"{describe_template(args, template, template_override)}")
    return tokenizer, template


def _describe_memory(engine: Any, model: Any, config: Any) -> None:
    from kvshare.model.loader import weight_bytes

    w = weight_bytes(model)
    kv = kv_pool_bytes(engine)
    ram = int(config.cache_ram_mib * 2**20)
    say(f"memory: weights {mib(w)} + KV pool {mib(kv)} ({engine.kv_dtype}, "
        f"{engine.n_blocks} blocks of {config.block_size} tokens) + RAM tier "
        + (f"up to {mib(ram)}" if ram else "off")
        + f" = {mib(w + kv + ram)} at most")
    huge = model.huge_page_fraction
    if huge:
        say(f"weights mapped in 2 MiB pages: {huge:.0%} of the file")
    remote = engine.tiers.remote
    if remote is not None:
        ok = remote.ping()
        say(f"shared tier: Redis at {remote.display_url} "
            + ("(reachable)" if ok else "(not reachable now: local tiers only until it "
                                        "answers; requests are not affected)"))


def load_engine(args: argparse.Namespace, path: str, label: str,
                template_override: tuple[str, str] | None = None) -> Any:
    """The engine of the GGUF file at `path` (`label`: the model's name)."""
    import dataclasses
    from pathlib import Path

    from kvshare.engine.engine import Engine, EngineConfig
    from kvshare.model.loader import load_model

    config = EngineConfig(**engine_config_kwargs(args))
    describe_file(path, label)
    model = load_model(path, device=args.device, progress=True if sys.stderr.isatty() else None)
    model.cuda_graphs = getattr(args, "cuda_graphs", True)  # GPU decode steps as CUDA graphs
    # llama-server caps each slot's context at the model's trained context, which `-c 0`
    # also means (config.ctx_per_sequence); known only now
    n_ctx = ctx_per_sequence(args, trained_context(model))
    if n_ctx is not None:
        config = dataclasses.replace(config, ctx_size=n_ctx)
    tokenizer, template = _load_tokenizer_and_template(args, model, path, template_override)
    try:
        engine = Engine(model, tokenizer, template, bytes.fromhex(model.fingerprint), config,
                        model_name=label if label else Path(path).stem)
    except (ValueError, TypeError) as e:  # e.g. a --kv-dtype the KV pool does not support
        raise KvDtypeError(str(e).splitlines()[0] if str(e) else type(e).__name__) from e
    _describe_memory(engine, model, config)
    return engine


def _resolve_offline(model: str, store: str | None) -> tuple[str, str | None]:
    """`catalog.resolve` without the network (`--offline`): a file, or a model already in the
    model store (a hub model's stored files; a PyPI catalog model stored or installed)."""
    from kvshare.model import catalog, hub

    key = model.strip().lower()
    if os.path.isfile(model):
        return model, None
    if hub.is_reference(model) or key in catalog.HUB_MODELS:
        ref = model if hub.is_reference(model) else catalog.HUB_MODELS[key].ref
        found = hub.resolve(ref, store, settings=hub.HubSettings.from_env(offline=True))
        return str(found), None if hub.is_reference(model) else key
    if key in catalog.MODELS and catalog.status(key, store) == "not downloaded":
        raise catalog.CatalogError(f"--offline and it is not in the model store (fetch it "
                                   f"first: kvshare pull {model})")
    return catalog.resolve(model, store)


def open_model(args: argparse.Namespace, template_override: tuple[str, str] | None) -> Any:
    """The engine of the model `--model` names (a catalog name is fetched into the model
    store on first use); every failure is a `StartupError` naming the flag to blame."""
    from kvshare._core import CacheIoError, KvshareError
    from kvshare.backend import BackendError
    from kvshare.model import catalog
    from kvshare.model.store import FetchError

    shown = args.model or catalog.DEFAULT_MODEL
    try:
        path, name = (_resolve_offline(shown, args.model_store) if args.offline
                      else catalog.resolve(args.model, args.model_store))
    except FetchError as e:  # the catalog's and the hub's
        raise StartupError(f"cannot load model {shown}: {e}") from e
    except KeyboardInterrupt:
        raise StartupError("interrupted while fetching the model", 130) from None
    bad_model: tuple[type[BaseException], ...] = (KvshareError, *model_errors())
    try:
        return load_engine(args, path, name or os.path.splitext(os.path.basename(path))[0],
                           template_override)
    except CacheIoError as e:  # e.g. the cache dir is locked by another running kvshare
        where = f"cannot use --cache-dir {args.cache_dir}" if args.cache_dir else "cache error"
        raise StartupError(f"{where}: {first_line(e)}") from e
    except BackendError as e:  # e.g. --device cuda without a usable device
        raise StartupError(f"cannot use --device {args.device}: {first_line(e)}") from e
    except KvDtypeError as e:
        logging.getLogger("kvshare.server").debug("engine construction failed", exc_info=True)
        if args.kv_dtype not in (None, "f32"):
            raise StartupError(f"cannot use --kv-dtype {args.kv_dtype}: {e}") from e
        raise StartupError(f"cannot start the engine: {e}") from e
    except bad_model as e:
        raise StartupError(f"cannot load model {shown}: {first_line(e)}") from e


class ModelReload:
    """`--sleep-idle-seconds`: how the engine is loaded again after an idle sleep
    (`server.idle_sleep.Reloader`): the same file (resolved at startup, so nothing is fetched
    or looked up again) under the same flags; the RAM tier's store is kept across the sleep
    and handed to the new engine (its blocks are keyed by the model's fingerprint, the KV
    element type and block size, all unchanged), the disk tier is opened again."""

    def __init__(self, args: argparse.Namespace, path: str, label: str,
                 template_override: tuple[str, str] | None):
        self.args, self.path, self.label = args, path, label
        self.template_override = template_override

    def keep(self, engine: Any) -> Any:
        return engine.tiers.ram

    def load(self, kept: Any) -> Any:
        engine = load_engine(self.args, self.path, self.label, self.template_override)
        if kept is not None and engine.tiers.ram is not None:
            engine.tiers.ram = kept  # the RAM tier made for it is empty: take the kept one
        return engine
