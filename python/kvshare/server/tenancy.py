"""Cache scope: which requests may share cached KV with which (docs/security.md).

A cache hit is observable (`usage.prompt_tokens_details.cached_tokens` is exact to the token and
a hit is much faster), so whoever can attach to a block can test what another request's prompt
was. The scope decides the salt every request's cache keys are derived from; the engine never
shares anything between different salts (pool, RAM and disk tiers):

- `global`: the request's own `cache_salt` (SHA-256 of the string) or none: every request without
  a salt shares with every other one.
- `key` (the default when API keys are set): a salt derived from the tenant (the API key that
  authenticated the request, or its name in the key file) and the request's `cache_salt`, so
  tenants never attach to each other's blocks and `cache_salt` narrows further inside a tenant.
- `salt`: the request's `cache_salt`; a request without one gets a fresh random salt, so it
  reuses nothing and nothing reuses it.

Public prefixes (`--public-prefix FILE`, the operator's shared system prompts and tool lists) are
the one exception: for each request the server sends the engine the length of the longest common
token prefix of the prompt with any public prefix (`GenerationRequest.public_prefix_tokens`), and
the engine keys those whole blocks without the salt, so every tenant shares them.

Tenant identities in logs and metrics are key-file names or `key:<12 hex digits of the key's
SHA-256>`, never the key.
"""

from __future__ import annotations

import hashlib
import hmac
import json
import logging
import os
import re
import secrets
import stat
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Callable, Protocol, Sequence

from .errors import APIError

if TYPE_CHECKING:  # pragma: no cover
    from kvshare.apis.base import ChatInput

log = logging.getLogger("kvshare.server")

SCOPES = ("global", "key", "salt")
_NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9._@-]{0,63}\Z")
_KEY = re.compile(r"[\x21-\x7e]+\Z")  # visible ASCII: what an HTTP header carries unchanged
_SALT_TAG = b"kvshare/tenant-salt/v1\0"


class TenancyError(ValueError):
    """A configuration problem, reported as one line at start-up (exit status 2). Messages
    never contain a key."""


# --------------------------------------------------------------------------- keys and tenants

@dataclass(frozen=True)
class ApiKey:
    key: str = field(repr=False)
    name: str | None = None  # tenant name (key file); None: the key is its own tenant


@dataclass(frozen=True)
class Tenant:
    """Who sent a request. `name` is safe to log; `ident` feeds the salt derivation (stable
    across restarts, so a tenant finds its own disk-tier entries again)."""

    name: str
    ident: bytes = field(repr=False)


def _digest(key: bytes) -> bytes:
    return hashlib.sha256(key).digest()


def tenant_of(k: ApiKey) -> Tenant:
    if k.name is not None:
        return Tenant(k.name, b"name\0" + k.name.encode())
    d = _digest(k.key.encode())
    return Tenant("key:" + d.hex()[:12], b"key\0" + d)


class KeyRing:
    """The accepted API keys. `match` compares the SHA-256 of the given token with every key's
    (constant time, fixed length, no early exit) and returns the tenant of the one that matched."""

    def __init__(self, keys: Sequence[ApiKey]):
        self._entries = [(_digest(k.key.encode()), tenant_of(k)) for k in keys]
        self.tenants = sorted({t.name for _, t in self._entries})

    def __len__(self) -> int:
        return len(self._entries)

    def match(self, given: bytes) -> Tenant | None:
        d = _digest(given)
        found = None
        for digest, tenant in self._entries:
            if hmac.compare_digest(d, digest) and found is None:
                found = tenant
        return found


def split_keys(value: str | None, what: str = "--api-key") -> list[ApiKey]:
    """Keys of `--api-key` / `KVSHARE_API_KEY`: comma-separated (the flag may be repeated)."""
    if value is None or value == "":
        return []
    out = []
    for i, part in enumerate(value.split(","), 1):
        part = part.strip()
        if not part:
            raise TenancyError(f"{what}: key {i} of the comma-separated list is empty")
        if not _KEY.match(part):
            raise TenancyError(f"{what}: key {i} has characters other than visible ASCII")
        out.append(ApiKey(part))
    return out


