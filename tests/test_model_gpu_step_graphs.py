"""Steps with prefill chunks as CUDA graphs (`kvshare.model.gpu_graphs`): prefill chunks that
want their last row's logits, every row's or none, decode rows beside a prefill chunk, the
tensor-core attention's shapes and the FMA kernels', against the same steps eager, logits and
KV cache, in a fixed script and in seeded random ones. Marked `gpu`: skipped without a CUDA
device; CI runs it on the CPU emulator (tests/gpu_emu), `bench/gpu_check.sh` on a GPU first of
all (a failure there keeps the figures' graphs to decode steps:
`KVSHARE_CUDA_GRAPHS_PREFILL=0`).
"""

from __future__ import annotations

import numpy as np
import pytest

from kvshare.model.batch import SeqChunk
from kvshare.ops import gpu as ops_gpu
from test_model_gpu import SPECS, _emulated, _rel, _tokens, write_model

pytestmark = pytest.mark.gpu


@pytest.fixture(scope="module", params=list(SPECS))
def gpu(request, tmp_path_factory):
    """The GPU model of one tiny architecture of tests/test_model_gpu.py."""
    from kvshare.model.loader import load_model  # noqa: PLC0415

    path = tmp_path_factory.mktemp("tiny-gpu-steps") / f"{request.param}.gguf"
    write_model(path, request.param)
    return load_model(path, "cuda")


@pytest.fixture
def fresh_qwen3(tmp_path):
    """A tiny qwen3 GPU model of its own (its graph runner starts with an empty workspace)."""
    from kvshare.model.loader import load_model  # noqa: PLC0415

    path = tmp_path / "qwen3.gguf"
    write_model(path, "qwen3")
    return load_model(path, "cuda")


def _cache_kv(model, cache):
    """Host copies of every attention layer's K and V arrays."""
    return [np.asarray(a.get() if hasattr(a, "get") else a)
            for L in model.layers for a in cache.layer_kv(L.attn_index)]


def _mixed_run(model, graphs, kv_dtype=None, cache=None):
    """A script of steps as the engine makes them: prefill chunks that want the last row's
    logits, every row's, or none; decode rows beside a prefill chunk; a chunk long enough
    for the tensor-core attention (f16 caches) beside one that is not; the same shapes again
    with other tokens (replays). Returns each step's logits (None where a chunk wants none)
    and the KV cache's arrays at the end (`cache`: the cache to run on, else a new one; the
    script writes the same KV into it again)."""
    model.cuda_graphs = graphs
    bs, per = 16, 6
    if cache is None:
        cache = model.new_cache(4 * per + 1, bs, kv_dtype=kv_dtype)
    perm = np.random.default_rng(11).permutation(4 * per + 1)
    tab = [perm[i * per : (i + 1) * per] for i in range(4)]

    def chunk(seq, n, pos, logits, seed):
        return SeqChunk(_tokens(n, seed=seed), pos, tab[seq], logits=logits)

    script = [
        [chunk(0, 20, 0, "last", 1)],
        [chunk(1, 7, 0, "none", 2)],
        [chunk(1, 6, 7, "all", 3)],
        [chunk(0, 1, 20, "last", 4), chunk(1, 1, 13, "last", 5), chunk(2, 33, 0, "last", 6)],
        [chunk(0, 1, 21, "last", 7), chunk(2, 5, 33, "none", 8)],
        [chunk(0, 1, 22, "last", 9), chunk(2, 5, 38, "none", 10)],  # the same shape
        [chunk(3, 3, 0, "last", 12), chunk(1, 1, 14, "none", 13), chunk(2, 1, 43, "last", 14)],
        [chunk(0, 1, 23, "last", 15), chunk(1, 1, 15, "last", 16), chunk(2, 1, 44, "last", 17)],
        [chunk(0, 1, 24, "last", 18), chunk(1, 1, 16, "last", 19), chunk(2, 1, 45, "last", 20)],
    ]
    out = []
    for step in script:
        out.append(model.forward(step, cache))
    return out, _cache_kv(model, cache), cache


