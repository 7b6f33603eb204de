"""The decorator in-process: patches on only during the call, RAVEX_ENABLED=0, nothing on stdout,
a damaged newest checkpoint skipped, the run lock, restore/weights-only, ravex status."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import torch

import ravex
import ravex_convert
from ravex_convert.errors import RavexError
from ravex_runtime.patches import patched_targets
from ravex_runtime.status import store_status


def originals() -> list[Any]:
    return [cls.__dict__[name] for cls, name in patched_targets()]


def tiny_training(steps: int, seen: list[float] | None = None) -> torch.nn.Module:
    torch.manual_seed(0)
    model = torch.nn.Linear(4, 1)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    data = torch.randn(16, 4)
    for _ in range(steps):
        ravex.batch_boundary()
        i = ravex.step() % 4
        loss = model(data[i * 4:(i + 1) * 4]).pow(2).mean()
        loss.backward()
        opt.step()
        opt.zero_grad()
        if seen is not None:
            seen.append(loss.item())
    return model


def test_patches_are_on_only_during_the_call_and_gone_after_return_and_raise(env: Path) -> None:
    before = originals()
    during: list[bool] = []

    @ravex.train_loop
    def ok() -> None:
        during.append(originals() != before)
        tiny_training(3)

    @ravex.train_loop
    def boom() -> None:
        during.append(originals() != before)
        raise ValueError("user error")

    ok()
    assert originals() == before
    with pytest.raises(ValueError, match="user error"):
        boom()
    assert originals() == before
    assert during == [True, True]
    assert not ravex.is_active()


def test_disabled_changes_nothing(env: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("RAVEX_ENABLED", "0")
    before = originals()
    seen: list[bool] = []

    @ravex.train_loop
    def run() -> int:
        seen.append(originals() == before and not ravex.is_active())
        tiny_training(4)
        return 5

    assert run() == 5
    assert seen == [True]
    assert not env.exists()


def test_nothing_on_stdout_and_checkpoints_written(env: Path, capfd: pytest.CaptureFixture[str]) -> None:
    @ravex.train_loop
    def run() -> None:
        tiny_training(5)
        assert ravex.status()["active"]

    run()
    out, _ = capfd.readouterr()
    assert out == ""
    st = store_status(env)
    assert [c["step"] for c in st["checkpoints"]] == [2, 4, 5]  # every 2 steps, then the final one
    assert st["resume"] == st["checkpoints"][-1]["index"]


@pytest.mark.parametrize("damage", ["flip", "truncate"])
def test_a_damaged_newest_checkpoint_is_reported_and_the_previous_one_used(env: Path, caplog: pytest.LogCaptureFixture, damage: str) -> None:
    @ravex.train_loop
    def run() -> None:
        tiny_training(4)

    run()
    st = store_status(env)
    newest = st["checkpoints"][-1]
    assert newest["step"] == 4
    data = sorted((env / "checkpoints" / f"{newest['index']:08d}").glob("*.safetensors"))
    assert data
    raw = bytearray(data[0].read_bytes())
    if damage == "flip":
        raw[-1] ^= 0xFF
    else:
        del raw[-3:]
    data[0].write_bytes(bytes(raw))
    steps: list[int] = []

    @ravex.train_loop
    def again() -> None:
        model = torch.nn.Linear(4, 1)  # the restore is checked against the live objects: build them as the first run did
        _opt = torch.optim.SGD(model.parameters(), lr=0.1)
        ravex.batch_boundary()
        steps.append(ravex.step())

    import logging

    logging.getLogger("ravex").addHandler(caplog.handler)
    try:
        again()
    finally:
        logging.getLogger("ravex").removeHandler(caplog.handler)
    assert steps == [2]
    why = "checksum" if damage == "flip" else "truncated"
    assert any("damaged" in r.getMessage() and why in r.getMessage() for r in caplog.records), [r.getMessage() for r in caplog.records]


def test_resume_continues_the_same_losses(env: Path) -> None:
    ref: list[float] = []

    @ravex.train_loop
    def full() -> None:
        tiny_training(6, ref)

    full()
    for p in env.iterdir():
        pass
    import shutil

    shutil.rmtree(env)
    first: list[float] = []
    second: list[float] = []

    @ravex.train_loop
    def part1() -> None:
        tiny_training(4, first)

    @ravex.train_loop
    def part2() -> None:
        tiny_training(2, second)

    part1()
    part2()
    assert first + second == ref


def test_a_second_run_on_the_same_store_gets_a_clear_error(env: Path) -> None:
    code = ("import ravex, time\n@ravex.train_loop\ndef f():\n    open('ready','w').close(); time.sleep(30)\nf()\n")
    p = subprocess.Popen([sys.executable, "-P", "-c", code], env=dict(os.environ), cwd=env.parent)
    try:
        for _ in range(300):
            if (env.parent / "ready").exists():
                break
            import time

            time.sleep(0.05)

        @ravex.train_loop
        def second() -> None:
            pass

        with pytest.raises(RavexError, match="another training run is using this checkpoint store"):
            second()
    finally:
        p.kill()
        p.wait()


def test_weights_only_start_and_status_json(env: Path) -> None:
    @ravex.train_loop
    def run() -> None:
        tiny_training(2)

    run()
    torch.manual_seed(1)
    fresh = torch.nn.Linear(4, 1)
    step = ravex.load_weights(fresh, env)
    assert step == 2
    res = subprocess.run([str(Path(sys.executable).with_name("ravex")), "status", str(env), "--json"], capture_output=True, text=True, check=False)
    assert res.returncode == 0, res.stderr
    doc = json.loads(res.stdout)
    assert doc["resume"] == doc["checkpoints"][-1]["index"] and doc["checkpoints"][-1]["complete"]
    res = subprocess.run([str(Path(sys.executable).with_name("ravex")), "status", str(env.parent / "nope")], capture_output=True, text=True, check=False)
    assert res.returncode != 0 and "not a Ravex store" in res.stderr


def test_bad_config_raises_before_training(env: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("RAVEX_BACKEND", "pickle")
    ran: list[int] = []

    @ravex.train_loop
    def run() -> None:
        ran.append(1)

    with pytest.raises(RavexError, match="RAVEX_BACKEND"):
        run()
    assert ran == []


def test_keep_last_prunes_but_never_the_checkpoint_resumed_from(env: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("RAVEX_KEEP_LAST", "2")
    monkeypatch.setenv("RAVEX_CHECKPOINT_EVERY", "1")

    @ravex.train_loop
    def run(steps: int) -> None:
        tiny_training(steps)

    run(3)
    first = store_status(env)["checkpoints"]
    assert [c["step"] for c in first] == [2, 3]
    resumed_from = first[-1]["index"]
    run(4)
    after = store_status(env)["checkpoints"]
    assert resumed_from in [c["index"] for c in after]  # pinned while the run that resumed from it wrote
    assert [c["step"] for c in after][-2:] == [6, 7]


def test_an_unchanged_frozen_layer_is_not_written_again(env: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("RAVEX_CHECKPOINT_EVERY", "1")

    @ravex.train_loop
    def run() -> None:
        torch.manual_seed(0)
        model = torch.nn.Sequential(torch.nn.Linear(256, 256), torch.nn.Linear(256, 4))
        model[0].requires_grad_(False)
        opt = torch.optim.SGD([p for p in model.parameters() if p.requires_grad], lr=0.1)
        x = torch.randn(8, 256)
        for _ in range(3):
            ravex.batch_boundary()
            model(x).pow(2).mean().backward()
            opt.step()
            opt.zero_grad()

    run()
    sizes = [c["bytes_on_disk"] for c in store_status(env)["checkpoints"]]
    frozen = 256 * 257 * 4
    assert sizes[0] > frozen
    assert all(s < frozen for s in sizes[1:]), sizes  # the frozen layer is referenced, not rewritten


class _Stream(torch.utils.data.IterableDataset[torch.Tensor]):
    def __iter__(self) -> Any:
        g = torch.Generator().manual_seed(3)
        for _ in range(8):
            yield torch.randn(4, generator=g)


def _iterable_run(seen: list[list[float]]) -> Any:
    @ravex.train_loop
    def run(limit: int) -> int:
        torch.manual_seed(0)
        model = torch.nn.Linear(4, 1)
        opt = torch.optim.SGD(model.parameters(), lr=0.1)
        for n, x in enumerate(torch.utils.data.DataLoader(_Stream(), batch_size=2), start=1):
            seen.append(x.flatten().tolist())
            model(x).sum().backward()
            opt.step()
            opt.zero_grad()
            if n == limit:
                break
        return ravex.step()
    return run


def test_an_iterable_dataset_without_state_is_replayed_to_its_position(env: Path, caplog: pytest.LogCaptureFixture,
                                                                       monkeypatch: pytest.MonkeyPatch) -> None:
    import logging

    whole: list[list[float]] = []
    monkeypatch.setenv("RAVEX_ENABLED", "0")
    _iterable_run(whole)(4)
    monkeypatch.delenv("RAVEX_ENABLED")
    seen: list[list[float]] = []
    run = _iterable_run(seen)
    assert run(3) == 3
    logging.getLogger("ravex").addHandler(caplog.handler)
    try:
        assert run(1) == 4  # resumed at step 3, one more step
    finally:
        logging.getLogger("ravex").removeHandler(caplog.handler)
    assert seen == whole, "after the resume the stream went on with its 4th batch"
    assert any("read again and dropped" in r.getMessage() for r in caplog.records)


def test_restore_by_index_into_live_objects(env: Path) -> None:
    @ravex.train_loop
    def first() -> None:
        tiny_training(4)

    first()
    indices = [c["index"] for c in store_status(env)["checkpoints"]]
    got: list[int] = []

    @ravex.train_loop
    def second() -> None:
        torch.manual_seed(0)
        model = torch.nn.Linear(4, 1)
        _opt = torch.optim.SGD(model.parameters(), lr=0.1)  # kept alive: the restore is checked against the live optimizer
        got.append(ravex.restore(index=indices[0]))
        got.append(ravex.step())

    second()
    assert got == [2, 2]


def test_a_loop_without_any_boundary_is_warned_about(env: Path, caplog: pytest.LogCaptureFixture) -> None:
    import logging

    @ravex.train_loop
    def run() -> None:
        model = torch.nn.Linear(2, 1)
        opt = torch.optim.SGD(model.parameters(), lr=0.1)
        for _ in range(4):
            model(torch.ones(1, 2)).sum().backward()
            opt.step()

    logging.getLogger("ravex").addHandler(caplog.handler)
    try:
        run()
    finally:
        logging.getLogger("ravex").removeHandler(caplog.handler)
    assert any("no iteration boundary seen" in r.getMessage() for r in caplog.records)


def test_a_step_the_grad_scaler_skips_is_not_counted(env: Path) -> None:
    counted: list[int] = []

    @ravex.train_loop
    def run() -> None:
        model = torch.nn.Linear(2, 1)
        opt = torch.optim.SGD(model.parameters(), lr=0.1)
        scaler = torch.amp.GradScaler("cpu", init_scale=2.0 ** 127)
        for big in (True, False):
            ravex.batch_boundary()
            loss = model(torch.ones(1, 2)).sum() * (1e10 if big else 1e-30)
            scaler.scale(loss).backward()  # the first overflows to inf: the scaler skips optimizer.step()
            scaler.step(opt)
            scaler.update()
            opt.zero_grad()
            counted.append(ravex.step())

    run()
    assert counted == [0, 1]


def test_every_checkpoint_holds_its_own_step_although_snapshot_buffers_are_reused(env: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    # Collections copy into the buffers of the snapshot written before (no fresh allocation);
    # each checkpoint must still hold the weights of its own step, never a later or earlier one.
    monkeypatch.setenv("RAVEX_CHECKPOINT_EVERY", "1")
    expected: dict[int, torch.Tensor] = {}
    buffers: list[int] = []
    import queue

    real_put = queue.Queue.put

    def watch(q: Any, item: Any, *a: Any, **k: Any) -> None:
        if item is not None:
            buffers.append(item.tensors["model/weight"].data_ptr())
        real_put(q, item, *a, **k)

    monkeypatch.setattr(queue.Queue, "put", watch)

    @ravex.train_loop
    def run() -> None:
        torch.manual_seed(0)
        model = torch.nn.Linear(64, 64)
        opt = torch.optim.SGD(model.parameters(), lr=0.1)
        for _ in range(6):
            ravex.batch_boundary()
            expected[ravex.step()] = model.weight.detach().clone()
            model(torch.randn(8, 64)).pow(2).mean().backward()
            opt.step()
            opt.zero_grad()
            ravex.flush()  # the writer is done: the next collection reuses its buffers

    run()
    assert len(set(buffers)) < len(buffers), "no snapshot buffer was ever reused"
    checked = 0
    for c in store_status(env)["checkpoints"]:
        got = ravex_convert.load_state_dict(env, index=c["index"])["weight"]
        if c["step"] in expected:
            assert torch.equal(got, expected[c["step"]]), f"checkpoint of step {c['step']}"
            checked += 1
    assert checked >= 5
