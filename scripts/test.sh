#!/usr/bin/env bash
# Installs kvshare with its test extras (building the Rust extension; no GPU packages) and
# redis-server and headless Chromium where missing (apt-get), checks
# lint, types and formatting (`ruff check`, `mypy` on apis/, server/ and engine/, `cargo fmt --check`,
# `cargo clippy -D warnings`), then runs
# every test: `cargo test --workspace`, then pytest. Exit code is non-zero on any finding or
# failure, and pytest's "no tests collected" (exit 5) counts as a failure. Arguments go to pytest.
set -euo pipefail
cd "$(dirname "$0")/.."
step() { echo "== $* (at ${SECONDS} s)" >&2; }
step "install"
python3 -m pip install -q --upgrade pip
python3 -m pip install -q -e ".[test]"
# the shared-tier tests start a real redis-server (Debian's package) on a loopback port
if ! command -v redis-server >/dev/null; then
    sudo=""; [ "$(id -u)" -eq 0 ] || sudo="sudo"
    $sudo apt-get update -q >/dev/null && $sudo apt-get install -y -q redis-server >/dev/null
fi
export KVSHARE_REQUIRE_REDIS=1  # from here a missing redis-server fails those tests
# the web page's tests drive a real headless Chromium (Debian's package) through selenium
if ! command -v chromedriver >/dev/null; then
    sudo=""; [ "$(id -u)" -eq 0 ] || sudo="sudo"
    $sudo apt-get update -q >/dev/null
    $sudo apt-get install -y -q chromium chromium-driver >/dev/null
fi
export KVSHARE_REQUIRE_BROWSER=1
step "ruff check"
python3 -m ruff check .
step "mypy (apis/, server/, engine/)"
# the typed seams between the HTTP APIs, the pipeline and the engine (engine.api.EngineClient)
python3 -m mypy --ignore-missing-imports --follow-imports=silent \
    python/kvshare/apis python/kvshare/server python/kvshare/engine
step "cargo fmt --check"
cargo fmt --all --check
step "cargo clippy -D warnings"
# --release: shares the build scripts and proc macros of the release builds (maturin's above,
# `cargo test --release` below), ~15 s instead of ~100 s for a dev-profile check on 2 cores
cargo clippy -q --release --workspace --all-targets -- -D warnings
step "cargo test"
# kvshare-py (the binding) has no Rust tests; it is built by the install above and linted by
# clippy. Excluding it saves a second build of pyo3 with cargo's own PyO3 configuration.
cargo test --workspace --release --exclude kvshare-py
step "pytest"
set +e
python3 -m pytest --durations=15 "$@"
rc=$?
set -e
step "done"
if [ "$rc" -eq 5 ]; then echo "pytest collected no tests: failing" >&2; exit 1; fi
exit "$rc"