def _assert_same_steps(graph, kv_graph, eager, kv_eager):
    """Each step's logits and the KV cache at the end as the eager run's: bit for bit on the
    emulator; on a GPU within the GPU-vs-GPU tolerance (cuBLAS may pick another algorithm
    for a padded row count)."""
    for i, (a, b) in enumerate(zip(graph, eager)):
        assert [x is None for x in a] == [x is None for x in b], i
        for x, y in zip(a, b):
            if x is None:
                continue
            assert x.shape == y.shape, i
            if _emulated():
                assert np.array_equal(x, y), i
            else:
                assert _rel(x, y) <= 1e-2, i
    for a, b in zip(kv_graph, kv_eager):
        if _emulated():
            assert np.array_equal(a, b)
        else:
            assert np.abs(a.astype(np.float32) - b.astype(np.float32)).max() <= 2e-2


@pytest.mark.parametrize("kv", ["f16", "f32"])
def test_step_graphs_equal_eager_for_prefill_and_mixed_steps(gpu, kv):
    """Steps with prefill chunks run as graphs too (padded to their token, sequence and
    logit-row buckets; the last layer keeps only the rows whose logits are wanted, as the
    eager step does): the same logits and the same KV cache as the eager steps, bit for bit
    on the emulator (on a GPU, cuBLAS may pick another algorithm for the padded rows: within
    the GPU-vs-GPU tolerance), and padding rows write no KV. A shape with a prefill chunk is
    captured the second time it comes: the script runs again until every step replays."""
    from kvshare.model import gpu_graphs  # noqa: PLC0415

    try:
        eager, kv_eager, _ = _mixed_run(gpu, False, kv_dtype=kv)
        gpu.cuda_graphs = True
        r = gpu_graphs.runner(gpu)
        captures = r.captures
        runs = [_mixed_run(gpu, True, kv_dtype=kv)]
        # the same cache again until a run captures nothing (a larger workspace drops the
        # graphs captured before it; it at least doubles each time): that run replays all
        for _ in range(4):
            settled = (r.captures, r.replays)
            runs.append(_mixed_run(gpu, True, cache=runs[0][2]))
            if r.captures == settled[0]:
                break
    finally:
        gpu.cuda_graphs = None
    assert not r.failures, r.failures
    shapes = set(r.graphs)
    assert len(shapes) >= 6 and r.captures - captures >= 6
    assert r.captures == settled[0] and r.replays - settled[1] == len(runs[-1][0])
    assert any(s.gather for s in shapes) and any(s.rows == 0 for s in shapes)
    # the tensor-core attention takes f16 caches of its head sizes (gemma3's 256 among them)
    assert any(s.mma for s in shapes) == (kv == "f16" and gpu.config.head_dim in ops_gpu.PM_HD)
    for graph, kv_graph, _ in runs:
        _assert_same_steps(graph, kv_graph, eager, kv_eager)


def test_graphs_can_be_turned_off_or_kept_to_decode(gpu, monkeypatch):
    from kvshare.model import gpu_graphs  # noqa: PLC0415

    monkeypatch.setenv(gpu_graphs.ENV, "0")
    assert gpu_graphs.runner(gpu) is None
    monkeypatch.setenv(gpu_graphs.ENV, "1")
    monkeypatch.setenv(gpu_graphs.PREFILL_ENV, "0")
    r = gpu_graphs.runner(gpu)
    cache = gpu.new_cache(8, 16)
    before = (r.captures, r.replays)
    gpu.forward([SeqChunk(_tokens(5), 0, np.arange(8), logits="all")], cache)  # prefill
    gpu.forward([SeqChunk(_tokens(3), 5, np.arange(8), logits="none")], cache)
    assert (r.captures, r.replays) == before
    gpu.forward([SeqChunk(_tokens(1), 8, np.arange(8))], cache)  # decode: captured
    assert r.captures == before[0] + 1
    monkeypatch.setenv(gpu_graphs.PREFILL_ENV, "1")
    for p in (9, 12):  # a prefill shape: captured when it comes again
        gpu.forward([SeqChunk(_tokens(3), p, np.arange(8), logits="last")], cache)
    assert r.captures == before[0] + 2


