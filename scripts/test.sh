#!/usr/bin/env bash
# The test command (README, .ci/run): set up the environment, run the Rust
# tests, build and install the wheel, lint, run every Python test (slow and
# distributed ones included). Fails if any suite runs no test.
#
#   scripts/test.sh                 everything (what CI runs)
#   scripts/test.sh --fast          for development, a few minutes: cargo test, build + install,
#                                   pytest without the tests marked slow or distributed; no lint
#   scripts/test.sh [PYTEST ARGS]   cargo test, build + install, lint, then pytest with these arguments
set -euo pipefail
root=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
cd "$root"
fast=0
if [ "${1:-}" = "--fast" ]; then
  fast=1
  shift
fi
venv=$(scripts/env.sh)
export CARGO_TARGET_DIR=${CARGO_TARGET_DIR:-$(dirname "$venv")/cargo-target}

t=$SECONDS
took() { echo "== took $((SECONDS - t)) s"; t=$SECONDS; }
echo "== cargo test"
cargo_log=$(mktemp)
trap 'rm -f "$cargo_log"' EXIT
# with the S3 client (no pyo3), so that its unit tests (the read-ahead's) run too
cargo test --locked --features remote 2>&1 | tee "$cargo_log"
grep -qE '^test result: ok\. [1-9][0-9]* passed' "$cargo_log" \
  || { echo "test.sh: cargo test ran no test" >&2; exit 1; }

took
echo "== build and install"
scripts/install.sh "$venv"
took

if [ "$fast" -eq 0 ]; then
  echo "== lint: ruff, mypy --strict, stubtest of the compiled module, clippy"
  "$venv/bin/ruff" check ravex ravex_convert ravex_runtime tests integration scripts fixtures bench
  "$venv/bin/mypy"
  # from outside the tree, so the installed module (with its .so) is what is checked
  (cd "$(mktemp -d)" && "$venv/bin/python" -m mypy.stubtest ravex_convert._core)
  cargo clippy --locked --all-targets --quiet -- -D warnings
  cargo clippy --locked --all-targets --features remote --quiet -- -D warnings
  took
fi

echo "== S3 server for the tests: weed mini on 127.0.0.1 (tests/_s3server.py)"
# One real S3-compatible server for the whole run (the tests' fixtures use it; each test takes a
# prefix of its own). Loopback only, telemetry off; stopped when this script exits.
s3dir=$(mktemp -d)
"$venv/bin/python" tests/_s3server.py "$s3dir/server" "$s3dir/info" &
s3pid=$!
trap 'rm -f "$cargo_log"; kill "$s3pid" 2>/dev/null; wait "$s3pid" 2>/dev/null; rm -rf "$s3dir"' EXIT
for _ in $(seq 600); do
  [ -f "$s3dir/info" ] && break
  kill -0 "$s3pid" 2>/dev/null || { echo "test.sh: the S3 server did not start" >&2; exit 1; }
  sleep 0.1
done
[ -f "$s3dir/info" ] || { echo "test.sh: the S3 server did not start in 60 s" >&2; exit 1; }
read -r WEED_TEST_ENDPOINT WEED_TEST_PID WEED_TEST_BUCKET < "$s3dir/info"
export WEED_TEST_ENDPOINT WEED_TEST_PID WEED_TEST_BUCKET
echo "S3 server at $WEED_TEST_ENDPOINT (pid $WEED_TEST_PID, bucket $WEED_TEST_BUCKET)"
took

echo "== pytest"
# The `pytest` script (not `python -m pytest`) keeps the source tree off
# sys.path, so the installed wheel is what gets tested. --durations: the slowest
# tests in every run's output, so a suite that grows is seen where it grows.
export DS_ACCELERATOR=cpu OMP_NUM_THREADS=1
marks=()
[ "$fast" -eq 1 ] && marks=(-m "not slow and not distributed")
set +e
"$venv/bin/pytest" --durations=25 "${marks[@]}" "$@"
rc=$?
set -e
took
if [ "$rc" -eq 5 ]; then
  echo "test.sh: pytest collected no test" >&2
  exit 1
fi
# The writers' tests run on every storage backend within this run (conftest's storage_backend).
exit "$rc"
