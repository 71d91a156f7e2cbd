"""The server's seam to the engine: `EngineClient` is implemented by the real engine and by
the test fake alike (every member, every keyword the server passes), and `ModelInfo` carries
what the APIs read about the loaded model."""

from __future__ import annotations

import inspect

import pytest

from kvshare.engine.api import EngineClient, GenerationRequest, ModelInfo, RequestRejected
from kvshare.engine.engine import Engine

from fake_engine import FakeEngine
from tier_helpers import TINY_MODEL

MEMBERS = [name for name in dir(EngineClient)
           if not name.startswith("_") and name not in ("info",)]


def keyword_names(fn) -> set[str]:
    return {p.name for p in inspect.signature(fn).parameters.values()
            if p.kind in (p.POSITIONAL_OR_KEYWORD, p.KEYWORD_ONLY)} - {"self"}


@pytest.mark.parametrize("impl", [Engine, FakeEngine])
@pytest.mark.parametrize("name", MEMBERS)
def test_every_member_with_the_protocols_keywords(impl, name):
    theirs = getattr(impl, name, None)
    assert callable(theirs), f"{impl.__name__} lacks EngineClient.{name}"
    missing = keyword_names(getattr(EngineClient, name)) - keyword_names(theirs)
    assert not missing, f"{impl.__name__}.{name} lacks the keywords {sorted(missing)}"


def test_the_fake_is_an_engine_client():
    fake = FakeEngine()
    assert isinstance(fake, EngineClient)
    assert isinstance(fake.info, ModelInfo) and fake.info.ctx_size == fake.ctx_size


def test_real_engine_info_and_checks():
    from kvshare.engine.engine import EngineConfig

    engine = Engine.from_model_path(str(TINY_MODEL), EngineConfig(ctx_size=256, parallel=2))
    try:
        assert isinstance(engine, EngineClient)
        info = engine.info
        assert (info.ctx_size, info.parallel, info.vocab_size) == (256, 2, engine.vocab_size)
        assert info.fingerprint and info.path.endswith(".gguf") and info.max_token_chars >= 1
        assert info.chat_template == engine.chat_template.source
        ids = engine.tokenize("hello", True, True)
        assert (info.bos_id is not None) == (ids[0] == engine.tokenizer.bos_id)
        # the one check of what the engine accepts, with the client's message
        with pytest.raises(RequestRejected) as e:
            engine.submit(GenerationRequest(prompt_tokens=[5] * 256, max_tokens=4))
        assert e.value.code == "context_length_exceeded"
        assert e.value.details == {"n_prompt_tokens": 256, "n_ctx": 256}
        with pytest.raises(RequestRejected, match="empty"):
            engine.submit(GenerationRequest(prompt_tokens=[], max_tokens=4))
        with pytest.raises(RequestRejected) as e:
            engine.submit(GenerationRequest(prompt_tokens=[info.vocab_size], max_tokens=4))
        assert e.value.code == "invalid_token_id"
    finally:
        engine.shutdown()
