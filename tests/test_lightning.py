"""PyTorch Lightning checkpoints, written by Lightning itself and loaded back by its own loaders.

The sources are made here by ``Trainer.save_checkpoint`` after a few steps on CPU
(tests/_lightning_model.py: Adam with a StepLR scheduler, one or two param groups, a
callback with a tensor in its state; a module with two optimizers). What is checked:
a torch_save output of a Lightning ``.ckpt`` is the source's own tree (every key where
it was, tensors bit-identical, the optimizers keyed by position again); it loads with
``load_from_checkpoint`` and resumes with ``Trainer.fit(ckpt_path=...)`` exactly as the
source does; it survives a Ravex store and a DCP; ``--layout lightning`` turns a
DeepSpeed ZeRO fixture into a ``.ckpt`` that ``load_from_checkpoint`` takes.
"""

from __future__ import annotations

import warnings
from collections import OrderedDict
from pathlib import Path
from typing import Any

import lightning as L
import pytest
import torch
from _lightning_model import Counter, LitTinyLM, Tiny, TwoOptimizers, loader
from conftest import DATA, run_ravex
from torch.distributed.checkpoint.filesystem import FileSystemReader

import ravex_convert
from ravex_convert import ConvertOptions, CorruptCheckpointError, RavexError


def quiet(fn: Any, *args: Any, **kwargs: Any) -> Any:
    with warnings.catch_warnings():  # Lightning warns about CPU, workers, deprecations of its own
        warnings.simplefilter("ignore")
        return fn(*args, **kwargs)


def trainer(steps: int) -> L.Trainer:
    return quiet(L.Trainer, max_steps=steps, accelerator="cpu", logger=False, enable_progress_bar=False, enable_checkpointing=False,
                 enable_model_summary=False, callbacks=[Counter()])


def same(a: torch.Tensor, b: torch.Tensor) -> bool:
    return a.dtype == b.dtype and a.shape == b.shape and torch.equal(a.reshape(-1).view(torch.uint8), b.reshape(-1).view(torch.uint8))


def assert_same_tree(want: Any, got: Any, where: str = "") -> int:
    """The same nesting, keys, types and values at every level, tensors bit for bit; the number of tensors compared."""
    if isinstance(want, torch.Tensor):
        assert isinstance(got, torch.Tensor) and same(want, got), where
        return 1
    assert type(got) is type(want), (where, type(want), type(got))
    if isinstance(want, dict):
        assert set(got) == set(want), (where, sorted(map(str, want)), sorted(map(str, got)))
        return sum(assert_same_tree(v, got[k], f"{where}/{k}") for k, v in want.items())
    if isinstance(want, (list, tuple)):
        assert len(got) == len(want), where
        return sum(assert_same_tree(v, g, f"{where}/{i}") for i, (v, g) in enumerate(zip(want, got)))
    assert got == want, (where, want, got)
    return 0


def load(path: Path) -> dict[str, Any]:
    loaded: dict[str, Any] = torch.load(path, weights_only=True)
    return loaded


@pytest.fixture(scope="module")
def made(tmp_path_factory: pytest.TempPathFactory) -> dict[int, tuple[Path, dict[str, torch.Tensor]]]:
    """groups -> (the .ckpt Lightning saved after 3 steps, the trained module's weights)."""
    out = {}
    for groups in (1, 2):
        torch.manual_seed(0)
        module = Tiny(groups=groups)
        t = trainer(3)
        quiet(t.fit, module, loader())
        path = tmp_path_factory.mktemp(f"lightning{groups}") / "last.ckpt"
        quiet(t.save_checkpoint, path)
        out[groups] = (path, OrderedDict((k, v.detach().clone()) for k, v in module.state_dict().items()))
    return out


def resumed(ckpt: Path, groups: int) -> tuple[dict[str, torch.Tensor], dict[str, Any], dict[str, Any], int]:
    """One more step from ``ckpt`` with Lightning's own resume: weights, optimizer state, the callback's state, the global step."""
    module = Tiny(groups=groups)
    t = trainer(4)
    quiet(t.fit, module, loader(), ckpt_path=ckpt)
    counter = next(c for c in t.callbacks if isinstance(c, Counter))  # type: ignore[attr-defined]
    return module.state_dict(), t.optimizers[0].state_dict(), counter.state_dict(), t.global_step


def assert_resumes_like(src: Path, out: Path, groups: int) -> None:
    theirs, ours = resumed(src, groups), resumed(out, groups)
    assert theirs[3] == ours[3] == 4  # the loops were restored: one step, not four from the start
    assert assert_same_tree(theirs[0], ours[0]) == 4
    assert assert_same_tree(theirs[1], ours[1]) == 12 and assert_same_tree(theirs[2], ours[2]) == 1
    assert ours[2]["count"] == 4
    start = load(src)["state_dict"]
    assert not any(same(start[k], v) for k, v in ours[0].items())  # and the step changed every weight


