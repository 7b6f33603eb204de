"""Multi-rank gloo jobs without torchrun's start-up, for tests where no process's
death is what is tested.

``launch(nproc, argv, cwd=..., env=...)`` runs ``argv`` (a script and its
arguments, or ``["-m", module, ...]``) as ``nproc`` ranks, as
``python -m torch.distributed.run --standalone --nproc_per_node N argv`` would:
each rank its own process with torchrun's variables (RANK, LOCAL_RANK,
WORLD_SIZE, LOCAL_WORLD_SIZE, MASTER_ADDR=127.0.0.1, a free MASTER_PORT, ...),
the script run as ``__main__`` with its directory first on ``sys.path``, the
process left through interpreter shutdown (threads joined, ``atexit`` run).
When one rank fails the others are stopped and the job exits 1, as torchrun's
does. The difference is where the ranks come from: a warm interpreter (torch,
DeepSpeed and Ravex imported once per test session) forks them, so a job costs
a fork instead of N + 1 interpreter start-ups (torchrun's launcher imports torch
too), about 6 s a job on this project's 2-CPU machine.

Where a rank's death, torchrun's own teardown or a fresh interpreter is what a
test is about (SIGKILL, the elastic agent), the test launches real torchrun.
"""

from __future__ import annotations

import atexit
import contextlib
import json
import os
import signal
import subprocess
import sys
import tempfile
import threading
from pathlib import Path
from typing import Any

# torch's default CPU generator seed: a forked rank starts from it as a fresh interpreter does.
_TORCH_DEFAULT_SEED = 67280421310721
_PRELOAD = ("torch", "torch.distributed", "numpy", "ravex", "ravex_convert", "ravex_runtime", "deepspeed")


def _free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _rank_main(argv: list[str], cwd: str, env: dict[str, str], out: str, err: str) -> int:
    """In a forked rank: become ``python argv`` in ``cwd`` with ``env``; the exit status."""
    import runpy
    import traceback

    os.chdir(cwd)
    os.environ.clear()
    os.environ.update(env)
    for fd, path in ((1, out), (2, err)):
        f = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)
        os.dup2(f, fd)
        os.close(f)
    # The process's own streams for its life (the server's stdout is its result pipe).
    sys.stdin = open(os.devnull)  # noqa: SIM115
    sys.stdout = open(1, "w", buffering=1, closefd=False)  # noqa: SIM115
    sys.stderr = open(2, "w", buffering=1, closefd=False)  # noqa: SIM115
    import torch

    torch.manual_seed(_TORCH_DEFAULT_SEED)
    code = 0
    try:
        if argv[0] == "-m":
            sys.argv = [argv[1], *argv[2:]]
            sys.path.insert(0, cwd)
            runpy.run_module(argv[1], run_name="__main__", alter_sys=True)
        else:
            sys.argv = list(argv)
            sys.path.insert(0, str(Path(argv[0]).resolve().parent))
            runpy.run_path(argv[0], run_name="__main__")
    except SystemExit as e:
        code = e.code if isinstance(e.code, int) else (0 if e.code is None else 1)
        if e.code is not None and not isinstance(e.code, int):
            print(e.code, file=sys.stderr)
    except BaseException:  # noqa: BLE001 - as the interpreter would: print it, exit 1
        traceback.print_exc()
        code = 1
    # What interpreter shutdown does before the process ends: wait for the threads, run atexit.
    try:
        threading._shutdown()  # type: ignore[attr-defined]
        atexit._run_exitfuncs()
    except BaseException:  # noqa: BLE001 - as above
        traceback.print_exc()
        code = code or 1
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()
        except (OSError, ValueError):
            pass
    return code


