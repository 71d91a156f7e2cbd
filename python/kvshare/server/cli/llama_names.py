"""llama-server's spelling of kvshare's flags (tools/server/README.md, common/arg.cpp): its
other names and `LLAMA_ARG_*` environment variables for the flags kvshare has, and the
llama-server flags kvshare refuses, with the reason each error line gives."""

from __future__ import annotations

# llama-server's names for kvshare's flags (tools/server/README.md, common/arg.cpp): flag ->
# (other flag names, llama-server's environment variable, read after KVSHARE_<FLAG>).
LLAMA_NAMES: dict[str, tuple[tuple[str, ...], str | None]] = {
    "--model": (("-m",), "LLAMA_ARG_MODEL"),
    "--hf-repo": (("-hf", "-hfr"), "LLAMA_ARG_HF_REPO"),
    "--hf-file": (("-hff",), "LLAMA_ARG_HF_FILE"),
    "--hf-token": (("-hft",), None),
    "--host": ((), "LLAMA_ARG_HOST"),
    "--port": ((), "LLAMA_ARG_PORT"),
    "--parallel": (("-np",), "LLAMA_ARG_N_PARALLEL"),
    "--ctx-size": (("-c",), "LLAMA_ARG_CTX_SIZE"),
    "--n-predict": (("-n", "--predict"), "LLAMA_ARG_N_PREDICT"),
    "--threads": (("-t",), "LLAMA_ARG_THREADS"),
    "--alias": (("-a",), "LLAMA_ARG_ALIAS"),
    "--tags": ((), "LLAMA_ARG_TAGS"),
    "--api-key": ((), "LLAMA_API_KEY"),
    "--api-key-file": ((), "LLAMA_ARG_API_KEY_FILE"),
    "--cache-ram": (("-cram",), "LLAMA_ARG_CACHE_RAM"),
    "--swa-full": ((), "LLAMA_ARG_SWA_FULL"),
    "--ctx-checkpoints": (("-ctxcp", "--swa-checkpoints"), "LLAMA_ARG_CTX_CHECKPOINTS"),
    "--checkpoint-min-step": (("-cms",), "LLAMA_ARG_CHECKPOINT_MIN_SPACING_NT"),
    "--body-timeout": (("-to", "--timeout"), "LLAMA_ARG_TIMEOUT"),
    "--chat-template": ((), "LLAMA_ARG_CHAT_TEMPLATE"),
    "--chat-template-file": ((), "LLAMA_ARG_CHAT_TEMPLATE_FILE"),
    "--jinja": ((), "LLAMA_ARG_JINJA"),
    "--reasoning-format": ((), "LLAMA_ARG_THINK"),
    "--reasoning": (("-rea",), "LLAMA_ARG_REASONING"),
    "--reasoning-budget": ((), "LLAMA_ARG_THINK_BUDGET"),
    "--reasoning-budget-message": ((), "LLAMA_ARG_THINK_BUDGET_MESSAGE"),
    "--cors-origins": ((), "LLAMA_ARG_CORS_ORIGINS"),
    "--cors-methods": ((), "LLAMA_ARG_CORS_METHODS"),
    "--cors-headers": ((), "LLAMA_ARG_CORS_HEADERS"),
    "--cors-credentials": ((), "LLAMA_ARG_CORS_CREDENTIALS"),
    "--slots": ((), "LLAMA_ARG_ENDPOINT_SLOTS"),
    "--metrics": ((), "LLAMA_ARG_ENDPOINT_METRICS"),
    "--cont-batching": (("-cb",), "LLAMA_ARG_CONT_BATCHING"),
    "--no-webui": (("--no-ui",), None),
    "--slot-save-path": ((), None),
    "--batch-size": (("-b",), "LLAMA_ARG_BATCH"),
    "--ubatch-size": (("-ub",), "LLAMA_ARG_UBATCH"),
    "--kv-unified": (("-kvu",), "LLAMA_ARG_KV_UNIFIED"),
    "--kv-unified-per-slot": ((), "LLAMA_ARG_KV_UNIFIED_PER_SLOT"),
    "--n-gpu-layers": (("-ngl", "--gpu-layers"), "LLAMA_ARG_N_GPU_LAYERS"),
    "--flash-attn": (("-fa",), "LLAMA_ARG_FLASH_ATTN"),
    "--offline": ((), "LLAMA_OFFLINE"),
    "--verbose": (("-v", "--log-verbose"), None),
    "--seed": (("-s",), None),
    "--backend-sampling": (("-bs",), "LLAMA_ARG_BACKEND_SAMPLING"),
    "--context-shift": ((), "LLAMA_ARG_CONTEXT_SHIFT"),
    "--keep": ((), None),
    "--tools": ((), "LLAMA_ARG_TOOLS"),
    "--tools-runtime": ((), "LLAMA_ARG_TOOLS_RUNTIME"),
    "--mcp-servers-config": ((), "LLAMA_ARG_MCP_SERVERS_CONFIG"),
    "--mcp-servers-json": ((), "LLAMA_ARG_MCP_SERVERS_JSON"),
    "--ui-mcp-proxy": (("--webui-mcp-proxy", "--no-webui-mcp-proxy"), "LLAMA_ARG_UI_MCP_PROXY"),
    "--agent": (("-ag", "-no-ag"), "LLAMA_ARG_AGENT"),
    "--cache-idle-slots": ((), "LLAMA_ARG_CACHE_IDLE_SLOTS"),
    "--ui-config": (("--webui-config",), "LLAMA_ARG_UI_CONFIG"),
    "--ui-config-file": (("--webui-config-file",), "LLAMA_ARG_UI_CONFIG_FILE"),
    "--sleep-idle-seconds": ((), None),
    "--models-dir": ((), "LLAMA_ARG_MODELS_DIR"),
    "--models-preset": ((), "LLAMA_ARG_MODELS_PRESET"),
    "--models-max": ((), "LLAMA_ARG_MODELS_MAX"),
    "--models-autoload": ((), "LLAMA_ARG_MODELS_AUTOLOAD"),
}

