"""Issue 40's acceptance table from what the steps of `bench/gpu_check.sh` wrote.

Reads, from one directory (`--dir`), the files the device check's steps write:

    gpu_bench_q15.json       bench/gpu_bench.py on the random Qwen3-1.7B-shaped Q4_K_M GGUF
                             with KVSHARE_GPU_WEIGHTS=blocks: decode tok/s at batch 1/8/32
                             (1K context), prefill 1K, weights memory, greedy graphs on == off
    agent_fleet.json         bench/agent_fleet.py --server-args "--device cuda" on that model
    pytest_graphs_on.xml     pytest -m gpu --junitxml, CUDA graphs on (TESTS_ONLY=1)
    pytest_graphs_off.xml    the same with KVSHARE_CUDA_GRAPHS=0 (TESTS_ONLY=1)
    pytest_q2k.xml           the Q2_K block tests alone (the default run)
    pytest_kernels.xml       the fused decode, mmvq and device-sampling tests (the default run)
    pytest_moe.xml           the MoE tests (MOE_ONLY=1)
    pytest_compile.xml       the NVRTC compile and machine-code tests (EXTRAS_ONLY=1)
    gpu_matvec_bench.json    bench/gpu_matvec_bench.py (bmv vs mmvq), shown, no target
    step_<name>.json         {"rc": ..., "seconds": ...} per step: a timeout (rc 124) or a
                             crash shows as such instead of "not run"

    triage.json              `--triage pytest_kernels.xml`: the kernel families whose tests
                             failed in the default run's first step and the switches that
                             took them out of the figures measured after it

and prints ONE table (figure | target | measured | status | source), also written to
`--out-dir`/targets.txt and targets.json (the rows plus the JSON sources themselves, so that
one file brings every measurement back). A figure counts only when measured as the issue
states it: on cuda, on the 1.5b shape (28 layers, 2048 wide), block weights, 1K context;
otherwise its status is "invalid" with the reason (the CPU dry run of gpu_check.sh gives
those). A missing measurement is "not run" (with the mode of gpu_check.sh that measures it),
never a pass.

    python bench/gpu_targets.py --dir /tmp/kvshare-gpu-check --out-dir "$OUT" [--mode default]
    python bench/gpu_targets.py --dir /tmp/kvshare-gpu-check --triage pytest_kernels.xml
"""

from __future__ import annotations

import argparse
import json
import re
import sys
import xml.etree.ElementTree as ET
from dataclasses import asdict, dataclass, field
from pathlib import Path

QWEN2_VOCAB = 151936  # Qwen3-1.7B's LM head rows (the Qwen2 tokenizer's vocabulary)
Q15_SHAPE = {"n_layers": 28, "n_embd": 2048}  # scripts/make_random_gguf.py --size 1.5b
CTX = 1024

# the gpu_check.sh mode that fills each group of rows
MODE_OF = {"bench": "default run", "fleet": "default run", "q2k": "default run",
           "kernels": "default run",
           "tests": "TESTS_ONLY=1 run or the default run's end", "matvec": "default run", "moe": "MOE_ONLY=1 run",
           "compile": "EXTRAS_ONLY=1 run"}


# The default run tests the kernels no device has run yet before it measures anything
# (gpu_check.sh): a test module that fails there -> the environment switch that takes its
# kernels out of the figures measured after it, so that they time what computes correctly
# (None: the figures do not run them by default).
TRIAGE_SWITCHES = {
    "test_ops_gpu_attention_mma": "KVSHARE_GPU_ATTN_MMA=0",  # prefill attention on FMA units
    "test_sampling_gpu": "KVSHARE_DEVICE_SAMPLING=0",  # sampling on the host
    "test_engine_overlap": "KVSHARE_EMIT_OVERLAP=0",  # each token's emission in its step
    "test_engine_step_ahead": "KVSHARE_ASYNC_SCHEDULING=0",  # every step scheduled in turn
    "test_ops_gpu_mmvq": None,  # opt-in (KVSHARE_GPU_MATVEC=q8): its info run is skipped
    "test_ops_gpu_fused": "KVSHARE_GPU_FUSED=0",  # the op sequences the fused ops replace
    "test_model_gpu_step_graphs": "KVSHARE_CUDA_GRAPHS_PREFILL=0",  # prefill chunks eager
}