def read_key_file(path: str) -> list[ApiKey]:
    """`--api-key-file`: one key per line, optionally followed by whitespace and a tenant name
    (letters, digits, `._@-`, at most 64); blank lines and lines starting with `#` are skipped.
    Keys that share a name are one tenant (they share the cache, e.g. during a key rotation)."""
    try:
        st = os.stat(path)
        with open(path, encoding="utf-8") as f:
            lines = f.read().splitlines()
    except OSError as e:
        raise TenancyError(f"cannot read --api-key-file {path}: {e.strerror or e}") from None
    except UnicodeDecodeError:
        raise TenancyError(f"--api-key-file {path} is not UTF-8 text") from None
    if stat.S_ISREG(st.st_mode) and st.st_mode & 0o077:
        log.warning("--api-key-file %s is readable by other users (mode %o); chmod 600 it",
                    path, stat.S_IMODE(st.st_mode))
    out = []
    for n, line in enumerate(lines, 1):
        line = line.strip()
        if not line or line.startswith("#"):
            continue
        parts = line.split()
        if len(parts) > 2:
            raise TenancyError(f"--api-key-file {path} line {n}: expected 'KEY [NAME]', "
                               f"got {len(parts)} fields")
        if not _KEY.match(parts[0]):
            raise TenancyError(f"--api-key-file {path} line {n}: the key has characters other "
                               "than visible ASCII")
        name = parts[1] if len(parts) == 2 else None
        if name is not None and not _NAME.match(name):
            raise TenancyError(f"--api-key-file {path} line {n}: tenant name {name!r} must be "
                               "1-64 letters, digits or ._@- (starting with a letter or digit)")
        out.append(ApiKey(parts[0], name))
    if not out:
        raise TenancyError(f"--api-key-file {path} has no keys")
    return out


def check_unique(keys: Sequence[ApiKey]) -> None:
    seen: dict[str, int] = {}
    for i, k in enumerate(keys, 1):
        if k.key in seen:
            raise TenancyError(f"API key {i} is the same as API key {seen[k.key]} "
                               "(--api-key and --api-key-file, in that order)")
        seen[k.key] = i


# --------------------------------------------------------------------------- public prefixes

@dataclass(frozen=True)
class PublicPrefix:
    """One `--public-prefix` file: chat messages (a .json file) or prompt text (any other)."""

    source: str
    text: str | None = None
    chat: "ChatInput | None" = None


def read_public_prefix(path: str) -> PublicPrefix:
    """A `.json` file is an object like a chat request's body: `messages` (required), `tools`,
    `chat_template_kwargs`; it is rendered by the model's chat template without a generation
    prompt. Any other file is UTF-8 prompt text, tokenized as `/v1/completions` does (special
    tokens parsed, BOS per the model), so it must be the text as the template renders it."""
    try:
        with open(path, encoding="utf-8") as f:
            data = f.read()
    except OSError as e:
        raise TenancyError(f"cannot read --public-prefix {path}: {e.strerror or e}") from None
    except UnicodeDecodeError:
        raise TenancyError(f"--public-prefix {path} is not UTF-8 text") from None
    if not path.lower().endswith(".json"):
        if not data:
            raise TenancyError(f"--public-prefix {path} is empty")
        return PublicPrefix(path, text=data)
    from kvshare.apis.base import ChatInput
    from kvshare.apis.parsing import parse_chat

    try:
        body = json.loads(data)
    except ValueError as e:
        raise TenancyError(f"--public-prefix {path}: malformed JSON: {e}") from None
    if not isinstance(body, dict):
        raise TenancyError(f"--public-prefix {path}: expected a JSON object with 'messages'")
    try:
        chat = parse_chat(body)
    except APIError as e:
        raise TenancyError(f"--public-prefix {path}: {e.message}") from None
    kwargs = body.get("chat_template_kwargs") or {}
    if not isinstance(kwargs, dict):
        raise TenancyError(f"--public-prefix {path}: 'chat_template_kwargs' must be an object")
    kwargs = {**kwargs, "add_generation_prompt": False}
    return PublicPrefix(path, chat=ChatInput(chat.messages, chat.tools, kwargs))


def common_prefix(a: Sequence[int], b: Sequence[int]) -> int:
    n = min(len(a), len(b))
    i = 0
    # compare in slices (C speed), then find the first difference inside the first unequal one
    step = 256
    while i < n:
        j = min(i + step, n)
        if a[i:j] != b[i:j]:
            while a[i] == b[i]:
                i += 1
            return i
        i = j
    return n


# --------------------------------------------------------------------------- the policy

@dataclass
class Tenancy:
    scope: str = "global"
    keyring: KeyRing | None = None
    public: list[tuple[str, list[int]]] = field(default_factory=list)  # (source, tokens)

    def stores(self, cache_salt: bytes | None) -> bool:
        """Whether a request's blocks are worth keeping in the RAM and disk tiers: not under
        `salt` scope without a cache_salt, whose one-off random salt nobody can ever match."""
        return not (self.scope == "salt" and cache_salt is None)

    def salt(self, tenant: Tenant | None, cache_salt: bytes | None) -> bytes | None:
        """The cache salt the engine gets for a request from `tenant` that sent `cache_salt`
        (`hash_salt` of the request's, by the pipeline; None when absent)."""
        if self.scope == "global":
            return cache_salt
        if self.scope == "salt":
            return cache_salt if cache_salt is not None else secrets.token_bytes(32)
        if tenant is None:  # key scope always runs behind AuthMiddleware
            raise RuntimeError("cache scope 'key' but the request has no tenant")
        h = hashlib.sha256(_SALT_TAG)
        h.update(len(tenant.ident).to_bytes(8, "little") + tenant.ident)
        if cache_salt is None:
            h.update(b"\0")
        else:
            h.update(b"\1" + len(cache_salt).to_bytes(8, "little") + cache_salt)
        return h.digest()

    def public_prefix_tokens(self, tokens: Sequence[int]) -> int:
        """Leading tokens of `tokens` that are a public prefix's: the longest common prefix
        with any of them (the engine shares only its whole blocks)."""
        best = 0
        for _, p in self.public:
            if p and tokens and p[0] == tokens[0]:
                best = max(best, common_prefix(p, tokens))
        return best

    def describe(self) -> str:
        parts = [f"cache scope {self.scope}"]
        if self.keyring is not None:
            parts.append(f"{len(self.keyring)} API keys, {len(self.keyring.tenants)} tenants")
        if self.public:
            parts.append("public prefixes " + ", ".join(
                f"{os.path.basename(src)} ({len(t)} tokens)" for src, t in self.public))
        return "; ".join(parts)


