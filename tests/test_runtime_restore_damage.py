"""A resume never trains on half-restored state (issue 11, point 6).

Each test writes a real run's checkpoints with the runtime, then resumes onto a
checkpoint that is a valid file but does not fit the live objects — a changed
model or optimizer, as a user's edited script gives, or an RNG state of the
wrong size / a NumPy state asking for an object dtype, written through the
runtime's own writer so every checksum is right. The resumed run must either
hold exactly the state of the previous complete checkpoint (saying so, and
pruning nothing), or stop before its first step with one clear error.
"""

from __future__ import annotations

import logging
from collections import OrderedDict
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
import torch

import ravex
import ravex_convert
from ravex_convert.errors import IncompleteCheckpointError, LayoutMismatchError
from ravex_runtime import ResumeError
from ravex_runtime import state as statemod
from ravex_runtime.loading import load_checkpoint, load_torch_save
from ravex_runtime.state import Snapshot, capture_rng
from ravex_runtime.status import store_status


@pytest.fixture
def logs(caplog: pytest.LogCaptureFixture) -> Iterator[Callable[[], str]]:
    """The messages Ravex has logged so far, one a line (its logger does not propagate)."""
    logger = logging.getLogger("ravex")
    logger.addHandler(caplog.handler)
    try:
        yield lambda: "\n".join(r.getMessage() for r in caplog.records)
    finally:
        logger.removeHandler(caplog.handler)


def build(kind: str = "same") -> torch.nn.Module:
    torch.manual_seed(0)
    width = 6 if kind == "reshaped" else 8
    last = "out" if kind == "renamed" else "head"
    return torch.nn.Sequential(OrderedDict([("body", torch.nn.Linear(4, width)), (last, torch.nn.Linear(width, 1))]))


def train(steps: int, model_kind: str = "same", optimizer: str = "sgd", seen: dict[str, Any] | None = None,
          before_first_step: Callable[[], None] | None = None) -> None:
    """A small run: the model, an optimizer, a loop of ``steps`` iterations with ``batch_boundary``.
    ``seen`` gets the state the objects hold when the first step is about to run."""
    model = build(model_kind)
    opt: torch.optim.Optimizer = (torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9) if optimizer == "sgd"
                                  else torch.optim.Adam(model.parameters(), lr=0.01))
    if seen is not None:
        seen["initial"] = {k: v.detach().clone() for k, v in model.state_dict().items()}
    data = torch.randn(16, 4, generator=torch.Generator().manual_seed(1))
    for n in range(steps):
        ravex.batch_boundary()
        if n == 0:
            if seen is not None:
                seen["weights"] = {k: v.detach().clone() for k, v in model.state_dict().items()}
                seen["step"] = ravex.step()
                seen["torch_rng"] = torch.get_rng_state()
            if before_first_step is not None:
                before_first_step()
        i = ravex.step() % 4
        loss = model(data[i * 4:(i + 1) * 4]).pow(2).mean() + torch.randn(()) * 1e-3
        loss.backward()
        opt.step()
        opt.zero_grad()
        if seen is not None:
            seen.setdefault("steps", []).append(ravex.step())


def listed(store: Path) -> list[tuple[int, int]]:
    return [(c["index"], c["step"]) for c in store_status(store)["checkpoints"]]


def first_run(store: Path) -> list[tuple[int, int]]:
    @ravex.train_loop
    def run() -> None:
        train(4)

    run()
    got = listed(store)
    assert [s for _, s in got] == [2, 4]
    return got


# ---------------------------------------------------------------- a changed script: nothing fits, stop before step 1


@pytest.mark.parametrize(("change", "message"), [
    ("renamed", "missing in the checkpoint ['out.bias', 'out.weight']"),
    ("reshaped", "tensor 'model/body.bias' is [8] float32 in the checkpoint, [6] float32 in Sequential"),
    ("optimizer", "the checkpoint was written by another optimizer than Adam"),
])
def test_a_changed_model_or_optimizer_stops_before_the_first_step(env: Path, logs: Callable[[], str], change: str, message: str) -> None:
    before = first_run(env)
    files = sorted(p.relative_to(env) for p in env.rglob("*") if p.is_file() and p.name != "lock")
    seen: dict[str, Any] = {}

    @ravex.train_loop
    def again() -> None:
        train(4, model_kind=change if change != "optimizer" else "same", optimizer="adam" if change == "optimizer" else "sgd", seen=seen)

    with pytest.raises(ResumeError) as info:
        again()
    err = str(info.value)
    assert "no checkpoint of the store can be resumed from" in err and message in err, err
    assert "checkpoint 1 (step 4)" in err and "checkpoint 0 (step 2)" in err  # both were tried, newest first
    assert "hint: fix what the error names" in err
    assert "steps" not in seen and "weights" not in seen  # not one step, and the loop never got past its first boundary
    assert listed(env) == before
    assert sorted(p.relative_to(env) for p in env.rglob("*") if p.is_file() and p.name != "lock") == files  # nothing written or pruned
    assert "falling back to checkpoint 0 (step 2)" in logs()
    assert not ravex.is_active()