@dataclass
class Row:
    id: str
    figure: str
    target: str
    measured: str = "-"
    status: str = "not run"  # pass | FAIL | not run | timed out | invalid | info
    source: str = ""
    value: float | None = None
    notes: list[str] = field(default_factory=list)


def load_json(path: Path) -> dict | None:
    try:
        return json.loads(path.read_text())
    except (OSError, ValueError):
        return None


def step_status(d: Path, name: str) -> str | None:
    """'timed out' / 'failed (rc N)' for a step that wrote no result, None if it ran fine or
    never ran."""
    st = load_json(d / f"step_{name}.json")
    if not st:
        return None
    rc = st.get("rc")
    if rc in (124, 137):
        return f"timed out after {st.get('seconds', '?')} s"
    if rc:
        return f"failed (rc {rc})"
    return None


def unmeasured(row: Row, d: Path, step: str, group: str, what: str) -> Row:
    why = step_status(d, step)
    if why:
        row.status = "timed out" if why.startswith("timed out") else "FAIL"
        row.measured = why
        row.source = f"{what}: {why}"
    else:
        row.source = f"{what} (measured by the {MODE_OF[group]})"
    return row


def judge(row: Row, value: float, op: str, limit: float, fmt: str, why_invalid: list[str]) -> Row:
    row.value = value
    row.measured = format(value, fmt)
    if why_invalid:
        row.status = "invalid"
        row.notes += why_invalid
    else:
        ok = value >= limit if op == ">=" else value <= limit
        row.status = "pass" if ok else "FAIL"
    return row


# ----------------------------------------------------------------------------- rows

def bench_conditions(b: dict) -> tuple[list[str], list[str]]:
    """(reasons the bench's figures do not count, notes) for gpu_bench_q15.json."""
    bad, notes = [], []
    if not str(b.get("device", "")).startswith("cuda"):
        bad.append(f"device {b.get('device')}")
    shape = {k: b.get(k) for k in Q15_SHAPE}
    if shape != Q15_SHAPE:
        bad.append(f"model {b.get('model')} ({shape.get('n_layers')} layers, "
                   f"{shape.get('n_embd')} wide), not the 1.5b shape")
    if b.get("gpu_weights") != "blocks":
        bad.append(f"weights {b.get('gpu_weights')}, not blocks")
    if b.get("vocab") is not None and b.get("vocab") != QWEN2_VOCAB:
        notes.append(f"vocab {b.get('vocab')}, not Qwen2's {QWEN2_VOCAB}: smaller LM head")
    return bad, notes


