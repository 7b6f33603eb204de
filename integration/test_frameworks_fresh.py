"""The frameworks' kill-and-resume under real torchrun, each rank a fresh interpreter (issue 41).

integration/test_frameworks_dist.py forks its ranks from a zygote that has imported every
framework already, with one hash seed: an import-order bug (a framework module loaded lazily,
after Ravex looked for it) cannot show there. Here each job is ``python -m torch.distributed.run``,
whose workers start Python from nothing and import what the script imports, in its order:

- Hugging Face with ``lazy``: the script imports ``transformers`` only, builds its model, and then
  first touches ``transformers.Trainer`` (transformers loads ``transformers.trainer`` at that
  moment), as the script of a user who writes ``import transformers`` does;
- Lightning with its defaults (sanity check, a partial validation batch, ``self.log`` with
  ``sync_dist=True``, a torchmetrics metric);
- Accelerate with 2 DataLoader workers.

Per framework, at 2 ranks, randomness on: the reference (``RAVEX_ENABLED=0``) and the run that
kills itself after step 33 run side by side; the kill is checked to have landed (non-zero exit,
rank 0 logged 1..33 only, the store's newest checkpoint at step 30); the same command again
resumes from step 30 and every rank's steps 31..40 and final state equal the reference's, bit
for bit.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _zygote import base_env  # integration/ is no package
from test_dist_runtime import _descendants
from test_frameworks_dist import (
    CKPT,
    EVERY,
    KILL,
    NPROC,
    SCRIPT,
    STEPS,
    first_difference,
    log_lines,
    newest_checkpoint,
    outcome,
    steps_of,
    tail,
)

pytestmark = [pytest.mark.slow, pytest.mark.distributed]

TIMEOUT = 300.0  # one job, fresh interpreters on 2 cores: imports are most of it
CASES: dict[str, dict[str, Any]] = {
    "hf": {"framework": "hf", "noise": True, "workers": 0, "lazy": True},
    "lightning": {"framework": "lightning", "noise": True, "workers": 0, "lazy": True},
    "accelerate": {"framework": "accelerate", "noise": True, "workers": 2, "lazy": True},
}


def torchrun(tmp: Path, opts: dict[str, Any], tag: str, env_extra: dict[str, str]) -> subprocess.Popen[str]:
    env = {**base_env(), "RAVEX_STORAGE_PATH": str(tmp / f"store-{tag}"), "RAVEX_CHECKPOINT_EVERY": str(EVERY), **env_extra}
    if opts["framework"] == "accelerate":
        env["RAVEX_MAX_STEPS"] = str(STEPS)
    cmd = [sys.executable, "-P", "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", str(NPROC),
           str(SCRIPT), json.dumps({**opts, "steps": STEPS, "tag": tag}), str(tmp)]
    # a session of its own: on a time-out the agent and every worker (each in a session of its own) are killed
    return subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env, cwd=tmp, start_new_session=True)


def finish(p: subprocess.Popen[str]) -> tuple[int, str]:
    try:
        out, _ = p.communicate(timeout=TIMEOUT)
    except subprocess.TimeoutExpired:
        for pid in [p.pid, *_descendants(p.pid)]:
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
        out, _ = p.communicate()
        pytest.fail(f"torchrun did not finish in {TIMEOUT:.0f} s:\n{tail(out)}")
    return p.returncode, out


@pytest.mark.parametrize("case", list(CASES))
def test_killed_under_torchrun_resumes_bit_identically_in_fresh_interpreters(case: str, tmp_path: Path) -> None:
    opts = CASES[case]
    kill_p = torchrun(tmp_path, opts, "kill", {"KILL_AT_STEP": str(KILL)})
    ref_p = torchrun(tmp_path, opts, "ref", {"RAVEX_ENABLED": "0"})
    (ref_rc, ref_out), (kill_rc, kill_out) = finish(ref_p), finish(kill_p)
    assert ref_rc == 0, f"the reference run failed:\n{tail(ref_out)}"
    assert kill_rc != 0, f"the run to kill at step {KILL} exited 0: the kill did not land\n{tail(kill_out)}"
    assert steps_of(log_lines(tmp_path, "kill", 0)) == list(range(1, KILL + 1)), tail(kill_out)
    assert newest_checkpoint(tmp_path / "store-kill") == CKPT, tail(kill_out)
    before = {r: len(log_lines(tmp_path, "kill", r)) for r in range(NPROC)}

    rc, out = finish(torchrun(tmp_path, opts, "kill", {}))
    assert rc == 0, f"the resumed run exited {rc}:\n{tail(out)}"
    assert "resuming from checkpoint" in out and f"(step {CKPT})" in out, tail(out)
    assert "could not be hooked" not in out and "internal error" not in out, tail(out)
    problems = []
    for r in range(NPROC):
        new = log_lines(tmp_path, "kill", r)[before[r]:]
        if steps_of(new) != list(range(CKPT + 1, STEPS + 1)):
            problems.append(f"resumed run rank {r}: logged steps {steps_of(new)}, expected {CKPT + 1}..{STEPS}")
        for what, lines in (("killed run", log_lines(tmp_path, "kill", r)[:before[r]]), ("resumed run", new)):
            diff = first_difference(log_lines(tmp_path, "ref", r), lines, f"{what} rank {r}")
            if diff:
                problems.append(diff)
        want, got = outcome(tmp_path, "ref", r), outcome(tmp_path, "kill", r)
        if got != want:
            problems.append(f"rank {r}: final state differs\n  reference: {json.dumps(want)}\n  resumed run: {json.dumps(got)}")
    assert not problems, "\n".join(problems) + f"\nthe resumed job's output (last lines):\n{tail(out)}"