def test_inspect_names_the_parts(made: dict[int, tuple[Path, dict[str, torch.Tensor]]]) -> None:
    path, weights = made[2]
    info = ravex_convert.inspect(path)
    assert (info.format, info.variant, info.step) == ("torch_save", "training_state", 3)
    assert {t.name for t in info.model_tensors} == set(weights) and info.num_params == sum(v.numel() for v in weights.values())
    assert info.optimizer is not None and (info.optimizer.kind, info.optimizer.param_groups) == ("Adam", 2)
    assert info.extra["state_layout"] == {"model": "state_dict", "optimizer": "optimizer_states.0", "optimizer_form": "nested",
                                          "optimizer_keys": "position"}
    assert info.extra["lightning"] == {"version": L.__version__, "optimizers": 1,
                                       "state": ["epoch", "global_step", "loops", "callbacks", "lr_schedulers", "hparams_name", "hyper_parameters"]}
    assert any("PyTorch Lightning checkpoint" in r for r in info.reasons)


@pytest.mark.parametrize("groups", [1, 2])
def test_to_torch_save_gives_back_the_source_tree(made: dict[int, tuple[Path, dict[str, torch.Tensor]]], tmp_path: Path, groups: int) -> None:
    src = made[groups][0]
    res = ravex_convert.convert(src, tmp_path / "out.ckpt", "torch_save")
    want, got = load(src), load(tmp_path / "out.ckpt")
    # 4 weights, 4 x (step, exp_avg, exp_avg_sq), the callback's tensor
    assert assert_same_tree(want, got) == 4 + 12 + 1
    assert list(got["optimizer_states"][0]["state"]) == [0, 1, 2, 3]
    assert [g["params"] for g in got["optimizer_states"][0]["param_groups"]] == ([[0, 1, 2, 3]] if groups == 1 else [[0, 1], [2, 3]])
    assert got["callbacks"]["Counter"]["count"] == 3 and "step" not in got and "model" not in got
    assert res["tensors"] == 17


def test_the_cli_gives_back_the_source_tree(made: dict[int, tuple[Path, dict[str, torch.Tensor]]], tmp_path: Path) -> None:
    src = made[2][0]
    res = run_ravex("convert", src, tmp_path / "out.ckpt", "--to", "torch_save")
    assert res.returncode == 0, res.stderr
    assert assert_same_tree(load(src), load(tmp_path / "out.ckpt")) == 17
    assert run_ravex("verify", src, tmp_path / "out.ckpt").returncode == 0


@pytest.mark.parametrize("groups", [1, 2])
def test_the_output_loads_and_resumes_as_the_source_does(made: dict[int, tuple[Path, dict[str, torch.Tensor]]], tmp_path: Path,
                                                        groups: int) -> None:
    src, weights = made[groups]
    out = tmp_path / "out.ckpt"
    ravex_convert.convert(src, out, "torch_save")
    module = quiet(Tiny.load_from_checkpoint, out)
    assert module.hparams["groups"] == groups
    assert assert_same_tree(weights, module.state_dict()) == 4
    assert_resumes_like(src, out, groups)


def test_through_a_ravex_store_and_back(made: dict[int, tuple[Path, dict[str, torch.Tensor]]], tmp_path: Path) -> None:
    src, weights = made[2]
    store, out = tmp_path / "store", tmp_path / "out.ckpt"
    ravex_convert.convert(src, store, "native", ConvertOptions(world_size=2))
    ravex_convert.convert(store, out, "torch_save")
    assert assert_same_tree(load(src), load(out)) == 17
    assert assert_same_tree(weights, quiet(Tiny.load_from_checkpoint, out).state_dict()) == 4
    assert_resumes_like(src, out, 2)


def test_through_dcp_in_the_portable_layout_and_back(made: dict[int, tuple[Path, dict[str, torch.Tensor]]], tmp_path: Path) -> None:
    """DCP's loaders key optimizer state by name: a Lightning source goes into DCP as {"model", "optim", ...}
    (said in a note), and --layout lightning makes the .ckpt again, which resumes as the source does."""
    src = made[2][0]
    res = ravex_convert.convert(src, tmp_path / "dcp", "dcp", ConvertOptions(world_size=2))
    assert any("'optimizer_states.0', keyed by position" in n and "portable layout" in n for n in res["notes"])
    keys = set(FileSystemReader(str(tmp_path / "dcp")).read_metadata().state_dict_metadata)
    assert {"model.net.0.weight", "optim.state.net.0.weight.exp_avg", "optim.param_groups.1.lr", "lr_schedulers.0.last_epoch",
            "pytorch-lightning_version", "callbacks.Counter.total"} <= keys
    assert not any(k.startswith(("state_dict.", "optimizer_states.")) for k in keys)
    out = tmp_path / "out.ckpt"
    ravex_convert.convert(tmp_path / "dcp", out, "torch_save", writer={"layout": "lightning"})
    want, got = load(src), load(out)
    assert set(got) == set(want)
    assert assert_same_tree(want["state_dict"], got["state_dict"]) == 4
    assert assert_same_tree(want["optimizer_states"], got["optimizer_states"]) == 12
    assert_resumes_like(src, out, 2)