def bench_rows(d: Path) -> list[Row]:
    b = load_json(d / "gpu_bench_q15.json")
    src = "gpu_bench_q15.json"
    rows = [Row("decode_b1", "decode, 1 sequence, 1K context (tok/s)", ">= 500"),
            Row("decode_b8", "decode, 8 sequences, 1K context (tok/s, aggregate)", ">= 2,500"),
            Row("decode_b32", "decode, 32 sequences, 1K context (tok/s, aggregate)",
                ">= 6,000"),
            Row("prefill_1k", "prefill 1K tokens (tok/s)", ">= 40,000"),
            Row("weights_memory", "GPU memory for weights / file's tensor bytes", "<= 1.05"),
            Row("greedy_graphs", "greedy tokens, CUDA graphs on == off (bench)", "equal")]
    if b is None:
        return [unmeasured(r, d, "gpu_bench_q15", "bench", src) for r in rows]
    bad, notes = bench_conditions(b)
    limits = {"decode_b1": ("1", 500), "decode_b8": ("8", 2500), "decode_b32": ("32", 6000)}
    for r in rows:
        r.source = src
        r.notes += notes
        if r.id in limits:
            key, lim = limits[r.id]
            e = (b.get("decode") or {}).get(key)
            if e is None:
                unmeasured(r, d, "gpu_bench_q15", "bench", f"{src}: no decode batch {key}")
                continue
            why = list(bad)
            if e.get("ctx") != CTX:
                why.append(f"context {e.get('ctx')}, not {CTX}")
            if not e.get("cuda_graphs"):
                r.notes.append("CUDA graphs not captured: eager steps"
                               + (f" ({next(iter(e['graph_failures'].values()))})"
                                  if e.get("graph_failures") else ""))
            judge(r, float(e["tokens_per_s"]), ">=", lim, ",.0f", why)
            r.source = (f"{src} decode[{key}]: {e.get('ms_per_step')} ms/step"
                        + (f"; eager {b['decode_eager'][key]['tokens_per_s']:,.0f} tok/s"
                           if key in (b.get("decode_eager") or {}) else ""))
        elif r.id == "prefill_1k":
            e = (b.get("prefill") or {}).get(str(CTX))
            if e is None:
                unmeasured(r, d, "gpu_bench_q15", "bench", f"{src}: no prefill {CTX}")
                continue
            judge(r, float(e["tokens_per_s"]), ">=", 40000, ",.0f", list(bad))
            r.source = (f"{src} prefill[{CTX}]: {e.get('seconds')} s, chunk "
                        f"{b.get('prefill_chunk')}"
                        + (f", issued by the host in {e['host_issue_seconds']} s"
                           if e.get("host_issue_seconds") is not None else "")
                        + (f"; eager {e['eager_tokens_per_s']:,.0f} tok/s, issued in "
                           f"{e.get('eager_host_issue_seconds')} s"
                           if e.get("eager_tokens_per_s") is not None else ""))
        elif r.id == "weights_memory":
            m = b.get("weights_memory") or {}
            if m.get("ratio") is None:
                unmeasured(r, d, "gpu_bench_q15", "bench", f"{src}: no weights_memory ratio")
                continue
            why = list(bad)
            if m.get("device_pool_bytes") is None:
                why.append("no device pool measured")
            judge(r, float(m["ratio"]), "<=", 1.05, ".3f", why)
            measured = m.get("device_pool_bytes")
            if measured is None:
                measured = m.get("weight_bytes")
            r.source = (f"{src}: {measured / 2**20:,.0f} MiB ({m.get('measured_by')}) / "
                        f"{m['file_tensor_bytes'] / 2**20:,.0f} MiB")
        elif r.id == "greedy_graphs":
            g = b.get("greedy_graphs")
            if g is None:
                unmeasured(r, d, "gpu_bench_q15", "bench", f"{src}: no greedy_graphs")
                continue
            r.measured = ("equal" if g.get("equal")
                          else f"{g.get('differing')} of {g.get('tokens')} differ")
            r.source = f"{src}: batch {g.get('batch')}, {g.get('steps')} steps"
            if not g.get("cuda_graphs"):
                r.status = "invalid"
                r.notes.append("no CUDA graph captured: eager compared with eager")
            else:
                r.status = "pass" if g.get("equal") else "FAIL"
    return rows


def fleet_rows(d: Path) -> list[Row]:
    src = "agent_fleet.json"
    rows = [Row("fleet_ttft", "agent_fleet later-turn TTFT, median (ms)", "<= 30"),
            Row("fleet_wall", "agent_fleet wall, 4 sessions x 3 turns (s)", "<= 1.5")]
    f = load_json(d / src)
    run = ((f or {}).get("runs") or {}).get("kvshare")
    if run is None:
        return [unmeasured(r, d, "agent_fleet", "fleet", src) for r in rows]
    cfg = f.get("config") or {}
    args = cfg.get("kvshare_serve_args") or []
    bad, notes = [], []
    if not re.search(r"--device[= ]cuda", " ".join(args)):
        bad.append(f"server not on cuda ({' '.join(args)})")
    if (cfg.get("sessions"), cfg.get("turns")) != (4, 3) or (cfg.get("prefix_tokens") or 0) < 6000:
        bad.append(f"{cfg.get('sessions')} sessions x {cfg.get('turns')} turns, prefix "
                   f"{cfg.get('prefix_tokens')} (the target is 4 x 3 on a 6K prefix)")
    if "KVSHARE_GPU_WEIGHTS=blocks" not in (cfg.get("server_env") or []):
        notes.append("block weights not set for the server")
    if run.get("errors"):
        bad.append(f"{len(run['errors'])} failed turn(s): {run['errors'][0].get('error')}")
    if run.get("empty_replies"):
        notes.append(f"{run['empty_replies']} empty replies (TTFT at the finish chunk)")
    model = Path(cfg.get("model") or "?").name
    ttft = (run.get("later_ttft") or {}).get("median")
    for r in rows:
        r.notes += notes
        r.source = f"{src}: {model}, prefix {run.get('prefix_tokens')} tokens"
    if ttft is None:
        rows[0].status, rows[0].measured = "FAIL", "no later turn answered"
    else:
        judge(rows[0], ttft * 1e3, "<=", 30, ".1f", list(bad))
        rows[0].source += f", later max {run['later_ttft']['max'] * 1e3:.1f} ms"
        split = run.get("later_ttft_split")
        if split:  # where it went, medians: the server before the engine, the engine, the rest
            rows[0].source += (f"; before the engine {split['before_engine_ms']['median']:.1f}"
                               f", engine {split['engine_ms']['median']:.1f}, rest "
                               f"{split['rest_ms']['median']:.1f} ms")
    judge(rows[1], float(run["wall_s"]), "<=", 1.5, ".2f", list(bad))
    return rows


