"""Where the time of one ``ravex convert`` goes (a diagnostic; bench/run.py runs it once per
Ravex command, outside the timed runs).

    python bench/_phases.py SRC DST --to safetensors|torch_save

Runs the real CLI in this process (``ravex.cli.main``), with timers wrapped around Ravex's
phases, and prints one JSON object (seconds):

- ``import``: importing ``ravex.cli`` (Python start-up is not included);
- ``read``: ``read_checkpoint`` (detecting the format, reading headers / pickles, planning where
  every byte is);
- ``copy``: the Rust executor (``_core.execute``: mmap reads, positional writes);
- ``checksum``: ``_core.checksum_ranges`` (torch_save: the zip's CRC-32 of every entry, read
  back from the written file);
- ``fsync``: every ``os.fsync`` (files and directories: Ravex makes its output durable);
- ``other``: the rest (building the target layout, pickling, renames, output).

Nothing in Ravex is changed: the wrappers only time calls.
"""

from __future__ import annotations

import json
import os
import sys
import time
from collections import defaultdict


def main() -> None:
    t0 = time.perf_counter()
    from ravex import cli
    from ravex_convert import _core

    C = sys.modules["ravex_convert.convert"]  # the package's ``convert`` attribute is the function

    t_import = time.perf_counter() - t0
    acc: dict[str, float] = defaultdict(float)

    def wrap(obj, name: str, key: str) -> None:
        f = getattr(obj, name)

        def timed(*a, **k):
            t = time.perf_counter()
            try:
                return f(*a, **k)
            finally:
                acc[key] += time.perf_counter() - t

        setattr(obj, name, timed)

    wrap(C, "read_checkpoint", "read")
    wrap(_core, "execute", "copy")
    wrap(_core, "checksum_ranges", "checksum")
    wrap(os, "fsync", "fsync")
    t1 = time.perf_counter()
    rc = 0
    try:
        cli.main(["convert", *sys.argv[1:], "-q"], standalone_mode=False)
    except SystemExit as e:
        rc = e.code or 0
    total = time.perf_counter() - t1
    out = {"import": t_import, **{k: acc.get(k, 0.0) for k in ("read", "copy", "checksum", "fsync")}}
    out["other"] = total - sum(acc.values())
    out["total"] = t_import + total
    out["rc"] = rc
    print(json.dumps({k: round(v, 3) if isinstance(v, float) else v for k, v in out.items()}))


if __name__ == "__main__":
    main()
