"""Training runs as real processes, without paying the frameworks' imports for each one.

Importing torch with transformers, Lightning and Accelerate takes 5-6 s here, longer than the
tiny runs themselves. A zygote imports them once and forks a child per run: each run is a process
of its own (or a job of N gloo ranks, each its own process, with torchrun's variables), with its
own environment, working directory and output files, that can be SIGKILLed (the scripts kill
themselves) and whose exit status comes back. tests/_launch.py does this one job at a time for
jobs none of whose processes die; the zygote runs several at once and reports a one-process
run's own status (-9 for SIGKILL), and uses _launch's rank set-up (streams, environment,
interpreter shutdown) for each child. What a fork cannot give is a fresh interpreter: modules
are imported already, and Python's hash seed is the zygote's (the scripts seed what they draw).

    with Zygote(PRELOAD, base_env()) as z:
        run = z.start(script, argv, env, cwd, "name")          # one process
        job = z.start(script, argv, env, cwd, "name", nproc=2)  # two gloo ranks
        code = z.wait(run, timeout)                             # negative: the signal that ended it
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any, Self

# What every framework run's environment has, the zygote's too (torch and the frameworks read some
# of it at import), and what the zygote imports for them.
BASE_ENV = {"DS_ACCELERATOR": "cpu", "OMP_NUM_THREADS": "1", "CUDA_VISIBLE_DEVICES": "", "TOKENIZERS_PARALLELISM": "false", "HF_HUB_OFFLINE": "1"}
PRELOAD = ["torch", "numpy", "transformers", "transformers.trainer", "lightning.pytorch", "accelerate", "ravex", "ravex_runtime.runtime",
              "ravex_runtime.patches"]


def base_env() -> dict[str, str]:
    """This process's environment without Ravex's settings and the kill switch, plus :data:`BASE_ENV`."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("RAVEX_") and k != "KILL_AT_STEP"}
    env.update(BASE_ENV)
    return env

# The zygote itself: reads one JSON request per line on stdin ({"id", "nproc", "argv", "env", "cwd",
# "out", "err"}), forks a child per request and writes one JSON line per child that ended ({"id",
# "status"}) on stdout. A one-process run is the child itself (so a SIGKILL shows as -9); a job of
# several ranks is a leader that forks them (tests/_launch.py's ``_job``: torchrun's variables, the
# others stopped when one fails, exit 1). The child becomes the script as tests/_launch.py's
# ``_rank_main`` makes a rank (working directory, environment, streams, interpreter shutdown).
# Single-threaded (forking is then safe): it polls for requests and for children that ended.
_SERVER = r'''
import importlib, json, os, select, sys
sys.path.insert(0, sys.argv[2])
import _launch
for name in json.loads(sys.argv[1]):
    importlib.import_module(name)
running, pending, done = {}, b"", False
out = sys.stdout
out.write("ready\n"); out.flush()
while not done:
    if b"\n" not in pending and select.select([0], [], [], 0.05)[0]:
        chunk = os.read(0, 1 << 16)  # unbuffered: a request left in a buffer would never wake select
        done = not chunk
        pending += chunk
    if b"\n" in pending:
        line, pending = pending.split(b"\n", 1)
        req = json.loads(line)
        pid = os.fork()
        if pid == 0:
            os.setpgid(0, 0)
            if req["nproc"] == 1:
                os._exit(_launch._rank_main(req["argv"], req["cwd"], req["env"], req["out"], req["err"]))
            os._exit(_launch._job(req))
        running[pid] = req["id"]
    while running:
        pid, status = os.waitpid(-1, os.WNOHANG)
        if pid == 0:
            break
        out.write(json.dumps({"id": running.pop(pid), "status": os.waitstatus_to_exitcode(status)}) + "\n"); out.flush()
for pid in running:  # the test is done with the zygote: nothing it started outlives it
    os.killpg(pid, 9)
    os.waitpid(pid, 0)
'''


