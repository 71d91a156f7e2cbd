"""The mixture-of-experts models on the GPU backend (`device="cuda"`) against llama.cpp's
logits (the reference files of the CPU tests: tests/test_model_moe.py,
tests/test_model_lfm2moe.py), with the experts held as `gpu_moe.GpuStackedExperts` and every
MoE layer run by the grouped kernels (kernels/moe_blocks.cu), in both GPU weight modes: the
default (experts dequantized to f16, one stacked part per matrix) and
`KVSHARE_GPU_WEIGHTS=blocks` (the file's blocks). Marked `gpu`: skipped without a CUDA device;
runs on the CPU emulator (tests/gpu_emu).

Models: tiny-qwen3moe (F16 experts), tiny-qwen3moe-q8 (Q8_0 / Q4_0 / Q5_0 experts),
tiny-qwen35moe (the gated-delta-net hybrid with a shared expert), tiny-lfm2moe (the short-conv
hybrid, sigmoid routing with a selection bias), tiny-gpt-oss (attention sinks, window-128
layers, q/k/v/o biases, YaRN, MXFP4 experts with biases and swiglu_oai; its reference files
are tests/test_model_gpt_oss.py's).

Text: `chat` (81 tokens), prefilled in one chunk of 75 then 6 decode steps with an f16 KV
cache, and in one chunk with an f32 KV cache (blocks mode; the emulator runs a CUDA thread per
fiber, so the prompts stay short).

Tolerance: the dense and hybrid models' GPU tolerance (tests/test_model_hybrid.py,
tests/test_model_gpu.py): max |delta logit| <= 2% of the position's logit range, at every
position whose routing is decided (the k-th and (k+1)-th selection scores of every layer at
least `TIE` = 1e-4 apart, as the CPU tests decide it: there llama.cpp may pick the other
expert), top-1 equal wherever llama.cpp's top-1 leads its top-2 by >= 0.5, and at >= 97% of
the decided positions (Gemma 3 270M's GPU acceptance, tests/test_model_gpu.py: a position
where llama.cpp's top two logits are closer than the f16 noise may flip). On tiny-qwen3moe-q8, where llama.cpp rounds the experts'
activations to 8 bits (~0.5% of the range, median, on the CPU too), the check is the CPU
test's: top-1 equal wherever llama.cpp leads by >= 0.5 and a median |delta logit| < 1.5%.
On tiny-gpt-oss, whose reference also rounds the experts' activations to 8 bits (and, with
f16 KV, q and the softmax weights to f16), the same check (tests/test_model_gpt_oss.py's for
its default path). Measured on the emulator: max |delta logit| <= 0.47% of the range (decided
positions) and top-1 >= 98.7% on the three F16-expert models, a median of 0.57% on q8, both
weight modes; tiny-gpt-oss: top-1 100% where llama.cpp leads by >= 0.5, median 0.79% (`chat`,
f16 KV, both modes), 0.69% (`tools_long[:540]`), 0.83% (f32 KV).
"""

from __future__ import annotations

import contextlib
import os
from functools import lru_cache
from pathlib import Path

import numpy as np
import pytest

from kvshare.model.batch import SeqChunk
from kvshare.model.loader import load_model
from kvshare.model.moe import MoeFFN
from kvshare.ops import moe_routing

pytestmark = pytest.mark.gpu

DATA = Path(__file__).parent / "data"
BS = 16
TIE = 1e-4
REL_MAX = 0.02  # the dense and hybrid models' GPU tolerance (fraction of the logit range)
SURE = 0.5  # llama.cpp's top-1 margin from which top-1 must agree
TOP1_MIN = 0.97  # top-1 agreement over the decided positions (near-ties in the logits aside)
F16_MODELS = ("tiny-qwen3moe", "tiny-qwen35moe", "tiny-lfm2moe")
GPT_OSS_LONG = 540  # tokens of tools_long: past the window of 128 and the split-KV threshold
MODES = ("f16", "blocks")


@lru_cache(maxsize=None)
def gpu_model(name: str, mode: str):
    old = os.environ.get("KVSHARE_GPU_WEIGHTS")
    os.environ["KVSHARE_GPU_WEIGHTS"] = mode
    try:
        return load_model(DATA / "models" / f"{name}.gguf", "cuda")
    finally:
        if old is None:
            del os.environ["KVSHARE_GPU_WEIGHTS"]
        else:
            os.environ["KVSHARE_GPU_WEIGHTS"] = old