def test_a_prefill_shape_is_captured_at_once_when_it_comes_again(fresh_qwen3):
    """A shape with a prefill chunk: its first step runs eager on the shape's inputs and
    measures its workspace; its second is captured at once and replayed for the step (no
    eager run before the capture). A larger shape grows the workspace (dropping the graphs):
    the first shape is then captured at once again. Logits and KV as the eager steps'."""
    from kvshare.model import gpu_graphs  # noqa: PLC0415

    model = fresh_qwen3
    # (position, tokens, logits): 5, 6, 7 tokens the 8-token bucket; 200 tokens wanting every
    # row's logits the 256-token bucket, whose workspace is larger
    script = [(0, 5, "last"), (5, 6, "last"), (11, 200, "all"), (211, 200, "all"),
              (411, 7, "last")]

    def run(graphs):
        model.cuda_graphs = graphs
        cache = model.new_cache(27, 16, kv_dtype="f16")
        r = gpu_graphs.runner(model)
        out, seen = [], []
        for p, n, lg in script:
            out.append(model.forward([SeqChunk(_tokens(n, seed=p), p, np.arange(27),
                                               logits=lg)], cache))
            if r is not None:
                seen.append((r.captures, r.replays, r.ws.nbytes))
        return out, _cache_kv(model, cache), seen, r

    try:
        eager, kv_eager, _, _ = run(False)
        graph, kv_graph, seen, r = run(True)
    finally:
        model.cuda_graphs = None
    assert not r.failures, r.failures
    (c1, r1, w1), (c2, r2, _), (c3, r3, w3), (c4, r4, _), (c5, r5, _) = seen
    assert (c1, r1) == (0, 0) and w1 > 0  # eager, measured
    assert (c2, r2) == (1, 1)  # captured at once, replayed
    assert (c3, r3) == (1, 1) and w3 > w1  # eager, measured: a larger workspace
    assert (c4, r4) == (2, 2)
    assert (c5, r5) == (3, 3)  # the first shape's graph was dropped: captured at once again
    _assert_same_steps(graph, kv_graph, eager, kv_eager)


def test_a_failed_capture_leaves_its_shape_eager(fresh_qwen3, monkeypatch):
    """A capture that raises leaves its shape eager, with one warning, and the step still
    computes the eager step's logits and KV: a prefill shape captured at once (its step
    runs eager after the failed capture) and a decode shape captured after its eager run."""
    from kvshare.model import gpu_graphs  # noqa: PLC0415

    model = fresh_qwen3
    # a prefill shape twice, a decode shape twice, the prefill shape again
    script = [[(0, _tokens(n, seed=p), p, "last")]
              for p, n in ((0, 5), (5, 6), (11, 1), (12, 1), (13, 7))]

    def run(graphs):
        model.cuda_graphs = graphs
        out, kv = _run_script(model, script, [np.arange(8)],
                              model.new_cache(8, 16, kv_dtype="f16"))
        return out, kv, gpu_graphs.runner(model)

    class _Refused:
        def __enter__(self):
            raise RuntimeError("capture refused")

        def __exit__(self, *exc):
            return False

    try:
        eager, kv_eager, _ = run(False)
        monkeypatch.setattr(gpu_graphs.rt, "capturing", _Refused)
        with pytest.warns(RuntimeWarning, match="capture refused") as warned:
            graph, kv_graph, r = run(True)
    finally:
        model.cuda_graphs = None
    assert len(warned) == 1 and len(r.failures) == 2 and r.captures == 0 and not r.graphs
    assert {s.tokens for s in r.failures} == {8, 1}
    _assert_same_steps(graph, kv_graph, eager, kv_eager)


