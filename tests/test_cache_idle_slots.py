"""`--cache-idle-slots` / `--no-cache-idle-slots` (EngineConfig.cache_idle_slots) on the tiny
model: by default a finished request's full blocks are copied to the RAM tier; switched off,
the RAM tier holds only the prefix entry pinned while the prompt was computed, the finished
blocks stay findable in the KV pool, and the disk tier still gets them."""

from __future__ import annotations

import pytest

from kvshare import _core
from kvshare.engine.api import GenerationRequest, SamplingParams
from kvshare.engine.engine import Engine, EngineConfig
from kvshare.server.cli.config import engine_config_kwargs
from kvshare.server.cli.parser import parse_args
from tier_helpers import TINY_MODEL

BS = 16
PROMPT = list(range(10, 10 + 7 * BS + 5))  # 7 full blocks and a partial one
BOUNDARY = 2 * BS  # the "first user message": a 2-block prefix entry


def finish_one(tmp_path, cache_idle_slots: bool) -> Engine:
    cfg = EngineConfig(kv_blocks=64, block_size=BS, cache_ram_mib=64, cache_dir=str(tmp_path),
                       cache_min_tokens=16, cache_idle_slots=cache_idle_slots)
    eng = Engine.from_model_path(str(TINY_MODEL), cfg)
    eng.submit(GenerationRequest(prompt_tokens=PROMPT, max_tokens=4,
                                 sampling=SamplingParams(temperature=0.0),
                                 first_user_boundary=BOUNDARY))
    eng.run_until_idle()  # flushes the tier saves
    eng.tiers.disk.flush()
    return eng


@pytest.mark.parametrize("on", [True, False])
def test_the_switch_decides_what_the_ram_tier_holds(tmp_path, on):
    eng = finish_one(tmp_path, on)
    ram = eng.tiers.ram.stats()
    keys = _core.hash_blocks(eng.cache.root_key(None), PROMPT, BS)
    assert len(keys) == 7
    if on:  # the whole finished prompt (+ reply's full blocks) in RAM
        assert ram["blocks"] >= 7, ram
        assert all(eng.tiers.ram.contains_block(k) for k in keys)
    else:  # only the pinned prefix entry
        assert ram["blocks"] == BOUNDARY // BS and ram["pinned"] == BOUNDARY // BS, ram
        assert [eng.tiers.ram.contains_block(k) for k in keys] == [True] * 2 + [False] * 5
    # either way the blocks stay in the pool and reach the disk tier
    assert len(eng.pool.match_prefix(keys)[0]) == 7
    assert eng.tiers.disk.stored_prefix(keys) == 7
    eng.shutdown()


def test_flags_and_llama_env_reach_the_engine_config():
    assert engine_config_kwargs(parse_args(["--no-cache-idle-slots"]))["cache_idle_slots"] \
        is False
    assert "cache_idle_slots" not in engine_config_kwargs(parse_args(["--cache-idle-slots"]))
    args = parse_args([], environ={"LLAMA_ARG_CACHE_IDLE_SLOTS": "0"})
    assert engine_config_kwargs(args)["cache_idle_slots"] is False
