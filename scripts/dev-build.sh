#!/usr/bin/env bash
# For development: build the compiled core (release) and install Ravex into the
# environment scripts/env.sh made, EDITABLE, so edits to the Python packages are
# live without a rebuild. Rerun after changing src/*.rs. CI does not use this
# (scripts/test.sh installs the wheel, as users do).
set -euo pipefail
root=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
venv=${RAVEX_VENV:-$HOME/.cache/ravex/venv}
export CARGO_TARGET_DIR=${CARGO_TARGET_DIR:-$(dirname "$venv")/cargo-target}
cd "$root"
VIRTUAL_ENV=$venv PATH="$venv/bin:$PATH" "$venv/bin/maturin" develop --release --quiet >&2