class Run:
    """One run started by :meth:`Zygote.start`: its output files."""

    def __init__(self, ident: int, out: Path, err: Path):
        self.id, self.out, self.err = ident, out, err
        self.returncode: int | None = None

    @property
    def stdout(self) -> str:
        return self.out.read_text(errors="replace") if self.out.exists() else ""

    @property
    def stderr(self) -> str:
        return self.err.read_text(errors="replace") if self.err.exists() else ""


class Zygote:
    """A process that has imported ``modules`` (under ``env``) and forks a run per :meth:`start`."""

    def __init__(self, modules: list[str], env: dict[str, str]):
        launcher = str(Path(__file__).resolve().parents[1] / "tests")  # tests/_launch.py
        self.proc = subprocess.Popen([sys.executable, "-P", "-c", _SERVER, json.dumps(modules), launcher], stdin=subprocess.PIPE,
                                     stdout=subprocess.PIPE, text=True, env=env, bufsize=1)
        assert self.proc.stdout is not None and self.proc.stdin is not None
        first = self.proc.stdout.readline()
        if first.strip() != "ready":
            self.close()
            raise RuntimeError(f"the zygote did not start (it said {first!r}, exit {self.proc.poll()})")
        self.next_id = 0
        self.runs: dict[int, Run] = {}
        self.buffer = b""  # what the zygote said and was not read yet

    def start(self, script: Path, argv: list[str], env: dict[str, str], cwd: Path, name: str, nproc: int = 1) -> Run:
        """Run ``script`` with ``argv`` as ``__main__`` in a new child, or as a job of ``nproc`` gloo ranks
        (stdout and stderr of all in ``cwd/<name>.out|.err``)."""
        self.next_id += 1
        run = Run(self.next_id, cwd / f"{name}.out", cwd / f"{name}.err")
        self.runs[run.id] = run
        run.out.touch()
        run.err.touch()
        req: dict[str, Any] = {"id": run.id, "nproc": nproc, "argv": [str(script), *argv], "env": env, "cwd": str(cwd),
                               "out": str(run.out), "err": str(run.err)}
        assert self.proc.stdin is not None
        self.proc.stdin.write(json.dumps(req) + "\n")
        self.proc.stdin.flush()
        return run

    def wait(self, run: Run, timeout: float) -> int:
        """The run's exit status (negative: the signal that ended it); TimeoutError after ``timeout`` s."""
        import os
        import select
        import time

        assert self.proc.stdout is not None
        fd = self.proc.stdout.fileno()
        deadline = time.monotonic() + timeout
        while run.returncode is None:
            if b"\n" not in self.buffer:
                left = deadline - time.monotonic()
                if left <= 0 or not select.select([fd], [], [], left)[0]:
                    raise TimeoutError(f"run {run.id} did not end in {timeout} s")
                chunk = os.read(fd, 1 << 16)  # unbuffered, as the zygote reads its requests
                if not chunk:
                    raise RuntimeError(f"the zygote ended (exit {self.proc.poll()}) before run {run.id} did")
                self.buffer += chunk
                continue
            line, self.buffer = self.buffer.split(b"\n", 1)
            msg = json.loads(line)
            self.runs[msg["id"]].returncode = int(msg["status"])
        return run.returncode

    def finish(self, run: Run, timeout: float) -> Run:
        """:meth:`wait`, for a test: a run that does not end in time fails it with its stderr's last lines."""
        try:
            self.wait(run, timeout)
        except TimeoutError:
            raise AssertionError(f"{run.out.stem} did not finish in {timeout:.0f} s\n" + "\n".join(run.stderr.splitlines()[-40:])) from None
        return run

    def close(self) -> None:
        if self.proc.stdin is not None:
            self.proc.stdin.close()
        if self.proc.stdout is not None:
            self.proc.stdout.close()
        try:
            self.proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()

    def __enter__(self) -> Self:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
