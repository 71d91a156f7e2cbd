"""The flags of `kvshare serve`: one table (`OPTIONS`) of each flag's name, value type,
default and help text, from which the parser, `--help` and docs/configuration.md's tables
(scripts/gen_flag_docs.py) are all made; and each flag's environment variable (`env_name`)."""

from __future__ import annotations

import os
from typing import Any, Callable

from kvshare.argtypes import (non_negative_float, non_negative_int, port, positive_float,
                              positive_int)
from kvshare.server.server_tools.config import tools_runtime

from . import flag_types
from .chat_template_flags import reasoning_budget, reasoning_mode

ENV_PREFIX = "KVSHARE_"


def env_name(flag: str) -> str:
    """`KVSHARE_<FLAG>`: the flag's environment variable (dashes as underscores)."""
    return ENV_PREFIX + flag.lstrip("-").replace("-", "_").upper()


# `type` of an OPTIONS entry that is a `--flag` / `--no-flag` pair (a boolean, default on).
TOGGLE = "toggle"

# An OPTIONS entry's value type: a parser of one string, TOGGLE, or None (a boolean switch).
FlagType = Callable[[str], Any] | str | None
# flag, value type, default, help
Option = tuple[str, FlagType, Any, str]

OPTIONS: list[Option] = [
    ("--model", str, None,
     "a catalog model name (fetched on first use; `kvshare models` lists them), a Hugging "
     "Face reference hf:OWNER/NAME[:QUANT] or a GGUF file (default: qwen2.5-coder-0.5b-instruct)"),
    ("--hf-repo", str, None,
     "a Hugging Face GGUF repository to fetch and serve, OWNER/NAME[:QUANT] (the same as "
     "--model hf:OWNER/NAME[:QUANT]; no QUANT: Q4_K_M, else Q8_0)"),
    ("--hf-file", str, None,
     "with --hf-repo: the repository's GGUF of this name (folders in it aside), instead of a "
     "quantization tag; the first part of a split GGUF names them all"),
    ("--hf-token", str, None,
     "Hugging Face token for gated and private repositories (default: $HF_TOKEN)"),
    ("--model-store", str, None,
     "directory of fetched models (older name: --model-cache) (default: $XDG_CACHE_HOME/kvshare/models or "
     "~/.cache/kvshare/models)"),
    ("--host", flag_types.host, "127.0.0.1",
     "address to listen on, or a comma-separated list (each is listened on, one port)"),
    ("--port", port, 8080, "port to listen on (0: any free port)"),
    ("--parallel", flag_types.parallel, 4,
     "sequences decoded together (-1: llama-server's auto, 4 over a unified KV)"),
    ("--ctx-size", flag_types.ctx_size, None,
     "llama-server's context of all sequences together, in tokens: with --parallel (and "
     "without --kv-unified) each sequence gets ctx-size / parallel, rounded up to a multiple "
     "of 256 as llama-server's; without --parallel (llama-server's automatic slots) or with "
     "--kv-unified each may use all of it (0: the model's trained context) (default: 8192 "
     "per sequence)"),
    ("--kv-unified-per-slot", positive_int, None,
     "each sequence's context in tokens (llama-server's per-slot limit): without --ctx-size "
     "the KV pool is sized for --parallel sequences of it; with --ctx-size, the smaller of "
     "the two"),
    ("--n-predict", flag_types.n_predict, None,
     "max_tokens of a request that gives none (-1: until the context is full; a request's "
     "own limit wins)"),
    ("--context-shift", TOGGLE, False,
     "a reply that fills its context drops the older half of what follows the kept tokens "
     "(--keep) and goes on, as llama-server's; kvshare recomputes the remaining tokens' KV "
     "at their new positions (models with recurrent state never shift) (default: off, the "
     "reply ends with finish_reason length)"),
    ("--keep", flag_types.keep, 0,
     "with --context-shift: prompt tokens a shift keeps, BOS aside, for requests that give no "
     "n_keep (-1: the whole prompt)"),
    ("--kv-mem", positive_int, None, "KV pool size in MiB"),
    ("--kv-blocks", positive_int, None, "KV pool size in blocks (instead of --kv-mem)"),
    ("--block-size", positive_int, None, "tokens per KV block (default: 16)"),
    ("--kv-dtype", flag_types.kv_dtype, None,
     "element type of the KV cache: f16 (the default, as llama.cpp), f32 (twice the memory) "
     "or q8_0 (ggml's Q8_0 blocks as llama.cpp's -ctk/-ctv q8_0: 34 bytes per 32 values, "
     "0.53x f16; CPU only, head_dim a multiple of 32)"),
    ("--prefill-chunk", positive_int, None, "prompt tokens computed per step (default: 512)"),
    ("--batch-size", positive_int, None,
     "llama-server's logical batch: prompt tokens computed per step are at most this "
     "(with --ubatch-size and --prefill-chunk: the smallest)"),
    ("--ubatch-size", positive_int, None,
     "llama-server's physical batch: prompt tokens computed per step are at most this "
     "(with --batch-size and --prefill-chunk: the smallest)"),
    ("--kv-unified", None, False,
     "llama-server's unified KV cache: --ctx-size is then each sequence's context, not the "
     "total of --parallel sequences (kvshare's KV pool is always one pool shared by all)"),
    ("--queue-timeout", non_negative_float, None,
     "seconds a request may wait to be admitted before it gets 503 with Retry-After "
     "(default 600; 0: no limit)"),
    ("--no-slot-attach", None, False, "turn cross-session prefix sharing off"),
    ("--swa-full", None, False,
     "sliding-window layers keep K/V of every position, as full-attention layers do (default: "
     "only each sequence's window, in a pool of their own; docs/architecture.md)"),
    ("--alias", str, None,
     "name(s) /v1/models lists for the loaded model (repeatable or comma-separated); any "
     "requested model name is served by the loaded model and echoed back"),
    ("--tags", str, None,
     "informative tags /v1/models lists for the model (repeatable or comma-separated)"),
    ("--chat-template", str, None,
     "chat template: a built-in name (llama.cpp's: chatml, llama3, mistral-v7, phi4, gemma, "
     "deepseek3, command-r, gpt-oss, ...) or an inline Jinja template (default: the model "
     "file's)"),
    ("--chat-template-file", str, None, "chat template: a Jinja template file"),
    ("--jinja", TOGGLE, True,
     "accepted either way: kvshare renders the chat template with Jinja (--no-jinja: "
     "llama-server's C++ copies of known templates; kvshare renders the template itself)"),
    ("--reasoning-format", flag_types.reasoning_format, "auto",
     "reasoning_format of a request that gives none: none (thoughts stay in content), auto or "
     "deepseek (thoughts in reasoning_content), deepseek-legacy"),
    ("--reasoning", reasoning_mode, "auto",
     "thinking in the chat template: on or off sets its enable_thinking, auto leaves it on "
     "(a request's chat_template_kwargs wins)"),
    ("--reasoning-budget", reasoning_budget, -1,
     "llama-server's thinking token budget: after N tokens inside a <think> block its end "
     "is forced and the answer follows (0: at once; -1: unlimited); a request's "
     "reasoning_budget_tokens wins"),
    ("--reasoning-budget-message", str, None,
     "text forced before the end of thinking when the budget is spent (default: none)"),
    ("--tool-parser", str, None,
     "tool-call format: hermes, qwen35, lfm2 or llama3 (default: detected from the chat "
     "template)"),
    ("--max-n", positive_int, None, "most choices (n) one request may ask for (default 8)"),
    ("--max-parallel-tool-calls", positive_int, 8,
     "most tool calls one reply may make when parallel calls are allowed (forced calls end "
     "after them)"),
    ("--cache-ram", non_negative_int, None, "RAM tier budget in MiB (default 8192; 0: off)"),
    ("--cache-ram-pin", non_negative_int, None,
     "of the RAM tier, MiB that prefix entries (up to the first user message) may pin "
     "(default: half of --cache-ram)"),
    ("--cache-idle-slots", TOGGLE, True,
     "a finished request's blocks are copied to the RAM tier as it ends (llama-server's "
     "idle slots saved to its prompt cache); --no-cache-idle-slots: only prefix entries "
     "reach the RAM tier, finished blocks stay in the KV pool until evicted (the disk and "
     "Redis tiers get them either way)"),
    ("--cache-dir", str, None, "directory of the crash-safe disk tier (default: off)"),
    ("--cache-disk-max", positive_int, None, "disk tier budget in MiB (default 10240)"),
    ("--cache-ttl", non_negative_float, None,
     "seconds a disk entry lives unused, and a stored Responses API response lives "
     "(default 259200 = 3 days; 0: no limit)"),
    ("--cache-min-tokens", non_negative_int, None,
     "shortest prompt written to disk or Redis (default 256)"),
    ("--cache-redis", flag_types.redis_url, None,
     "shared tier on Redis or Valkey, e.g. redis://127.0.0.1:6379/0: replicas pointing at one "
     "server share computed prefixes (default: off; docs/replicas.md)"),
    ("--cache-redis-timeout", positive_float, None,
     "seconds one Redis command may take before it counts as a miss (default 0.5)"),
    ("--checkpoint-min-step", positive_int, None,
     "hybrid models: a state checkpoint every N prompt tokens (default 1024)"),
    ("--checkpoint-min-gain", positive_int, None,
     "hybrid models: a checkpoint where a prompt splits from a cached one (before the first "
     "user message) when it saves at least N tokens of recomputation (default 64)"),
    ("--ctx-checkpoints", non_negative_int, None,
     "hybrid models: at most N checkpoints per sequence (default 8)"),
    ("--api-key", str, None,
     "require 'Authorization: Bearer <key>' (all but /health); several keys: comma-separated "
     "or the flag repeated, each key its own tenant"),
    ("--api-key-file", str, None,
     "file of API keys, one 'KEY [TENANT-NAME]' per line (# comments); keys sharing a name "
     "are one tenant"),
    ("--cache-scope", flag_types.cache_scope, None,
     "who may share cached prefixes: global (everyone without a cache_salt), key (per tenant; "
     "the default with API keys) or salt (only requests with the same cache_salt); "
     "see docs/security.md"),
    ("--public-prefix", str, None,
     "a prefix every tenant may share (repeatable; env: paths joined by ':'): a .json file "
     "{\"messages\": [...], \"tools\": [...]} rendered by the chat template, or a text file "
     "of prompt text"),
    ("--device", str, "cpu", "cpu or cuda"),
    ("--n-gpu-layers", flag_types.gpu_layers, None,
     "llama-server's GPU offload: 0 runs on the CPU, any other count (auto, all) on a CUDA "
     "device when one is usable, else on the CPU; kvshare puts every layer on one device "
     "(--device, when given, wins)"),
    ("--cuda-graphs", TOGGLE, True,
     "with --device cuda: steps of up to 1,024 tokens (decode, prefill, mixed) of "
     "attention models, dense or MoE, and the decode steps of hybrids (qwen35, lfm2), "
     "replayed as CUDA graphs, the common shapes captured at start (--no-cuda-graphs: every "
     "step launched op by op)"),
    ("--flash-attn", flag_types.flash_attn, "auto",
     "accepted: on, off or auto; kvshare's attention is always tiled (flash-style)"),
    ("--backend-sampling", None, False,
     "accepted: where tokens are sampled changes no reply (kvshare samples after each step's "
     "logits)"),
    ("--offline", None, False,
     "fetch nothing: a catalog model must already be in the model store"),
    # llama-server's router mode: without --model, any of these serves several models, each
    # in a `kvshare serve` child started on demand (model_router/, docs/llama-server.md)
    ("--models-dir", str, None,
     "router mode: serve the GGUF models of this directory (a file each, or a folder each "
     "for split or multi-file models), each in its own `kvshare serve` process started on "
     "demand; requests pick one by their model field"),
    ("--models-preset", str, None,
     "router mode: llama-server's preset .ini file: a section per model of `kvshare serve` "
     "flags (without dashes), [*] for all of them"),
    ("--models-max", non_negative_int, None,
     "router mode: most models loaded at once; loading one more unloads the least recently "
     "used idle one (default: 4; 0: no limit)"),
    ("--models-autoload", TOGGLE, None,
     "router mode: a request for a model that is not loaded loads it (--no-models-autoload: "
     "it gets a 400 unless its query says ?autoload=true) (default: on)"),
    ("--threads", flag_types.threads, None, "CPU threads for the model runtime (<= 0: one per core)"),
    ("--root-path", str, "", "mount prefix behind a reverse proxy, e.g. /kvshare"),
    ("--cors-origins", str, None,
     "origins browsers may call the API from, besides the loopback ones (comma-separated or "
     "repeated; *: any origin) (default: loopback origins only)"),
    ("--cors-methods", str, "GET, POST, DELETE, OPTIONS", "methods a CORS preflight allows"),
    ("--cors-headers", str, None,
     "request headers a CORS preflight allows (default: those the browser asks for)"),
    ("--cors-credentials", TOGGLE, True,
     "CORS responses to allowed origins say Access-Control-Allow-Credentials: true "
     "(--no-cors-credentials: they do not)"),
    ("--slots", TOGGLE, True, "serve GET /slots (--no-slots: 501, as llama-server)"),
    ("--slot-save-path", str, None,
     "directory of the files POST /slots/{id}?action=save|restore writes and reads (default: "
     "off)"),
    ("--metrics", None, False, "accepted: kvshare always serves /metrics"),
    ("--cont-batching", None, False, "accepted: kvshare always batches continuously"),
    ("--ui-config", str, None,
     "JSON of llama.cpp's web UI default settings, served as /props' ui_settings (kvshare's "
     "own page at / does not read it)"),
    ("--ui-config-file", str, None, "a file of --ui-config's JSON"),
    ("--sleep-idle-seconds", flag_types.sleep_idle_seconds, -1,
     "after this many seconds without a request that needs the model, release the model and "
     "its KV pool (/props is_sleeping: true); the next such request loads it again "
     "(-1: never; docs/llama-server.md)"),
    ("--no-webui", None, False,
     "serve no web UI: no page at / (a 404 there) and no /webui/state (docs/webui.md)"),
    ("--tools", str, None,
     "llama-server's built-in tools served at /tools for a trusted local client, "
     "comma-separated or all: read_file, file_glob_search, grep_search, exec_shell_command, "
     "write_file, edit_file, get_info (they read, write and run anything this user may) "
     "(default: none)"),
    ("--tools-runtime", tools_runtime, "none",
     "where tools run: none (the host; kvshare has no container or ssh runtime)"),
    ("--mcp-servers-config", str, None,
     "JSON file of MCP stdio servers (Cursor's mcpServers format) whose tools /tools serves "
     "as <server>_<tool> (default: none)"),
    ("--mcp-servers-json", str, None,
     "the same MCP server definitions inline, as JSON (default: none)"),
    ("--ui-mcp-proxy", TOGGLE, False,
     "serve llama-server's MCP CORS proxy at /cors-proxy?url=... for a web UI (default: off, "
     "a 403)"),
    ("--agent", TOGGLE, False,
     "llama-server's -ag: every built-in tool and the MCP CORS proxy on (--no-agent: both "
     "off; a later --tools or --ui-mcp-proxy wins) (default: off)"),
    ("--max-body-mib", positive_int, 16, "largest request body in MiB (larger: 413)"),
    ("--body-timeout", positive_float, 30.0,
     "seconds a client gets to send a request's headers, and the longest gap while it sends "
     "a body (the whole body: 10x this); then 408 and the connection closed. Also the "
     "keep-alive idle time"),
    ("--max-connections", positive_int, 1024,
     "requests in progress at once (/health, /metrics not counted); more get 503 with "
     "Retry-After"),
    ("--graceful-timeout", non_negative_float, 10.0, "seconds in-flight requests get at shutdown"),
    ("--log-level", str, "info", "debug, info, warning or error"),
    ("--verbose", None, False, "log everything: --log-level debug"),
    # llama-server's sampling defaults: a request that leaves a field out gets this value
    # (server/settings.py ServerSettings.sampling_defaults, apis/sampling_fields.py)
    ("--temp", float, None,
     "temperature of requests that give none (0: greedy)"),
    ("--top-k", int, None, "top_k of requests that give none (0: off)"),
    ("--top-p", float, None, "top_p of requests that give none (1: off)"),
    ("--min-p", float, None, "min_p of requests that give none (0: off)"),
    ("--seed", int, None,
     "seed of requests that give none: a fixed seed makes them reproducible (-1: random)"),
    ("--repeat-penalty", float, None, "repeat_penalty of requests that give none (1: off)"),
    ("--repeat-last-n", int, None,
     "repeat_last_n of requests that give none: tokens the penalties look back over "
     "(-1: the context)"),
    ("--presence-penalty", float, None, "presence_penalty of requests that give none (0: off)"),
    ("--frequency-penalty", float, None,
     "frequency_penalty of requests that give none (0: off)"),
]


# Flags that may be given several times: the values are joined with this separator (a value
# from the environment is replaced, not extended, by the flags on the command line).
REPEATABLE = {"--api-key": ",", "--public-prefix": os.pathsep, "--alias": ",", "--tags": ",",
              "--cors-origins": ","}


# Older spellings still accepted (not shown in --help).
OLD_NAMES: dict[str, tuple[str, ...]] = {"--model-store": ("--model-cache",)}

# `kvshare pull` and `kvshare models` take these of OPTIONS.
CATALOG_OPTIONS = ("--model-store", "--hf-token")
