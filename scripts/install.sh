#!/usr/bin/env bash
# Build the ravex wheel (maturin, release) and install it into the environment
# that scripts/env.sh made. Checks that the wheel holds all three packages and
# the compiled core before installing it. Usage: scripts/install.sh VENV
set -euo pipefail
root=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
venv=$1
# The Rust build cache lives beside the environment so fresh clones reuse it.
export CARGO_TARGET_DIR=${CARGO_TARGET_DIR:-$(dirname "$venv")/cargo-target}
wheels=$(mktemp -d)
trap 'rm -rf "$wheels"' EXIT
cd "$root"
"$venv/bin/maturin" build --release --quiet --interpreter "$venv/bin/python" -o "$wheels" >&2
wheel=$(ls "$wheels"/ravex-*.whl)
"$venv/bin/python" - "$wheel" <<'PY'
import sys, zipfile
names = zipfile.ZipFile(sys.argv[1]).namelist()
need = ["ravex/__init__.py", "ravex/cli.py", "ravex_convert/__init__.py", "ravex_convert/_core.pyi", "ravex_runtime/__init__.py"]
missing = [n for n in need if n not in names]
if not any(n.startswith("ravex_convert/_core.") and n.endswith((".so", ".pyd")) for n in names):
    missing.append("ravex_convert/_core.*.so")
if missing:
    sys.exit(f"install.sh: the wheel lacks {missing}")
print(f"install.sh: wheel ok ({len(names)} files)", file=sys.stderr)
PY
"$venv/bin/python" -m pip --disable-pip-version-check -q install --no-deps --force-reinstall "$wheel" >&2
# What `pip install ravex-*.whl` would resolve: every dependency the wheel declares is
# installed here at a version it accepts (a dependency the packages need but the wheel
# forgot to declare is tests/test_packaging.py's to find).
"$venv/bin/python" - <<'PY'
import sys
from importlib import metadata

from pip._vendor.packaging.requirements import Requirement

bad = []
for text in metadata.requires("ravex") or []:
    req = Requirement(text)
    if req.marker is not None and not req.marker.evaluate({"extra": ""}):
        continue
    try:
        have = metadata.version(req.name)
    except metadata.PackageNotFoundError:
        bad.append(f"{req} (not installed)")
        continue
    if not req.specifier.contains(have, prereleases=True):
        bad.append(f"{req} (installed: {have})")
if bad:
    sys.exit("install.sh: the wheel's declared dependencies are not met: " + ", ".join(bad))
print("install.sh: declared dependencies met", file=sys.stderr)
PY
