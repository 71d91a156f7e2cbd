"""bench/gpu_targets.py: issue 40's acceptance table from the files bench/gpu_check.sh's steps
write. The inputs are written here in the shapes the benches write (gpu_bench.py's and
agent_fleet.py's JSON; pytest's own junit XML, made by running pytest), and the table's
pass / FAIL / not run / timed out / invalid logic is checked row by row."""

from __future__ import annotations

import copy
import importlib.util
import json
import re
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

_PATH = Path(__file__).resolve().parents[1] / "bench" / "gpu_targets.py"


def _load():
    spec = importlib.util.spec_from_file_location("gpu_targets", _PATH)
    mod = importlib.util.module_from_spec(spec)
    sys.modules.setdefault("gpu_targets", mod)  # dataclasses look their module up
    spec.loader.exec_module(mod)
    return mod


gt = _load()


def _decode(tps: float, ctx: int = 1024, graphs: bool = True) -> dict:
    steps = 32
    return {"ctx": ctx, "steps": steps, "seconds": round(steps / tps, 4),
            "tokens_per_s": tps, "cuda_graphs": graphs, "ms_per_step": round(1e3 / tps, 2)}


# bench/gpu_bench.py --model q15.gguf --prefill-sizes 1024 --batches 1,8,32 --greedy-check 4,32
BENCH = {
    "model": "kvshare-qwen3-1.5b-rand-ggml-vocab-qwen2.gguf",
    "path": "/tmp/kvshare-qwen3-1.5b-rand-ggml-vocab-qwen2.gguf", "device": "cuda",
    "load_s": 3.1, "gpu_weights": "blocks", "n_layers": 28, "n_embd": 2048, "vocab": 151936,
    "weights_memory": {"device_pool_bytes": 1_110_000_000, "weight_bytes": 1_105_000_000,
                       "file_tensor_bytes": 1_100_000_000,
                       "measured_by": "cupy pool growth over the load", "ratio": 1.0091},
    "prefill_chunk": 2048,
    "prefill": {"1024": {"seconds": 0.02, "tokens_per_s": 51200.0}},
    "decode": {"1": _decode(610.0), "8": _decode(3100.0), "32": _decode(7200.0)},
    "decode_eager": {"1": _decode(80.0, graphs=False), "8": _decode(600.0, graphs=False),
                     "32": _decode(2000.0, graphs=False)},
    "greedy_graphs": {"batch": 4, "steps": 32, "ctx": 256, "cuda_graphs": True, "equal": True,
                      "tokens": 128, "differing": 0, "first_difference": None},
    # --engine-decode 1,32
    "engine_decode": {
        f"{b} async {on}": {"ctx": 1024, "tokens": 32 * b, "seconds": 1.0,
                            "tokens_per_s": tps, "steps": 32,
                            "steps_ahead": 30 if on == "on" else 0,
                            "async_scheduling": on == "on"}
        for b, on, tps in ((1, "on", 900.0), (1, "off", 700.0), (32, "on", 9000.0),
                           (32, "off", 7100.0))},
}