def test_an_explicit_restore_that_does_not_fit_touches_nothing(env: Path) -> None:
    first_run(env)
    got: dict[str, Any] = {}

    @ravex.train_loop
    def again() -> None:
        model = build("same")
        model.body = torch.nn.Linear(4, 8, bias=False)  # body.bias gone
        opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
        before = {k: v.clone() for k, v in model.state_dict().items()}
        with pytest.raises(LayoutMismatchError, match=r"in the checkpoint but not in the model \['body.bias'\]"):
            ravex.restore(index=0)
        got["same"] = all(torch.equal(v, before[k]) for k, v in model.state_dict().items())
        ravex.batch_boundary()  # the automatic resume, still due, refuses too
        del opt

    with pytest.raises(ResumeError, match="no checkpoint of the store can be resumed from"):
        again()
    assert got["same"]


def test_load_weights_checks_before_it_loads(env: Path) -> None:
    first_run(env)
    model = build("reshaped")
    before = {k: v.clone() for k, v in model.state_dict().items()}
    with pytest.raises(LayoutMismatchError, match=r"tensor 'model/body.bias' is \[8\] in the checkpoint, \[6\] in Sequential; nothing was loaded"):
        ravex.load_weights(model, env)
    assert all(torch.equal(v, before[k]) for k, v in model.state_dict().items())
    renamed = build("renamed")
    with pytest.raises(LayoutMismatchError, match=r"missing in the checkpoint \['out.bias', 'out.weight'\]"):
        ravex.load_weights(renamed, env)
    assert ravex.load_weights(renamed, env, strict=False) == 4  # fine-tuning a new head: what fits is loaded


# ---------------------------------------------------------------- damaged state in the newest checkpoint: fall back


def damage_rng(kind: str) -> Callable[[Snapshot, str], dict[str, Any]]:
    """A capture_rng that writes a damaged RNG state into the checkpoint of step 4 (checksums stay right)."""

    def capture(snap: Snapshot, key: str) -> dict[str, Any]:
        out = capture_rng(snap, key)
        if snap.step != 4:
            return out
        if kind == "torch_rng_size":
            out["torch"] = snap.add(f"obj/{key}/torch", torch.get_rng_state()[:100])
        elif kind == "numpy_object_dtype":
            name, arr, *rest = out["numpy"]
            out["numpy"] = (name, {**arr, "__ndarray__": "|O"}, *rest)
        elif kind == "numpy_key_size":
            name, arr, *rest = out["numpy"]
            out["numpy"] = (name, {**arr, "shape": [623], "data": arr["data"][:-4]}, *rest)
        elif kind == "python_state_shape":
            out["python"] = (3, (1, 2, 3), None)
        return out

    return capture


@pytest.mark.parametrize(("kind", "message"), [
    ("torch_rng_size", "the torch RNG state is [100] torch.uint8, expected a uint8 tensor of 5056 bytes"),
    ("numpy_object_dtype", "holds a NumPy array of dtype '|O'; only plain numeric dtypes are restored"),
    ("numpy_key_size", "the NumPy random state is not ('MT19937', 624 uint32 words"),
    ("python_state_shape", "the Python random state is malformed"),
])
@pytest.mark.parametrize("backend", ["native", "torch_save"])
def test_a_damaged_rng_state_falls_back_to_the_previous_checkpoint_and_prunes_nothing(
        env: Path, logs: Callable[[], str], monkeypatch: pytest.MonkeyPatch, kind: str, message: str, backend: str) -> None:
    monkeypatch.setenv("RAVEX_BACKEND", backend)
    with monkeypatch.context() as m:
        m.setattr(statemod, "capture_rng", damage_rng(kind))

        @ravex.train_loop
        def run() -> None:
            train(4)

        run()
    if backend == "native":
        before = listed(env)
        assert [s for _, s in before] == [2, 4]
        good_index = before[0][0]
        good = ravex_convert.load_state_dict(env, index=good_index)
        good_rng = load_checkpoint(env, good_index)[1]["obj/rng/torch"]
    else:
        files = sorted(env.glob("ckpt-*.pt"))
        assert len(files) == 2
        good_index = 0
        ckpt, tensors = load_torch_save(files[0])
        good = {k[len("model/"):]: v for k, v in tensors.items() if k.startswith("model/")}
        good_rng = ckpt.objects["rng"]["torch"]

    monkeypatch.setenv("RAVEX_KEEP_LAST", "1")  # would prune every older checkpoint after the first write
    seen: dict[str, Any] = {}

    @ravex.train_loop
    def again() -> None:
        train(4, seen=seen)

    again()
    text = logs()
    assert f"checkpoint {good_index + 1} (step 4) of {env} cannot be restored into this run" in text and message in text, text
    assert f"falling back to checkpoint {good_index} (step 2)" in text
    # Exactly the fallback checkpoint's state, not the damaged one's, nor a fresh one's.
    assert seen["step"] == 2 and seen["steps"] == [3, 4, 5, 6]
    assert seen["weights"].keys() == good.keys() and all(torch.equal(seen["weights"][k], good[k]) for k in good)
    assert not all(torch.equal(seen["weights"][k], seen["initial"][k]) for k in good)
    assert torch.equal(seen["torch_rng"], good_rng)
    assert "keep_last is not applied in this run" in text
    if backend == "native":
        after = listed(env)
        assert after[:2] == before  # the damaged one and the good one are both still there
        assert [s for _, s in after[2:]] == [4, 6]
    else:
        assert len(list(env.glob("ckpt-*.pt"))) == 4