def _job(req: dict[str, Any]) -> int:
    """In the job's leader process: fork the ranks, wait, stop the rest when one fails."""
    import time

    nproc = int(req["nproc"])
    base = dict(req["env"])
    base.setdefault("OMP_NUM_THREADS", "1")
    port = _free_port()
    pids: dict[int, int] = {}
    for rank in range(nproc):
        env = dict(base, RANK=str(rank), LOCAL_RANK=str(rank), WORLD_SIZE=str(nproc), LOCAL_WORLD_SIZE=str(nproc),
                   GROUP_RANK="0", GROUP_WORLD_SIZE="1", ROLE_RANK=str(rank), ROLE_WORLD_SIZE=str(nproc), ROLE_NAME="default",
                   MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), TORCHELASTIC_RESTART_COUNT="0",
                   TORCHELASTIC_MAX_RESTARTS="0", TORCHELASTIC_RUN_ID="ravex-test", TORCHELASTIC_USE_AGENT_STORE="False")
        pid = os.fork()
        if pid == 0:
            os._exit(_rank_main(req["argv"], req["cwd"], env, req["out"], req["err"]))
        pids[pid] = rank
    failed = 0
    deadline = None
    while pids:
        if deadline is not None and time.monotonic() > deadline:
            for pid in pids:
                os.kill(pid, signal.SIGKILL)
            deadline = None
        pid, status = os.waitpid(-1, os.WNOHANG if deadline is not None else 0)
        if pid == 0:
            time.sleep(0.05)
            continue
        rank = pids.pop(pid)
        code = os.waitstatus_to_exitcode(status)
        if code != 0 and not failed:
            failed = 1
            with open(req["err"], "a") as f:
                f.write(f"launch: rank {rank} (pid {pid}) exited with {code}; stopping the others\n")
            for other in pids:
                os.kill(other, signal.SIGTERM)
            deadline = time.monotonic() + 5.0
    return failed


def _serve() -> None:
    """The warm interpreter: one request per line on stdin, one result per line on stdout."""
    import importlib

    for name in _PRELOAD:
        try:
            importlib.import_module(name)
        except ImportError:
            pass
    out = sys.stdout
    sys.stdout = sys.stderr  # nothing but results on the pipe
    for line in sys.stdin:
        req = json.loads(line)
        out.flush()
        sys.stderr.flush()
        leader = os.fork()
        if leader == 0:
            os.setsid()  # the job's processes in a group of their own: a hung job is killed whole
            os._exit(_job(req))
        out.write(json.dumps({"leader": leader}) + "\n")
        out.flush()
        _, status = os.waitpid(leader, 0)
        out.write(json.dumps({"rc": os.waitstatus_to_exitcode(status)}) + "\n")
        out.flush()


_server: subprocess.Popen[str] | None = None
_lock = threading.Lock()


def _server_proc() -> subprocess.Popen[str]:
    global _server
    if _server is None or _server.poll() is not None:
        # -P: the source tree (no compiled core) stays off sys.path; the installed Ravex is preloaded.
        code = f"import sys; sys.path.insert(0, {str(Path(__file__).parent)!r}); import _launch; _launch._serve()"
        _server = subprocess.Popen([sys.executable, "-P", "-c", code],
                                   stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True,
                                   env=dict(os.environ, DS_ACCELERATOR=os.environ.get("DS_ACCELERATOR", "cpu")))
        atexit.register(_server.kill)
    return _server


def launch(nproc: int, argv: list[str], *, cwd: Path | str, env: dict[str, str] | None = None,
           timeout: float = 600) -> subprocess.CompletedProcess[str]:
    """Run ``argv`` as ``nproc`` gloo ranks (see the module's docstring); stdout and stderr
    of every rank together, as torchrun's own would be."""
    with _lock, tempfile.TemporaryDirectory() as tmp:
        out, err = Path(tmp, "out"), Path(tmp, "err")
        out.touch()
        err.touch()
        req = {"nproc": nproc, "argv": [str(a) for a in argv], "cwd": str(Path(cwd).resolve()), "env": dict(env or os.environ),
               "out": str(out), "err": str(err)}
        server = _server_proc()
        assert server.stdin is not None and server.stdout is not None
        server.stdin.write(json.dumps(req) + "\n")
        server.stdin.flush()
        leader = int(json.loads(server.stdout.readline())["leader"])

        def stop() -> None:  # a hung job: its processes and the server go
            with contextlib.suppress(ProcessLookupError):
                os.killpg(leader, signal.SIGKILL)
            server.kill()

        timer = threading.Timer(timeout, stop)
        timer.start()
        try:
            line = server.stdout.readline()
        finally:
            timer.cancel()
        if not line:
            raise subprocess.TimeoutExpired(["launch", *req["argv"]], timeout, out.read_text(), err.read_text())
        rc = int(json.loads(line)["rc"])
        return subprocess.CompletedProcess(["launch", str(nproc), *req["argv"]], rc, out.read_text(), err.read_text())
