"""The value types of `kvshare serve`'s flags that are more than a number check
(kvshare.argtypes has those): each parses one string, raises ValueError when it is not a
valid value, and has the `__name__` argparse shows in its "invalid ... value" error."""

from __future__ import annotations

from urllib.parse import urlsplit

KV_DTYPES = ("f32", "f16", "q8_0")

REASONING_FORMATS = ("none", "auto", "deepseek", "deepseek-legacy")


def cache_scope(s: str) -> str:
    v = s.strip().lower()
    if v not in ("global", "key", "salt"):
        raise ValueError(s)
    return v


cache_scope.__name__ = "cache scope (global, key or salt)"


def redis_url(s: str) -> str:
    u = urlsplit(s)
    if u.scheme not in ("redis", "rediss", "unix", "valkey", "valkeys") or not (u.netloc or u.path):
        raise ValueError(s)
    # redis-py speaks the same protocol to Valkey; it knows only the redis schemes
    return s.replace("valkey", "redis", 1) if u.scheme.startswith("valkey") else s


redis_url.__name__ = "Redis URL (redis://host:port/db, rediss://..., unix:///path)"


def kv_dtype(s: str) -> str:
    v = s.strip().lower()
    if v not in KV_DTYPES:
        raise ValueError(s)
    return v


kv_dtype.__name__ = "KV dtype (f32, f16 or q8_0)"


def ctx_size(s: str) -> int:
    v = int(s)
    if v < 0:
        raise ValueError(s)
    return v


ctx_size.__name__ = "context size (0: the model's trained context)"


# llama-server's slot count when -np is negative ("auto"; tools/server/server.cpp), with its KV
# unified
AUTO_SLOTS = 4


def parallel(s: str) -> int:
    """`--parallel`: a slot count; a negative one is llama-server's "auto" (AUTO_SLOTS slots
    over a unified KV: llama_meanings), kept as -1 until then; 0 is refused, as there."""
    v = int(s)
    if v == 0:
        raise ValueError(s)
    return -1 if v < 0 else v


parallel.__name__ = "slot count (-1: auto)"


def threads(s: str) -> int | None:
    v = int(s)
    return v if v > 0 else None  # llama-server: <= 0 means one per core


threads.__name__ = "thread count"


def n_predict(s: str) -> int:
    v = int(s)
    if v == 0 or v < -2:
        raise ValueError(s)
    return -1 if v < 0 else v


n_predict.__name__ = "token count (-1: until the context is full)"


def keep(s: str) -> int:
    v = int(s)
    if v < -1:
        raise ValueError(s)
    return v


keep.__name__ = "token count (-1: the whole prompt)"


def reasoning_format(s: str) -> str:
    v = s.strip().lower()
    if v not in REASONING_FORMATS:
        raise ValueError(s)
    return v


reasoning_format.__name__ = "reasoning format (none, auto, deepseek or deepseek-legacy)"


FLASH_ATTN = ("on", "off", "auto")


def flash_attn(s: str) -> str:
    v = s.strip().lower()
    v = {"1": "on", "true": "on", "enabled": "on", "0": "off", "false": "off",
         "disabled": "off"}.get(v, v)
    if v not in FLASH_ATTN:
        raise ValueError(s)
    return v


flash_attn.__name__ = "flash attention setting (on, off or auto)"


def gpu_layers(s: str) -> int:
    """llama-server's `-ngl`: a layer count, `auto` or `all` (-1: as many as fit)."""
    v = s.strip().lower()
    if v in ("auto", "all"):
        return -1
    n = int(v)
    return -1 if n < 0 else n


gpu_layers.__name__ = "layer count (auto, all or a number)"


def host(s: str) -> str:
    """One address or llama-server's comma-separated list (`127.0.0.1,::1`), listened on
    each. A Unix socket path (llama-server's `*.sock`) is refused: kvshare listens on TCP."""
    hosts = [h.strip() for h in s.split(",")]
    if not all(hosts) or any(h.endswith(".sock") or "/" in h for h in hosts):
        raise ValueError(s)
    return ",".join(hosts)


host.__name__ = "host (an address or a comma-separated list; no Unix socket paths)"


def sleep_idle_seconds(s: str) -> int:
    """llama-server's `--sleep-idle-seconds`: -1 (off) or at least 1 (0 and below -1 are
    refused, as there)."""
    v = int(s)
    if v == 0 or v < -1:
        raise ValueError(s)
    return v


sleep_idle_seconds.__name__ = "number of seconds (-1: off, else at least 1)"