def test_warm_up_captures_an_agent_servers_first_steps(fresh_qwen3):
    """`Model.warm_up` captures the step shapes an agent server meets first, writing no KV;
    then a turn's prompt chunk (alone, or beside 1 to 3 other sessions' decode rows: one
    shape, its sequences and logit rows padded to `PREFILL_MIN_SEQS`), decode batches and a
    long prompt's middle chunk all replay those graphs, with no capture and no eager step,
    and compute the eager steps' logits and KV."""
    from kvshare.model import gpu_graphs  # noqa: PLC0415

    model = fresh_qwen3
    seqs, per = 4, 8
    tables = list(np.random.default_rng(5).permutation(seqs * per + 1).reshape(-1)[: seqs * per]
                  .reshape(seqs, per))
    script = [
        [(0, _tokens(40, seed=1), 0, "last")],  # a turn's prompt chunk, alone
        [(0, _tokens(1, seed=2), 40, "last"), (1, _tokens(30, seed=3), 0, "last")],
        [(1, _tokens(30, seed=21), 30, "last")],  # the second step's tokens, alone
        [(0, _tokens(1, seed=4), 41, "last"), (1, _tokens(1, seed=5), 60, "last")],
        [(0, _tokens(1, seed=6), 42, "last"), (1, _tokens(1, seed=7), 61, "last"),
         (2, _tokens(1, seed=8), 0, "last")],
        # the second step's shape again: a 29-token chunk beside three decode rows
        [(0, _tokens(1, seed=9), 43, "last"), (1, _tokens(1, seed=10), 62, "last"),
         (2, _tokens(1, seed=11), 1, "last"), (3, _tokens(29, seed=12), 0, "last")],
        [(3, _tokens(64, seed=13), 29, "none")],  # a long prompt's middle chunk
    ]

    def cache():
        return model.new_cache(seqs * per + 1, 16, kv_dtype="f16")

    try:
        model.cuda_graphs = False
        assert model.warm_up(cache(), 4, 64) == 0  # graphs off: nothing to capture
        eager, kv_eager = _run_script(model, script, tables, cache())
        model.cuda_graphs = True
        c = cache()
        zeros = _cache_kv(model, c)
        assert not any(a.any() for a in zeros)
        n = model.warm_up(c, 4, 64)
        r = gpu_graphs.runner(model)
        warmed = set(r.graphs)
        kv_warm = _cache_kv(model, c)
        graph, kv_graph = _run_script(model, script, tables, c)
    finally:
        model.cuda_graphs = None
    # decode batches 1, 2, 4; last chunks of 32, 64 and 128 tokens (64 + 3 decode rows),
    # alone and beside decode rows; the middle chunk of 64
    assert n == 10 == r.captures == len(warmed) and not r.failures
    assert not any(a.any() for a in kv_warm)  # no KV written
    assert r.captures == 10 and r.replays == len(script) and set(r.graphs) == warmed
    assert {(s.seqs, s.rows) for s in warmed if s.prefill} == {(4, 1), (4, 4), (4, 0)}
    _assert_same_steps(graph, kv_graph, eager, kv_eager)


def test_warm_up_covers_an_agent_turns_steps(fresh_qwen3):
    """With the server's defaults (4 sequences, 512-token prefill chunks) the warmed shapes are
    every shape an agent fleet's steps take: a turn's last prompt chunk of 17 to 512 tokens
    beside 0 to 3 other sessions' decode rows, a long prompt's 512-token middle chunks, and
    decode batches of 1 to 4 (the shapes only: nothing runs)."""
    from kvshare.model import gpu_graphs  # noqa: PLC0415
    from kvshare.model.base import make_plan  # noqa: PLC0415

    model = fresh_qwen3
    cache = model.new_cache(80, 16, kv_dtype="f16")
    model.cuda_graphs = True
    try:
        r = gpu_graphs.runner(model)

        def shape(step):
            return r.step_shape(step, cache, make_plan(step, 16, model.config))

        warmed = {shape(s) for s in gpu_graphs.warm_up_steps(cache, 4, 512)}
        table = np.zeros(40, np.int32)

        def chunk(n, pos=600, logits="last"):
            return SeqChunk(np.zeros(n, np.int32), pos, table, logits=logits)

        steps = [[chunk(1) for _ in range(d)] for d in range(1, 5)]
        steps += [[chunk(512, 0, "none")], [chunk(512, 0, "none"), chunk(1)]]
        steps += [[chunk(n, 0)] + [chunk(1) for _ in range(d)]
                  for n in (17, 31, 32, 33, 64, 65, 100, 191, 200, 256, 450, 510, 512)
                  for d in range(4)]
        missing = [(sum(c.n for c in st), len(st)) for st in steps if shape(st) not in warmed]
    finally:
        model.cuda_graphs = None
    assert len(warmed) == 24 and not missing, missing


