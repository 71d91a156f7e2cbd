"""RAM and disk tiers behind the pool, on the real default model: a returning conversation is
served from a tier and its tokens equal a cold run's."""

from __future__ import annotations

import pytest

from kvshare import _core
from kvshare.engine.api import GenerationRequest, SamplingParams
from kvshare.engine.engine import Engine, EngineConfig
from test_engine import SYSTEM, collect, parts, prompt  # noqa: F401  (module fixture)

GREEDY = SamplingParams(temperature=0.0)


def engine(parts, **kw) -> Engine:  # noqa: F811
    model, tok, tmpl, fp = parts
    cfg = EngineConfig(**{"kv_blocks": 64, "block_size": 16, "prefill_chunk": 128,
                          "cache_ram_mib": 0, "cache_min_tokens": 32, **kw})
    return Engine(model, tok, tmpl, fp, cfg)


def run(eng: Engine, ids, n=6):
    h = eng.submit(GenerationRequest(prompt_tokens=list(ids), max_tokens=n, sampling=GREEDY))
    eng.run_until_idle()
    return collect(h)


def turn2(parts, first, reply):  # noqa: F811
    return first + reply + parts[1].encode("<end_of_turn>\n<start_of_turn>user\nAnd then?<end_of_turn>\n"
                                           "<start_of_turn>model\n", add_special=False)


def evict_everything(eng: Engine, parts):  # noqa: F811
    # Fill the small pool with other conversations so the first one's blocks are reused.
    for i in range(3):
        run(eng, prompt(parts, f"Unrelated system prompt number {i}. " * 12, "Hi."), 2)


def test_ram_tier_serves_an_evicted_conversation(parts):  # noqa: F811
    first = prompt(parts, SYSTEM, "Describe the build.")
    cold_eng = engine(parts, slot_attach=False)
    reply, _ = run(cold_eng, first)
    second = turn2(parts, first, reply)
    cold, _ = run(cold_eng, second)

    eng = engine(parts, cache_ram_mib=256, kv_blocks=16)
    assert run(eng, first)[0] == reply
    evict_everything(eng, parts)
    keys = _core.hash_blocks(eng.cache.root_key(None), first, 16)
    assert eng.pool.match_prefix(keys)[0] == [], "the first conversation should be out of the pool"
    got, fin = run(eng, second)
    assert got == cold
    assert fin.timings.cache_n >= 0.9 * len(first)
    snap = eng.snapshot()["tiers"]["ram"]
    assert snap["restores"] >= 1 and snap["tokens_served"] >= 16
    eng.pool.check_invariants()
    assert eng.pool.stats()["used"] == 0


def test_disk_tier_survives_a_restart_and_resident_blocks_cost_no_reads(parts, tmp_path):  # noqa: F811
    first = prompt(parts, SYSTEM, "What does the CI do?")
    cold_eng = engine(parts, slot_attach=False)
    reply, _ = run(cold_eng, first)
    second = turn2(parts, first, reply)
    cold, _ = run(cold_eng, second)

    eng = engine(parts, cache_dir=str(tmp_path))
    run(eng, first)
    # Resident in the pool: served there, zero disk reads.
    got, fin = run(eng, second)
    assert got == cold
    assert eng.snapshot()["tiers"]["disk"]["bytes_read"] == 0
    eng.shutdown(timeout=1)
    # "Restart": a new engine on the same directory.
    eng2 = engine(parts, cache_dir=str(tmp_path))
    got2, fin2 = run(eng2, second)
    assert got2 == cold
    assert fin2.timings.cache_n >= 0.95 * (len(second) - 16)
    disk = eng2.snapshot()["tiers"]["disk"]
    assert disk["restores"] == 1 and disk["bytes_read"] > 0
    eng2.shutdown(timeout=1)


def test_corrupt_disk_entry_is_recomputed_not_served(parts, tmp_path):  # noqa: F811
    first = prompt(parts, SYSTEM, "Name one file.")
    cold, _ = run(engine(parts, slot_attach=False), first)
    eng = engine(parts, cache_dir=str(tmp_path))
    run(eng, first)
    eng.shutdown(timeout=1)
    for f in tmp_path.glob("*.kv"):
        data = bytearray(f.read_bytes())
        data[len(data) // 2] ^= 0xFF
        f.write_bytes(bytes(data))
    eng2 = engine(parts, cache_dir=str(tmp_path))
    got, fin = run(eng2, first)
    assert got == cold
    assert eng2.snapshot()["tiers"]["disk"]["evictions_corrupt"] >= 1
    eng2.shutdown(timeout=1)
