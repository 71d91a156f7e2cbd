#!/usr/bin/env bash
# Installs kvshare with its test extras (building the Rust extension) and runs every test:
# `cargo test --workspace`, then pytest. Exit code is non-zero on any failure, and pytest's
# "no tests collected" (exit 5) counts as a failure.
set -euo pipefail
cd "$(dirname "$0")/.."
python3 -m pip install -q --upgrade pip
python3 -m pip install -q -e ".[test]"
cargo test --workspace --release
set +e
python3 -m pytest --durations=15 "$@"
rc=$?
set -e
if [ "$rc" -eq 5 ]; then echo "pytest collected no tests: failing" >&2; exit 1; fi
exit "$rc"
