"""Issue 6 acceptance: the RAM and disk tiers in the real server process, with real files.

Every check runs `kvshare serve` processes on loopback ports (see tests/tier_helpers.py) with
the tiny attention-only test model (tests/data/models/tiny-qwen3-chat.gguf: random weights, the
real 367-token SentencePiece vocabulary and a ChatML template; it loads in well under a second,
which makes dozens of restarts and kill -9s affordable). Requests are greedy chat completions
with logprobs; "equal to the cold run" means the same tokens and the same logprobs and top-3
alternatives (within 1e-4) as a server with every cache off (`--no-slot-attach --cache-ram 0`,
no `--cache-dir`).

- restart and continue: SIGTERM drains the disk writer; a new process on the same dir serves
  turn 2 >= 95% from disk, equal to the cold run (a plain `python -m kvshare.server.cli`).
- 4 conversations x 2 turns (1 2 3 4 / 1 2 4 3), --parallel 2, a pool too small for them, RAM
  tier off: every turn 2 >= 95% cached; the 1 2 1 2 case reads zero disk bytes.
- isolation: 8 conversations with secrets (one-token system-prompt differences; identical
  prefixes diverging inside turn 1), cache_salt: every reply equals its cold run, through the
  pool, the RAM tier and (after a restart) the disk tier.
- crash safety: kill -9 at each step of an entry's write (the writer's park hook makes each
  kill land exactly there), restart each time; truncated / bit-flipped files; TTL; the disk
  budget.
"""

from __future__ import annotations

import os
import random
import re
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import httpx
import pytest

from tier_helpers import (COLD_ARGS, TINY_MODEL, ColdRuns, Server, SubprocessLauncher,
                          assert_same_output, chat_body, cache_n, cached_fraction, conversation, dir_files,
                          entry_files, next_turn, reply_text, text)

pytestmark = pytest.mark.skipif(not TINY_MODEL.exists(), reason="run tests/data/make_tiny_qwen3_chat.py")

TIER = ("--parallel", "2", "--cache-min-tokens", "64")  # every tier server
KILLS = int(os.environ.get("KVSHARE_TIER_TEST_KILLS", "20"))  # kills parked in a write


@pytest.fixture(scope="module")
def servers(launcher):
    """`start(*args)`: a tier server (killed at the end if still running)."""
    started: list[Server] = []

    def start(*args: str, via=None, env: dict[str, str] | None = None) -> Server:
        s = Server(via or launcher, *TIER, *args, env=env)
        started.append(s)
        return s

    yield start
    for s in started:
        if s.rc is None:
            s.kill9()


def in_pairs(server: Server, jobs: list[tuple]) -> list[dict]:
    """Send chat requests two at a time (as many as --parallel 2 runs), in order."""
    out: list[dict] = []
    with ThreadPoolExecutor(2) as ex:
        for i in range(0, len(jobs), 2):
            out += list(ex.map(lambda job: server.chat(*job), jobs[i:i + 2]))
    return out


def metric(server: Server, name: str, tier: str) -> float:
    body = server.client.get("/metrics").text
    m = re.search(rf'^{name}(?:_total)?{{tier="{tier}"}} (\S+)$', body, re.M)
    assert m, f"{name}{{tier={tier}}} not in /metrics"
    return float(m.group(1))


# ------------------------------------------------------------------------ restart and continue

def test_restart_and_continue(tmp_path, cold, servers):
    """Turn 1; SIGTERM (drains the writer); a new process on the same dir serves turn 2 >= 95%
    from disk, equal to a cold run. Both tier servers are plain `python -m kvshare.server.cli`."""
    real = SubprocessLauncher()
    try:
        t1 = conversation(text(100, 1300), "Here is the plan: " + text(101, 60))
        c1 = cold(t1)
        a = servers("--cache-dir", str(tmp_path), via=real)
        r1 = a.chat(t1)
        assert_same_output(r1, c1, "turn 1")
        assert a.terminate() == 0  # no wait for the writer: the shutdown drains it
        files = entry_files(tmp_path)
        assert any(f.endswith(".idx") for f in files) and any(f.endswith(".kv") for f in files)
        assert not any(f.endswith(".tmp") for f in files)

        t2 = next_turn(t1, reply_text(c1), "Go on.")
        c2 = cold(t2)
        b = servers("--cache-dir", str(tmp_path), via=real)
        r2 = b.chat(t2)
        assert cached_fraction(r2) >= 0.95, r2["timings"]
        assert_same_output(r2, c2, "turn 2 after a restart")
        disk = b.tier("disk")
        assert disk["restores"] == 1 and disk["tokens_served"] == cache_n(r2)
        assert disk["bytes_read"] > 0 and disk["errors"] == 0 and disk["evictions_corrupt"] == 0
        assert b.tier("ram")["restores"] == 0  # a new process: nothing in RAM yet
        assert metric(b, "kvshare_cache_tier_restores", "disk") == 1
        assert metric(b, "kvshare_cache_tier_tokens_served", "disk") == cache_n(r2)
        assert metric(b, "kvshare_cache_tier_read_bytes", "disk") == disk["bytes_read"]
        assert b.terminate() == 0
    finally:
        real.close()