def _stats(xs: list[float]) -> dict:
    return {"median": sorted(xs)[len(xs) // 2], "max": max(xs), "n": len(xs)}


# bench/agent_fleet.py --model q15.gguf --server-args "--device cuda"
#   --server-env KVSHARE_GPU_WEIGHTS=blocks --out agent_fleet.json (summarize()'s keys)
FLEET = {
    "config": {"prefix_tokens": 6000, "sessions": 4, "turns": 3, "new_tokens": 150,
               "max_tokens": 32, "quick": False, "seed": 0, "ignore_eos": False,
               "no_warm_up": False, "model": "/tmp/kvshare-qwen3-1.5b-rand-ggml-vocab-qwen2.gguf",
               "server_args": "--device cuda", "server_env": ["KVSHARE_GPU_WEIGHTS=blocks"],
               "out": "/tmp/kvshare-gpu-check/agent_fleet.json", "peer_url": None,
               "no_kvshare": False,
               "kvshare_serve_args": ["--model", "/tmp/q15.gguf", "--device", "cuda"]},
    "runs": {"kvshare": {
        "wall_s": 1.21, "turn1_ttft": _stats([0.2, 0.21, 0.22, 0.25]),
        "later_ttft": _stats([0.018, 0.019, 0.021, 0.022, 0.024, 0.025, 0.026, 0.028]),
        "per_turn": {}, "later_cached_fraction": 0.95, "turn1_max_cached": 0,
        "completion_tokens": 384, "empty_replies": 0, "errors": [], "records": [],
        "prefix_tokens": 5989,
        "later_ttft_split": {"n": 8, "before_engine_ms": _stats([2.0, 3.0]),
                             "engine_ms": _stats([12.0, 14.0]),
                             "engine_prompt_ms": _stats([8.0, 9.0]),
                             "rest_ms": _stats([6.0, 7.0])}}},
    "prompts": {"counted_by": "http://127.0.0.1:1/tokenize", "prefix_tokens": 5989},
}

_TEST_FILE = textwrap.dedent('''
    import pytest

    @pytest.mark.parametrize("t", ["Q2_K", "Q4_K", "Q6_K"])
    def test_dequantize_f16_tiles(t):
        assert t != FAIL_TYPE

    def test_skipped():
        pytest.skip("the Gemma 3 270M package is not installed")
''')


@pytest.fixture(scope="module")
def junit(tmp_path_factory):
    """Real pytest junit XML files: {'ok': every Q2_K..Q6_K case passes, 'q2k_fails': the
    Q2_K case fails, 'all_skipped': every case skips (as on a machine without a GPU)}."""
    d = tmp_path_factory.mktemp("junit")
    out = {}
    for name, body in {
        "ok": _TEST_FILE.replace("FAIL_TYPE", "'none'"),
        "q2k_fails": _TEST_FILE.replace("FAIL_TYPE", "'Q2_K'"),
        "all_skipped": "import pytest\npytestmark = pytest.mark.skip('no GPU')\n"
                       + _TEST_FILE.replace("FAIL_TYPE", "'none'"),
    }.items():
        src = d / f"test_{name}.py"
        src.write_text(body)
        xml = d / f"{name}.xml"
        subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider",
                        f"--junitxml={xml}", str(src)], cwd=d, capture_output=True,
                       timeout=120, check=False)
        out[name] = xml.read_text()
    return out


def _write(d: Path, bench=BENCH, fleet=FLEET, junit: dict | None = None,
           steps: dict | None = None) -> Path:
    if bench is not None:
        (d / "gpu_bench_q15.json").write_text(json.dumps(bench))
    if fleet is not None:
        (d / "agent_fleet.json").write_text(json.dumps(fleet))
    for name, text in (junit or {}).items():
        (d / name).write_text(text)
    for name, st in (steps or {}).items():
        (d / f"step_{name}.json").write_text(json.dumps(st))
    return d


def _rows(d: Path) -> dict:
    return {r.id: r for r in gt.build(d)}