@lru_cache(maxsize=None)
def reference(name: str, case: str = "chat") -> dict:
    with np.load(DATA / f"{name}.logits.npz") as d:
        q = d[f"{case}/logits_u16"].astype(np.float64)
        lo, rng = d[f"{case}/lo"], d[f"{case}/range"]
        return dict(tokens=d[f"{case}/tokens"], logits=lo[:, None] + q / 65535.0 * rng[:, None],
                    range=rng, top1=d[f"{case}/top1"].astype(np.int64))


def moe_layers(m) -> list[MoeFFN]:
    out = []
    for L in m.layers:
        for f in (getattr(L, "moe", None), getattr(L, "w_gate_up", None)):
            if isinstance(f, MoeFFN):
                out.append(f)
    return out


def selection_gap(logits, routing, selection_bias=None) -> np.ndarray:
    """Per row, the gap between the k-th and (k+1)-th score the router picks by."""
    x = np.asarray(logits, np.float64)
    if routing.gating == "softmax":
        s = np.exp(x - x.max(1, keepdims=True))
        s /= s.sum(1, keepdims=True)
    elif routing.gating == "sigmoid":
        s = 1.0 / (1.0 + np.exp(-x))
    else:
        s = x
    if selection_bias is not None:
        s = s + np.asarray(selection_bias, np.float64)
    s = np.sort(s, axis=1)[:, ::-1]
    return s[:, routing.k - 1] - s[:, routing.k]


@contextlib.contextmanager
def grouped_only(gaps: list):
    """Every MoE layer must take the grouped GPU kernels: the per-expert loop raises; each
    routing call appends its rows' selection gaps to `gaps`."""
    from kvshare.model import moe as model_moe  # noqa: PLC0415

    from kvshare.ops import gpu_moe  # noqa: PLC0415
    from kvshare.ops import gpu_runtime as rt  # noqa: PLC0415

    route, route_dev, per_expert = moe_routing.route, gpu_moe.route_device, model_moe.moe_ffn

    def recording(logits, routing, **kw):
        gaps.append(selection_gap(logits, routing, kw.get("selection_bias")))
        return route(logits, routing, **kw)

    def recording_dev(logits, routing, selection_bias=None):
        sb = None if selection_bias is None else rt.host(selection_bias, np.float32)
        gaps.append(selection_gap(rt.host(logits, np.float32), routing, sb))
        return route_dev(logits, routing, selection_bias)

    def refused(*a, **kw):
        raise AssertionError("a MoE layer took the per-expert path")

    moe_routing.route, gpu_moe.route_device, model_moe.moe_ffn = recording, recording_dev, refused
    try:
        yield
    finally:
        moe_routing.route, gpu_moe.route_device, model_moe.moe_ffn = route, route_dev, per_expert


@contextlib.contextmanager
def eager(m):
    """The model's steps without CUDA graphs."""
    old = m.cuda_graphs
    m.cuda_graphs = False
    try:
        yield
    finally:
        m.cuda_graphs = old


