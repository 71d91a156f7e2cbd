"""Several prompts in one request (llama-server's list of prompts on `/completion`,
`/completions` and `/v1/completions`), parsed as llama-server's `tokenize_input_prompts`
reads them: an array holding any token id is ONE prompt (ids, or strings and ids mixed);
any other array is one prompt per element (a string, an array of ids or of strings and ids,
or `{"prompt_string": ...}`).

The API parses each prompt into its own `ApiRequest` (`PromptListRequest.parts`); the
pipeline generates each as its own sequence (`server/prompt_list.py`) and the answer holds
one result per prompt, each with its `index`. The count is bounded by `--max-n` (times `n`
on `/v1/completions`), the most sequences one request may start."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from kvshare.server.errors import bad_request

from .base import ApiRequest


@dataclass
class PromptListRequest(ApiRequest):
    """A request that may carry several prompts: `parts` holds one request per prompt when
    there are several (empty: this request is the one prompt). `merged_choices`: the answer
    is one object whose `choices` hold every prompt's (OpenAI) rather than an array of one
    result per prompt (llama-server's native API)."""

    parts: list[ApiRequest] = field(default_factory=list)
    index: int = 0  # a part's place in the request's list (its results' `index`)
    merged_choices = False


def is_token_id(x: Any) -> bool:
    return isinstance(x, int) and not isinstance(x, bool)


def split_prompts(v: Any) -> list[Any]:
    """The prompts of a `prompt` field, each still in its JSON form: an array without token
    ids is one prompt per element; anything else (a string, ids, a mix) is one prompt."""
    if isinstance(v, list) and v and not any(is_token_id(x) for x in v):
        return list(v)
    return [v]


def check_count(n_prompts: int, n_choices: int, max_n: int) -> None:
    """At most `max_n` sequences (prompts times choices) per request."""
    if n_prompts * n_choices > max_n:
        what = f"{n_prompts} prompts" + (f" x {n_choices} choices" if n_choices > 1 else "")
        raise bad_request(f"'prompt' holds {what}; at most {max_n} sequences per request "
                          "(--max-n)", "prompt")
