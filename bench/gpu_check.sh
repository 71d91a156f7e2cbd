#!/usr/bin/env bash
# kvshare's GPU check in one go: the `gpu`-marked tests (every op and whole-model logits
# against NumPy), the NVRTC compile test with the device's own CuPy, and a short throughput
# run (bench/gpu_bench.py; bench/model_bench.py --device cuda too when that flag exists).
# Budget: about 4 minutes of device time after the machine is up; the step timeouts add up
# to 8 minutes at most (240 s tests, 60 s compile test, 60 s model_bench, 120 s gpu_bench).
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
    ls -la .whl python/kvshare/_core*.so
    echo
    echo 'device run: carry [".whl", "python/kvshare/_core.abi3.so"], command:'
    echo '  bash bench/gpu_check.sh'
    exit 0
fi

OUT=${OUT:-$ROOT/bench/out/gpu_check}
mkdir -p "$OUT"
PY=${PYTHON:-python3}
export PYTHONUNBUFFERED=1
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
if ls .whl/*.whl >/dev/null 2>&1; then
    $PY -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
        --target /tmp/kvshare-site .whl/*.whl && export PYTHONPATH=/tmp/kvshare-site${PYTHONPATH:+:$PYTHONPATH}
fi
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
RC=0
timeout 240 $PY -m pytest -m gpu -v -p no:cacheprovider --durations=15 \
    tests/test_ops_gpu.py tests/test_model_gpu.py > "$OUT/pytest_gpu.log" 2>&1
rc=$?; [ $rc -ne 0 ] && RC=$rc
log "pytest -m gpu: rc=$rc, $(grep -E '(passed|failed|error)' "$OUT/pytest_gpu.log" | tail -1)"

timeout 60 $PY -m pytest -q -p no:cacheprovider tests/test_kernels_compile.py \
    > "$OUT/pytest_compile.log" 2>&1
rc=$?; [ $rc -ne 0 ] && RC=$rc
log "compile test (device CuPy's NVRTC): rc=$rc, $(tail -1 "$OUT/pytest_compile.log")"

# --- throughput ------------------------------------------------------------------------------
if [ -f bench/model_bench.py ] && grep -q -- '--device' bench/model_bench.py; then
    timeout 60 $PY bench/model_bench.py --device cuda > "$OUT/model_bench.log" 2>&1
    log "bench/model_bench.py --device cuda: rc=$? (model_bench.log)"
fi
timeout 120 $PY bench/gpu_bench.py --out "$OUT/gpu_bench.json" > "$OUT/gpu_bench.log" 2>&1
log "bench/gpu_bench.py: rc=$? ($(grep -cE 'tok/s' "$OUT/gpu_bench.log") rates; gpu_bench.log)"
grep -E 'model:|tok/s|paged attention' "$OUT/gpu_bench.log" | tee -a "$OUT/summary.txt"

log "done, rc=$RC"
exit $RC