# ------------------------------------------------------------------------ interleaved sessions

CONVS = [conversation(text(200 + i, 1200), f"Conversation {i}: " + text(210 + i, 40)) for i in range(4)]


def test_interleaved_conversations_through_a_small_pool(tmp_path, cold, servers):
    """1 2 3 4 / 1 2 4 3 through --parallel 2 and a 200-block pool (each conversation needs
    ~80 blocks), RAM tier off: each turn 2 is >= 95% cached, from the pool or the disk."""
    s = servers("--cache-dir", str(tmp_path), "--cache-ram", "0", "--kv-blocks", "200")
    firsts = in_pairs(s, [(m,) for m in CONVS])
    for i, r in enumerate(firsts):
        assert_same_output(r, cold(CONVS[i]), f"conversation {i + 1} turn 1")
    s.wait_disk_idle()
    seconds = [next_turn(m, reply_text(cold(m)), "Go on.") for m in CONVS]
    order = [0, 1, 3, 2]
    got = dict(zip(order, in_pairs(s, [(seconds[i],) for i in order])))
    for i in order:
        assert cached_fraction(got[i]) >= 0.95, (i + 1, got[i]["timings"])
        assert_same_output(got[i], cold(seconds[i]), f"conversation {i + 1} turn 2")
    disk = s.tier("disk")
    assert disk["restores"] >= 2 and disk["bytes_read"] > 0, disk  # the pool could not keep them
    assert disk["errors"] == 0
    assert s.cache()["pool"]["total"] == 200


def test_resident_conversations_cost_no_disk_reads(tmp_path, cold, servers):
    """1 2 1 2 with both conversations resident in the pool: zero disk reads."""
    s = servers("--cache-dir", str(tmp_path), "--cache-ram", "0", "--kv-blocks", "1024")
    in_pairs(s, [(m,) for m in CONVS[:2]])
    s.wait_disk_idle()
    seconds = [next_turn(m, reply_text(cold(m)), "Go on.") for m in CONVS[:2]]
    for i, r in enumerate(in_pairs(s, [(m,) for m in seconds])):
        assert cached_fraction(r) >= 0.95, r["timings"]
        assert_same_output(r, cold(seconds[i]), f"conversation {i + 1} turn 2")
    disk = s.tier("disk")
    assert disk["bytes_read"] == 0 and disk["restores"] == 0, disk
    assert disk["writes"] >= 2  # the tier was on: both conversations were written


# ------------------------------------------------------------------------ isolation

SECRETS = [f"SECRET-{w}" for w in ("alpha", "bravo", "charlie", "delta", "echo", "foxtrot", "golf", "hotel")]


def isolation_conversations() -> tuple[list[list[dict]], list[str | None]]:
    convs = []
    # Four system prompts that differ in one token (one character of this vocabulary).
    base = text(300, 360)
    p = 170
    for k in range(4):
        system = base[:p] + "WXYZ"[k] + base[p + 1:]
        convs.append(conversation(system, f"Remember this: my password is {SECRETS[k]}."))
    # Four conversations byte-identical up to inside turn 1, then diverging at the secret.
    system = text(301, 300)
    common = "Please keep this safe for me. " + text(302, 90) + " The password is "
    for k in range(4, 8):
        convs.append(conversation(system, common + SECRETS[k] + "."))
    salts = [None] * 8
    salts[0], salts[5] = "tenant-a", "tenant-b"
    return convs, salts