def test_every_target_met_passes_and_the_table_says_so(tmp_path, junit):
    _write(tmp_path, junit={"pytest_graphs_on.xml": junit["ok"],
                            "pytest_graphs_off.xml": junit["ok"],
                            "pytest_q2k.xml": junit["ok"],
                            "pytest_kernels.xml": junit["ok"]})
    rows = _rows(tmp_path)
    for rid in ("decode_b1", "decode_b8", "decode_b32", "prefill_1k", "weights_memory",
                "greedy_graphs", "fleet_ttft", "fleet_wall", "pytest_graphs_on",
                "pytest_graphs_off", "q2k", "pytest_kernels"):
        assert rows[rid].status == "pass", (rid, rows[rid])
    assert rows["decode_b1"].measured == "610"
    assert rows["decode_b32"].value == 7200.0
    assert rows["fleet_ttft"].measured == "24.0"  # the later-turn median, in ms
    # where it went (the fleet's split of the server's request log), medians
    assert "before the engine 3.0, engine 14.0, rest 7.0 ms" in rows["fleet_ttft"].source
    assert rows["weights_memory"].measured == "1.009"
    assert rows["pytest_graphs_on"].measured.startswith("3 passed, 0 failed, 0 errors, 1 skipped")
    # the rows filled by other modes
    assert rows["pytest_moe"].status == "not run"
    assert "MOE_ONLY=1" in rows["pytest_moe"].source
    assert rows["matvec"].status == "not run"
    assert rows["gpt_oss_decode"].status == "not run"
    assert "MOE_ONLY=1" in rows["gpt_oss_decode"].source
    assert rows["engine_decode"].status == "info"
    assert rows["engine_decode"].measured == ("batch 1: 900 / 700 (30 of 32 steps ahead); "
                                              "batch 32: 9,000 / 7,100 (30 of 32 steps ahead)")

    out = tmp_path / "out"
    assert gt.main(["--dir", str(tmp_path), "--out-dir", str(out), "--mode", "default run"]) == 0
    text = (out / "targets.txt").read_text()
    lines = text.splitlines()
    assert lines[1].split()[:5] == ["figure", "target", "measured", "status", "source"]
    b1 = next(ln for ln in lines if ln.startswith("decode, 1 sequence"))
    assert ">= 500" in b1 and " 610 " in b1 and re.search(r"\s{2}pass\s{2}", b1)
    assert lines[-1] == "12 pass, 4 not run"
    saved = json.loads((out / "targets.json").read_text())
    assert [r["id"] for r in saved["rows"]] == [r.id for r in gt.build(tmp_path)]
    # the measurements come back inside targets.json
    assert saved["sources"]["gpu_bench_q15.json"]["decode"]["8"]["tokens_per_s"] == 3100.0
    assert saved["sources"]["agent_fleet.json"]["runs"]["kvshare"]["wall_s"] == 1.21


def test_targets_missed_fail(tmp_path, junit):
    bench = copy.deepcopy(BENCH)
    bench["decode"]["1"] = _decode(74.0)
    bench["decode"]["32"] = _decode(5999.0)
    bench["prefill"]["1024"]["tokens_per_s"] = 28800.0
    bench["weights_memory"]["ratio"] = 1.9
    bench["greedy_graphs"].update(equal=False, differing=3, first_difference=[1, 5])
    fleet = copy.deepcopy(FLEET)
    fleet["runs"]["kvshare"]["later_ttft"] = _stats([0.081, 0.09])
    fleet["runs"]["kvshare"]["wall_s"] = 3.96
    _write(tmp_path, bench, fleet, junit={"pytest_graphs_on.xml": junit["q2k_fails"],
                                          "pytest_q2k.xml": junit["q2k_fails"]})
    rows = _rows(tmp_path)
    for rid in ("decode_b1", "decode_b32", "prefill_1k", "weights_memory", "greedy_graphs",
                "fleet_ttft", "fleet_wall", "pytest_graphs_on", "q2k"):
        assert rows[rid].status == "FAIL", (rid, rows[rid])
    assert rows["decode_b8"].status == "pass"
    assert rows["greedy_graphs"].measured == "3 of 128 differ"
    assert any("test_dequantize_f16_tiles[Q2_K]" in n for n in rows["pytest_graphs_on"].notes)
    assert rows["q2k"].measured.startswith("Q2_K: 0 passed, 1 failed")
    assert rows["pytest_graphs_off"].status == "not run"


def test_bounds_are_inclusive(tmp_path):
    bench = copy.deepcopy(BENCH)
    bench["decode"]["1"] = _decode(500.0)
    bench["weights_memory"]["ratio"] = 1.05
    fleet = copy.deepcopy(FLEET)
    fleet["runs"]["kvshare"]["later_ttft"] = _stats([0.030])
    fleet["runs"]["kvshare"]["wall_s"] = 1.5
    rows = _rows(_write(tmp_path, bench, fleet))
    for rid in ("decode_b1", "weights_memory", "fleet_ttft", "fleet_wall"):
        assert rows[rid].status == "pass", (rid, rows[rid])


