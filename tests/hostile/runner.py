"""Running Ravex on one hostile input, isolated: each operation in a child
forked from a clean server process (``multiprocessing``'s forkserver), with a
time limit, a memory limit and a file-size limit, so that a crash, a hang or a
memory bomb is a finding about that case and never takes the test run down.

The children are forked from the forkserver, not from pytest, because pytest
may already have run conversions in-process: a copy of a process whose Rust
thread pool is running has the pool without its threads, and hangs.
"""

from __future__ import annotations

import multiprocessing
import os
import resource
import signal
import time
import traceback
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

TIME_LIMIT_S = 20.0
MEMORY_HEADROOM = 2 << 30  # address space a child may add to what it starts with
FILE_SIZE_LIMIT = 256 << 20  # no file a child writes may grow past this


@dataclass
class Outcome:
    """What one operation did."""

    status: str  # ok | ravex_error | exception | crash | timeout
    seconds: float = 0.0
    value: Any = None  # ok: the operation's result (JSON-ready)
    error_class: str = ""
    message: str = ""
    hint: str | None = None
    exit_code: int | None = None
    error_path: str | None = None
    traceback: str = ""
    signal: int | None = None
    extra: dict[str, Any] = field(default_factory=dict)

    def describe(self) -> str:
        if self.status == "ok":
            return "ok"
        if self.status == "ravex_error":
            return f"{self.error_class}: {self.message.splitlines()[0][:200]}"
        if self.status == "exception":
            return f"bare {self.error_class}: {self.message[:200]}"
        if self.status == "crash":
            return f"crash (signal {self.signal})" if self.signal else f"crash (exit {self.exit_code})"
        return f"timeout (> {TIME_LIMIT_S:.0f} s)"


def _limit_child() -> None:
    with open("/proc/self/status") as f:
        vm = next((int(line.split()[1]) * 1024 for line in f if line.startswith("VmSize:")), 0)
    resource.setrlimit(resource.RLIMIT_AS, (vm + MEMORY_HEADROOM, vm + MEMORY_HEADROOM))
    resource.setrlimit(resource.RLIMIT_FSIZE, (FILE_SIZE_LIMIT, FILE_SIZE_LIMIT))
    resource.setrlimit(resource.RLIMIT_CORE, (0, 0))
    # past the file-size limit, write() then fails with EFBIG instead of killing us
    signal.signal(signal.SIGXFSZ, signal.SIG_IGN)
    os.environ["RAYON_NUM_THREADS"] = "1"


def _op(op: str, src: str, dst: str | None) -> Any:
    import ravex_convert

    if op == "inspect":
        info = ravex_convert.inspect(src)
        return info.to_json(tensors=True)
    if op == "convert":
        assert dst is not None
        result = ravex_convert.convert(src, dst, "safetensors", ravex_convert.ConvertOptions(sync=False))
        return {k: v for k, v in result.items() if k in ("tensors", "files", "bytes", "notes")}
    if op == "fuzz":
        # a saved fuzzer input through its harness (fuzz/python/fuzz_readers.py); dst names the harness
        import sys

        assert dst is not None
        sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "fuzz" / "python"))
        import fuzz_readers  # type: ignore[import-not-found]

        fuzz_readers._import()
        fuzz_readers.HARNESSES[dst](Path(src).read_bytes())
        return None
    raise ValueError(op)


def _child(conn: Any, op: str, src: str, dst: str | None) -> None:
    _limit_child()
    t0 = time.perf_counter()
    try:
        from ravex_convert.errors import RavexError

        try:
            value = _op(op, src, dst)
            out = Outcome("ok", value=value)
        except RavexError as exc:
            out = Outcome("ravex_error", error_class=type(exc).__name__, message=exc.message, hint=exc.hint,
                          exit_code=exc.exit_code, error_path=exc.path)
        except BaseException as exc:  # noqa: BLE001 -- any other exception is the finding
            out = Outcome("exception", error_class=type(exc).__name__, message=str(exc)[:2000],
                          traceback="".join(traceback.format_exception(exc))[-4000:])
        out.seconds = time.perf_counter() - t0
        conn.send(out)
    finally:
        conn.close()
        os._exit(0)


_CTX: Any = None


def _context() -> Any:
    global _CTX
    if _CTX is None:
        _CTX = multiprocessing.get_context("forkserver")
        _CTX.set_forkserver_preload(["ravex_convert", "ravex_convert.formats.zero.reader", "ravex_convert.formats.dcp.reader", "hostile.runner"])
    return _CTX


def run(op: str, src: Path, dst: Path | None = None, time_limit: float = TIME_LIMIT_S) -> Outcome:
    """``inspect`` or ``convert --to safetensors`` of ``src`` in an isolated child."""
    ctx = _context()
    parent, child = ctx.Pipe(duplex=False)
    p = ctx.Process(target=_child, args=(child, op, str(src), None if dst is None else str(dst)))
    t0 = time.perf_counter()
    p.start()
    child.close()
    out: Outcome | None = None
    try:
        if parent.poll(time_limit):
            try:
                out = parent.recv()
            except EOFError:
                out = None
    finally:
        parent.close()
    p.join(5 if out is not None else 0.5)
    if p.is_alive():
        p.kill()
        p.join(5)
        if out is None:
            return Outcome("timeout", seconds=time.perf_counter() - t0)
    if out is None:
        code = p.exitcode
        return Outcome("crash", seconds=time.perf_counter() - t0, signal=-code if code is not None and code < 0 else None, exit_code=code)
    return out
