"""The HTTP APIs kvshare speaks, one module per API, each a thin translator between its wire
format and the generation pipeline's typed request and events (`kvshare.server.pipeline`):
OpenAI chat completions (`openai_chat`), OpenAI completions (`openai_completions`), OpenAI
Responses (`responses`, with its store), Anthropic Messages (`anthropic`) and llama-server's
native API (`llama_server`: /completion, /infill; `llama_slots`: /slots and slot files).
Request fields every API shares are parsed by `parsing`; `base` holds the typed request and
the response-format interface."""
