"""Run a reference converter exactly as its CLI does, with torch's thread count fixed.

    python bench/_ref.py zero_to_fp32 CKPT_ROOT OUT_DIR [--safe_serialization]
        runs CKPT_ROOT/zero_to_fp32.py (the script DeepSpeed copied into the checkpoint) as __main__
    python bench/_ref.py dcp_to_torch_save DCP_DIR OUT.pt
        runs ``python -m torch.distributed.checkpoint.format_utils dcp_to_torch DCP_DIR OUT.pt``

Both tools import torch anyway; importing it here first only lets us call
``torch.set_num_threads`` before they start (BENCH_THREADS, default 2). The tool's own code and
arguments are untouched. Exit status: the tool's (its CLI's SystemExit), 0 if it returns.
"""

from __future__ import annotations

import os
import runpy
import sys


def main() -> None:
    import torch

    torch.set_num_threads(int(os.environ.get("BENCH_THREADS", "2")))
    tool, args = sys.argv[1], sys.argv[2:]
    if tool == "zero_to_fp32":
        script = os.path.join(args[0], "zero_to_fp32.py")
        sys.argv = [script, *args]
        runpy.run_path(script, run_name="__main__")
    elif tool == "dcp_to_torch_save":
        src, dst = args
        if not os.path.isdir(src):  # the CLI would print "skipping" and exit 0
            sys.exit(f"_ref.py: {src} is not a directory")
        sys.argv = ["format_utils", "dcp_to_torch", src, dst]
        runpy.run_module("torch.distributed.checkpoint.format_utils", run_name="__main__", alter_sys=True)
    else:
        sys.exit(f"_ref.py: unknown tool {tool}")


if __name__ == "__main__":
    main()
