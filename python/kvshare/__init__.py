"""kvshare: an OpenAI-compatible LLM server for agents that computes a shared prompt prefix once."""

from kvshare._core import __version__  # noqa: F401