def test_nothing_measured_is_never_a_pass(tmp_path):
    rows = gt.build(tmp_path)
    assert {r.status for r in rows} == {"not run"}
    text = gt.render(rows, "default run")
    assert not re.search(r"\s{2}pass\s{2}", text)  # no status "pass" ("all pass" is a target)
    assert text.splitlines()[-1] == f"{len(rows)} not run"


def test_a_step_that_timed_out_or_crashed_says_so(tmp_path):
    _write(tmp_path, bench=None, fleet=None,
           steps={"gpu_bench_q15": {"rc": 124, "seconds": 240, "timeout": 240},
                  "agent_fleet": {"rc": 1, "seconds": 12, "timeout": 150}})
    rows = _rows(tmp_path)
    assert rows["decode_b1"].status == "timed out"
    assert rows["prefill_1k"].measured == "timed out after 240 s"
    assert rows["fleet_wall"].status == "FAIL"
    assert rows["fleet_wall"].measured == "failed (rc 1)"
    assert rows["pytest_graphs_on"].status == "not run"


def test_a_run_off_the_issues_conditions_is_invalid(tmp_path, junit):
    """The CPU dry run's figures (tiny model, cpu, short context, f16 weights, --quick fleet,
    every GPU test skipped) beat the targets but are never a pass."""
    bench = copy.deepcopy(BENCH)
    bench.update(device="cpu", n_layers=2, n_embd=256, vocab=367, gpu_weights="f16")
    bench["decode"] = {k: _decode(9000.0, ctx=128, graphs=False) for k in ("1", "8", "32")}
    bench["weights_memory"].update(device_pool_bytes=None,
                                   measured_by="kvshare.model.loader.weight_bytes")
    bench["greedy_graphs"]["cuda_graphs"] = False
    fleet = copy.deepcopy(FLEET)
    fleet["config"].update(sessions=2, turns=2, prefix_tokens=1500, quick=True)
    fleet["config"]["kvshare_serve_args"] = ["--model", "/tmp/tiny.gguf", "--device", "cpu"]
    _write(tmp_path, bench, fleet, junit={"pytest_graphs_on.xml": junit["all_skipped"],
                                          "pytest_q2k.xml": junit["all_skipped"]})
    rows = _rows(tmp_path)
    for rid in ("decode_b1", "decode_b8", "decode_b32", "prefill_1k", "weights_memory",
                "greedy_graphs", "fleet_ttft", "fleet_wall", "pytest_graphs_on", "q2k"):
        assert rows[rid].status == "invalid", (rid, rows[rid])
    notes = "; ".join(rows["decode_b1"].notes)
    for why in ("device cpu", "not the 1.5b shape", "not blocks", "context 128",
                "vocab 367", "CUDA graphs not captured"):
        assert why in notes
    assert any("server not on cuda" in n for n in rows["fleet_ttft"].notes)


def test_only_the_vocabulary_differing_is_noted_not_invalid(tmp_path):
    bench = copy.deepcopy(BENCH)
    bench["vocab"] = 367  # the fallback tokenizer: the rows still count, with a note
    rows = _rows(_write(tmp_path, bench))
    assert rows["decode_b1"].status == "pass"
    assert any("vocab 367" in n for n in rows["decode_b1"].notes)


def test_the_matvec_bench_is_shown_without_a_target(tmp_path):
    # bench/gpu_matvec_bench.py --out gpu_matvec_bench.json
    rows = [{"product": p, "m": m, "k": 2048, "n": n, "weight_mb": 1.0, "types": ["Q4_K"],
             "bmv_ms": 0.010 * m, "mmvq_ms": 0.008 * m, "quantize_ms": 0.002,
             "bmv_gbs": 100.0, "mmvq_gbs": 125.0, "rel_diff": 0.003}
            for p, n in (("qkv", 4096), ("down", 2048)) for m in (1, 4, 8)]
    (tmp_path / "gpu_matvec_bench.json").write_text(json.dumps(
        {"device": "NVIDIA H200", "iters": 200, "rows": rows}))
    row = _rows(tmp_path)["matvec"]
    assert row.status == "info"
    assert row.measured == "m=1, 2 products: bmv 0.020 ms, mmvq 0.016 ms"


