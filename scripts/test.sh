#!/usr/bin/env bash
# Installs kvshare with its test extras (building the Rust extension; no GPU packages), checks
# lint and formatting (`ruff check`, `cargo fmt --check`, `cargo clippy -D warnings`), then runs
# every test: `cargo test --workspace`, then pytest. Exit code is non-zero on any finding or
# failure, and pytest's "no tests collected" (exit 5) counts as a failure. Arguments go to pytest.
set -euo pipefail
cd "$(dirname "$0")/.."
python3 -m pip install -q --upgrade pip
python3 -m pip install -q -e ".[test]"
echo "== ruff check" >&2
python3 -m ruff check .
echo "== cargo fmt --check" >&2
cargo fmt --all --check
echo "== cargo clippy -D warnings" >&2
cargo clippy -q --workspace --all-targets -- -D warnings
echo "== cargo test" >&2
cargo test --workspace --release
echo "== pytest" >&2
set +e
python3 -m pytest --durations=15 "$@"
rc=$?
set -e
if [ "$rc" -eq 5 ]; then echo "pytest collected no tests: failing" >&2; exit 1; fi
exit "$rc"