# llama-server flags kvshare refuses, with the reason (or what to use instead) in the one-line
# error. Any other unknown flag is refused too, just without a reason.
_NO_EMBEDDINGS = "kvshare generates text only: no embeddings or reranking"
_NO_LORA = "kvshare has no LoRA adapters"
_NO_DRAFT = "kvshare has no speculative decoding"
_TEXT_ONLY = "kvshare is text only: no vision or audio projector, no media files"
REFUSED = {
    "--no-cont-batching": "kvshare always batches continuously",
    "-nocb": "kvshare always batches continuously",
    "-dev": "use --device cpu or cuda",
    "-ctk": "use --kv-dtype", "--cache-type-k": "use --kv-dtype",
    "-ctv": "use --kv-dtype", "--cache-type-v": "use --kv-dtype",
    "--embedding": _NO_EMBEDDINGS, "--embeddings": _NO_EMBEDDINGS, "--rerank": _NO_EMBEDDINGS,
    "--reranking": _NO_EMBEDDINGS, "--pooling": _NO_EMBEDDINGS,
    "--lora": _NO_LORA, "--lora-scaled": _NO_LORA, "--lora-init-without-apply": _NO_LORA,
    "-md": _NO_DRAFT, "--model-draft": _NO_DRAFT, "-hfd": _NO_DRAFT, "--spec-default": _NO_DRAFT,
    "--draft-max": _NO_DRAFT, "--draft-min": _NO_DRAFT, "--draft": _NO_DRAFT,
    "--spec-type": _NO_DRAFT, "--spec-draft-n-max": _NO_DRAFT, "--spec-draft-n-min": _NO_DRAFT,
    "--spec-synth-len": _NO_DRAFT, "--spec-synth-rates": _NO_DRAFT,
    "-mm": _TEXT_ONLY, "--mmproj": _TEXT_ONLY, "-mmu": _TEXT_ONLY, "--mmproj-url": _TEXT_ONLY,
    "--no-mmproj": _TEXT_ONLY, "--media-path": _TEXT_ONLY,
}
