#!/usr/bin/env bash
# The main job on the bundled fixtures: set up, install, `ravex inspect` every
# checkpoint in fixtures/data, then convert a DeepSpeed ZeRO-3 bf16 run to
# safetensors, torch_save and a Ravex store and prove each holds the same state.
set -euo pipefail
root=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
cd "$root"
venv=$(scripts/env.sh --runtime)
scripts/install.sh "$venv"
ravex="$venv/bin/ravex"
for ckpt in fixtures/data/*/checkpoint; do
  name=$(basename "$(dirname "$ckpt")")
  target=$ckpt
  # single-file fixtures: inspect the file itself, as a user would; the frameworks' ones
  # (a Lightning last.ckpt/, an Accelerate save_state state/): the directory inside
  files=("$ckpt"/*)
  if [ ${#files[@]} -eq 1 ]; then target=${files[0]}; fi
  echo "=== $name: ravex inspect $target"
  "$ravex" inspect "$target"
  echo
done

out=$(mktemp -d)
trap 'rm -rf "$out"' EXIT
src=fixtures/data/zero3_ws2_bf16/checkpoint
echo "=== convert $src (DeepSpeed ZeRO-3, bf16, 2 ranks)"
"$ravex" convert "$src" "$out/model.safetensors" --to safetensors
"$ravex" convert "$src" "$out/state.pt" --to torch_save
"$ravex" convert "$src" "$out/store" --to native --world-size 3
"$ravex" verify "$src" "$out/state.pt"
"$ravex" verify "$src" "$out/store"
"$ravex" verify "$out/model.safetensors" "$out/state.pt" --weights-only