def test_triage_switches_off_the_kernels_whose_tests_failed(tmp_path):
    """The default run's first step: a kernel family failing its tests on the device is
    switched off for the figures after it, and the table says with what."""
    tests = tmp_path / "tests"
    tests.mkdir()
    (tests / "__init__.py").write_text("")
    (tests / "test_ops_gpu_attention_mma.py").write_text(
        "def test_prefill():\n    assert False\n\ndef test_decode_rows():\n    pass\n")
    (tests / "test_sampling_gpu.py").write_text(
        "class TestTopP:\n    def test_rows(self):\n        assert False\n")
    (tests / "test_ops_gpu_fused.py").write_text("def test_glu():\n    assert False\n")
    (tests / "test_engine_overlap.py").write_text("def test_events():\n    pass\n")
    # a module that does not import ran no test: it counts as failed
    (tests / "test_ops_gpu_mmvq.py").write_text("import kvshare_no_such_module\n")
    xml = tmp_path / "pytest_kernels.xml"
    subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider",
                    "--continue-on-collection-errors", f"--junitxml={xml}", "tests"],
                   cwd=tmp_path, capture_output=True, timeout=120, check=False)
    out = subprocess.run([sys.executable, str(_PATH), "--dir", str(tmp_path), "--triage",
                          "pytest_kernels.xml"], capture_output=True, text=True, timeout=60,
                         check=True).stdout
    # mmvq is opt-in (no switch, its info run is skipped); overlap passed
    assert out.splitlines() == ["KVSHARE_GPU_ATTN_MMA=0", "KVSHARE_GPU_FUSED=0",
                                "KVSHARE_DEVICE_SAMPLING=0"]
    t = json.loads((tmp_path / "triage.json").read_text())
    assert sorted(t["failed"]) == ["test_ops_gpu_attention_mma", "test_ops_gpu_fused",
                                   "test_ops_gpu_mmvq", "test_sampling_gpu"]
    assert t["failed"]["test_ops_gpu_attention_mma"] == [
        "tests.test_ops_gpu_attention_mma::test_prefill"]
    rows = _rows(_write(tmp_path))
    note = ("measured with KVSHARE_GPU_ATTN_MMA=0 KVSHARE_GPU_FUSED=0 "
            "KVSHARE_DEVICE_SAMPLING=0: the tests of "
            "test_ops_gpu_attention_mma, test_ops_gpu_fused, test_ops_gpu_mmvq, "
            "test_sampling_gpu failed on this device first")
    for rid in ("decode_b1", "prefill_1k", "fleet_ttft"):
        assert note in rows[rid].notes, rows[rid]
    assert rows["decode_b1"].status == "pass"  # the figure still stands, with its note
    assert note not in rows["pytest_graphs_on"].notes


def test_triage_without_failures_switches_nothing(tmp_path, junit):
    (tmp_path / "pytest_kernels.xml").write_text(junit["ok"])
    assert gt.main(["--dir", str(tmp_path), "--triage", "pytest_kernels.xml"]) == 0
    assert json.loads((tmp_path / "triage.json").read_text())["switches"] == []
    assert gt.triage(tmp_path / "absent.xml") == {"failed": {}, "switches": []}
    rows = _rows(_write(tmp_path))
    assert not any("measured with" in n for n in rows["decode_b1"].notes)


