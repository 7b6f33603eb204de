#!/usr/bin/env bash
# Make (or reuse) the virtual environment Ravex is built and tested in, and
# print its path on stdout. The environment lives outside the clone, under the
# home directory, so that fresh clones (CI) reuse it; it is re-synced only when
# constraints.txt, requirements-build.txt or requirements-dev.txt change.
#
# Install order matters: torch first, then DeepSpeed built against that torch
# (--no-build-isolation, DS_BUILD_OPS=0: otherwise pip fetches a second torch
# into an isolated build environment), then the rest.
#
#   scripts/env.sh            runtime + test/fixture tools (DeepSpeed included)
#   scripts/env.sh --runtime  runtime dependencies and the build tool (maturin) only
set -euo pipefail

root=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
mode=${1:-full}
venv=${RAVEX_VENV:-$HOME/.cache/ravex/venv}
stamp_key=$(cat "$root/constraints.txt" "$root/requirements-build.txt" "$root/requirements-dev.txt" | sha256sum | cut -c1-16)
stamp="$venv/.ravex-$mode-$stamp_key"

log() { printf 'env.sh: %s\n' "$*" >&2; }

if [ ! -f "$stamp" ]; then
  if [ ! -x "$venv/bin/python" ]; then
    log "creating $venv"
    mkdir -p "$(dirname "$venv")"
    python3 -m venv "$venv"
  fi
  pip=("$venv/bin/python" -m pip --disable-pip-version-check -q)
  "${pip[@]}" install -c "$root/constraints.txt" 'setuptools' 'wheel' >&2
  # pip skips torch when the pinned version is already installed: no download.
  log "torch (pinned in constraints.txt)"
  "${pip[@]}" install -c "$root/constraints.txt" torch numpy >&2
  "${pip[@]}" install -c "$root/constraints.txt" click rich pyyaml >&2
  log "build tool"
  "${pip[@]}" install -c "$root/constraints.txt" -r "$root/requirements-build.txt" >&2
  if [ "$mode" != "--runtime" ]; then
    log "test and fixture tools"
    "${pip[@]}" install -c "$root/constraints.txt" -r "$root/requirements-dev.txt" >&2
    log "deepspeed (built against the installed torch)"
    DS_BUILD_OPS=0 "${pip[@]}" install --no-build-isolation -c "$root/constraints.txt" deepspeed >&2
  fi
  rm -f "$venv"/.ravex-"$mode"-*
  touch "$stamp"
fi
printf '%s\n' "$venv"
