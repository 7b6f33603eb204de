"""Recipes (issue 34): a checkpoint that rebuilds its own model, safely.

Three models are trained a few steps under the decorator, in this process (tests/_recipe_models.py:
a class with keyword arguments and an EMA of it tracked by name, a ``ravex_recipe()`` factory, a
Hugging Face GPT-2 built from its config, nothing downloaded), then rebuilt by
``ravex.load_model`` in a fresh interpreter that has no training script: class, arguments or
config, and weights bit-identical. The refusals are checked in this process, each one error
naming what it refused; the untrusted package also in the fresh interpreter, where nothing of it
may have been imported.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import _recipe_models
import pytest
import torch
from _recipe_models import Net, Wraps, make_blocks
from conftest import run_ravex

import ravex
from ravex_convert._output import Options
from ravex_convert.errors import CorruptCheckpointError, LayoutMismatchError, RavexError
from ravex_convert.formats.native import reader as native
from ravex_convert.formats.native import writer as native_write
from ravex_convert.model import Box, Checkpoint, Chunk, LogicalTensor
from ravex_runtime.errors import RecipeError, UntrustedRecipeError
from ravex_runtime.loading import load_checkpoint

TESTS = Path(__file__).resolve().parent


def _net_args() -> dict[str, Any]:
    return {"width": 8, "depth": 2, "act": "gelu", "sizes": [3, 5], "extra": {"scale": 0.5}, "shape": (4, 1), "dtype": torch.float32,
            "device": torch.device("cpu")}


def _training(store: Path, build: Callable[[], tuple[torch.nn.Module, Callable[[torch.nn.Module], torch.Tensor]]],
              steps: int = 4, during: Callable[[], None] | None = None) -> torch.nn.Module:
    """Train what ``build`` makes for ``steps`` steps under the decorator, checkpointing into ``store``."""
    env = {"RAVEX_STORAGE_PATH": str(store), "RAVEX_CHECKPOINT_EVERY": "2", "RAVEX_KEEP_LAST": "10", "HF_HUB_OFFLINE": "1"}
    with pytest.MonkeyPatch.context() as mp:
        for k in [k for k in os.environ if k.startswith("RAVEX_")]:
            mp.delenv(k)
        for k, v in env.items():
            mp.setenv(k, v)

        @ravex.train_loop
        def run() -> torch.nn.Module:
            torch.manual_seed(0)
            model, loss_of = build()
            opt = torch.optim.AdamW(model.parameters(), lr=0.05)
            for i in range(steps):
                ravex.batch_boundary()
                if i == 0 and during is not None:
                    during()
                loss_of(model).backward()
                opt.step()
                opt.zero_grad()
            return model

        out: torch.nn.Module = run()
    return out


def _net() -> tuple[torch.nn.Module, Callable[[torch.nn.Module], torch.Tensor]]:
    model = Net(**_net_args())
    ema = Net(**_net_args())
    ravex.track(ema, name="ema")
    x = torch.randn(8, 4)

    def loss(m: torch.nn.Module) -> torch.Tensor:
        out: torch.Tensor = m(x).pow(2).mean()
        with torch.no_grad():
            for e, p in zip(ema.parameters(), m.parameters()):
                e.lerp_(p, 0.5)
        return out
    return model, loss


def _blocks() -> tuple[torch.nn.Module, Callable[[torch.nn.Module], torch.Tensor]]:
    x = torch.randn(8, 6)
    return make_blocks(width=6, depth=3), lambda m: m(x).pow(2).mean()


def _gpt2() -> tuple[torch.nn.Module, Callable[[torch.nn.Module], torch.Tensor]]:
    from transformers import GPT2Config, GPT2LMHeadModel

    config = GPT2Config(n_layer=2, n_embd=16, n_head=2, vocab_size=64, n_positions=16, bos_token_id=0, eos_token_id=0)
    ids = torch.randint(0, 64, (2, 8))
    return GPT2LMHeadModel(config), lambda m: m(input_ids=ids, labels=ids).loss


@pytest.fixture(scope="module")
def trained(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    """The three runs: their stores, and what a rebuild must equal (the live models at the end)."""
    root = tmp_path_factory.mktemp("recipes")
    out: dict[str, Any] = {"root": root}
    for name, build in (("net", _net), ("blocks", _blocks), ("gpt2", _gpt2)):
        out[name] = _training(root / name, build)
    return out


@pytest.fixture(scope="module")
def fresh(trained: dict[str, Any]) -> dict[str, Any]:
    """One fresh interpreter, no training script, PYTHONPATH=tests: refused loads first (what they
    left imported), then every rebuild; the rebuilt modules come back as a torch.save file."""
    root: Path = trained["root"]
    code = r'''
import json, sys, torch, ravex
root = sys.argv[1]
out = {}
def refused(key, store, **kw):
    try:
        ravex.load_model(f"{root}/{store}", **kw)
        out[key] = None
    except ravex.RavexError as exc:
        out[key] = [type(exc).__name__, str(exc)]
refused("untrusted", "net")
refused("untrusted_gpt2", "gpt2", trust=["_recipe_models"])
out["imported_after_refusal"] = sorted(m for m in ("_recipe_models", "transformers") if m in sys.modules)
net = ravex.load_model(f"{root}/net", trust=["_recipe_models"])
ema = ravex.load_model(f"{root}/net", name="ema", trust=["_recipe_models"])
blocks = ravex.load_model(f"{root}/blocks", trust=["_recipe_models"])
gpt2 = ravex.load_model(f"{root}/gpt2", trust=["transformers"])
out["types"] = {k: f"{type(m).__module__}.{type(m).__qualname__}" for k, m in dict(net=net, ema=ema, blocks=blocks, gpt2=gpt2).items()}
out["net_args"] = [net.width, net.depth, net.act, [str(p.dtype) for p in net.parameters()][0]]
out["gpt2_config"] = gpt2.config.to_dict()
out["tied"] = gpt2.lm_head.weight is gpt2.transformer.wte.weight
torch.save({k: m.state_dict() for k, m in dict(net=net, ema=ema, blocks=blocks, gpt2=gpt2).items()}, f"{root}/rebuilt.pt")
print(json.dumps(out))
'''
    env = dict(os.environ, PYTHONPATH=str(TESTS), HF_HUB_OFFLINE="1", OMP_NUM_THREADS="1")
    res = subprocess.run([sys.executable, "-P", "-c", code, str(root)], capture_output=True, text=True, env=env, cwd=root, timeout=120, check=False)
    assert res.returncode == 0, res.stderr
    doc: dict[str, Any] = json.loads(res.stdout)
    doc["rebuilt"] = torch.load(root / "rebuilt.pt", weights_only=True)
    return doc


def _same_weights(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> None:
    assert list(a) == list(b)
    for k, t in a.items():
        assert t.dtype == b[k].dtype and torch.equal(t, b[k]), k


def _recipes(store: Path) -> dict[str, Any]:
    out: dict[str, Any] = native.read(store).objects["recipes"]
    return out


# ---------------------------------------------------------------- recorded, stored, rebuilt


def test_a_class_with_keyword_arguments_is_rebuilt_in_a_fresh_interpreter(trained: dict[str, Any], fresh: dict[str, Any]) -> None:
    entry = _recipes(trained["root"] / "net")["modules"]["model"]
    assert entry["call"] == "_recipe_models.Net" and entry["kind"] == "class" and entry["weights"] == "model/"
    # every argument by name, as given: the list before __init__ appended to it, the tuple, dtype and device typed
    assert entry["kwargs"] == {"width": 8, "depth": 2, "act": "gelu", "sizes": [3, 5], "extra": {"scale": 0.5},
                               "shape": {"__recipe__": "tuple", "items": [4, 1]}, "dtype": {"__recipe__": "torch.dtype", "value": "float32"},
                               "device": {"__recipe__": "torch.device", "value": "cpu"}}
    assert fresh["types"]["net"] == "_recipe_models.Net"
    assert fresh["net_args"] == [8, 2, "gelu", "torch.float32"]
    _same_weights(fresh["rebuilt"]["net"], trained["net"].state_dict())


def test_a_module_tracked_by_name_is_rebuilt_by_that_name(trained: dict[str, Any], fresh: dict[str, Any]) -> None:
    entry = _recipes(trained["root"] / "net")["modules"]["ema"]
    assert entry["call"] == "_recipe_models.Net" and entry["weights"] == "obj/model.1/"
    assert fresh["types"]["ema"] == "_recipe_models.Net"
    ema = ravex.load_model(trained["root"] / "net", name="ema", trust=["_recipe_models"])
    _same_weights(fresh["rebuilt"]["ema"], ema.state_dict())
    assert not torch.equal(fresh["rebuilt"]["ema"]["inp.weight"], fresh["rebuilt"]["net"]["inp.weight"])  # its own weights, not the model's


def test_a_ravex_recipe_factory_wins_and_is_rebuilt(trained: dict[str, Any], fresh: dict[str, Any]) -> None:
    entry = _recipes(trained["root"] / "blocks")["modules"]["model"]
    assert (entry["call"], entry["kind"], entry["kwargs"], entry["from"]) == ("_recipe_models.make_blocks", "factory", {"width": 6, "depth": 3},
                                                                            "ravex_recipe")
    assert fresh["types"]["blocks"] == "_recipe_models.Blocks"
    _same_weights(fresh["rebuilt"]["blocks"], trained["blocks"].state_dict())


def test_a_hugging_face_model_is_rebuilt_from_its_config(trained: dict[str, Any], fresh: dict[str, Any]) -> None:
    live = trained["gpt2"]
    entry = _recipes(trained["root"] / "gpt2")["modules"]["model"]
    assert entry["call"] == "transformers.models.gpt2.modeling_gpt2.GPT2LMHeadModel"
    assert entry["kwargs"]["config"]["class"] == "transformers.models.gpt2.configuration_gpt2.GPT2Config"
    assert fresh["types"]["gpt2"] == "transformers.models.gpt2.modeling_gpt2.GPT2LMHeadModel"
    assert fresh["gpt2_config"] == json.loads(json.dumps(live.config.to_dict()))  # both as JSON (id2label's keys)
    assert fresh["tied"]  # built by the class itself: its tied embedding is tied again
    _same_weights(fresh["rebuilt"]["gpt2"], live.state_dict())


def test_an_older_checkpoint_and_another_storage_and_world_size(trained: dict[str, Any], tmp_path: Path) -> None:
    store = trained["root"] / "net"
    older = ravex.load_model(store, index=0, trust=["_recipe_models"])
    _, tensors = load_checkpoint(store, 0)
    _same_weights(older.state_dict(), {k[len("model/"):]: v for k, v in tensors.items() if k.startswith("model/")})
    # the same checkpoint resharded for 4 ranks: the store holds whole logical tensors, any world size loads
    import ravex_convert

    ravex_convert.convert(store, tmp_path / "ws4", to="native", options=ravex_convert.ConvertOptions(world_size=4))
    _same_weights(ravex.load_model(tmp_path / "ws4", trust=["_recipe_models"]).state_dict(), trained["net"].state_dict())
    # a store on object-store semantics (objdir:): the storage layer's path, as the runtime's
    (tmp_path / "bucket").mkdir()
    live = _training(Path(f"objdir:{tmp_path / 'bucket' / 'store'}"), _blocks)
    objdir = ravex.load_model(f"objdir:{tmp_path / 'bucket' / 'store'}", trust=["_recipe_models"])
    _same_weights(objdir.state_dict(), live.state_dict())


def test_a_store_in_a_bucket(trained: dict[str, Any], s3: Any) -> None:
    url = s3.upload(trained["root"] / "net", "store")
    _same_weights(ravex.load_model(url, trust=["_recipe_models"]).state_dict(), trained["net"].state_dict())
    _same_weights(ravex.load_model(url, name="ema", trust=["_recipe_models"]).state_dict(),
                  ravex.load_model(trained["root"] / "net", name="ema", trust=["_recipe_models"]).state_dict())


def test_inspect_shows_each_recipe(trained: dict[str, Any]) -> None:
    res = run_ravex("inspect", trained["root"] / "net")
    assert res.returncode == 0, res.stderr
    assert ("recipe      _recipe_models.Net(width=8, depth=2, act='gelu', sizes=[3, 5], extra={'scale': 0.5}, shape=(4, 1), "
            "dtype=torch.float32, device=torch.device('cpu'))") in res.stdout
    assert "recipe ema  _recipe_models.Net(width=8," in res.stdout
    res = run_ravex("inspect", trained["root"] / "gpt2")
    assert res.returncode == 0, res.stderr
    flat = " ".join(res.stdout.split())  # the table wraps a long value
    assert ("recipe transformers.models.gpt2.modeling_gpt2.GPT2LMHeadModel(config=GPT2Config(embd_pdrop=0.1, layer_norm_epsilon=1e-05, "
            "model_type='gpt2', n_embd=16, n_head=2, n_inner=None, n_layer=2, n_positions=16, ...))") in flat
    res = run_ravex("inspect", trained["root"] / "gpt2", "--json")
    assert res.returncode == 0, res.stderr
    doc = json.loads(res.stdout)
    assert doc["recipes"]["format_version"] == 1
    assert doc["recipes"]["modules"]["model"]["kwargs"]["config"]["value"]["n_embd"] == 16


# ---------------------------------------------------------------- refused


def test_an_untrusted_package_is_refused_and_nothing_is_imported(fresh: dict[str, Any], trained: dict[str, Any]) -> None:
    kind, message = fresh["untrusted"]
    assert kind == "UntrustedRecipeError"
    assert "names _recipe_models.Net, code of the package '_recipe_models', which is not trusted; nothing was imported" in message
    assert "hint: if you trust the code of '_recipe_models' (the checkpoint's recipe runs it), pass trust=['_recipe_models']" in message
    kind, message = fresh["untrusted_gpt2"]  # trusting another package does not trust this one
    assert kind == "UntrustedRecipeError" and "package 'transformers'" in message
    assert fresh["imported_after_refusal"] == []
    with pytest.raises(RavexError, match=r"'my_project\.models' is not a top-level package name"):
        ravex.load_model(trained["root"] / "net", trust=["my_project.models"])


def _crafted(tmp_path: Path, call: str, kwargs: dict[str, Any] | None = None, kind: str = "factory", version: int = 1) -> Path:
    """A store whose recipe was written by hand: what an attacker hands over."""
    ckpt = Checkpoint("crafted", tmp_path, step=1)
    ckpt.add(LogicalTensor("model/weight", (2,), "float32", [Chunk(Box((0,), (2,)), "float32", data=b"\0" * 8)]))
    ckpt.objects = {"recipes": {"format_version": version, "modules": {"model": {
        "weights": "model/", "call": call, "kind": kind, "kwargs": kwargs or {}, "from": "constructor"}}}}
    store = tmp_path / f"crafted-{call.replace('.', '-')}"
    native_write.write(ckpt, store, Options())
    return store


@pytest.mark.parametrize(("call", "kwargs", "trust", "error", "fragment"), [
    ("builtins.exec", {"source": "open('{pwned}', 'w')"}, ["builtins"], RecipeError,
     "builtins.exec is a builtin_function_or_method, neither a torch.nn.Module subclass nor a Python function"),
    ("os.system", {"command": "touch {pwned}"}, ["os"], UntrustedRecipeError, "names os.system, which is defined in 'posix', a package that is not"),
    ("os.makedirs", {"name": "{pwned}"}, ["os"], RecipeError, "os.makedirs is a function whose return annotation does not name a torch.nn.Module"),
    ("os.path.join", {"a": "{pwned}"}, ["os"], UntrustedRecipeError, "which is defined in 'posixpath', a package that is not trusted"),
    ("collections.OrderedDict", {}, ["collections"], RecipeError, "collections.OrderedDict is a class that is not a torch.nn.Module subclass"),
    ("_recipe_models.torch", {}, ["_recipe_models"], RecipeError, "_recipe_models.torch is a module, neither"),
    ("_recipe_models.unannotated", {"width": 4}, ["_recipe_models"], RecipeError, "return annotation does not name a torch.nn.Module subclass"),
    ("_recipe_models.not_a_module", {"width": 4}, ["_recipe_models"], RecipeError, "_recipe_models.not_a_module(...) returned a dict, not a torch.nn.Module"),
    ("os.__builtins__", {}, ["os"], CorruptCheckpointError, "is not a dotted path of identifiers (no part may start with '__')"),
    ("_recipe_models.Net", {"width": {"__recipe__": "pickle"}}, ["_recipe_models"], RecipeError, "has the type 'pickle', which this process has not"),
])
def test_a_crafted_recipe_is_refused_before_anything_runs(tmp_path: Path, call: str, kwargs: dict[str, Any], trust: list[str],
                                                           error: type[RavexError], fragment: str) -> None:
    pwned = tmp_path / "pwned"
    store = _crafted(tmp_path, call, {k: v.format(pwned=pwned) if isinstance(v, str) else v for k, v in kwargs.items()})
    with pytest.raises(error) as exc:
        ravex.load_model(store, trust=trust)
    assert fragment in exc.value.message
    assert exc.value.hint
    assert not pwned.exists()  # nothing was called with the recorded arguments


def test_a_recipe_of_a_newer_format_asks_for_an_upgrade(tmp_path: Path) -> None:
    with pytest.raises(RavexError, match="the recipe object has format_version 2; this Ravex reads 1") as exc:
        ravex.load_model(_crafted(tmp_path, "_recipe_models.Net", version=2), trust=["_recipe_models"])
    assert exc.value.hint == "a newer Ravex wrote it: upgrade Ravex"


def test_a_missing_or_renamed_class_or_changed_arguments_are_clear_errors(trained: dict[str, Any], monkeypatch: pytest.MonkeyPatch,
                                                                         tmp_path: Path) -> None:
    store = trained["root"] / "net"
    with monkeypatch.context() as mp:
        mp.delattr(_recipe_models, "Net")  # renamed since the checkpoint was written
        with pytest.raises(RecipeError, match=r"names _recipe_models\.Net, but _recipe_models has no 'Net' \(renamed or removed"):
            ravex.load_model(store, trust=["_recipe_models"])

    class Renamed(torch.nn.Module):
        def __init__(self, size: int = 4) -> None:
            super().__init__()

    Renamed.__module__ = "_recipe_models"  # as if _recipe_models.Net had changed its arguments

    with monkeypatch.context() as mp:
        mp.setattr(_recipe_models, "Net", Renamed)  # its arguments changed
        with pytest.raises(RecipeError, match=r"the recorded arguments \(width, depth, .*\) do not fit _recipe_models\.Net\(size: 'int' = 4\)"):
            ravex.load_model(store, trust=["_recipe_models"])
    with pytest.raises(RecipeError, match=r"the module gone_project\.models cannot be imported: No module named 'gone_project'") as exc:
        ravex.load_model(_crafted(tmp_path, "gone_project.models.Net", kind="class"), trust=["gone_project"])
    assert "install the package" in (exc.value.hint or "")
    with pytest.raises(RecipeError, match=r"has no recipe for 'nope'; it has: 'model', 'ema'"):
        ravex.load_model(store, name="nope", trust=["_recipe_models"])
    with pytest.raises(LayoutMismatchError, match=r"Net does not match the checkpoint: missing in the checkpoint \['body.0.bias', .*"
                                                  r"in the checkpoint but not in the model \['weight'\]; nothing was loaded"):
        ravex.load_model(_crafted(tmp_path, "_recipe_models.Net", kind="class"), trust=["_recipe_models"])


def _script_init(self: torch.nn.Module, width: int) -> None:
    torch.nn.Module.__init__(self)
    self.lin = torch.nn.Linear(4, width)


# a class as a script defines it: its module is __main__ (no interpreter can import it by name)
_Script = type("Script", (torch.nn.Module,), {"__module__": "__main__", "__init__": _script_init, "__qualname__": "Script"})


def _in_a_function() -> torch.nn.Module:
    class Local(torch.nn.Module):
        def __init__(self, width: int) -> None:
            super().__init__()
            self.lin = torch.nn.Linear(4, width)
    return Local(width=2)


@pytest.mark.parametrize(("build", "cls", "why"), [
    (lambda: Wraps(torch.nn.Linear(4, 1)), "Wraps", "Wraps(): argument 'inner' is a Linear module (a live object), not data"),
    (lambda: _recipe_models.PositionalOnly(4), "PositionalOnly", "PositionalOnly.__init__ has a positional-only parameter 'width'"),
    (lambda: _Script(width=1), "Script", "Script is defined in the script (__main__), which a loader cannot import"),
    (_in_a_function, "_in_a_function.<locals>.Local", "_in_a_function.Local is defined inside a function, which a loader cannot import"),
], ids=["module-argument", "positional-only", "main", "local-class"])
def test_no_recipe_is_said_once_at_start_and_training_goes_on(tmp_path: Path, capsys: pytest.CaptureFixture[str],
                                                              build: Callable[[], torch.nn.Module], cls: str, why: str) -> None:
    said: list[str] = []

    def build_it() -> tuple[torch.nn.Module, Callable[[torch.nn.Module], torch.Tensor]]:
        return build(), lambda m: next(m.parameters()).pow(2).sum()

    _training(tmp_path / "store", build_it, steps=4, during=lambda: said.append(capsys.readouterr().err))
    after = capsys.readouterr().err
    assert f"ravex.load_model cannot rebuild 'model' ({cls}) from this run's checkpoints: {why}; training goes on" in said[0]
    assert "hint: give the class a ravex_recipe() method" in said[0]
    assert (said[0] + after).count("cannot rebuild") == 1  # once, at the first iteration boundary, not at every checkpoint
    assert native.read(tmp_path / "store").step == 4  # training went on, and was checkpointed
    entry = _recipes(tmp_path / "store")["modules"]["model"]
    assert entry == {"weights": "model/", "unavailable": why}
    with pytest.raises(RecipeError, match="no recipe was recorded for 'model'") as exc:
        ravex.load_model(tmp_path / "store", trust=["_recipe_models"])
    assert why in exc.value.message and "ravex_recipe()" in (exc.value.hint or "")


def test_recording_leaves_torch_as_it_was(tmp_path: Path) -> None:
    before = torch.nn.Module.__init__
    _training(tmp_path / "store", _blocks, steps=2)
    assert torch.nn.Module.__init__ is before
    assert "__new__" not in vars(torch.nn.Module)


@pytest.fixture(autouse=True)
def _hf_offline(monkeypatch: pytest.MonkeyPatch) -> Iterator[None]:
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    yield

