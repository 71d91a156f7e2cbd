"""RAM and disk tiers behind the pool, on the real default model: a returning conversation is
served from a tier and its tokens equal a cold run's."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

from kvshare import _core
from kvshare.engine.api import GenerationRequest, SamplingParams
from kvshare.engine.engine import Engine, EngineConfig
from test_engine import SYSTEM, collect, parts, prompt  # noqa: F401  (module fixture)

GREEDY = SamplingParams(temperature=0.0)


def engine(parts, **kw) -> Engine:  # noqa: F811
    model, tok, tmpl, fp = parts
    # the RAM budgets below are counted in f32 blocks (8 KiB): the pool's dtype is explicit
    cfg = EngineConfig(**{"kv_blocks": 64, "block_size": 16, "prefill_chunk": 128,
                          "cache_ram_mib": 0, "cache_min_tokens": 32, "kv_dtype": "f32", **kw})
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


@pytest.mark.parametrize("chunk_blocks", [64, 2])
def test_disk_tier_survives_a_restart_and_resident_blocks_cost_no_reads(parts, tmp_path,  # noqa: F811
                                                                        monkeypatch, chunk_blocks):
    # chunk_blocks 2: the restore runs as a pipeline of many chunk reads (tiers.DISK_DEPTH)
    import kvshare.engine.cache.tiers as T

    monkeypatch.setattr(T, "CHUNK_BLOCKS", chunk_blocks)
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


@pytest.mark.parametrize("chunk_blocks", [64, 2])
def test_corrupt_disk_entry_is_recomputed_not_served(parts, tmp_path, monkeypatch,  # noqa: F811
                                                     chunk_blocks):
    # chunk_blocks 2: the bad byte sits in a middle chunk while later ones are being read
    import kvshare.engine.cache.tiers as T

    monkeypatch.setattr(T, "CHUNK_BLOCKS", chunk_blocks)
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


# ---- prefix entries pinned in RAM (tiny attention-only chat model: 8 KiB per block) ---------

TINY_QWEN3 = Path(__file__).parent / "data" / "models" / "tiny-qwen3-chat.gguf"
AGENT_SYSTEM = ("You are the build agent. Tools: search(q), open(path), run(cmd), diff(a, b). "
                "Answer in one line and never guess file names.")


@pytest.fixture(scope="module")
def tiny():
    from kvshare.model.chat_template import ChatTemplate
    from kvshare.model.loader import load_model
    from kvshare.model.tokenizer import Tokenizer

    model = load_model(TINY_QWEN3)
    tok = Tokenizer.from_gguf(TINY_QWEN3)
    return model, tok, ChatTemplate.from_gguf(TINY_QWEN3, tok), bytes.fromhex(model.fingerprint)


def chat_request(eng: Engine, system: str, user: str, n=4) -> GenerationRequest:
    text, boundary = eng.apply_chat_template([{"role": "system", "content": system},
                                              {"role": "user", "content": user}])
    return GenerationRequest(prompt_tokens=eng.tokenize(text), max_tokens=n, sampling=GREEDY,
                             first_user_boundary=boundary, logprobs=True, top_logprobs=3)


def serve(eng: Engine, req: GenerationRequest):
    h = eng.submit(req)
    eng.run_until_idle()
    toks, fin = h.result(timeout=0)
    return [(t.token_id, t.logprob and t.logprob.logprob) for t in toks if t.token_id >= 0], fin


def flood(eng: Engine, n_sessions=6):
    """Sessions of the same agent with long, distinct user messages (their tails flood the RAM
    tier's unpinned part), then raw prompts without a chat boundary that push everything out
    of the small device pool."""
    for i in range(n_sessions):
        serve(eng, chat_request(eng, AGENT_SYSTEM, f"Session {i}: " + f"check module {i} and report. " * 5))
    for i in range(3):
        text = f"Unrelated raw completion prompt {i}, no chat template at all. " * 5
        serve(eng, GenerationRequest(prompt_tokens=eng.tokenize(text), max_tokens=2, sampling=GREEDY))


@pytest.mark.parametrize("pin_mib", [None, 0])
def test_prefix_entry_stays_pinned_in_ram_through_a_flood(tiny, pin_mib):
    first_q, new_q = "Where is the linker script?", "Which test is flaky today?"
    cold = engine(tiny, slot_attach=False, kv_blocks=64)
    cold_new, _ = serve(cold, chat_request(cold, AGENT_SYSTEM, new_q))

    # RAM: 32 blocks of 8 KiB, half of it pinnable (the default) or none of it (the control).
    eng = engine(tiny, kv_blocks=48, cache_ram_mib=0.25, cache_ram_pin_mib=pin_mib)
    req = chat_request(eng, AGENT_SYSTEM, first_q)
    bs, boundary = 16, req.first_user_boundary
    assert boundary is not None and boundary >= 6 * bs
    n_prefix = boundary // bs
    root = eng.cache.root_key(None)
    keys = _core.hash_blocks(root, req.prompt_tokens, bs)
    serve(eng, req)
    ram = eng.tiers.ram
    if pin_mib is None:
        assert ram.pinned_bytes == n_prefix * eng.kv.block_nbytes, "pinned as soon as computed"
    flood(eng)
    assert eng.pool.match_prefix(keys)[0] == [], "the prefix should be out of the device pool"
    assert ram.match_prefix(keys) < len(keys), "the first session's tail should be evicted"
    snap = eng.snapshot()["tiers"]["ram"]
    assert snap["evictions"] > 0

    got, fin = serve(eng, chat_request(eng, AGENT_SYSTEM, new_q))
    assert [t for t, _ in got] == [t for t, _ in cold_new]
    assert [lp for _, lp in got] == pytest.approx([lp for _, lp in cold_new], abs=1e-4)
    if pin_mib is None:
        assert ram.match_prefix(keys) == n_prefix
        assert all(ram.is_pinned(k) for k in keys[:n_prefix])
        assert fin.timings.cache_n >= n_prefix * bs
        snap = eng.snapshot()["tiers"]["ram"]
        assert snap["pinned"] == n_prefix and snap["pinned_bytes"] == n_prefix * eng.kv.block_nbytes
        assert snap["restores"] >= 1 and snap["restore_seconds"] > 0
        assert snap["pinned_bytes"] <= snap["pin_budget"] == snap["budget"] // 2
    else:  # the control: without pins the flood took the prefix too
        assert fin.timings.cache_n < n_prefix * bs
        assert eng.snapshot()["tiers"]["ram"]["pinned_bytes"] == 0
    ram.check_invariants()
    eng.pool.check_invariants()
    assert eng.pool.stats()["used"] == 0


def test_finish_event_reaches_the_client_before_the_tier_save(tiny, tmp_path):
    eng = engine(tiny, cache_ram_mib=1, cache_dir=str(tmp_path))
    seen = []
    save = eng.tiers.save

    def checking_save(*args, **kw):
        seen.append(handle.result(timeout=0)[1])  # raises queue.Empty if the finish is not out yet
        return save(*args, **kw)

    eng.tiers.save = checking_save
    handle = eng.submit(chat_request(eng, AGENT_SYSTEM, "Ping?"))
    eng.run_until_idle()
    assert len(seen) == 1 and seen[0].reason in ("stop", "length")
    assert eng.tiers.ram.stats()["blocks"] > 0
    eng.shutdown(timeout=1)


# ---- hybrid models (attention + recurrent layers): blocks plus checkpoints in the tiers -------

@pytest.fixture(scope="module", params=["tiny-qwen35.gguf", "tiny-lfm2.gguf"])
def hybrid(request):
    from kvshare.model.chat_template import ChatTemplate
    from kvshare.model.loader import load_model
    from kvshare.model.tokenizer import Tokenizer

    path = Path(__file__).parent / "data" / "models" / request.param
    model = load_model(path)
    tok = Tokenizer.from_gguf(path)
    return model, tok, ChatTemplate.from_gguf(path, tok), bytes.fromhex(model.fingerprint)


def hybrid_turns(eng: Engine, cold: Engine, system: str, user: str):
    """Turn 1 (served by `eng`) and turn 2 = turn 1 + its reply + a new user message."""
    first = chat_request(eng, system, user, n=7)
    reply, _ = serve(eng, first)
    nxt = eng.tokenize("<|im_end|>\n<|im_start|>user\nAnd then?<|im_end|>\n<|im_start|>assistant\n",
                       add_special=False)
    second = GenerationRequest(prompt_tokens=first.prompt_tokens + [t for t, _ in reply] + nxt,
                               max_tokens=6, sampling=GREEDY, first_user_boundary=first.first_user_boundary,
                               logprobs=True, top_logprobs=3)
    cold_reply, _ = serve(cold, first)
    assert [t for t, _ in cold_reply] == [t for t, _ in reply]
    return first, second, serve(cold, second)[0]


def same_output(got, ref):
    assert [t for t, _ in got] == [t for t, _ in ref]
    assert [lp for _, lp in got] == pytest.approx([lp for _, lp in ref], abs=1e-4)


def flush_device(eng: Engine):
    """Forget everything the device holds: cached pool blocks and stored checkpoints."""
    eng.pool.evict_all_cached()
    store = eng.checkpoints.store
    for key in list(store.keys()):
        store.remove(key)


def test_hybrid_conversation_and_prefix_come_back_from_ram(hybrid):
    system = "You are the release agent. Tools: tag(v), build(t), publish(a). " * 3
    cold = engine(hybrid, slot_attach=False, kv_blocks=256)
    eng = engine(hybrid, kv_blocks=256, cache_ram_mib=4)
    first, second, ref = hybrid_turns(eng, cold, system, "Ship version two.")
    flush_device(eng)
    got, fin = serve(eng, second)
    same_output(got, ref)
    n1 = len(first.prompt_tokens)
    assert fin.timings.cache_n >= n1 - n1 % 16 and fin.timings.cache_n % 16 == 0
    ram = eng.snapshot()["tiers"]["ram"]
    assert ram["checkpoints_served"] == 1 and ram["restores"] == 1 and ram["checkpoints"] >= 2
    # The prefix entry (blocks + checkpoint before the first user message) is pinned.
    boundary = first.first_user_boundary - first.first_user_boundary % 16
    assert ram["pinned"] == boundary // 16 + 1
    flush_device(eng)
    other = chat_request(eng, system, "Roll back the last tag.", n=4)
    got, fin = serve(eng, other)
    same_output(got, serve(cold, other)[0])
    assert fin.timings.cache_n == boundary
    eng.tiers.ram.check_invariants()
    eng.pool.check_invariants()
    assert eng.pool.stats()["used"] == 0


def test_hybrid_reply_state_is_checkpointed_once_when_the_sequence_ends(hybrid, monkeypatch):
    """With tiers, decode keeps the state at the reply's latest block boundary as a snapshot on
    the state's device, overwritten at each boundary (`KVArrays.snapshot_state`: on a GPU no
    transfer and no wait); it becomes a checkpoint, one host copy, when the sequence ends. The
    next turn resumes exactly there: from the pool, and from RAM with the device flushed, with a
    cold run's tokens. (Each boundary was a host copy of the whole state: on a GPU a transfer
    the engine thread waited for, every 16 tokens of every reply.)"""
    system = "You are the triage agent. Tools: label(x), assign(x), close(x). " * 3
    cold = engine(hybrid, slot_attach=False, kv_blocks=256)
    eng = engine(hybrid, kv_blocks=256, cache_ram_mib=4)
    kv = eng.kv
    snapshots, host_reads, truth = [], [], []
    snapshot_state, read_snapshot = kv.snapshot_state, kv.read_snapshot

    def snapshot(slot, into=None):
        truth[:] = [np.array(s[slot]) for s in kv.states]  # the state there (CPU arrays)
        out = snapshot_state(slot, into)
        snapshots.append((slot, out is into))
        return out

    def read(arrays):
        host_reads.append(len(arrays))
        return read_snapshot(arrays)

    monkeypatch.setattr(kv, "snapshot_state", snapshot)
    monkeypatch.setattr(kv, "read_snapshot", read)
    first = chat_request(eng, system, "Triage the new issues.", n=40)
    first.ignore_eos = True
    n_prompt = len(first.prompt_tokens)
    reads_before = len(host_reads)  # (read_state reads through read_snapshot too)
    reply, _ = serve(eng, first)
    computed = n_prompt + len(reply) - 1  # the last token drawn is not computed
    boundaries = [p for p in range(n_prompt + 1, computed + 1) if p % 16 == 0]
    assert len(boundaries) >= 2
    assert len(snapshots) == len(boundaries)
    assert [reused for _, reused in snapshots] == [False] + [True] * (len(boundaries) - 1)
    # the prompt's checkpoints read the state as before; the reply's, once, at the end
    prompt_cks = eng.checkpoints.saved - 1
    assert len(host_reads) - reads_before == prompt_cks + 1, (host_reads, prompt_cks)
    tail = boundaries[-1]
    # the store's checkpoint at the tail holds the state there, not the slot's final one
    key = _core.prefix_key(eng.cache.root_key(None),
                           (first.prompt_tokens + [t for t, _ in reply])[:tail], 16)
    ck = eng.checkpoints.store.get(key)
    assert ck is not None and ck.position == tail
    np.testing.assert_array_equal(
        np.asarray(ck), np.concatenate([a.reshape(-1).view(np.uint8) for a in truth]))
    nxt = eng.tokenize("<|im_end|>\n<|im_start|>user\nAnd the old ones?<|im_end|>\n"
                       "<|im_start|>assistant\n", add_special=False)
    second = GenerationRequest(prompt_tokens=first.prompt_tokens + [t for t, _ in reply] + nxt,
                               max_tokens=6, sampling=GREEDY, logprobs=True, top_logprobs=3,
                               first_user_boundary=first.first_user_boundary)
    cold_first = GenerationRequest(**{**first.__dict__})
    assert [t for t, _ in serve(cold, cold_first)[0]] == [t for t, _ in reply]
    ref = serve(cold, second)[0]
    got, fin = serve(eng, second)
    same_output(got, ref)
    assert fin.timings.cache_n == tail  # from the pool, at the reply's tail checkpoint
    flush_device(eng)
    got, fin = serve(eng, second)
    same_output(got, ref)
    assert fin.timings.cache_n >= tail  # from RAM (the second turn's own tail, if deeper)
    assert eng.snapshot()["tiers"]["ram"]["checkpoints_served"] == 1
    eng.pool.check_invariants()


def test_hybrid_conversation_survives_a_restart_on_disk(hybrid, tmp_path):
    system = "You are the audit agent. Tools: grep(p), blame(f), log(n). " * 3
    cold = engine(hybrid, slot_attach=False, kv_blocks=256)
    eng = engine(hybrid, kv_blocks=256, cache_dir=str(tmp_path))
    first, second, ref = hybrid_turns(eng, cold, system, "Who changed the config?")
    eng.shutdown(timeout=1)
    eng2 = engine(hybrid, kv_blocks=256, cache_dir=str(tmp_path))
    got, fin = serve(eng2, second)
    same_output(got, ref)
    n1 = len(first.prompt_tokens)
    assert fin.timings.cache_n >= n1 - n1 % 16
    disk = eng2.snapshot()["tiers"]["disk"]
    assert disk["checkpoints_served"] == 1 and disk["restores"] == 1 and disk["bytes_read"] > 0
    eng2.shutdown(timeout=1)
    # A damaged checkpoint file is a miss: recomputed, same output.
    for f in tmp_path.glob("*.ckpt"):
        data = bytearray(f.read_bytes())
        data[len(data) // 2] ^= 0xFF
        f.write_bytes(bytes(data))
    eng3 = engine(hybrid, kv_blocks=256, cache_dir=str(tmp_path))
    got, fin = serve(eng3, second)
    same_output(got, ref)
    disk = eng3.snapshot()["tiers"]["disk"]
    assert disk["errors"] >= 1 and disk["checkpoints_served"] == 0 and disk["restores"] == 0
    eng3.shutdown(timeout=1)


class _RecordingDisk:
    """The disk store, recording the thread each `submit` runs on."""

    def __init__(self, inner):
        self.inner, self.threads = inner, []

    def __getattr__(self, name):
        return getattr(self.inner, name)

    def submit(self, *args, **kw):
        import threading  # noqa: PLC0415

        self.threads.append(threading.current_thread().name)
        return self.inner.submit(*args, **kw)


def test_hybrid_save_reads_the_pool_once_and_writes_on_the_saver_thread(hybrid, tmp_path,
                                                                       monkeypatch):
    """A hybrid's save takes the blocks RAM and disk lack out of the pool in one read
    (`read_blocks_later`, as an attention-only save does), and its RAM puts and disk submit
    (which copies and checksums the payload) run on the saver thread, not the engine's: the
    save read the pool again for the disk and submitted there."""
    eng = engine(hybrid, kv_blocks=256, cache_ram_mib=4, cache_dir=str(tmp_path))
    kv, tiers = eng.tiers.kv, eng.tiers
    disk = tiers.disk = _RecordingDisk(tiers.disk)
    calls = {"read_blocks_later": 0, "read_blocks": 0}

    def count(obj, name):
        inner = getattr(obj, name)

        def counted(*args, **kw):
            calls[name] += 1
            return inner(*args, **kw)

        monkeypatch.setattr(obj, name, counted)

    for obj, name in ((kv, "read_blocks_later"), (kv, "read_blocks")):
        count(obj, name)
    save_hybrid, in_saves = tiers.save_hybrid, []

    def save(*args, **kw):  # the pool reads the engine thread makes in a save
        before = dict(calls)
        save_hybrid(*args, **kw)
        in_saves.append({k: calls[k] - before[k] for k in calls})

    monkeypatch.setattr(tiers, "save_hybrid", save)
    system = "You are the deploy agent. Tools: plan(x), apply(x), diff(x). " * 3
    serve(eng, chat_request(eng, system, "Deploy the staging stack.", n=7))
    tiers.flush()
    # one bulk read (on the CPU it reads the pool through read_blocks, once)
    assert in_saves == [{"read_blocks_later": 1, "read_blocks": 1}], in_saves
    assert disk.threads and all(t.startswith("kvshare-save") for t in disk.threads), disk.threads
    eng.shutdown(timeout=1)
    # what it wrote comes back after a restart
    eng2 = engine(hybrid, kv_blocks=256, cache_dir=str(tmp_path))
    got, fin = serve(eng2, chat_request(eng2, system, "Deploy the staging stack.", n=7))
    assert fin.timings.cache_n > 0
    assert eng2.snapshot()["tiers"]["disk"]["checkpoints_served"] == 1
    eng2.shutdown(timeout=1)


def test_cache_point_pins_a_conversation_past_its_first_user_message(tiny):
    """A client's cache breakpoint (Anthropic cache_control, a stored Responses conversation)
    at the end of a later message pins the full blocks up to it, not only the prefix entry:
    the next turn attaches to all of them after a flood evicted everything unpinned."""
    # RAM: 48 blocks of 8 KiB, 24 of them pinnable (the default half)
    eng = engine(tiny, kv_blocks=48, cache_ram_mib=0.375)
    convo = [{"role": "system", "content": AGENT_SYSTEM},
             {"role": "user", "content": "Where is the linker script? " * 4},
             {"role": "assistant", "content": "It is in build/link.ld, next to the map file."},
             {"role": "user", "content": "Open it and tell me the entry symbol."}]
    r = eng.chat_prompt(convo, cache_after=3)
    bs = 16
    assert r.first_user_boundary is not None and r.cache_point is not None
    assert r.cache_point // bs > r.first_user_boundary // bs + 2  # reaches well past the prefix
    assert eng.tokenize(eng.chat_template.render(convo)) == r.tokens  # tokenized once, same ids
    n_pinned = r.cache_point // bs
    serve(eng, GenerationRequest(prompt_tokens=r.tokens, max_tokens=3, sampling=GREEDY,
                                 first_user_boundary=r.first_user_boundary,
                                 cache_point=r.cache_point))
    ram = eng.tiers.ram
    assert ram.pinned_bytes == n_pinned * eng.kv.block_nbytes
    flood(eng)
    nxt = eng.chat_prompt([*convo, {"role": "assistant", "content": "_start."},
                           {"role": "user", "content": "Thanks."}])
    assert nxt.tokens[:n_pinned * bs] == r.tokens[:n_pinned * bs]
    _, fin = serve(eng, GenerationRequest(prompt_tokens=nxt.tokens, max_tokens=2, sampling=GREEDY,
                                          first_user_boundary=nxt.first_user_boundary))
    assert fin.timings.cache_n >= n_pinned * bs
    ram.check_invariants()
    eng.pool.check_invariants()