def test_two_optimizers_are_both_kept(tmp_path: Path) -> None:
    torch.manual_seed(0)
    t = trainer(3)
    quiet(t.fit, TwoOptimizers(), loader())
    src = tmp_path / "two.ckpt"
    quiet(t.save_checkpoint, src)
    assert ravex_convert.inspect(src).extra["lightning"]["optimizers"] == 2
    for via in ("direct", "store"):
        out = tmp_path / f"{via}.ckpt"
        if via == "store":
            ravex_convert.convert(src, tmp_path / "store", "native")
            ravex_convert.convert(tmp_path / "store", out, "torch_save")
        else:
            ravex_convert.convert(src, out, "torch_save")
        got = load(out)
        # Adam: 2 x (step, exp_avg, exp_avg_sq); SGD: 2 momentum buffers; 4 weights
        assert assert_same_tree(load(src), got) == 4 + 6 + 2 + 1
        assert list(got["optimizer_states"][1]["state"]) == [0, 1]
        quiet(TwoOptimizers.load_from_checkpoint, out)


def test_a_zero_checkpoint_as_a_lightning_ckpt(tmp_path: Path) -> None:
    """No Lightning state in a DeepSpeed save: the weights and the optimizer (by position, in the
    order of the module's param groups) and the scheduler, and a note that loops are missing."""
    src = DATA / "zero2_ws2_fp32" / "checkpoint"
    out = tmp_path / "lit.ckpt"
    res = run_ravex("convert", src, out, "--to", "torch_save", "--layout", "lightning")
    assert res.returncode == 0, res.stderr
    assert "Lightning's layout" in res.stderr and "no Lightning loop state (loops)" in res.stderr
    got = load(out)
    assert {"state_dict", "optimizer_states", "lr_schedulers", "pytorch-lightning_version", "global_step"} <= set(got)
    assert "model" not in got and "optim" not in got and "lr_scheduler" not in got
    module = quiet(LitTinyLM.load_from_checkpoint, out)  # strict: every name of the module, and no other
    weights = ravex_convert.load_state_dict(src)
    assert assert_same_tree(weights, {k: v for k, v in module.state_dict().items() if k in weights}) == len(weights)
    assert set(module.state_dict()) == set(weights)
    optimizer = module.configure_optimizers()
    optimizer.load_state_dict(got["optimizer_states"][0])  # position i is the i-th parameter of the module's groups
    names = {id(p): n for n, p in module.named_parameters()}
    want = ravex_convert.load_state_dict(src, optimizer=True)["optim"]["state"]
    assert len(optimizer.state) == len(want) > 0
    for p, per in optimizer.state.items():
        assert same(per["exp_avg"], want[names[id(p)]]["exp_avg"]), names[id(p)]
    assert got["lr_schedulers"][0]["last_epoch"] == 3


def test_layout_is_a_torch_save_option(made: dict[int, tuple[Path, dict[str, torch.Tensor]]], tmp_path: Path) -> None:
    with pytest.raises(RavexError, match="--layout lightning: not a dcp layout"):
        ravex_convert.convert(made[1][0], tmp_path / "d", "dcp", writer={"layout": "lightning"})
    ravex_convert.convert(made[1][0], tmp_path / "p.pt", "torch_save", writer={"layout": "portable"})
    assert {"model", "optim", "step", "loops"} <= set(load(tmp_path / "p.pt"))
    assert list(tmp_path.iterdir()) == [tmp_path / "p.pt"]


def test_optimizer_states_not_a_list_is_refused(made: dict[int, tuple[Path, dict[str, torch.Tensor]]], tmp_path: Path) -> None:
    state = load(made[1][0])
    state["optimizer_states"] = {"adam": state["optimizer_states"][0]}
    bad = tmp_path / "bad.ckpt"
    torch.save(state, bad)
    out = tmp_path / "out.ckpt"
    with pytest.raises(CorruptCheckpointError) as err:
        ravex_convert.convert(bad, out, "torch_save")
    assert err.value.message == (f"{bad}: a Lightning checkpoint whose 'optimizer_states' is a dict, not a list of optimizer state dicts "
                                 "(one per optimizer, as Trainer.save_checkpoint writes it)")
    assert err.value.hint is not None and "--weights-only" in err.value.hint
    res = run_ravex("convert", bad, out, "--to", "torch_save")
    assert res.returncode == 6 and res.stderr.count("error: ") == 1 and "hint: " in res.stderr and str(bad) in res.stderr
    assert not out.exists() and sorted(tmp_path.iterdir()) == [bad]
    # the weights alone, as the hint says: a weights-only .ckpt that load_from_checkpoint takes
    res = run_ravex("convert", bad, out, "--to", "torch_save", "--weights-only", "--layout", "lightning")
    assert res.returncode == 0, res.stderr
    assert set(load(out)) == {"state_dict", "pytorch-lightning_version", "global_step"}
    assert assert_same_tree(made[1][1], quiet(Tiny.load_from_checkpoint, out).state_dict()) == 4