def test_gpt_oss_row_shows_the_decode_rates_and_refuses_another_shape(tmp_path):
    """MOE_ONLY=1's random gpt-oss-20b decode: an info row with graphs-on and eager rates;
    a CPU or other-shaped run is invalid; a failed bench step is a FAIL."""
    oss = {"model": "kvshare-gpt-oss-20b-rand.gguf", "device": "cuda", "gpu_weights": "blocks",
           "n_layers": 24, "n_embd": 2880, "vocab": 151936,
           "decode": {"1": _decode(210.0), "8": _decode(900.0)},
           "decode_eager": {"1": _decode(40.0, graphs=False), "8": _decode(150.0, graphs=False)}}
    (tmp_path / "gpu_bench_gpt_oss.json").write_text(json.dumps(oss))
    row = _rows(tmp_path)["gpt_oss_decode"]
    assert row.status == "info"
    assert row.measured == "batch 1: 210; eager 40; batch 8: 900; eager 150"
    assert "vocab 151936" in row.source
    small = {**oss, "device": "cpu", "n_layers": 2, "n_embd": 256,
             "decode": {"1": _decode(1300.0, graphs=False)}}
    (tmp_path / "gpu_bench_gpt_oss.json").write_text(json.dumps(small))
    row = _rows(tmp_path)["gpt_oss_decode"]
    assert row.status == "invalid" and row.measured == "batch 1: 1,300 (no graph); eager 40"
    assert any("device cpu" in n for n in row.notes)
    assert any("not gpt-oss-20b's shape" in n for n in row.notes)
    (tmp_path / "gpu_bench_gpt_oss.json").unlink()
    (tmp_path / "step_gpu_bench_gpt_oss.json").write_text(json.dumps({"rc": 1, "seconds": 3}))
    row = _rows(tmp_path)["gpt_oss_decode"]
    assert row.status == "FAIL" and "failed (rc 1)" in row.measured


def test_fleet_splits_a_later_turns_ttft_by_the_servers_request_log():
    """bench/agent_fleet.py's split of a later turn's TTFT: the server's request log line (as
    `RequestRecord.as_log` writes it) joined to the client's record by response id."""
    from kvshare.engine.api import FinishEvent, Timings
    from kvshare.server.request_log import RequestRecord

    sys.path.insert(0, str(_PATH.parent))
    spec = importlib.util.spec_from_file_location("agent_fleet", _PATH.parent / "agent_fleet.py")
    fleet = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(fleet)

    lines = ["kvshare: serving tiny at http://127.0.0.1:1", "not json: kvshare.server.requests: {"]
    for i, (prepare, ttft, prompt) in enumerate(((2.0, 10.0, 6.0), (4.0, 20.0, 8.0))):
        rec = RequestRecord(id=f"chatcmpl-{i}", endpoint="chat", t0=100.0)
        rec.submitted_at = 100.0 + prepare / 1e3
        rec.finish = FinishEvent(reason="length", prompt_tokens=10, completion_tokens=2,
                                 timings=Timings(prompt_n=5, cache_n=5, prompt_ms=prompt,
                                                 predicted_n=2, predicted_ms=1.0),
                                 time_to_first_token_s=ttft / 1e3)
        lines.append("2026-01-01 12:00:00,000 INFO kvshare.server.requests: "
                     + json.dumps(rec.as_log(), separators=(",", ":")))
    times = fleet.request_log_times("\n".join(lines))
    assert set(times) == {"chatcmpl-0", "chatcmpl-1"}
    run = {"records": [
        {"turn": 0, "id": "chatcmpl-9", "ttft_s": 0.5},  # a first turn: not counted
        {"turn": 1, "id": "chatcmpl-0", "ttft_s": 0.015},
        {"turn": 2, "id": "chatcmpl-1", "ttft_s": 0.031},
        {"turn": 2, "id": "chatcmpl-7", "ttft_s": 0.02},  # no log line: left out
    ]}
    split = fleet.ttft_split(run, times)
    assert split["n"] == 2
    assert split["before_engine_ms"] == {"median": 3.0, "max": 4.0, "n": 2}
    assert split["engine_ms"]["max"] == 20.0 and split["engine_prompt_ms"]["median"] == 7.0
    # the client's TTFT less the server's two parts: 15 - 2 - 10 and 31 - 4 - 20
    assert split["rest_ms"]["median"] == pytest.approx(5.0)
    assert split["rest_ms"]["max"] == pytest.approx(7.0)
    assert fleet.ttft_split({"records": run["records"][:1]}, times) is None
