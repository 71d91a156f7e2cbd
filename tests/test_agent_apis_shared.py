"""One rendering path for three APIs (issue 12): an agent's system prompt and tools sent through
`/v1/chat/completions`, `/v1/messages` and `/v1/responses` render the same tokens, so a session
on one API attaches to the prefix another API's session computed.

A real server (`kvshare serve`, loopback, Gemma 3 270M, whose template renders tools) driven by
the official `openai` and `anthropic` SDKs. The shared prefix is measured with the model's own
template and tokenizer (everything before the first user message), and each later API's
request must report at least 95% of it as cached.
"""

from __future__ import annotations

import pytest

from tier_helpers import Server

TIMEOUT = 300.0

SYSTEM = " ".join(
    f"Rule {i}: when the user asks about module m{i}, open src/m{i}.py first, read its tests in "
    f"tests/test_m{i}.py, and answer with the file and line you relied on."
    for i in range(24))

TOOL_PARAMS = {"type": "object",
               "properties": {"path": {"type": "string", "description": "file to open"},
                              "line": {"type": "integer"}},
               "required": ["path"]}
TOOL_DESC = "Open a file of the repository and return its text."


def _model_path() -> str:
    from kvshare.model.loader import default_model_path

    return str(default_model_path())


@pytest.fixture(scope="module")
def server(launcher):
    s = Server(launcher, "--parallel", "2", "--kv-unified-per-slot", "4096", model=_model_path())
    yield s
    s.terminate()


def shared_prefix_tokens() -> int:
    """Tokens before the first user message, as the server's template renders them."""
    from kvshare.model.chat_template import ChatTemplate
    from kvshare.model.tokenizer import Tokenizer

    path = _model_path()
    tok = Tokenizer.from_gguf(path)
    tmpl = ChatTemplate.from_gguf(path, tok)
    tools = [{"type": "function", "function": {"name": "open_file", "description": TOOL_DESC,
                                               "parameters": TOOL_PARAMS}}]
    r = tmpl.apply(tok, [{"role": "system", "content": SYSTEM},
                         {"role": "user", "content": "hello"}], tools=tools)
    assert r.first_user_token is not None
    return r.first_user_token


def test_chat_messages_and_responses_attach_to_one_prefix(server):
    import anthropic
    import openai

    prefix = shared_prefix_tokens()
    assert prefix > 400  # long enough that 95% is a strict bound on whole blocks
    oa = openai.OpenAI(base_url=server.url + "/v1", api_key="k", timeout=TIMEOUT, max_retries=0)
    an = anthropic.Anthropic(base_url=server.url, api_key="k", timeout=TIMEOUT, max_retries=0)

    chat = oa.chat.completions.create(
        model="agent", max_tokens=4, temperature=0,
        messages=[{"role": "system", "content": SYSTEM},
                  {"role": "user", "content": "Which file holds module m3?"}],
        tools=[{"type": "function", "function": {"name": "open_file", "description": TOOL_DESC,
                                                 "parameters": TOOL_PARAMS}}])
    assert chat.usage.prompt_tokens > prefix
    first_cached = chat.usage.prompt_tokens_details.cached_tokens or 0
    assert first_cached < prefix, "the first session should compute the prefix"

    msg = an.messages.create(  # this SDK takes no `temperature` argument: send it in the body
        model="agent", max_tokens=4, extra_body={"temperature": 0}, system=SYSTEM,
        messages=[{"role": "user", "content": "Where are the tests of module m7?"}],
        tools=[{"name": "open_file", "description": TOOL_DESC, "input_schema": TOOL_PARAMS}])
    read = msg.usage.cache_read_input_tokens or 0
    assert read >= 0.95 * prefix, (read, prefix)
    total = msg.usage.input_tokens + read + (msg.usage.cache_creation_input_tokens or 0)
    assert total > prefix

    resp = oa.responses.create(
        model="agent", max_output_tokens=16, temperature=0, instructions=SYSTEM,
        input="Summarize rule 11 in five words.",
        tools=[{"type": "function", "name": "open_file", "description": TOOL_DESC,
                "parameters": TOOL_PARAMS, "strict": False}], store=False)
    cached = resp.usage.input_tokens_details.cached_tokens
    assert cached >= 0.95 * prefix, (cached, prefix)
    assert resp.usage.input_tokens > prefix


def test_a_different_system_prompt_does_not_attach(server):
    """The control: the same user turn after another system prompt shares no prefix."""
    import anthropic

    an = anthropic.Anthropic(base_url=server.url, api_key="k", timeout=TIMEOUT, max_retries=0)
    msg = an.messages.create(
        model="agent", max_tokens=2, extra_body={"temperature": 0},
        system="Reply tersely. " + SYSTEM[::-1],
        messages=[{"role": "user", "content": "Where are the tests of module m7?"}],
        tools=[{"name": "open_file", "description": TOOL_DESC, "input_schema": TOOL_PARAMS}])
    assert (msg.usage.cache_read_input_tokens or 0) < 0.2 * shared_prefix_tokens()