def run(m, tokens, schedule, kv="f16"):
    """(logits of every position, per position the smallest selection gap of any layer)."""
    n = len(tokens)
    slot = 0 if m.config.n_recurrent_layers else None
    cache = m.new_cache(-(-n // BS) + 1, BS, kv_dtype=kv, n_state_slots=int(slot is not None))
    table = np.arange(-(-n // BS))
    out, ties, i = [], [], 0
    n_moe = len(moe_layers(m))
    for size in schedule:
        gaps: list = []
        # eager steps (each layer's routing recorded; a replayed graph routes unseen)
        with grouped_only(gaps), eager(m):
            lg = m.forward([SeqChunk(tokens[i : i + size], i, table, logits="all",
                                     state_slot=slot)], cache)[0]
        out.append(np.asarray(lg))
        assert len(gaps) == n_moe
        ties.append(np.min(np.stack(gaps), axis=0))
        i += size
    assert i == n
    return np.concatenate(out), np.concatenate(ties)


def check(got, gaps, ref, what):
    decided = gaps >= TIE
    rel = np.abs(got - ref["logits"]).max(1) / ref["range"]
    agree = got.argmax(1) == ref["top1"]
    top2 = np.sort(ref["logits"], axis=1)[:, -2:]
    sure = top2[:, 1] - top2[:, 0] >= SURE
    print(f"{what}: top-1 {100 * agree[decided].mean():.2f}% of {int(decided.sum())} decided "
          f"positions, max |dlogit| {100 * rel[decided].max():.4f}% (median "
          f"{100 * np.median(rel):.4f}%) of range; ties at {np.nonzero(~decided)[0].tolist()}")
    assert agree[decided].mean() >= TOP1_MIN, what
    assert agree[sure].all(), what
    assert rel[decided].max() <= REL_MAX, what
    assert (~decided).sum() <= 4, what


def check_q8(got, ref, what):
    rel = np.abs(got - ref["logits"]).max(1) / ref["range"]
    agree = got.argmax(1) == ref["top1"]
    top2 = np.sort(ref["logits"], axis=1)[:, -2:]
    sure = top2[:, 1] - top2[:, 0] >= SURE
    print(f"{what}: top-1 {100 * agree[sure].mean():.2f}% of {int(sure.sum())} with margin "
          f">= 0.5; |dlogit| median {100 * np.median(rel):.3f}% of range")
    assert agree[sure].all(), what
    assert np.median(rel) < 0.015, what


def test_experts_are_stacked_on_the_device_in_each_mode():
    import cupy as cp  # noqa: PLC0415

    from kvshare.ops.gpu_blocks import GpuBlockWeight  # noqa: PLC0415
    from kvshare.ops.gpu_moe import GpuStackedExperts  # noqa: PLC0415

    for mode in MODES:
        m = gpu_model("tiny-qwen3moe-q8", mode)
        moe = moe_layers(m)[1]
        gu, down = moe.stacked_gate_up, moe.stacked_down
        assert isinstance(gu, GpuStackedExperts) and isinstance(down, GpuStackedExperts)
        assert (gu.n_expert, gu.rows, gu.k, down.rows, down.k) == (16, 64, 64, 64, 32)
        if mode == "blocks":  # the file's blocks: gate Q8_0, up Q4_0, down Q5_0
            assert gu.qtypes == (8, 2) and down.qtypes == (6,)
            assert gu.nbytes == 16 * 32 * (68 + 36) and down.nbytes == 16 * 64 * 22
            assert isinstance(moe.gate_up[3], GpuBlockWeight)
        else:  # dequantized to f16, one part
            assert gu.qtypes == (1,) and down.qtypes == (1,)
            assert gu.nbytes == 16 * 64 * 64 * 2
            # the per-expert weights are views of the stacked part
            assert moe.gate_up[3].shape == (64, 64) and moe.gate_up[3].dtype == np.float16
            np.testing.assert_array_equal(
                cp.asnumpy(moe.gate_up[3]).view(np.uint8),
                cp.asnumpy(gu.parts[0][0])[3 * 64 : 4 * 64])
        assert moe.router.dtype == np.float32


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("name", F16_MODELS)
def test_gpu_matches_llama_cpp(name, mode):
    ref = reference(name)
    toks = ref["tokens"]
    n = len(toks)
    m = gpu_model(name, mode)
    got, gaps = run(m, toks, [n - 6] + [1] * 6)
    check(got, gaps, ref, f"{name} gpu {mode}, f16 KV, prefill {n - 6} + 6 decode steps")
    if mode == "blocks":
        got, gaps = run(m, toks, [n], kv="f32")
        check(got, gaps, ref, f"{name} gpu {mode}, f32 KV, one chunk")


@pytest.mark.parametrize("mode", MODES)
def test_gpu_quantized_experts_top1_where_llama_cpp_is_sure(mode):
    ref = reference("tiny-qwen3moe-q8")
    toks = ref["tokens"]
    n = len(toks)
    got, _ = run(gpu_model("tiny-qwen3moe-q8", mode), toks, [n - 6] + [1] * 6)
    check_q8(got, ref, f"tiny-qwen3moe-q8 gpu {mode}, prefill {n - 6} + 6 decode steps")


def test_gpu_batch_of_two_sequences_equals_each_alone():
    """Two sequences decoded in one step (their pairs share tiles of the grouped launch) give
    each the logits it has alone (f32 KV: to f32 rounding)."""
    m = gpu_model("tiny-qwen3moe-q8", "blocks")
    a, b = reference("tiny-qwen3moe")["tokens"][:40], reference("tiny-qwen3moe", "code")["tokens"][:36]
    cache = m.new_cache(8, BS, kv_dtype="f32")
    ta, tb = np.arange(0, 3), np.arange(3, 6)
    m.forward([SeqChunk(a[:37], 0, ta, logits="none"), SeqChunk(b[:33], 0, tb, logits="none")],
              cache)
    both = [[], []]
    for i in range(3):
        lg = m.forward([SeqChunk(a[37 + i : 38 + i], 37 + i, ta, logits="all"),
                        SeqChunk(b[33 + i : 34 + i], 33 + i, tb, logits="all")], cache)
        both[0].append(np.asarray(lg[0]))
        both[1].append(np.asarray(lg[1]))
    for toks, got, k in ((a, both[0], 37), (b, both[1], 33)):
        alone, _ = run(m, toks, [k, 1, 1, 1], kv="f32")
        got = np.concatenate(got)
        np.testing.assert_allclose(got, alone[k:], rtol=0, atol=1e-4 * np.abs(alone).max())


def test_per_expert_path_equals_the_grouped_kernels():
    """`KVSHARE_MOE_GROUPED=0`'s path (one product per active expert on the per-expert
    `GpuBlockWeight`s over the same device bytes) gives the grouped kernels' logits: in steps
    of 4 tokens both multiply f32 activations by the blocks with f32 accumulation (an expert
    with more than 16 rows would take the f16 GEMM there); f32 KV, to 1e-4 of the largest
    logit."""
    m = gpu_model("tiny-qwen3moe-q8", "blocks")
    toks = reference("tiny-qwen3moe-q8")["tokens"][:16]
    grouped, _ = run(m, toks, [4] * 4, kv="f32")
    layers = moe_layers(m)
    stacks = [(f.stacked_gate_up, f.stacked_down) for f in layers]
    try:
        for f in layers:
            f.stacked_gate_up = f.stacked_down = None
        cache = m.new_cache(2, BS, kv_dtype="f32")
        with eager(m):  # (the per-expert loop routes on the host: no graph takes it)
            per_expert = np.concatenate([np.asarray(m.forward(
                [SeqChunk(toks[a : a + 4], a, np.arange(1), logits="all")], cache)[0])
                for a in range(0, 16, 4)])
    finally:
        for f, (gu, d) in zip(layers, stacks):
            f.stacked_gate_up, f.stacked_down = gu, d
    np.testing.assert_allclose(per_expert, grouped, rtol=0, atol=1e-4 * np.abs(grouped).max())


@pytest.mark.parametrize("mode", MODES)
def test_gpt_oss_matches_llama_cpp(mode):
    """gpt-oss on the GPU (attention sinks in the paged attention, window-128 layers, MXFP4
    experts on the grouped kernels) with tests/test_model_gpt_oss.py's criterion for its
    default path: top-1 equal wherever llama.cpp leads by >= 0.5, median |delta logit| < 1.5%
    of the range (llama.cpp rounds the experts' activations to 8 bits). f16 KV against
    `tiny-gpt-oss` (`chat`, prefill then decode steps; the first `GPT_OSS_LONG` tokens of
    `tools_long`, where the window layers drop keys and the decode rows take split-KV), f32
    KV against `tiny-gpt-oss-f32kv` (blocks mode)."""
    m = gpu_model("tiny-gpt-oss", mode)
    ref = reference("tiny-gpt-oss")
    n = len(ref["tokens"])
    got, _ = run(m, ref["tokens"], [n - 6] + [1] * 6)
    check_q8(got, ref, f"tiny-gpt-oss gpu {mode}, chat, f16 KV, prefill {n - 6} + 6 decode steps")
    if mode == "blocks":
        long = reference("tiny-gpt-oss", "tools_long")
        n = GPT_OSS_LONG
        cut = {k: long[k][:n] for k in ("tokens", "logits", "range", "top1")}
        got, _ = run(m, cut["tokens"], [n - 4] + [1] * 4)
        check_q8(got, cut, f"tiny-gpt-oss gpu {mode}, tools_long[:{n}], f16 KV, "
                           f"prefill {n - 4} + 4 decode steps")
        f32 = reference("tiny-gpt-oss-f32kv")
        got, _ = run(m, f32["tokens"], [len(f32["tokens"])], kv="f32")
        check_q8(got, f32, f"tiny-gpt-oss gpu {mode}, chat, f32 KV, one chunk")


def test_gpt_oss_decode_rows_take_split_kv_with_sinks():
    """The long case's decode rows (one sequence, > 512 keys on the full layers) are cut into
    key splits on this device (the emulator reports an H200's 132 multiprocessors), so the
    merge with the sink is what the model runs there."""
    from kvshare.ops import gpu  # noqa: PLC0415
    from kvshare.ops import gpu_runtime as rt  # noqa: PLC0415

    cfg = gpu_model("tiny-gpt-oss", "blocks").config
    gc, n_gchunks = gpu.group_chunk(cfg.n_head, cfg.n_head_kv)
    tiles = gpu.pa_tiles(np.array([0, 1]), np.array([GPT_OSS_LONG - 4]), gc)
    assert gpu.pa_splits(tiles, 0, cfg.n_head_kv, n_gchunks, 1, cfg.n_head, cfg.head_dim,
                         rt.device_attr("MultiProcessorCount")) > 1


@pytest.mark.parametrize("mode", MODES)
def test_gpt_oss_experts_on_the_gpu_equal_the_cpu(mode):
    """gpt-oss's MoE layer loaded for the GPU on its own: MXFP4 experts with biases and
    `swiglu_oai`, held as their MXFP4 blocks
    (blocks; no per-expert weights, the dense kernels lack MXFP4) or dequantized to f16 (MXFP4
    values are f16 values), give the CPU layer's output (its grouped kernels, f32 activations)
    to 1e-4 of the largest value."""
    import cupy as cp  # noqa: PLC0415

    from kvshare.backend import get_backend  # noqa: PLC0415
    from kvshare.model.config import config_from_metadata  # noqa: PLC0415
    from kvshare.model.gguf_file import GGUFFile  # noqa: PLC0415
    from kvshare.model.moe import load_moe  # noqa: PLC0415
    from kvshare.model.weights import WeightLoader  # noqa: PLC0415

    path = DATA / "models" / "tiny-gpt-oss.gguf"
    gf = GGUFFile(path)
    cfg = config_from_metadata(gf.metadata)
    old = os.environ.get("KVSHARE_GPU_WEIGHTS")
    os.environ["KVSHARE_GPU_WEIGHTS"] = mode
    try:
        gpu = load_moe(WeightLoader(gf, get_backend("cuda")), cfg, 1, "swiglu_oai")
    finally:
        if old is None:
            del os.environ["KVSHARE_GPU_WEIGHTS"]
        else:
            os.environ["KVSHARE_GPU_WEIGHTS"] = old
    cpu = load_moe(WeightLoader(gf, get_backend("cpu")), cfg, 1, "swiglu_oai")
    assert gpu.stacked_gate_up.qtypes == ((39, 39) if mode == "blocks" else (1,))
    assert (len(gpu.gate_up) == 0) == (mode == "blocks") and gpu.n_ff_exp == cpu.n_ff_exp == 64
    rng = np.random.default_rng(4)
    for n in (1, 5):
        h = rng.standard_normal((n, cfg.n_embd)).astype(np.float32)
        want = cpu(h)
        gaps: list = []
        with grouped_only(gaps):
            got = cp.asnumpy(gpu(cp.asarray(h)))
        np.testing.assert_allclose(got, want, rtol=0, atol=1e-4 * np.abs(want).max())


# --- the engine ------------------------------------------------------------------------------

# Logprobs of the GPU engine against the CPU engine's: the logits differ by the GPU path's f16
# noise (above: <= 0.5% of the range), which moves a logprob by at most twice the largest
# logit change; measured <= 0.052 (tiny-qwen35moe's top-3 at its first token), so 0.1.
LOGPROB_TOL = 0.1


@lru_cache(maxsize=None)
def engine_output(name: str, device: str):
    """A greedy chat request (8 tokens, top-3 logprobs) on an engine on `device`: [(token,
    logprob, top-3 logprobs)], as tests/test_engine_moe.py reads them."""
    from kvshare.engine.api import GenerationRequest, SamplingParams  # noqa: PLC0415
    from kvshare.engine.engine import Engine, EngineConfig  # noqa: PLC0415
    from kvshare.model.chat_template import ChatTemplate  # noqa: PLC0415
    from kvshare.model.tokenizer import Tokenizer  # noqa: PLC0415

    path = DATA / "models" / f"{name}.gguf"
    model = load_model(path, device)
    tok = Tokenizer.from_gguf(path)
    eng = Engine(model, tok, ChatTemplate.from_gguf(path, tok), bytes.fromhex(model.fingerprint),
                 EngineConfig(kv_blocks=64, block_size=BS, prefill_chunk=128, cache_ram_mib=0,
                              device=device))
    text, _ = eng.apply_chat_template([{"role": "system", "content": "You are a build agent."},
                                       {"role": "user", "content": "List three tools."}])
    h = eng.submit(GenerationRequest(prompt_tokens=eng.tokenize(text), max_tokens=8,
                                     sampling=SamplingParams(temperature=0.0), logprobs=True,
                                     top_logprobs=3))
    eng.run_until_idle()
    toks, _ = h.result(timeout=0)
    eng.pool.check_invariants()
    return [(t.token_id, t.logprob.logprob, sorted(a.logprob for a in t.top_logprobs))
            for t in toks if t.token_id >= 0]


@pytest.mark.parametrize("name", F16_MODELS + ("tiny-gpt-oss",))
def test_engine_decode_on_the_gpu_equals_the_cpu(name):
    """The engine on `device="cuda"` (default GPU weights: f16 experts on the grouped kernels)
    prefills a chat prompt and decodes 8 greedy tokens: the CPU engine's tokens, and its
    chosen and top-3 logprobs within `LOGPROB_TOL`."""
    cpu, gpu = engine_output(name, "cpu"), engine_output(name, "cuda")
    assert [t for t, _, _ in gpu] == [t for t, _, _ in cpu] and len(cpu) == 8
    for (_, lp_g, top_g), (_, lp_c, top_c) in zip(gpu, cpu):
        assert lp_g == pytest.approx(lp_c, abs=LOGPROB_TOL)
        assert top_g == pytest.approx(top_c, abs=LOGPROB_TOL)


# --- steps as CUDA graphs ------------------------------------------------------------------------

@pytest.mark.parametrize("mode", MODES)
def test_moe_steps_as_cuda_graphs_equal_eager(mode, monkeypatch):
    """tiny-qwen3moe's steps as CUDA graphs (each MoE layer routed, its pairs sorted and cut
    into tiles on the device: nothing comes back to the host mid-step): a prefill chunk, decode
    rows, a chunk beside a decode row, each shape captured at its first step, then the same
    steps again (replays): the eager steps' logits and KV, bit for bit on the emulator."""
    from kvshare.model import gpu_graphs  # noqa: PLC0415
    from kvshare.ops import gpu_moe  # noqa: PLC0415

    monkeypatch.setattr(gpu_graphs, "PREFILL_SIGHTINGS", 1)
    m = gpu_model("tiny-qwen3moe", mode)
    assert all(f.graph_ready() for f in moe_layers(m))
    toks = reference("tiny-qwen3moe")["tokens"]
    tables = [np.arange(0, 4), np.arange(4, 8)]
    script = [[(0, 0, 20, "last")], [(0, 20, 1, "last")], [(0, 21, 1, "last"), (1, 0, 9, "last")],
              [(0, 22, 1, "last"), (1, 9, 1, "last")]]

    def run_script(cache, base):
        out = []
        for step in script:
            chunks = [SeqChunk(toks[base + s * 30 + p : base + s * 30 + p + n], p, tables[s],
                               logits=lg) for s, p, n, lg in step]
            out.append([np.asarray(x.get() if hasattr(x, "get") else x)
                        for x in m.forward(chunks, cache)])
        kv = [np.asarray(a.get()) for L in m.layers for a in cache.layer_kv(L.attn_index)]
        return out, kv

    try:
        m.cuda_graphs = False
        eager = run_script(m.new_cache(8, BS), 0)
        m.cuda_graphs = True
        r = gpu_graphs.runner(m)
        assert r is not None
        cache = m.new_cache(8, BS)
        first = run_script(cache, 0)
        captured, replays = r.captures, r.replays
        again = run_script(cache, 0)
    finally:
        m.cuda_graphs = None
    assert not r.failures and captured >= 3 and r.captures == captured
    assert r.replays - replays == len(script)
    for got, kv in (first, again):
        for a, b in zip(got, eager[0]):
            for x, y in zip(a, b):
                np.testing.assert_array_equal(x, y)
        for a, b in zip(kv, eager[1]):
            np.testing.assert_array_equal(a, b)
    assert gpu_moe.device_routing(moe_layers(m)[0].routing)


@pytest.mark.parametrize("mode", MODES)
def test_gpt_oss_steps_as_cuda_graphs_equal_eager(mode, monkeypatch):
    """tiny-gpt-oss's steps as CUDA graphs: YaRN rope tables from the positions buffer, the
    attention sinks in the combine, window-128 layers (a sequence past its window), MXFP4
    experts routed on the device. A prompt prefilled eagerly to position 136, then decode
    rows, a chunk beside a decode row, each shape captured at its first step, then the same
    steps again (replays): the eager steps' logits and KV, bit for bit on the emulator."""
    from kvshare.model import gpu_graphs  # noqa: PLC0415

    monkeypatch.setattr(gpu_graphs, "PREFILL_SIGHTINGS", 1)
    m = gpu_model("tiny-gpt-oss", mode)
    assert m.step_graphs_apply() and m.yarn is not None
    assert any(L.window for L in m.layers) and all(L.sinks is not None for L in m.layers)
    toks = reference("tiny-gpt-oss", "tools_long")["tokens"]
    tables = [np.arange(0, 10), np.arange(10, 12)]
    n0 = 136  # past the window of 128
    script = [[(0, n0, 1, "last")], [(0, n0 + 1, 1, "last"), (1, 0, 9, "last")],
              [(0, n0 + 2, 1, "last"), (1, 9, 1, "last")], [(1, 10, 6, "all")]]

    def run_script(cache, prefill=True):
        if prefill:
            with eager(m):  # the same KV for both runs to start from
                m.forward([SeqChunk(toks[:n0], 0, tables[0], logits="none")], cache)
        out = []
        for step in script:
            chunks = [SeqChunk(toks[s * 200 + p : s * 200 + p + n], p, tables[s], logits=lg)
                      for s, p, n, lg in step]
            out.append([np.asarray(x.get() if hasattr(x, "get") else x)
                        for x in m.forward(chunks, cache)])
        kv = [np.asarray(a.get()) for L in m.layers for a in cache.layer_kv(L.attn_index)]
        return out, kv

    try:
        m.cuda_graphs = False
        want = run_script(m.new_cache(12, BS))
        m.cuda_graphs = True
        r = gpu_graphs.runner(m)
        assert r is not None
        cache = m.new_cache(12, BS)  # (the graphs hold its addresses)
        first = run_script(cache)
        captured, replays = r.captures, r.replays
        again = run_script(cache, prefill=False)  # (the script rewrites its own KV alike)
    finally:
        m.cuda_graphs = None
    assert not r.failures and captured >= 4
    assert r.replays - replays == len(script)
    for got, kv in (first, again):
        for a, b in zip(got, want[0]):
            for x, y in zip(a, b):
                np.testing.assert_array_equal(x, y)
        for a, b in zip(kv, want[1]):
            np.testing.assert_array_equal(a, b)


def _run_hybrid_script(m, script, toks, tables, cache):
    """A hybrid's steps: each step's `(seq, start, n, logits)` chunks (seq s's tokens from
    `toks[20 s:]`, its table `tables[s]`, state slot s + 1); returns each step's logits (host
    arrays, None where a chunk wants none) and the cache's KV and states after the script."""
    out = []
    for step in script:
        chunks = [SeqChunk(toks[s * 20 + p : s * 20 + p + n], p, tables[s], logits=lg,
                           state_slot=s + 1) for s, p, n, lg in step]
        out.append([None if x is None else np.asarray(x.get() if hasattr(x, "get") else x)
                    for x in m.forward(chunks, cache)])
    kv = [np.asarray(a.get()) for L in m.layers if L.kind == "attention"
          for a in cache.layer_kv(L.attn_index)]
    kv += [np.asarray(a.get()) for a in cache.states]
    return out, kv


def _eager_then_graphs(m, script, toks, tables):
    """The script eager on a new cache, then with CUDA graphs twice on another: `(eager,
    first, again, runner, (captures, replays) after the first graphs run)`, each run's
    `_run_hybrid_script` result."""
    from kvshare.model import gpu_graphs  # noqa: PLC0415

    try:
        m.cuda_graphs = False
        want = _run_hybrid_script(m, script, toks, tables, m.new_cache(10, BS, n_state_slots=4))
        m.cuda_graphs = True
        r = gpu_graphs.runner(m)
        assert r is not None
        cache = m.new_cache(10, BS, n_state_slots=4)
        first = _run_hybrid_script(m, script, toks, tables, cache)
        counts = (r.captures, r.replays)
        again = _run_hybrid_script(m, script, toks, tables, cache)
    finally:
        m.cuda_graphs = None
    return want, first, again, r, counts


@pytest.mark.parametrize("name", ("tiny-lfm2", "tiny-lfm2moe", "tiny-qwen35", "tiny-qwen35moe"))
def test_hybrid_decode_steps_as_cuda_graphs_equal_eager(name, monkeypatch):
    """A hybrid's decode steps as CUDA graphs (its recurrent layers' `gpu_step` on the
    cache's states by the slots in the step's input buffer: lfm2's short conv, qwen35's
    delta net; qwen35's gated attention through `gpu_attention_step`; the experts routed
    on the device, qwen35moe's shared expert and its gate from the workspace): three sequences prefilled eagerly (graphs of steps with a prompt
    chunk off here: the next test has them), then decode steps of one, two and three rows, captured at their
    first step and replayed; the whole script again on the same cache (its prompts zero the
    states): the eager run's logits, KV and recurrent states, bit for bit on the emulator;
    the padding row of a bucket touches no state."""
    from kvshare.model import gpu_graphs  # noqa: PLC0415

    monkeypatch.setenv(gpu_graphs.PREFILL_ENV, "0")
    m = gpu_model(name, "f16")
    assert m.step_graphs_apply()
    if name == "tiny-qwen35moe":
        assert all(f.shared_gate is not None for f in moe_layers(m))
    toks = reference(name)["tokens"]
    tables = [np.arange(0, 3), np.arange(3, 6), np.arange(6, 8)]
    script = [[(0, 0, 12, "last")], [(1, 0, 7, "last")], [(2, 0, 5, "last")],
              [(0, 12, 1, "last")], [(0, 13, 1, "last"), (1, 7, 1, "last")],
              [(0, 14, 1, "last"), (1, 8, 1, "last")],
              [(0, 15, 1, "last"), (1, 9, 1, "last"), (2, 5, 1, "last")],  # a padding row
              [(1, 10, 1, "last")], [(0, 16, 1, "last"), (1, 11, 1, "last"), (2, 6, 1, "last")]]

    want, first, again, r, (captured, replays) = _eager_then_graphs(m, script, toks, tables)
    # decode steps of 1, 2 and 3 rows (a graph of 4); a shape whose workspace outgrew the
    # others' is captured again
    assert not r.failures and captured >= 3
    assert set(r.graphs) == {gpu_graphs.StepShape.decode(b) for b in (1, 2, 4)}
    assert r.replays - replays == 6  # every decode step of the second run is a graph's
    for got, kv in (first, again):
        for a, b in zip(got, want[0]):
            for x, y in zip(a, b):
                np.testing.assert_array_equal(x, y)
        for a, b in zip(kv, want[1]):
            np.testing.assert_array_equal(a, b)
    # slot 0 was never a sequence's: still zero in the graphs' run (its padding row's slot
    # is -1); the sequences' slots hold states
    for st in kv[-len(m.state_shapes()):]:
        assert not st[0].any() and st[1:].any(axis=tuple(range(1, st.ndim))).all()


@pytest.mark.parametrize("name", ("tiny-lfm2", "tiny-lfm2moe", "tiny-qwen35", "tiny-qwen35moe",
                                  "tiny-lfm2:3"))
def test_hybrid_prompt_steps_as_cuda_graphs_equal_eager(name):
    """A hybrid's steps with a prompt chunk as CUDA graphs (its recurrent layers' sequence
    kernels on the step's sequences from the input buffer, the padding rows a sequence of
    slot -1; the last layer's kept rows gathered, through qwen35's gated attention or after
    lfm2's conv): prompts with their last row's logits, a prompt chunk beside decode rows
    with every row's logits, one with none, decode steps; a shape is captured at its second
    step. The script twice on the same cache (its prompts zero the states): the eager run's
    logits, KV and recurrent states, bit for bit on the emulator; slot 0, never a sequence's,
    untouched. The tiny models end with an attention layer; "tiny-lfm2:3" is tiny-lfm2's
    first 3 layers, so that its last is a conv layer, as real LFM2 models' is (the kept
    rows gathered after it)."""
    name, _, cut = name.partition(":")
    m = gpu_model(name, "f16")
    if cut:
        m.layers = m.layers[: int(cut)]
        assert m.layers[-1].kind != "attention"
    assert m.step_graphs_apply()
    toks = reference(name)["tokens"]
    tables = [np.arange(0, 3), np.arange(3, 6), np.arange(6, 9)]
    script = [[(0, 0, 12, "last")], [(1, 0, 7, "last")], [(2, 0, 5, "last")],
              [(0, 12, 1, "last"), (1, 7, 1, "last")],
              [(0, 13, 3, "all"), (1, 8, 1, "last")],
              [(2, 5, 6, "none")],
              [(0, 16, 9, "last"), (1, 9, 1, "last"), (2, 11, 1, "last")],
              [(1, 10, 4, "last")]]

    want, first, again, r, _ = _eager_then_graphs(m, script, toks, tables)
    assert not r.failures
    prompt_shapes = {sh for sh in r.graphs if sh.prefill}
    # the 7- and 5-token prompts share a shape (captured at the second), as do their
    # reruns; every prompt shape of the second run is captured or replayed
    assert len(prompt_shapes) >= 4 and any(sh.gather for sh in prompt_shapes)
    assert any(not sh.gather and sh.rows for sh in prompt_shapes)
    assert any(sh.rows == 0 for sh in prompt_shapes)
    assert r.replays >= len(script)
    for got, kv in (first, again):
        for a, b in zip(got, want[0]):
            for x, y in zip(a, b):
                if y is None:
                    assert x is None
                else:
                    np.testing.assert_array_equal(x, y)
        for a, b in zip(kv, want[1]):
            np.testing.assert_array_equal(a, b)
    for st in kv[-len(m.state_shapes()):]:
        assert not st[0].any() and st[1:].any(axis=tuple(range(1, st.ndim))).all()

