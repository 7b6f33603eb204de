"""ravex.Session, driven by hand (issue 13, point 6): capture, commit, restore, on this rank.

The exactness test crosses a real process boundary: a hand-written loop (a dataset
whose items draw from the torch RNG, a shuffling DataLoader, dropout, AdamW, StepLR)
runs uninterrupted in one fresh interpreter; in another it commits checkpoints, the
last one at step k, and dies a step later without closing its session; a third builds
everything again from other seeds, restores, and trains on. Its losses and final
weights must be bit-identical to the uninterrupted run's. The rest runs in-process.
"""

from __future__ import annotations

import json
import os
import random
import subprocess
import sys
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
from _launch import launch

import ravex
from ravex_convert.errors import IncompleteCheckpointError, RavexError
from ravex_runtime import ResumeError
from ravex_runtime.config import ConfigError
from ravex_runtime.status import store_status

TOTAL = 12  # steps; 5 batches an epoch, so the runs cross two epoch ends

LOOP = r'''
import json, os, sys
import torch
import ravex

mode, store, out, k, workers = sys.argv[1], sys.argv[2], sys.argv[3], int(sys.argv[4]), int(sys.argv[5])
TOTAL = int(sys.argv[6])
torch.set_num_threads(1)


class Noisy(torch.utils.data.Dataset):
    """Every item draws fresh noise when it is loaded: the torch RNG at __getitem__ decides the data."""

    def __init__(self):
        g = torch.Generator().manual_seed(1)
        self.x, self.y = torch.randn(20, 6, generator=g), torch.randn(20, 1, generator=g)

    def __len__(self):
        return 20

    def __getitem__(self, i):
        return self.x[i] + 0.1 * torch.randn(6), self.y[i]


# A resumed run builds everything from other seeds: only the restore can make it the same run.
torch.manual_seed(1234 if mode == "resume" else 0)
model = torch.nn.Sequential(torch.nn.Linear(6, 16), torch.nn.ReLU(), torch.nn.Dropout(0.2), torch.nn.Linear(16, 1))
opt = torch.optim.AdamW(model.parameters(), lr=0.01)
sched = torch.optim.lr_scheduler.StepLR(opt, step_size=3, gamma=0.5)
loader = torch.utils.data.DataLoader(Noisy(), batch_size=4, shuffle=True, num_workers=workers)

session = None if mode == "plain" else ravex.Session(path=store, keep_last=None)
step, restored, losses = 0, None, {}
if session is not None:
    session.track(model=model, optimizer=opt, scheduler=sched, loader=loader)
    restored = session.restore()
    step = restored or 0


def done():
    torch.save(model.state_dict(), out + ".pt")
    with open(out, "w") as f:
        json.dump({"losses": losses, "restored": restored, "rank": getattr(session, "rank", None),
                   "world_size": getattr(session, "world_size", None)}, f)


while step < TOTAL:
    for x, y in (loader if session is None else session.iterate(loader)):
        loss = torch.nn.functional.mse_loss(model(x), y)
        loss.backward()
        opt.step()
        opt.zero_grad()
        sched.step()
        step += 1
        losses[step] = loss.item().hex()
        if mode == "part" and step == k + 1:
            done()
            os._exit(0)  # dies one step after its checkpoint, without closing the session
        if mode == "part" and step == k:
            session.commit(session.capture(step), wait=True)
        elif mode == "part" and step % 3 == 0:
            session.commit(session.capture(step))  # written in the background, before step k's
        if step == TOTAL:
            break
if session is not None:
    session.commit(session.capture(step), wait=True)
    session.close()
done()
'''


def clean_env() -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("RAVEX_")}
    env["OMP_NUM_THREADS"] = "1"
    return env


def loop(tmp_path: Path, mode: str, k: int, workers: int, store: Path | str) -> tuple[dict[str, Any], dict[str, torch.Tensor]]:
    """Run the loop in a fresh interpreter (-P: the installed Ravex, not the source tree, which lacks the compiled core)."""
    out = tmp_path / f"{mode}-{k}-{workers}.json"
    res = subprocess.run([sys.executable, "-P", "-c", LOOP, mode, str(store), str(out), str(k), str(workers), str(TOTAL)],
                         capture_output=True, text=True, cwd=tmp_path, env=clean_env(), timeout=300, check=False)
    assert res.returncode == 0 and out.is_file(), f"{mode} exited {res.returncode}\n{res.stdout[-2000:]}\n{res.stderr[-4000:]}"
    result = json.loads(out.read_text())
    result["losses"] = {int(s): v for s, v in result["losses"].items()}
    return result, torch.load(f"{out}.pt", weights_only=True)


