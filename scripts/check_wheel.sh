#!/usr/bin/env bash
# The wheel as a user gets it: `maturin build --release` into a temporary folder, then a fresh
# venv that installs it with no Rust toolchain on PATH, and one chat request served from it.
#
# Checks: the file is an abi3 manylinux wheel; it holds the web UI's files and the CUDA
# sources; `pip install` needs no cargo; `kvshare serve` (the default model) answers
# `POST /v1/chat/completions` and serves the page at `/`. Exits non-zero on any failure.
#
#   scripts/check_wheel.sh            # PYTHON=python3.X to build and test with another Python
#
# The model comes from the model store (`KVSHARE_MODEL_STORE`, else the default one), so a
# store that already holds it is not downloaded again. KVSHARE_WHEEL_KEEP=1 keeps the folder.
set -euo pipefail

ROOT=$(cd "$(dirname "$0")/.." && pwd)
PY=${PYTHON:-python3}
WORK=$(mktemp -d "${TMPDIR:-/tmp}/kvshare-wheel.XXXXXX")
SERVER_PID=""
T0=$(date +%s)

cleanup() {
    if [[ -n "$SERVER_PID" ]] && kill -0 "$SERVER_PID" 2>/dev/null; then
        kill -TERM "$SERVER_PID" 2>/dev/null || true
        wait "$SERVER_PID" 2>/dev/null || true
    fi
    if [[ "${KVSHARE_WHEEL_KEEP:-0}" != 1 ]]; then rm -rf "$WORK"; else echo "kept $WORK"; fi
}
trap cleanup EXIT

fail() { echo "check_wheel: FAIL: $*" >&2; exit 1; }
step() { echo "check_wheel: [$(( $(date +%s) - T0 )) s] $*"; }

step "maturin build --release (into $WORK/dist)"
(cd "$ROOT" && "$PY" -m maturin build --release --interpreter "$PY" --out "$WORK/dist") \
    > "$WORK/build.log" 2>&1 || { tail -40 "$WORK/build.log" >&2; fail "maturin build"; }
shopt -s nullglob
wheels=("$WORK"/dist/*.whl)
[[ ${#wheels[@]} -eq 1 ]] || fail "expected one wheel, found ${#wheels[@]}"
WHEEL=${wheels[0]}
NAME=$(basename "$WHEEL")
step "built $NAME ($(du -k "$WHEEL" | cut -f1) KiB)"
[[ "$NAME" =~ -abi3-.*manylinux.*_x86_64\.whl$ ]] || fail "$NAME is not an abi3 manylinux x86-64 wheel"

"$PY" - "$WHEEL" <<'PYEOF' || fail "the wheel lacks files"
import sys, zipfile
names = set(zipfile.ZipFile(sys.argv[1]).namelist())
want = ["kvshare/webui/index.html", "kvshare/webui/main.js", "kvshare/server/webui.py",
        "kvshare/kernels/common.cuh"]
missing = [n for n in want if n not in names]
if not any(n.startswith("kvshare/_core") and n.endswith(".so") for n in names):
    missing.append("kvshare/_core*.so")
if missing:
    sys.exit("missing: " + ", ".join(missing))
PYEOF

# PATH without any folder that holds cargo or rustc: the install must not build anything
CLEAN_PATH=""
IFS=: read -r -a dirs <<< "$PATH"
for d in "${dirs[@]}"; do
    [[ -z "$d" || -x "$d/cargo" || -x "$d/rustc" ]] && continue
    CLEAN_PATH=${CLEAN_PATH:+$CLEAN_PATH:}$d
done
PY_ABS=$(command -v "$PY")
step "fresh venv, pip install the wheel with PATH=$CLEAN_PATH"
"$PY_ABS" -m venv "$WORK/venv"
VENV_BIN="$WORK/venv/bin"
run_clean() { env -u CARGO_HOME -u RUSTUP_HOME PATH="$VENV_BIN:$CLEAN_PATH" "$@"; }
run_clean sh -c '! command -v cargo >/dev/null' || fail "cargo is still on the clean PATH"
run_clean "$VENV_BIN/python" -m pip install --quiet --disable-pip-version-check \
    --only-binary=:all: "$WHEEL" > "$WORK/pip.log" 2>&1 \
    || { tail -30 "$WORK/pip.log" >&2; fail "pip install of the wheel"; }
# run from an empty folder: nothing of the source tree may be imported
cd "$WORK"
run_clean "$VENV_BIN/python" -c "import kvshare, kvshare._core, sys; \
assert kvshare.__file__.startswith(sys.prefix), kvshare.__file__" \
    || fail "kvshare is not imported from the venv"

PORT=$("$VENV_BIN/python" -c "import socket; s = socket.socket(); s.bind(('127.0.0.1', 0)); print(s.getsockname()[1])")
URL="http://127.0.0.1:$PORT"
step "kvshare serve (default model) on $URL"
# env, not the run_clean function: in the background a function runs in a subshell, and $!
# would be that subshell's pid, which the cleanup's kill does not pass on to the server
env -u CARGO_HOME -u RUSTUP_HOME PATH="$VENV_BIN:$CLEAN_PATH" "$VENV_BIN/kvshare" serve \
    --host 127.0.0.1 --port "$PORT" --parallel 1 --ctx-size 1024 > "$WORK/serve.log" 2>&1 &
SERVER_PID=$!

"$VENV_BIN/python" - "$URL" "$SERVER_PID" <<'PYEOF' || { tail -30 "$WORK/serve.log" >&2; fail "serving from the wheel"; }
import json, os, sys, time, urllib.error, urllib.request
url, pid = sys.argv[1], int(sys.argv[2])

def get(path):
    with urllib.request.urlopen(url + path, timeout=5) as r:
        return r.status, r.read()

deadline = time.time() + 900  # a first run downloads the model
while True:
    try:
        if get("/health")[0] == 200:
            break
    except (urllib.error.URLError, ConnectionError, OSError):
        pass
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        sys.exit("the server exited")
    if time.time() > deadline:
        sys.exit("the server did not become healthy")
    time.sleep(0.5)
body = json.dumps({"messages": [{"role": "user", "content": "Say hello."}],
                   "max_tokens": 16, "temperature": 0}).encode()
req = urllib.request.Request(url + "/v1/chat/completions", body,
                             {"Content-Type": "application/json"})
t = time.time()
with urllib.request.urlopen(req, timeout=300) as r:
    reply = json.load(r)
text = reply["choices"][0]["message"]["content"]
if not text or reply["usage"]["completion_tokens"] < 1:
    sys.exit(f"empty reply: {reply}")
print(f"check_wheel: reply in {time.time() - t:.2f} s from {reply['model']}: {text!r}")
status, page = get("/")
if status != 200 or b"<title>kvshare</title>" not in page:
    sys.exit("the page at / is missing")
PYEOF

step "OK: $NAME installs without cargo and serves a chat request"