def junit_counts(path: Path, only: str | None = None) -> dict | None:
    """passed / failed / errors / skipped and the failed tests' ids of a pytest junit XML
    (`only`: the test cases whose name holds that text)."""
    try:
        root = ET.parse(path).getroot()
    except (OSError, ET.ParseError):
        return None
    c = {"passed": 0, "failed": 0, "errors": 0, "skipped": 0, "failed_tests": []}
    for case in root.iter("testcase"):
        if only is not None and only not in case.get("name", ""):
            continue
        kinds = {child.tag for child in case}
        name = f"{case.get('classname', '')}::{case.get('name', '')}"
        if "failure" in kinds:
            c["failed"] += 1
            c["failed_tests"].append(name)
        elif "error" in kinds:
            c["errors"] += 1
            c["failed_tests"].append(name)
        elif "skipped" in kinds:
            c["skipped"] += 1
        else:
            c["passed"] += 1
    return c


def pytest_row(row: Row, d: Path, xml: str, step: str, group: str) -> Row:
    c = junit_counts(d / xml)
    if c is None:
        return unmeasured(row, d, step, group, xml)
    return judge_pytest(row, c, xml, step_status(d, step))


def judge_pytest(row: Row, c: dict, src: str, step_problem: str | None) -> Row:
    row.measured = (f"{c['passed']} passed, {c['failed']} failed, {c['errors']} errors, "
                    f"{c['skipped']} skipped")
    row.source = src + (f" ({step_problem})" if step_problem else "")
    row.value = float(c["passed"])
    if c["failed"] or c["errors"]:
        row.status = "FAIL"
        row.notes.append("failed: " + ", ".join(c["failed_tests"][:5])
                         + (" ..." if len(c["failed_tests"]) > 5 else ""))
    elif step_problem:
        row.status = "timed out" if step_problem.startswith("timed out") else "FAIL"
    elif c["passed"] == 0:
        row.status = "invalid"
        row.notes.append("no test ran (no GPU?)")
    else:
        row.status = "pass"
    return row


def test_rows(d: Path) -> list[Row]:
    on = pytest_row(Row("pytest_graphs_on", "pytest -m gpu, CUDA graphs on", "all pass"),
                    d, "pytest_graphs_on.xml", "pytest_graphs_on", "tests")
    off = pytest_row(Row("pytest_graphs_off", "pytest -m gpu, CUDA graphs off", "all pass"),
                     d, "pytest_graphs_off.xml", "pytest_graphs_off", "tests")
    # the Q2_K cases must all have run and passed (elsewhere a skip is a test that does not
    # apply, e.g. the Gemma package's tests on the device); the default run's file, else the
    # Q2_K cases of the full run
    q2k = Row("q2k", "Q2_K block weights (+ tests/test_kernels_sass.py)", "all pass")
    src = "pytest_q2k.xml" if (d / "pytest_q2k.xml").exists() else "pytest_graphs_on.xml"
    every, q2 = junit_counts(d / src), junit_counts(d / src, only="Q2_K")
    if every is None or q2 is None:
        unmeasured(q2k, d, "pytest_q2k", "q2k", "pytest_q2k.xml")
    else:
        step = "pytest_q2k" if src == "pytest_q2k.xml" else "pytest_graphs_on"
        judge_pytest(q2k, every if src == "pytest_q2k.xml" else q2, src, step_status(d, step))
        q2k.measured = (f"Q2_K: {q2['passed']} passed, {q2['failed'] + q2['errors']} failed, "
                        f"{q2['skipped']} skipped"
                        + (f"; all: {q2k.measured}" if src == "pytest_q2k.xml" else ""))
        if q2k.status == "pass" and (q2["passed"] == 0 or q2["skipped"]):
            q2k.status = "invalid"
            q2k.notes.append("Q2_K cases skipped or absent")
    # the decode kernels new since the last device run, on their own (the full runs hold
    # them too): the fused ops, the 8-bit-activation mat-vec, sampling on the device
    kernels = pytest_row(Row("pytest_kernels", "pytest -m gpu, fused decode / mmvq / sampling",
                             "all pass"), d, "pytest_kernels.xml", "pytest_kernels", "kernels")
    moe = pytest_row(Row("pytest_moe", "pytest -m gpu, MoE kernels and models", "all pass"),
                     d, "pytest_moe.xml", "pytest_moe", "moe")
    compile_ = pytest_row(Row("pytest_compile", "NVRTC compile + machine-code tests (device)",
                              "all pass"), d, "pytest_compile.xml", "pytest_compile", "compile")
    return [on, off, q2k, kernels, moe, compile_]