def test_a_run_resumed_from_its_newest_checkpoint_prunes_again(env: Path, logs: Callable[[], str], monkeypatch: pytest.MonkeyPatch) -> None:
    with monkeypatch.context() as m:
        m.setattr(statemod, "capture_rng", damage_rng("torch_rng_size"))

        @ravex.train_loop
        def run() -> None:
            train(4)

        run()

    @ravex.train_loop
    def again(steps: int) -> None:
        train(steps)

    again(4)  # falls back to step 2, trains to 6; prunes nothing
    assert [s for _, s in listed(env)] == [2, 4, 4, 6]
    monkeypatch.setenv("RAVEX_KEEP_LAST", "2")
    again(2)  # resumes from the newest (step 6): keep_last applies again
    assert [s for _, s in listed(env)] == [6, 8]


# ---------------------------------------------------------------- applying fails midway: put back, then fall back or stop


class Counter:
    """A tracked object whose load_state_dict changes itself, then may fail."""

    def __init__(self, fail: str = "never") -> None:
        self.n = torch.zeros(())
        self.fail = fail

    def state_dict(self) -> dict[str, Any]:
        return {"n": self.n.clone()}

    def load_state_dict(self, sd: dict[str, Any]) -> None:
        self.n = sd["n"].clone()
        if self.fail == "always" or (self.fail == "saved" and float(sd["n"]) > 0):
            raise ValueError("Counter refuses this state")


def counted_run(steps: int, counter: Counter, seen: dict[str, Any]) -> None:
    model = build()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    ravex.track(counter, name="counter")
    seen["initial"] = {k: v.detach().clone() for k, v in model.state_dict().items()}
    seen["model"] = model
    for _ in range(steps):
        ravex.batch_boundary()
        model(torch.ones(2, 4)).sum().backward()
        opt.step()
        opt.zero_grad()
        counter.n += 1


@pytest.mark.parametrize("fail", ["saved", "always"])
def test_a_restore_failing_midway_puts_the_objects_back_and_stops(env: Path, fail: str) -> None:
    @ravex.train_loop
    def run() -> None:
        counted_run(4, Counter(), {})

    run()
    before = listed(env)
    seen: dict[str, Any] = {}
    counter = Counter(fail)

    @ravex.train_loop
    def again() -> None:
        counted_run(4, counter, seen)

    with pytest.raises(ResumeError) as info:
        again()
    err = str(info.value)
    if fail == "saved":
        # Model and optimizer were loaded before the counter failed: all put back, then the older one failed the same way.
        assert "restoring failed midway (ValueError: Counter refuses this state); the live objects were put back as they were" in err, err
        model = seen["model"]
        assert all(torch.equal(v, seen["initial"][k]) for k, v in model.state_dict().items())
        assert float(counter.n) == 0
    else:
        assert "the live objects could not be put back" in err and "so the run stops" in err, err
    assert listed(env) == before


def test_after_a_failed_restore_no_iteration_goes_on_even_if_the_error_is_caught(env: Path) -> None:
    first_run(env)
    steps: list[int] = []

    @ravex.train_loop
    def again() -> None:
        model = build("renamed")
        opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
        loader = torch.utils.data.DataLoader(torch.utils.data.TensorDataset(torch.randn(8, 4)), batch_size=2)
        for _ in range(2):
            try:
                for (x,) in loader:
                    model(x).sum().backward()
                    opt.step()
                    steps.append(1)
            except ResumeError:
                pass  # a careless script that swallows it
        ravex.batch_boundary()

    with pytest.raises(ResumeError):
        again()
    assert steps == []


# ---------------------------------------------------------------- the store itself