@pytest.mark.slow
@pytest.mark.parametrize(("k", "workers"), [(7, 0), (5, 0), (7, 2)], ids=["mid-epoch", "epoch-end", "mid-epoch-2-workers"])
def test_a_hand_written_loop_resumed_in_a_fresh_process_is_bit_identical(tmp_path: Path, k: int, workers: int) -> None:
    ref, ref_weights = loop(tmp_path, "plain", k, workers, tmp_path / "unused")
    assert sorted(ref["losses"]) == list(range(1, TOTAL + 1))
    store = tmp_path / "store"
    part, _ = loop(tmp_path, "part", k, workers, store)
    assert part["restored"] is None  # a new store: nothing to resume
    assert part["rank"] == 0 and part["world_size"] == 1
    assert part["losses"] == {s: ref["losses"][s] for s in range(1, k + 2)}  # the session does not change the run
    assert [c["step"] for c in store_status(store)["checkpoints"]] == sorted({*range(3, k, 3), k})

    resumed, weights = loop(tmp_path, "resume", k, workers, store)
    assert resumed["restored"] == k
    assert resumed["losses"] == {s: ref["losses"][s] for s in range(k + 1, TOTAL + 1)}
    assert weights.keys() == ref_weights.keys()
    assert all(torch.equal(weights[n], ref_weights[n]) for n in ref_weights)


@pytest.mark.slow
def test_the_loop_on_object_storage_killed_and_resumed_is_bit_identical(tmp_path: Path) -> None:
    """The same on ``objdir:`` (docs/format.md section 3): the killed run leaves its lease object
    behind (no kernel releases it), and the next run of this host takes it over."""
    k, workers = 7, 2
    ref, ref_weights = loop(tmp_path, "plain", k, workers, tmp_path / "unused")
    (tmp_path / "bucket").mkdir()
    store = f"objdir:{tmp_path}/bucket/store"
    part, _ = loop(tmp_path, "part", k, workers, store)
    assert part["losses"] == {s: ref["losses"][s] for s in range(1, k + 2)}
    assert (tmp_path / "bucket" / "store" / "run-lock").is_file()  # died holding it
    assert [c["step"] for c in store_status(store)["checkpoints"]] == sorted({*range(3, k, 3), k})
    resumed, weights = loop(tmp_path, "resume", k, workers, store)
    assert resumed["restored"] == k
    assert resumed["losses"] == {s: ref["losses"][s] for s in range(k + 1, TOTAL + 1)}
    assert all(torch.equal(weights[n], ref_weights[n]) for n in ref_weights)
    assert not (tmp_path / "bucket" / "store" / "run-lock").exists()  # closed: released
    assert not list((tmp_path / "bucket").rglob("*.tmp-*"))  # nothing renamed into place: no temporary names


# ---------------------------------------------------------------- in-process


def build(width: int = 8) -> tuple[torch.nn.Module, torch.optim.Optimizer, Any]:
    model = torch.nn.Sequential(torch.nn.Linear(4, width), torch.nn.Linear(width, 1))
    opt = torch.optim.AdamW(model.parameters(), lr=0.01)
    sched = torch.optim.lr_scheduler.StepLR(opt, step_size=2)
    model(torch.randn(3, 4)).sum().backward()  # one step: the optimizer holds state
    opt.step()
    opt.zero_grad()
    sched.step()
    return model, opt, sched