def matvec_row(d: Path) -> Row:
    row = Row("matvec", "mat-vec bmv vs mmvq (bench/gpu_matvec_bench.py)", "(no target)")
    m = load_json(d / "gpu_matvec_bench.json")
    st = load_json(d / "step_gpu_matvec_bench.json")
    if m is None and st is not None and st.get("rc") == 0:  # a bench without --out
        row.status, row.measured, row.source = "info", "ran", "its table in logs.txt"
        return row
    if m is None:
        return unmeasured(row, d, "gpu_matvec_bench", "matvec", "gpu_matvec_bench.json")
    row.status = "info"
    row.measured = "ran"
    row.source = "gpu_matvec_bench.json (in targets.json)"
    one = [r for r in m.get("rows") or [] if r.get("m") == 1]
    if one and all(isinstance(r.get(k), (int, float)) for r in one for k in ("bmv_ms", "mmvq_ms")):
        # one decode step's products at m = 1 (each product once)
        row.measured = (f"m=1, {len(one)} products: bmv {sum(r['bmv_ms'] for r in one):.3f} ms, "
                        f"mmvq {sum(r['mmvq_ms'] for r in one):.3f} ms")
    return row


def triage(xml: Path) -> dict:
    """{"failed": {test module: [failed test ids]}, "switches": [NAME=VALUE]} of a junit XML
    of the kernel tests (`TRIAGE_SWITCHES`); a missing or unreadable file fails nothing."""
    c = junit_counts(xml)
    failed: dict[str, list[str]] = {}
    for test in (c or {}).get("failed_tests", []):
        # classname tests.test_x (or tests.test_x.TestClass); a module that failed to import
        # has no classname, its name is the module (it ran no test: it counts as failed)
        cls, _, name = test.partition("::")
        parts = (cls or name).split(".")
        module = next((p for p in parts if p.startswith("test_")), parts[-1])
        failed.setdefault(module, []).append(test)
    switches = [TRIAGE_SWITCHES[m] for m in sorted(failed) if TRIAGE_SWITCHES.get(m)]
    return {"failed": failed, "switches": switches}


def triage_notes(d: Path) -> list[str]:
    t = load_json(d / "triage.json")
    if not t or not t.get("switches"):
        return []
    return [f"measured with {' '.join(t['switches'])}: the tests of "
            f"{', '.join(sorted(t['failed']))} failed on this device first"]


def engine_row(d: Path) -> Row:
    """Decode through the engine, async scheduling on vs off (gpu_bench.py --engine-decode):
    shown, no target (the decode targets time the model's step)."""
    row = Row("engine_decode", "decode through the engine, async scheduling on / off (tok/s)",
              "(no target)")
    b = load_json(d / "gpu_bench_q15.json")
    e = (b or {}).get("engine_decode")
    if not e:
        return unmeasured(row, d, "gpu_bench_q15", "bench", "gpu_bench_q15.json")
    parts = []
    for key in sorted({k.split(" ")[0] for k in e}, key=int):
        on, off = e.get(f"{key} async on"), e.get(f"{key} async off")
        if on and off:
            parts.append(f"batch {key}: {on['tokens_per_s']:,.0f} / {off['tokens_per_s']:,.0f}"
                         f" ({on['steps_ahead']} of {on['steps']} steps ahead)")
    row.status, row.measured = "info", "; ".join(parts) or "-"
    row.source = "gpu_bench_q15.json engine_decode"
    return row