def test_steps_with_many_logit_rows_stay_eager(gpu, monkeypatch):
    """A graph's logits stay in the workspace: a step with more than MAX_LOGIT_ROWS logit rows
    (a prompt's logits row by row) runs eager, never sighted or captured."""
    from kvshare.model import gpu_graphs  # noqa: PLC0415

    monkeypatch.setattr(gpu_graphs, "MAX_LOGIT_ROWS", 4)
    gpu.cuda_graphs = True
    try:
        r = gpu_graphs.runner(gpu)
        cache = gpu.new_cache(8, 16)
        before = (r.captures, r.replays, sum(r.sightings.values()))
        for p in (0, 6):
            out = gpu.forward([SeqChunk(_tokens(6), p, np.arange(8), logits="all")], cache)
            assert out[0].shape[0] == 6
        assert (r.captures, r.replays, sum(r.sightings.values())) == before
        for p in (12, 15):  # 3 rows: captured the second time
            gpu.forward([SeqChunk(_tokens(3), p, np.arange(8), logits="all")], cache)
        assert r.captures == before[0] + 1
    finally:
        gpu.cuda_graphs = None



def _random_script(seed, n_seqs=5, per=8, bs=16, n_steps=28):
    """A seeded random script of engine-like steps over `n_seqs` sequences of `per` blocks:
    each step takes 1-4 sequences that have room, each a decode row (half of them) or a
    prefill chunk of 2-40 tokens, wanting no logits, the last row's or every row's. Returns
    the steps as (sequence, tokens, position, logits) tuples and each sequence's table."""
    rng = np.random.default_rng(seed)
    tables = list(rng.permutation(n_seqs * per + 1)[: n_seqs * per].reshape(n_seqs, per))
    room = per * bs
    pos = [0] * n_seqs
    script = []
    for _ in range(n_steps):
        free = [s for s in range(n_seqs) if pos[s] < room]
        if not free:
            break
        step = []
        for s in rng.permutation(free)[: rng.integers(1, 5)]:
            n = 1 if (pos[s] and rng.random() < 0.5) else int(rng.integers(2, 41))
            n = min(n, room - pos[s])
            logits = "last" if n == 1 else str(rng.choice(["none", "last", "all"]))
            step.append((int(s), _tokens(n, seed=int(rng.integers(1 << 30))), pos[s], logits))
            pos[s] += n
        script.append(step)
    return script, tables


def _run_script(model, script, tables, cache):
    out = []
    for step in script:
        out.append(model.forward([SeqChunk(t, p, tables[s], logits=lg)
                                  for s, t, p, lg in step], cache))
    return out, _cache_kv(model, cache)


# the emulator runs every kernel thread by thread (about a second a step of these models):
# there two scripts of 14 steps, one of a plain model with the tensor-core attention and one
# of gemma3's sliding-window layers (a split cache, head size 256); on a GPU every
# architecture, two scripts of 28 steps each
FUZZ = ([("qwen3", 1, 14), ("gemma3", 2, 14)] if _emulated() else
        [(arch, seed, 28) for arch in SPECS for seed in (1, 2)])


