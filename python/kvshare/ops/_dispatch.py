"""Lazy access to the GPU twins of the ops (module `kvshare.ops.gpu`, CuPy + kernels/*.cu)."""

from __future__ import annotations

from typing import Any


def gpu_op(name: str) -> Any:
    try:
        from kvshare.ops import gpu  # noqa: PLC0415 - only ever imported on the GPU path
    except ImportError as exc:  # pragma: no cover - depends on the GPU teammate's module
        raise NotImplementedError(
            f"GPU op {name!r}: kvshare.ops.gpu is not available ({exc})") from exc
    try:
        return getattr(gpu, name)
    except AttributeError as exc:  # pragma: no cover
        raise NotImplementedError(f"GPU op {name!r} is not implemented in kvshare.ops.gpu") from exc
