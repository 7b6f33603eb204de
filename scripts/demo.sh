#!/usr/bin/env bash
# The main job on the bundled fixtures: set up, install, and `ravex inspect`
# every checkpoint in fixtures/data.
set -euo pipefail
root=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
cd "$root"
venv=$(scripts/env.sh --runtime)
scripts/install.sh "$venv"
for ckpt in fixtures/data/*/checkpoint; do
  name=$(basename "$(dirname "$ckpt")")
  target=$ckpt
  # single-file fixtures: inspect the file itself, as a user would
  files=("$ckpt"/*)
  if [ ${#files[@]} -eq 1 ] && [ -f "${files[0]}" ]; then target=${files[0]}; fi
  echo "=== $name: ravex inspect $target"
  "$venv/bin/ravex" inspect "$target"
  echo
done