def test_a_store_whose_checkpoints_are_all_damaged_is_refused_before_training(env: Path) -> None:
    first_run(env)
    for f in sorted((env / "checkpoints").rglob("*.safetensors")):
        raw = bytearray(f.read_bytes())
        raw[-1] ^= 0xFF
        f.write_bytes(bytes(raw))
    ran: list[int] = []

    @ravex.train_loop
    def again() -> None:
        ran.append(1)

    with pytest.raises(ResumeError, match="no checkpoint of the store can be resumed from") as info:
        again()
    assert "checksum mismatch" in str(info.value) and "RAVEX_FRESH=1" in str(info.value)
    assert ran == []


@pytest.mark.parametrize("left", ["both", "manifest", "checkpoints"])
def test_a_store_without_its_marker_is_refused_not_taken_for_empty(env: Path, left: str) -> None:
    first_run(env)
    (env / "ravex-store.json").unlink()
    if left == "manifest":
        import shutil

        shutil.rmtree(env / "checkpoints")
    elif left == "checkpoints":
        (env / "manifest.json").unlink()
    before = sorted(str(p.relative_to(env)) for p in env.rglob("*"))
    ran: list[int] = []

    @ravex.train_loop
    def again() -> None:
        ran.append(1)
        train(2)

    with pytest.raises(IncompleteCheckpointError) as info:
        again()
    err = str(info.value)
    held = {"both": "manifest.json and checkpoints", "manifest": "manifest.json", "checkpoints": "checkpoints"}[left]
    assert f"storage.path {env} holds {held} of a Ravex store but not its marker ravex-store.json" in err, err
    assert "hint: if it is your store, put its ravex-store.json back" in err
    assert ran == []
    assert sorted(str(p.relative_to(env)) for p in env.rglob("*")) == before


def test_an_empty_checkpoints_directory_alone_is_still_a_fresh_start(env: Path) -> None:
    (env / "checkpoints").mkdir(parents=True)

    @ravex.train_loop
    def run() -> None:
        train(2)

    run()
    assert [s for _, s in listed(env)] == [2]


# ---------------------------------------------------------------- max_steps after Ravex switched itself off


@pytest.mark.parametrize("loop", ["dataloader", "batch_boundary"])
def test_max_steps_is_enforced_after_a_failing_write_disables_ravex(env: Path, logs: Callable[[], str], monkeypatch: pytest.MonkeyPatch,
                                                                     loop: str) -> None:
    from ravex_convert.formats.native import writer as native_write

    monkeypatch.setenv("RAVEX_MAX_STEPS", "12")

    def broken(*a: Any, **k: Any) -> Any:
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(native_write, "write", broken)
    steps: list[int] = []
    status: dict[str, Any] = {}

    def one(model: torch.nn.Module, opt: torch.optim.Optimizer, x: torch.Tensor) -> None:
        model(x).sum().backward()
        opt.step()
        opt.zero_grad()
        steps.append(ravex.step())
        ravex.flush()  # the failing write has disabled Ravex before the next batch

    @ravex.train_loop
    def run() -> None:
        model = torch.nn.Linear(4, 1)
        opt = torch.optim.SGD(model.parameters(), lr=0.1)
        data = torch.randn(16, 4)
        if loop == "dataloader":
            loader = torch.utils.data.DataLoader(torch.utils.data.TensorDataset(data), batch_size=2)  # 8 batches an epoch
            for _ in range(3):
                for (x,) in loader:
                    one(model, opt, x)
        else:
            for n in range(24):
                ravex.batch_boundary()
                one(model, opt, data[n % 8 * 2:n % 8 * 2 + 2])
        status.update(ravex.status())

    run()
    assert steps == list(range(1, 13)), steps
    if status:  # the batch_boundary loop ends by returning from the function at its boundary
        assert not status["active"] and "checkpoint write failed" in status["error"]
    assert "disabled for the rest of this run: checkpoint write failed" in logs() and "training continues without checkpoints" in logs()


def test_objects_tracked_without_a_name_are_saved_and_restored(env: Path) -> None:
    """``ravex.track(obj)`` names each object by its type and its place: two counters tracked
    that way come back to their own values in the resumed run."""
    firsts: list[Counter] = []

    def body(steps: int, out: list[Counter]) -> None:
        a, b = Counter(), Counter()
        ravex.track(a)
        ravex.track(b)
        out += [a, b]
        model = build()
        opt = torch.optim.SGD(model.parameters(), lr=0.1)
        for _ in range(steps):
            ravex.batch_boundary()
            model(torch.ones(2, 4)).sum().backward()
            opt.step()
            opt.zero_grad()
            a.n += 1
            b.n += 10

    ravex.train_loop(lambda: body(4, firsts))()
    assert [float(c.n) for c in firsts] == [4, 40]
    again: list[Counter] = []
    ravex.train_loop(lambda: body(1, again))()  # restored at its first boundary, then one step more
    assert [float(c.n) for c in again] == [5, 50]