def test_isolation_secrets_and_salts(tmp_path, cold, servers):
    convs, salts = isolation_conversations()
    # RAM + disk, a pool that holds two running sequences but not the eight conversations.
    s = servers("--cache-dir", str(tmp_path), "--cache-ram", "64", "--kv-blocks", "64")

    def check(r: dict, k: int, what: str) -> None:
        assert_same_output(r, cold(msgs[k]), f"conversation {k} {what}")
        reply = reply_text(r)
        assert not any(sec in reply for j, sec in enumerate(SECRETS) if j != k)

    msgs = convs
    for k, r in enumerate(in_pairs(s, [(m, 6, salts[k]) for k, m in enumerate(convs)])):
        check(r, k, "turn 1")
    # Same tokens, different salt (or none): nothing is shared.
    fresh = s.chat(convs[6], salt="tenant-new")
    assert cache_n(fresh) == 0
    assert_same_output(fresh, cold(convs[6]), "a salted copy of conversation 6")
    again = s.chat(convs[6], salt="tenant-new")
    assert cache_n(again) > 0  # within one salt, sharing works
    # Conversation 0 was salted: unsalted, it finds at most the ~180 tokens it shares with 1-3.
    assert cache_n(s.chat(convs[0])) <= 192
    s.wait_disk_idle()

    seconds = [next_turn(m, reply_text(cold(m)), "What did I tell you?") for m in convs]
    msgs = seconds
    for k, r in enumerate(in_pairs(s, [(m, 6, salts[k]) for k, m in enumerate(seconds)])):
        check(r, k, "turn 2")
        assert cache_n(r) > 0
    assert s.tier("ram")["restores"] >= 1  # the small pool forced RAM restores
    assert s.terminate() == 0

    # A new process, RAM tier off: turn 2 again, from disk, within each conversation's salt.
    s2 = servers("--cache-dir", str(tmp_path), "--cache-ram", "0", "--kv-blocks", "64")
    for k, r in enumerate(in_pairs(s2, [(m, 6, salts[k]) for k, m in enumerate(seconds)])):
        check(r, k, "turn 2 after a restart")
        assert cached_fraction(r) >= 0.8, (k, r["timings"])
    # Another salt: a miss on disk too (tenant-b holds conversation 5, whose prompt shares
    # only the template's first tokens with conversation 0; a new salt holds nothing).
    assert cache_n(s2.chat(seconds[0], salt="tenant-b")) < 16
    assert cache_n(s2.chat(seconds[0], salt="tenant-c")) == 0
    disk = s2.tier("disk")
    assert disk["restores"] >= 8 and disk["errors"] == 0, disk
    s2.kill9()


# ------------------------------------------------------------------------ crash safety