def gpt_oss_row(d: Path) -> Row:
    """A random gpt-oss-20b's decode (MOE_ONLY=1: gpu_bench.py on it): shown, no target."""
    row = Row("gpt_oss_decode", "random gpt-oss-20b decode, 1 / 8 sequences (tok/s, graphs "
              "on; eager)", "(no target)")
    b = load_json(d / "gpu_bench_gpt_oss.json")
    dec = (b or {}).get("decode")
    if not dec:
        return unmeasured(row, d, "gpu_bench_gpt_oss", "moe", "gpu_bench_gpt_oss.json")
    eager = b.get("decode_eager") or {}
    parts = []
    for key in sorted(dec, key=int):
        e = dec[key]
        part = f"batch {key}: {e['tokens_per_s']:,.0f}"
        if not e.get("cuda_graphs"):
            part += " (no graph)"
        if key in eager:
            part += f"; eager {eager[key]['tokens_per_s']:,.0f}"
        parts.append(part)
    bad = []
    if not str(b.get("device", "")).startswith("cuda"):
        bad.append(f"device {b.get('device')}")
    if (b.get("n_layers"), b.get("n_embd")) != (24, 2880):
        bad.append(f"{b.get('n_layers')} layers, {b.get('n_embd')} wide: not gpt-oss-20b's shape")
    row.status = "invalid" if bad else "info"
    row.measured = "; ".join(parts)
    row.source = (f"gpu_bench_gpt_oss.json ({b.get('gpu_weights')} weights, vocab "
                  f"{b.get('vocab')})")
    row.notes += bad
    return row


def build(d: Path) -> list[Row]:
    rows = [*bench_rows(d), *fleet_rows(d)]
    notes = triage_notes(d)
    for r in rows:
        if r.status != "not run":
            r.notes += notes
    return [*rows, engine_row(d), *test_rows(d), matvec_row(d), gpt_oss_row(d)]


# ----------------------------------------------------------------------------- output

def render(rows: list[Row], mode: str) -> str:
    heads = ("figure", "target", "measured", "status", "source")
    cells = [(r.figure, r.target, r.measured, r.status,
              r.source + ("; " + "; ".join(r.notes) if r.notes else "")) for r in rows]
    widths = [max(len(h), *(len(c[i]) for c in cells)) for i, h in enumerate(heads[:4])]
    lines = [f"issue 40 acceptance ({mode}; one H200, random Qwen3-1.7B-shaped Q4_K_M, "
             "blocks weights)"]
    fmt = "  ".join(f"{{:{w}}}" for w in widths) + "  {}"
    lines.append(fmt.format(*heads))
    lines.append(fmt.format(*("-" * w for w in widths), "-" * 6))
    lines += [fmt.format(*c) for c in cells]
    n = {s: sum(r.status == s for r in rows) for s in ("pass", "FAIL", "not run", "timed out",
                                                       "invalid")}
    lines.append(", ".join(f"{v} {k}" for k, v in n.items() if v))
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--dir", required=True, help="where the steps wrote their files")
    ap.add_argument("--out-dir", default=None, help="write targets.txt / targets.json here")
    ap.add_argument("--mode", default="default run", help="the gpu_check.sh mode, for the title")
    ap.add_argument("--triage", default=None, metavar="XML",
                    help="instead of the table: write --dir/triage.json from this junit XML "
                         "(in --dir) and print the switches, one NAME=VALUE a line")
    args = ap.parse_args(argv)
    d = Path(args.dir)
    if args.triage:
        t = triage(d / args.triage)
        (d / "triage.json").write_text(json.dumps(t, indent=1))
        sys.stdout.write("".join(f"{sw}\n" for sw in t["switches"]))
        return 0
    rows = build(d)
    text = render(rows, args.mode)
    sys.stdout.write(text)
    if args.out_dir:
        out = Path(args.out_dir)
        out.mkdir(parents=True, exist_ok=True)
        (out / "targets.txt").write_text(text)
        sources = {p.name: load_json(p) for p in sorted(d.glob("*.json"))}
        (out / "targets.json").write_text(json.dumps(
            {"mode": args.mode, "rows": [asdict(r) for r in rows], "sources": sources},
            indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
