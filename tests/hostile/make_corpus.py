"""The hostile-input corpus: damaged and crafted checkpoints made from the
bundled fixtures, one :class:`Case` each, built on demand.

Every case is a small copy of a fixture with one thing wrong: a truncation at
a structural boundary (zip local headers, central directory, EOCD; the
safetensors length and header end; DCP ``.metadata``; the native JSON), a bit
flip in metadata or data, a path that leaves the checkpoint (``../``,
absolute, symlinks), a declared size that does not fit, a foreign pickle that
runs code, an empty file, a directory that is not a checkpoint. Everything is
deterministic: random positions come from a generator seeded by the case name.

Layout of a built case (``build(case, work)``)::

    work/src/       the damaged checkpoint (what Ravex is pointed at)
    work/outside/   files a path trick points at (copies of real checkpoint
                    files, so that following the trick would "work"), and the
                    file a foreign pickle would create
    work/out/       where DST goes

Run as a script to write cases to a directory for a look::

    python tests/hostile/make_corpus.py OUT_DIR [NAME_SUBSTRING ...]
"""

from __future__ import annotations

import shutil
import sys
from pathlib import Path

if __package__ in (None, ""):  # run as a script
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
    __package__ = "hostile"

from . import cases_dcp, cases_native, cases_safetensors, cases_zip  # noqa: F401 -- each registers its cases
from .corpus import CASES, PWNED, Case, base_paths, build

__all__ = ["PWNED", "Case", "base_paths", "build", "cases"]


def cases() -> list[Case]:
    names = [c.name for c in CASES]
    dups = {n for n in names if names.count(n) > 1}
    if dups:
        raise RuntimeError(f"duplicate case names: {sorted(dups)}")
    return list(CASES)


def main(argv: list[str]) -> int:
    if not argv:
        print(__doc__)
        return 2
    out = Path(argv[0])
    ravex = shutil.which("ravex") or str(Path(sys.executable).with_name("ravex"))
    bases = base_paths(out / "_bases", ravex)
    chosen = [c for c in cases() if not argv[1:] or any(s in c.name for s in argv[1:])]
    for c in chosen:
        work = out / c.name.replace("/", "__")
        if work.exists():
            shutil.rmtree(work)
        src = build(c, work, bases)
        print(f"{c.name}\t{c.kind}\t{src}")
    print(f"{len(chosen)} cases", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))