def clone(value: Any) -> Any:
    if isinstance(value, torch.Tensor):
        return value.detach().clone()
    if isinstance(value, np.ndarray):
        return value.copy()
    if isinstance(value, dict):
        return {k: clone(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return type(value)(clone(v) for v in value)
    return value


def same(a: Any, b: Any) -> bool:
    if isinstance(a, torch.Tensor):
        return isinstance(b, torch.Tensor) and a.dtype == b.dtype and a.shape == b.shape and torch.equal(a, b)
    if isinstance(a, np.ndarray):
        return isinstance(b, np.ndarray) and a.dtype == b.dtype and bool(np.array_equal(a, b))
    if isinstance(a, dict):
        return isinstance(b, dict) and a.keys() == b.keys() and all(same(a[k], b[k]) for k in a)
    if isinstance(a, (list, tuple)):
        return isinstance(b, (list, tuple)) and len(a) == len(b) and all(same(x, y) for x, y in zip(a, b))
    return bool(a == b)


def everything(model: torch.nn.Module, opt: torch.optim.Optimizer, sched: Any) -> dict[str, Any]:
    state: dict[str, Any] = clone({"model": model.state_dict(), "optim": opt.state_dict(), "sched": sched.state_dict(),
                                   "torch_rng": torch.get_rng_state(), "python_rng": random.getstate(),
                                   "numpy_rng": tuple(np.random.get_state(legacy=True))})
    return state


def test_restore_with_nothing_in_the_store_returns_none_and_touches_nothing(env: Path, tmp_path: Path) -> None:
    torch.manual_seed(0)
    model, opt, sched = build()
    before = everything(model, opt, sched)
    with ravex.Session(path=tmp_path / "empty") as session:
        session.track(model=model, optimizer=opt, scheduler=sched)
        assert session.restore() is None
        assert (session.rank, session.world_size) == (0, 1)  # no process group
    assert same(everything(model, opt, sched), before)
    assert not (tmp_path / "empty" / "ravex-store.json").exists()


def test_a_store_whose_creation_was_killed_is_finished_and_a_lost_marker_refused(env: Path, tmp_path: Path) -> None:
    # creation writes an empty manifest, then the marker: a kill between the two leaves this
    store = tmp_path / "half"
    (store / "checkpoints").mkdir(parents=True)
    (store / "manifest.json").write_text('{"format_version": 1, "checkpoints": [], "next_index": 0}')
    model, opt, sched = build()
    with ravex.Session(path=store) as session:
        session.track(model=model, optimizer=opt, scheduler=sched)
        assert session.restore() is None
    # a manifest that lists checkpoints without its marker is a damaged store: refused, as before
    (store / "manifest.json").write_text('{"format_version": 1, "checkpoints": [{"index": 0}], "next_index": 1}')
    (store / "ravex-store.json").unlink(missing_ok=True)
    with pytest.raises(IncompleteCheckpointError, match="not its marker"):
        ravex.Session(path=store)


def test_fresh_leaves_the_store_s_checkpoints_alone(env: Path, tmp_path: Path) -> None:
    torch.manual_seed(0)
    model, opt, sched = build()
    with ravex.Session(path=tmp_path / "s") as session:
        session.track(model=model, optimizer=opt, scheduler=sched)
        session.commit(session.capture(1), wait=True)
    torch.manual_seed(1)
    model, opt, sched = build()
    before = everything(model, opt, sched)
    with ravex.Session(path=tmp_path / "s", fresh=True) as session:
        session.track(model=model, optimizer=opt, scheduler=sched)
        assert session.restore() is None
        assert session.restore(index=-1) == 1  # an index asks for that checkpoint, fresh or not
    assert not same(everything(model, opt, sched)["model"], before["model"])


@pytest.mark.parametrize("index", [None, -1])
def test_restore_into_a_mismatched_model_raises_resume_error_before_changing_anything(env: Path, tmp_path: Path, index: int | None) -> None:
    store = tmp_path / "s"
    torch.manual_seed(0)
    model, opt, sched = build(width=8)
    with ravex.Session(path=store) as session:
        session.track(model=model, optimizer=opt, scheduler=sched)
        session.commit(session.capture(1), wait=True)
    listed = store_status(store)["checkpoints"]
    files = sorted(p.relative_to(store) for p in store.rglob("*"))

    torch.manual_seed(1)
    narrower, opt2, sched2 = build(width=6)
    before = everything(narrower, opt2, sched2)
    with ravex.Session(path=store) as session:
        session.track(model=narrower, optimizer=opt2, scheduler=sched2)
        with pytest.raises(ResumeError, match="no checkpoint of the store can be resumed from") as info:
            session.restore(index)
    assert "tensor 'model/0.bias' is [8] float32 in the checkpoint, [6] float32 in Sequential" in str(info.value), str(info.value)
    assert same(everything(narrower, opt2, sched2), before)  # weights, optimizer, scheduler, every RNG
    assert store_status(store)["checkpoints"] == listed
    assert sorted(p.relative_to(store) for p in store.rglob("*")) == files


def test_a_failed_write_raises_on_a_waiting_commit_and_the_session_writes_no_more(env: Path, tmp_path: Path,
                                                                                  monkeypatch: pytest.MonkeyPatch) -> None:
    from ravex_convert.formats.native import writer as native_write

    def broken(*a: Any, **k: Any) -> Any:
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(native_write, "write", broken)
    told: list[str] = []
    torch.manual_seed(0)
    model, opt, _ = build()
    with ravex.Session(path=tmp_path / "s", on_error=told.append) as session:
        session.track(model=model, optimizer=opt)
        with pytest.raises(RavexError, match="No space left on device"):
            session.commit(session.capture(1), wait=True)
        assert told == [session.error] and session.error is not None and session.error.startswith("checkpoint write failed")
        with pytest.raises(RavexError, match="an earlier write failed"):
            session.commit(session.capture(2))
        with pytest.raises(RavexError, match="No space left on device"):
            session.flush()
        assert session.writes == 0


def test_commits_are_written_in_the_background_and_keep_last_applies(env: Path, tmp_path: Path) -> None:
    torch.manual_seed(0)
    model, opt, sched = build()
    seen: dict[int, torch.Tensor] = {}
    with ravex.Session(path=tmp_path / "s", keep_last=2) as session:
        session.track(model=model, optimizer=opt, scheduler=sched)
        for step in range(1, 5):
            model(torch.randn(3, 4)).sum().backward()
            opt.step()
            opt.zero_grad()
            seen[step] = model.state_dict()["0.weight"].clone()
            session.commit(session.capture(step))  # the snapshot's buffers are reused once written
        session.flush()
        assert session.writes == 4
    kept = store_status(tmp_path / "s")["checkpoints"]
    assert [c["step"] for c in kept] == [3, 4]
    import ravex_convert

    for c in kept:
        assert torch.equal(ravex_convert.load_state_dict(tmp_path / "s", index=c["index"])["0.weight"], seen[c["step"]])


def test_one_session_per_store_and_arguments_are_checked(env: Path, tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match="keep_last is 0, expected a positive integer or null"):
        ravex.Session(path=tmp_path / "s", keep_last=0)
    with ravex.Session(path=tmp_path / "s") as session:
        with pytest.raises(RavexError, match="another training run is using this checkpoint store"):
            ravex.Session(path=tmp_path / "s")
        _, opt, _ = build()
        with pytest.raises(RavexError, match=r"Session.track\(model=...\): AdamW is not a torch.nn.Module"):
            session.track(model=opt, optimizer=opt)
        with pytest.raises(RavexError, match="no model is tracked"):
            session.capture(1)  # the failed track() tracked nothing, not even the optimizer
        with pytest.raises(RavexError, match="has no state_dict"):
            session.track(counter=object())
    with ravex.Session(path=tmp_path / "s"):  # closed: the store is free again
        pass


# ---------------------------------------------------------------- rank awareness, under a real torchrun

RANKS = r'''
import json, os, sys
import torch.distributed as dist
import ravex

dist.init_process_group("gloo")
s = ravex.Session(path=os.path.join(sys.argv[1], f"store-{dist.get_rank()}"))
with open(os.path.join(sys.argv[1], f"rank-{dist.get_rank()}.json"), "w") as f:
    json.dump({"rank": s.rank, "world_size": s.world_size}, f)
s.close()
dist.barrier()
dist.destroy_process_group()
'''


@pytest.mark.distributed
def test_the_session_knows_its_rank_and_world_size_under_torchrun(tmp_path: Path) -> None:
    worker = tmp_path / "ranks.py"
    worker.write_text(RANKS)
    res = launch(2, [str(worker), str(tmp_path)], cwd=tmp_path, env=clean_env(), timeout=300)
    assert res.returncode == 0, f"{res.stdout[-2000:]}\n{res.stderr[-4000:]}"
    got = [json.loads((tmp_path / f"rank-{r}.json").read_text()) for r in range(2)]
    assert got == [{"rank": 0, "world_size": 2}, {"rank": 1, "world_size": 2}]
