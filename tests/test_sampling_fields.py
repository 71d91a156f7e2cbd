"""The one table of sampling fields (apis/sampling_fields.py) read through each API's dialect:
defaults, limits refused or clamped, names, llama-server's `samplers`, and the server's own
defaults (llama-server's --temp, --top-k, ...) under a request's values."""

import dataclasses

import pytest

from kvshare.apis.anthropic_request import parse_messages_request
from kvshare.apis.base import RequestContext
from kvshare.apis.llama_request import default_settings
from kvshare.apis.sampling_fields import (FIELDS, LLAMA_SERVER, OPENAI, RESPONSES,
                                          check_server_defaults, parse_sampling)
from kvshare.engine.api import SamplingParams
from kvshare.server.errors import APIError

CTX = 4096


def test_every_sampling_param_has_one_row():
    """A knob added to SamplingParams without a row here would be unreachable from every API."""
    params = {f.name for f in dataclasses.fields(SamplingParams)} - {"logit_bias"}
    rows = [f.param for f in FIELDS]
    assert sorted(rows) == sorted(params) and len(rows) == len(set(rows))


def test_defaults_per_api():
    assert parse_sampling({}, OPENAI, ctx_size=CTX) == SamplingParams()
    assert parse_sampling({}, RESPONSES, ctx_size=CTX) == SamplingParams()
    s = parse_sampling({}, LLAMA_SERVER, ctx_size=CTX)
    assert (s.temperature, s.top_k, s.top_p, s.min_p) == (0.8, 40, 0.95, 0.05)
    assert (s.repetition_penalty, s.penalty_last_n, s.seed) == (1.0, 64, None)


def test_server_defaults_fill_in_and_requests_win():
    server = {"temperature": 0.2, "top_k": 7, "seed": 42, "min_p": 0.1}
    for dialect in (OPENAI, LLAMA_SERVER, RESPONSES):
        s = parse_sampling({}, dialect, ctx_size=CTX, server_defaults=server)
        assert (s.temperature, s.top_k, s.seed, s.min_p) == (0.2, 7, 42, 0.1)
    s = parse_sampling({"temperature": 0.9, "seed": 5}, OPENAI, ctx_size=CTX,
                       server_defaults=server)
    assert (s.temperature, s.seed, s.top_k) == (0.9, 5, 7)
    # an API without the field (Responses has no top_k) still gets the server's default,
    # and a request cannot set it there
    s = parse_sampling({"top_k": 3}, RESPONSES, ctx_size=CTX, server_defaults=server)
    assert s.top_k == 7


@pytest.mark.parametrize("body", [{"top_p": 1.5}, {"temperature": -1}, {"min_p": 2},
                                  {"temperature": 101}, {"presence_penalty": 3},
                                  {"repetition_penalty": 0.001}, {"top_k": -2},
                                  {"top_k": 1.5}, {"seed": "7"}, {"temperature": True}])
def test_openai_refuses_out_of_range(body):
    with pytest.raises(APIError) as e:
        parse_sampling(body, OPENAI, ctx_size=CTX)
    assert e.value.status == 400 and e.value.param == next(iter(body))


def test_llama_server_clamps_soft_limits_and_refuses_hard_ones():
    s = parse_sampling({"top_p": 1.5, "min_p": -1, "temperature": -3, "top_k": -5},
                       LLAMA_SERVER, ctx_size=CTX)
    assert (s.top_p, s.min_p, s.temperature, s.top_k) == (1.0, 0.0, 0.0, 0)
    assert parse_sampling({"top_k": 12.7}, LLAMA_SERVER, ctx_size=CTX).top_k == 12
    for body in ({"temperature": 101}, {"presence_penalty": -3}, {"repeat_penalty": 0}):
        with pytest.raises(APIError):
            parse_sampling(body, LLAMA_SERVER, ctx_size=CTX)


def test_names_and_engine_values():
    s = parse_sampling({"repeat_penalty": 1.3, "repetition_penalty": 1.1,
                        "repeat_last_n": -1, "seed": -1}, OPENAI, ctx_size=CTX)
    assert (s.repetition_penalty, s.penalty_last_n, s.seed) == (1.3, CTX, None)
    s = parse_sampling({"repetition_penalty": 1.1, "penalty_last_n": 8, "seed": -2},
                       OPENAI, ctx_size=CTX)
    assert (s.repetition_penalty, s.penalty_last_n, s.seed) == (1.1, 8, 2**64 - 2)
    # llama-server knows only its own names
    s = parse_sampling({"repetition_penalty": 1.1}, LLAMA_SERVER, ctx_size=CTX)
    assert s.repetition_penalty == 1.0


def test_samplers_turn_fields_off():
    s = parse_sampling({"top_k": 5, "top_p": 0.5, "repeat_penalty": 1.2}, LLAMA_SERVER,
                       ctx_size=CTX, samplers=["top_k", "temperature"])
    assert (s.top_k, s.top_p, s.min_p, s.repetition_penalty) == (5, 1.0, 0.0, 1.0)
    assert s.temperature == 0.8


def test_anthropic_limits_in_its_wording():
    ctx = RequestContext(model_name="m", ctx_size=CTX, vocab_size=None, max_n=8,
                         sampling_defaults={"temperature": 0.3})
    body = {"model": "m", "max_tokens": 5, "messages": [{"role": "user", "content": "hi"}]}
    req = parse_messages_request(dict(body, top_k=3), ctx, generate=True)
    assert (req.opts.sampling.temperature, req.opts.sampling.top_k) == (0.3, 3)
    with pytest.raises(APIError) as e:
        parse_messages_request(dict(body, temperature=1.5), ctx, generate=True)
    assert e.value.message == "temperature: Input should be less than or equal to 1"
    # min_p is no Anthropic field: ignored, as unknown fields are
    assert parse_messages_request(dict(body, min_p=5), ctx, generate=True).opts.sampling.min_p == 0


def test_props_show_the_server_defaults():
    d = default_settings(None, {"temperature": 0.1, "top_k": 3, "seed": 9})
    assert (d["temperature"], d["top_k"], d["seed"], d["top_p"]) == (0.1, 3, 9, 0.95)
    d = default_settings(None)
    assert (d["temperature"], d["top_k"], d["top_p"], d["min_p"]) == (0.8, 40, 0.95, 0.05)


def test_server_defaults_checked():
    check_server_defaults({"temperature": 0.5, "top_k": 10})
    with pytest.raises(ValueError, match="top_p"):
        check_server_defaults({"top_p": 2})
    with pytest.raises(ValueError, match="unknown"):
        check_server_defaults({"tempreature": 1})
