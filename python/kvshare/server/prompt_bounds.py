"""Prompt bounds: how much text one request may make the server render and tokenize.

A prompt of C characters has at least C / L tokens, L being the longest token text of the
vocabulary (every token covers at most L characters of the text it was cut from; see
`max_token_chars`). A prompt longer than (ctx - 1) * L characters is rejected with the usual
400 `context_length_exceeded` without being tokenized, so a prompt is tokenized only when it is
at most ctx * L characters long: tokenization cost and memory are bounded by the context size,
not by the body limit. Prompts that fit tokenize exactly as before. `/tokenize` and
`/detokenize` have their own caps (below).
"""

from __future__ import annotations

from .errors import bad_request

MiB = 1024 * 1024
# /tokenize: characters of `content` (at least this; more with a context over 256K tokens:
# 4 * ctx), and tokens returned with `with_pieces`.
TOKENIZE_MIN_CHARS = 1 << 20
TOKENIZE_MAX_PIECES = 1 << 17
# /detokenize: token ids in, characters out.
DETOKENIZE_MAX_TOKENS = 1 << 17
DETOKENIZE_MAX_CHARS = 4 * MiB


# --------------------------------------------------------------------------- prompt bounds

class PromptBounds:
    """The no-tokenization context check (see the module doc). `max_chars_per_token`: the
    model's longest token text (`ModelInfo.max_token_chars`); None checks nothing."""

    def __init__(self, max_chars_per_token: int | None):
        self.max_chars_per_token = max_chars_per_token

    def limit_chars(self, ctx: int) -> int | None:
        """Prompts longer than this many characters certainly have >= ctx tokens."""
        per = self.max_chars_per_token
        return None if per is None else (ctx - 1) * per

    def may_exceed(self, n_chars: int, ctx: int) -> bool:
        """Whether a text of up to `n_chars` characters might not fit: a chat whose body is
        this large is rendered (not tokenized) and checked first."""
        limit = self.limit_chars(ctx)
        return limit is not None and n_chars > limit

    def check_text(self, n_chars: int, ctx: int, param: str) -> None:
        per = self.max_chars_per_token
        if per is not None and self.may_exceed(n_chars, ctx):
            at_least = -(-n_chars // per)
            raise bad_request(
                f"This model's maximum context length is {ctx} tokens, but the prompt has at "
                f"least {at_least} tokens ({n_chars} characters; no token of this model is "
                f"longer than {per} characters)", param, "context_length_exceeded")


def tokenize_max_chars(ctx: int) -> int:
    return max(TOKENIZE_MIN_CHARS, 4 * ctx)