def hash_salt(cache_salt: str | None) -> bytes | None:
    """A request's `cache_salt` as the cache keys use it (SHA-256 of its UTF-8 bytes)."""
    return hashlib.sha256(cache_salt.encode("utf-8")).digest() if cache_salt else None


def default_scope(scope: str | None, have_keys: bool) -> str:
    return scope or ("key" if have_keys else "global")


class TenancySettings(Protocol):
    """The `ServerSettings` fields the policy is built from."""

    api_key: str | None
    api_keys: list[ApiKey]
    cache_scope: str | None
    public_prefixes: list[PublicPrefix]


def build_tenancy(settings: TenancySettings, tokenize_text: Callable[[str], list[int]],
                  tokenize_chat: Callable[[Any], list[int]]) -> Tenancy:
    """The policy for `settings` (ServerSettings); public prefixes are tokenized here."""
    keys = list(settings.api_keys)
    if settings.api_key:
        keys.insert(0, ApiKey(settings.api_key))
    check_unique(keys)
    scope = default_scope(settings.cache_scope, bool(keys))
    if scope not in SCOPES:
        raise TenancyError(f"unknown cache scope {scope!r} (use {', '.join(SCOPES)})")
    if scope == "key" and not keys:
        raise TenancyError("--cache-scope key needs API keys (--api-key or --api-key-file)")
    public = []
    for pp in settings.public_prefixes:
        try:
            toks = (tokenize_chat(pp.chat) if pp.chat is not None
                    else tokenize_text(pp.text or ""))
        except TenancyError:
            raise
        except Exception as e:  # noqa: BLE001 - template errors, bad text: one line at start-up
            msg = (e.message if isinstance(e, APIError) else str(e)) or type(e).__name__
            raise TenancyError(f"--public-prefix {pp.source}: {msg.splitlines()[0]}") from None
        if not toks:
            raise TenancyError(f"--public-prefix {pp.source} has no tokens")
        public.append((pp.source, list(toks)))
    return Tenancy(scope=scope, keyring=KeyRing(keys) if keys else None, public=public)


def settings_from_args(args) -> dict:
    """ServerSettings fields for the tenancy flags of `kvshare serve` (files are read here;
    public prefixes are tokenized when the app is built). Raises TenancyError."""
    keys = split_keys(args.api_key)
    if getattr(args, "api_key_file", None):
        keys += read_key_file(args.api_key_file)
    check_unique(keys)
    scope = default_scope(getattr(args, "cache_scope", None), bool(keys))
    if scope == "key" and not keys:
        raise TenancyError("--cache-scope key needs API keys (--api-key or --api-key-file)")
    prefixes = [read_public_prefix(p) for p in split_paths(getattr(args, "public_prefix", None))]
    return {"api_key": None, "api_keys": keys, "cache_scope": scope,
            "public_prefixes": prefixes}


def split_paths(value: str | None) -> list[str]:
    """`--public-prefix` (repeatable) / `KVSHARE_PUBLIC_PREFIX`: paths joined by os.pathsep."""
    if not value:
        return []
    return [p for p in value.split(os.pathsep) if p]


# --------------------------------------------------------------------------- metrics

class TenantMetrics:
    """Per-tenant request and prompt-token counters (only when API keys are set; the label is
    the tenant name, so the series are bounded by the key file)."""

    def __init__(self, registry, keyring: KeyRing | None):
        self.enabled = keyring is not None
        if not self.enabled:
            return
        from prometheus_client import Counter

        self.requests = Counter("kvshare_tenant_requests", "Completion requests by tenant",
                                ["tenant"], registry=registry)
        self.prompt = Counter("kvshare_tenant_prompt_tokens",
                              "Prompt tokens of finished requests by tenant", ["tenant"],
                              registry=registry)
        self.cached = Counter("kvshare_tenant_prompt_tokens_cached",
                              "Of them, prompt tokens reused from the cache, by tenant",
                              ["tenant"], registry=registry)

    def count(self, tenant: str | None, finish) -> None:
        if not self.enabled or tenant is None:
            return
        self.requests.labels(tenant).inc()
        if finish is not None:
            self.prompt.labels(tenant).inc(finish.prompt_tokens)
            self.cached.labels(tenant).inc(finish.timings.cache_n)