def crash_conversation(i: int) -> list[dict]:
    # Groups of conversations share a system prompt, so entries reference their parents'
    # blocks (the disk store's dependency chains) and restores span several entries.
    return conversation(text(400 + i // 6, 200), f"Session {i}. " + text(500 + i, 60))


def _request_into(url: str, messages: list[dict], out: list[dict]) -> None:
    """A chat request that may be cut off by a kill; its answer, if one arrived, goes to `out`."""
    try:
        with httpx.Client(base_url=url, timeout=30) as client:
            out.append(client.post("/v1/chat/completions", json=chat_body(messages, 4)))
    except httpx.HTTPError:
        pass  # the server was killed under it


def _unfinished_write(files: dict[str, int]) -> bool:
    """Temporaries, or data files without their index: what a cut-off write leaves."""
    return any(n.endswith(".tmp") for n in files) or any(
        n.endswith((".kv", ".ckpt")) and n.rsplit(".", 1)[0] + ".idx" not in files for n in files)


def _committed(files: dict[str, int]) -> int:
    return sum(n.endswith(".idx") for n in files)


def _idx_names(path: Path) -> set[str]:
    return {n for n in dir_files(path) if n.endswith(".idx")}


# The writer's park steps, in protocol order (crates/kvshare-core/src/disk/writer.rs, `park`).
PARK_STEPS = ("start", "data", "data_synced", "idx_tmp", "committed")


def _wait_for_marker(server: Server, marker: Path, timeout: float = 120.0) -> None:
    """Until the server's disk writer has parked (it creates `marker`). No timing window: the
    writer stays parked until the kill; the timeout only bounds a broken run."""
    deadline = time.monotonic() + timeout
    while not marker.exists():
        assert server.alive(), f"the server exited before its writer parked:\n{server.log()}"
        assert time.monotonic() < deadline, f"the writer did not park in {timeout} s:\n{server.log()}"
        time.sleep(0.02)


def test_kill_9_while_writing(tmp_path, cold, servers):
    """kill -9 at each step of an entry's write, restarting on the same dir each time. The
    writer's test hook (KVSHARE_DISK_WRITER_PARK=<step>, see docs/cache_disk.md) parks the
    server's first entry write at the step and creates a marker file; the test waits for the
    marker, then kills: the kill lands exactly there, however loaded the machine. What each
    kill leaves is checked exactly: before `committed`, no new `.idx` (and, after `start`, the
    cut write's leftovers); at `committed`, exactly one new complete entry. Every reply equals
    the cold run's: the request whose write is cut, and the one after each restart (a new
    conversation, or a returning one, restored from the entries the kills committed). Every
    sixth kill lands at a random moment of a request instead (no hook; correctness only)."""
    rng = random.Random(6)
    cache_dir = tmp_path / "cache"
    cache_dir.mkdir()
    marker = tmp_path / "parked"
    seen: list[list[dict]] = []
    committed_convs: list[list[dict]] = []  # conversations whose entry a kill left committed
    parked = {step: 0 for step in PARK_STEPS}
    restored = returning = 0
    n_parked = 0
    t0 = time.monotonic()
    n_parked_kills = max(KILLS, len(PARK_STEPS))  # each step at least once
    for i in range(n_parked_kills + n_parked_kills // 5):
        step = None if i % 6 == 5 else PARK_STEPS[n_parked % len(PARK_STEPS)]
        back = None
        if seen and rng.random() < 0.6:
            back = rng.choice(committed_convs if committed_convs and rng.random() < 0.6 else seen)
            m = next_turn(back, reply_text(cold(back, 4)), f"More, part {i}. " + text(700 + i, 40))
        else:
            m = crash_conversation(i)
        ref = cold(m, 4)  # references first: nothing runs beside the kill below
        before = _idx_names(cache_dir)
        if step is None:
            s = servers("--cache-dir", str(cache_dir))
            got: list[dict] = []
            th = threading.Thread(target=_request_into, args=(s.url, m, got))
            th.start()
            time.sleep(rng.uniform(0, 0.3))
            s.kill9()
            th.join(30)
            for r in got:  # the answer, if it arrived before the kill
                assert r.status_code == 200, r.text
                assert_same_output(r.json(), ref, f"kill {i}: at a random moment")
            seen.append(m)
            continue
        s = servers("--cache-dir", str(cache_dir), env={
            "KVSHARE_DISK_WRITER_PARK": step, "KVSHARE_DISK_WRITER_PARK_MARKER": str(marker)})
        # After a restart the pool and RAM are empty: a returning conversation is served from
        # disk (or recomputed where its entry did not make it), never an error or another output.
        r = s.chat(m, 4)
        assert_same_output(r, ref, f"kill {i} ({step}): {'returning' if back else 'new'}")
        if back is not None:
            returning += 1
            restored += cache_n(r) > 0
            if any(back is c for c in committed_convs):
                assert cache_n(r) > 0, f"kill {i}: a committed entry was not restored"
        _wait_for_marker(s, marker)  # its entry's write is parked at `step`
        files = dir_files(cache_dir)
        s.kill9()
        marker.unlink()
        n_parked += 1
        parked[step] += 1
        idx = {n for n in files if n.endswith(".idx")}
        what = f"kill {i} at {step}: {sorted(files)}"
        if step == "committed":
            assert idx > before and len(idx - before) == 1, what
            assert not _unfinished_write(files), what
            committed_convs.append(m)
        else:
            assert idx == before, what
            assert _unfinished_write(files) == (step != "start"), what
        seen.append(m)
    elapsed = time.monotonic() - t0
    assert all(parked.values()), parked
    # A clean start sweeps what the kills left; a clean stop leaves only complete entries.
    s = servers("--cache-dir", str(cache_dir))
    for m in seen[-3:] + committed_convs[-2:]:
        assert_same_output(s.chat(m, 4), cold(m, 4), "after the last kill")
    disk = s.tier("disk")
    assert disk["errors"] == 0 and disk["evictions_corrupt"] == 0, disk
    assert s.terminate() == 0
    files = entry_files(cache_dir)
    assert not _unfinished_write(files), files
    print(f"\n{i + 1} kills in {elapsed:.1f} s: {parked} parked in a write, the rest at random "
          f"moments of a request; {restored}/{returning} returning requests restored from "
          f"disk, the rest recomputed; all equal to cold runs")


def test_damaged_files_are_detected_removed_and_recomputed(tmp_path, cold, servers):
    convs = [conversation(text(600 + k, 400), text(610 + k, 40)) for k in range(3)]
    owned: list[set[str]] = []
    for m in convs:  # one entry per process, so each file is known to belong to one conversation
        before = set(entry_files(tmp_path))
        s = servers("--cache-dir", str(tmp_path))
        s.chat(m, 4)
        assert s.terminate() == 0
        owned.append(set(entry_files(tmp_path)) - before)
    kv = [next(n for n in names if n.endswith(".kv")) for names in owned]
    idx = [next(n for n in names if n.endswith(".idx")) for names in owned]
    # 0: a truncated .kv; 1: a flipped byte in the middle of a .kv; 2: a flipped byte in a .idx
    p = tmp_path / kv[0]
    p.write_bytes(p.read_bytes()[: p.stat().st_size // 2])
    p = tmp_path / kv[1]
    data = bytearray(p.read_bytes())
    data[len(data) // 2] ^= 0x10
    p.write_bytes(bytes(data))
    p = tmp_path / idx[2]
    data = bytearray(p.read_bytes())
    data[len(data) - 5] ^= 0x01
    p.write_bytes(bytes(data))

    s = servers("--cache-dir", str(tmp_path))
    left = set(entry_files(tmp_path))
    assert not owned[0] & left and not owned[2] & left  # the start-up sweep removed them
    for k, m in enumerate(convs):
        r = s.chat(m, 4)
        # Nothing trustworthy to restore: recomputed (at most the chat template's first
        # tokens are shared, inside the pool, with the conversation computed before it).
        assert cache_n(r) < 16, k
        assert_same_output(r, cold(m, 4), f"damaged conversation {k}")
    disk = s.tier("disk")
    assert disk["restores"] == 0 and disk["tokens_served"] == 0, disk
    assert disk["evictions_corrupt"] >= 1 and disk["errors"] >= 1, disk  # the flipped .kv
    s.wait_disk_idle()
    assert s.terminate() == 0
    # Recomputed entries were written again and restore correctly.
    s = servers("--cache-dir", str(tmp_path))
    for k, m in enumerate(convs):
        r = s.chat(m, 4)
        assert cache_n(r) > 0, k
        assert_same_output(r, cold(m, 4), f"rewritten conversation {k}")
    assert s.tier("disk")["evictions_corrupt"] == 0
    s.kill9()


def test_ttl_expired_entries_are_never_restored(tmp_path, cold, servers):
    m = conversation(text(700, 400), text(701, 40))
    s = servers("--cache-dir", str(tmp_path), "--cache-ttl", "1")
    s.chat(m, 4)
    s.wait_disk_idle()
    assert s.terminate() == 0
    assert any(n.endswith(".idx") for n in entry_files(tmp_path))
    time.sleep(2.0)
    s = servers("--cache-dir", str(tmp_path), "--cache-ttl", "1")
    r = s.chat(m, 4)
    assert cache_n(r) == 0
    assert_same_output(r, cold(m, 4), "after the TTL")
    disk = s.tier("disk")
    assert disk["evictions_ttl"] >= 1 and disk["restores"] == 0, disk
    s.wait_disk_idle()
    assert s.terminate() == 0
    # The entry written again is restored by a server whose TTL it is within.
    s = servers("--cache-dir", str(tmp_path), "--cache-ttl", "3600")
    r = s.chat(m, 4)
    assert cache_n(r) > 0
    assert_same_output(r, cold(m, 4), "within the TTL")
    s.kill9()


def test_disk_usage_stays_within_the_budget(tmp_path, launcher, servers):
    budget = 2**20  # --cache-disk-max 1 (MiB); each entry below is ~330 KB of f32 KV
    convs = [conversation(text(800 + k, 560), text(810 + k, 40)) for k in range(6)]
    f32 = ("--kv-dtype", "f32")  # the budget counts f32 blocks (and so does the cold twin)
    cold_server = Server(launcher, *COLD_ARGS, *f32)
    cold = ColdRuns(cold_server)
    try:
        s = servers("--cache-dir", str(tmp_path), "--cache-disk-max", "1", "--cache-ram", "0", *f32)
        for m in convs:
            s.chat(m, 4)
            disk = s.wait_disk_idle()
            used = sum(dir_files(tmp_path).values())
            assert used <= budget, (used, disk)
            assert disk["bytes_on_disk"] == sum(entry_files(tmp_path).values())
        assert disk["writes"] == len(convs) and disk["evictions_budget"] >= 3, disk
        assert s.terminate() == 0
        s = servers("--cache-dir", str(tmp_path), "--cache-disk-max", "1", "--cache-ram", "0", *f32)
        r = s.chat(convs[-1], 4)  # the most recent entry survived the LRU
        assert cache_n(r) > 0
        assert_same_output(r, cold(convs[-1], 4), "the newest entry")
        restores = s.tier("disk")["restores"]
        r = s.chat(convs[0], 4)  # the oldest did not (the pool may share the template's header)
        assert cache_n(r) < 16 and s.tier("disk")["restores"] == restores
        assert_same_output(r, cold(convs[0], 4), "an evicted entry")
        s.kill9()
    finally:
        cold_server.kill9()