@pytest.mark.parametrize("gpu,seed,n_steps", FUZZ, indirect=["gpu"])
def test_random_step_scripts_equal_eager(gpu, seed, n_steps, monkeypatch):
    """Seeded random scripts of decode rows and prefill chunks (1-4 sequences a step, chunks
    of 2-40 tokens wanting no logits, the last row's or all; f16 KV: tensor-core and FMA
    attention) as graphs, every shape captured at its first step, then the script again on
    the same cache (most steps replays): logits and KV as the eager steps'."""
    from kvshare.model import gpu_graphs  # noqa: PLC0415

    monkeypatch.setattr(gpu_graphs, "PREFILL_SIGHTINGS", 1)
    script, tables = _random_script(seed, n_steps=n_steps)
    try:
        gpu.cuda_graphs = False
        cache = gpu.new_cache(5 * 8 + 1, 16, kv_dtype="f16")
        eager, kv_eager = _run_script(gpu, script, tables, cache)
        gpu.cuda_graphs = True
        r = gpu_graphs.runner(gpu)
        cache = gpu.new_cache(5 * 8 + 1, 16, kv_dtype="f16")
        runs = [_run_script(gpu, script, tables, cache)]
        replays = r.replays
        runs.append(_run_script(gpu, script, tables, cache))
    finally:
        gpu.cuda_graphs = None
    assert not r.failures, r.failures
    # the second run replays the steps whose shapes the first captured (a larger workspace
    # drops the graphs captured before it: those steps are captured again)
    assert r.replays - replays >= len(script) // 2
    for graph, kv_graph in runs:
        _assert_same_steps(graph, kv_graph, eager, kv_eager)


@pytest.mark.parametrize("weights", ["blocks", "f16"])
def test_warm_up_compiles_the_kernels_its_steps_launch_ahead(tmp_path, monkeypatch, weights):
    """`Model.warm_up` first compiles the kernel units the model may launch
    (`gpu_runtime.kernel_units`: its block weights' types, every module without parts) in
    threads (`kernels.compile_parallel`); the steps it then captures load no other unit, so
    none waits for a compile on the engine's thread."""
    import threading  # noqa: PLC0415

    import cupy as cp  # noqa: PLC0415

    from kvshare import kernels  # noqa: PLC0415
    from kvshare.model.loader import load_model  # noqa: PLC0415
    from kvshare.ops import gpu_runtime as rt  # noqa: PLC0415

    monkeypatch.setenv("KVSHARE_GPU_WEIGHTS", weights)
    path = tmp_path / "qwen3.gguf"
    write_model(path, "qwen3")
    model = load_model(path, "cuda")
    units = model.kernel_units()
    typed = {u for u in units if u[1] is not None}
    if weights == "blocks":  # the tiny file's block types, each a part of blocks.cu
        assert typed and {m for m, _ in typed} == {"blocks"}
        assert all(p in kernels.parts("blocks") for _, p in typed)
    else:  # f16 copies: no kernel of a block type
        assert not typed

    # every unit compiled afresh: first by a compile-ahead thread, then nothing new
    monkeypatch.setattr(kernels, "_modules", {})
    monkeypatch.setattr(rt, "_kernel_cache", {})
    loaded, built_by = [], {}
    load, compile_ = kernels.load_module, cp.RawModule.compile

    def recording_load(name, part=None):
        loaded.append((name, part))
        return load(name, part)

    def recording_compile(self, log_stream=None):
        built_by.setdefault(id(self), threading.current_thread().name)
        return compile_(self, log_stream)

    monkeypatch.setattr(kernels, "load_module", recording_load)
    monkeypatch.setattr(cp.RawModule, "compile", recording_compile)
    assert model.warm_up(model.new_cache(33, 16, kv_dtype="f16"), 2, 64) > 0
    assert set(loaded) <= set(units), f"compiled at first launch: {set(loaded) - set(units)}"
    assert len(built_by) == len(units)
    assert all(name.startswith("kvshare-nvrtc") for name in built_by.values()), built_by
