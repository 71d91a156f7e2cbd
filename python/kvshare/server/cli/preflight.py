"""Checks of `kvshare serve`'s flags that need more than the parser (the catalog, the KV
pool's element types, the file system), run before anything slow: a typo costs one error
line, not a model load."""

from __future__ import annotations

import argparse
import os
import re
import tempfile


def kv_dtype_problem(kv_dtype: str | None, device: str = "cpu") -> str | None:
    """Why the KV pool cannot hold `kv_dtype` on `device` (asked of
    kvshare.model.kv_arrays.kv_dtype_of, which every pool allocation goes through), or None.
    q8_0 is CPU-only (the CUDA attention kernels read f16 or f32)."""
    if kv_dtype is None:
        return None
    from kvshare.model.kv_arrays import kv_dtype_name, kv_dtype_of

    try:
        kv_dtype_of(kv_dtype)
    except (ValueError, TypeError) as e:
        return f"the KV pool does not support it yet ({str(e).splitlines()[0] if str(e) else e})"
    if device != "cpu" and kv_dtype_name(kv_dtype) == "q8_0":
        return (f"q8_0 KV is CPU-only (--device {device}: the GPU attention kernels read f16 "
                "or f32; use --kv-dtype f16)")
    return None


def cache_dir_problem(path: str) -> str | None:
    """Why `--cache-dir path` cannot be used (created if missing, must be a writable
    directory), or None. The disk store's own lock is checked when it opens."""
    try:
        os.makedirs(path, exist_ok=True)
    except FileExistsError:
        return "it exists and is not a directory"
    except OSError as e:
        return f"cannot create it: {e.strerror or e}"
    if not os.path.isdir(path):
        return "it is not a directory"
    try:
        with tempfile.NamedTemporaryFile(dir=path, prefix=".kvshare-probe-"):
            pass
    except OSError as e:
        return f"it is not writable: {e.strerror or e}"
    return None


def hf_file_tag(name: str) -> str:
    """`--hf-file`'s file name as the tag that picks it (model/hub.py matches a tag against
    file names between separators, so a file's whole stem picks it; a split GGUF's first part
    its stem without the part number, which picks every part)."""
    stem = name.rsplit("/", 1)[-1]
    stem = re.sub(r"\.gguf$", "", stem, flags=re.IGNORECASE)
    return re.sub(r"-\d{5}-of-\d{5}$", "", stem)


def hub_flags_problem(args: argparse.Namespace) -> str | None:
    """`--hf-repo R` becomes `--model hf:R` (with `--hf-file F`: `hf:R:<F's tag>`, the file
    overriding R's tag as in llama-server); `--hf-token` the token the hub client sends."""
    repo = getattr(args, "hf_repo", None)
    hf_file = getattr(args, "hf_file", None)
    if hf_file and not repo:
        return "--hf-file names a file of the --hf-repo repository: give --hf-repo too"
    if repo:
        if args.model:
            return "give --model or --hf-repo, not both"
        repo = repo[3:] if repo.startswith("hf:") else repo
        if hf_file:
            tag = hf_file_tag(hf_file)
            if not re.fullmatch(r"[A-Za-z0-9_.-]+", tag):
                return f"cannot use --hf-file {hf_file}: not a GGUF file name"
            repo = repo.split(":", 1)[0] + ":" + tag
        args.model = "hf:" + repo
    token = getattr(args, "hf_token", None)
    if token:
        os.environ["HF_TOKEN"] = token  # read by kvshare.model.hub.HubSettings.from_env
    return None


def flag_problem(args: argparse.Namespace) -> str | None:
    """What is wrong with the model name, --kv-dtype, --cache-dir or --slot-save-path, or
    None."""
    from kvshare.model import catalog

    problem = hub_flags_problem(args)
    if problem:
        return problem
    if not catalog.is_known(args.model):
        return catalog.not_found_message(args.model)
    problem = kv_dtype_problem(args.kv_dtype, args.device)
    if problem:
        return f"cannot use --kv-dtype {args.kv_dtype}: {problem}"
    if args.cache_dir:
        problem = cache_dir_problem(args.cache_dir)
        if problem:
            return f"cannot use --cache-dir {args.cache_dir}: {problem}"
    if args.slot_save_path is not None and not os.path.isdir(args.slot_save_path):
        return f"cannot use --slot-save-path {args.slot_save_path}: it is not a directory"
    return None


def choose_device(args: argparse.Namespace) -> str | None:
    """llama-server's `-ngl N` as kvshare's `--device`, unless `--device` was given: 0 is the
    CPU, any other count a CUDA device when one is usable, else the CPU. Sets `args.device`;
    returns a line for the log when a GPU was asked for and is not there, else None."""
    n = getattr(args, "n_gpu_layers", None)
    if n is None or getattr(args, "device_given", False):
        return None
    if n == 0:
        args.device = "cpu"
        return None
    from kvshare.backend import BackendError, get_backend

    try:
        get_backend("cuda")
    except BackendError as e:
        args.device = "cpu"
        shown = "all" if n < 0 else n
        return f"-ngl {shown}: no usable CUDA device ({str(e).splitlines()[0]}): running on the CPU"
    args.device = "cuda"
    return None
