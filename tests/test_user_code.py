"""The code users write, under the decorator (issue 41): modules that hash oddly, frameworks reached
late, a framework restore that does not fit, and recipes that must stay data.

- A torchmetrics metric (and any module whose ``__hash__`` fails until its ``__init__`` ends)
  built inside the decorated call leaves Ravex on: checkpoints written, ``max_steps`` kept.
- A framework module loaded lazily inside the call (``transformers.Trainer`` first touched after
  the model is built; ``accelerate`` imported there) is hooked when its import completes (a fresh
  interpreter: this process has imported them already); one that cannot be hooked is said once,
  at ERROR.
- Lightning's fit loop or a callback whose saved state does not load is a warning and a fresh
  start of that piece; ``fit`` raises nothing.
- A constructor argument whose name says secret is never written into a checkpoint and never
  shown; a recorded Hugging Face config's code-loading fields are dropped on rebuild, with
  nothing fetched or imported.
"""

from __future__ import annotations

import json
import logging
import os
import subprocess
import sys
import warnings
from pathlib import Path
from typing import Any

import pytest
import torch
import torchmetrics
from conftest import run_ravex, said

import ravex
from ravex_convert.formats.native import reader as native

TESTS = Path(__file__).resolve().parent


def completed_steps(store: Path) -> list[int]:
    manifest = json.loads((store / "manifest.json").read_text())
    return [int(c["step"]) for c in manifest["checkpoints"] if c.get("status") == "complete"]


def ravex_errors(caplog: pytest.LogCaptureFixture) -> list[str]:
    return [r.getMessage() for r in caplog.records if r.name == "ravex" and r.levelno >= logging.ERROR]


# ---------------------------------------------------------------- modules that hash oddly


class Touchy(torch.nn.Module):
    """A module whose ``__hash__`` and ``__eq__`` read an attribute its ``__init__`` sets last, as
    torchmetrics' Metric does: hashing it inside ``Module.__init__`` raises."""

    def __init__(self) -> None:
        super().__init__()
        self.lin = torch.nn.Linear(4, 1)
        self.ready = True

    def __hash__(self) -> int:
        return hash((type(self), self.__dict__["ready"]))  # KeyError until __init__ ends

    def __eq__(self, other: object) -> bool:
        return self is other and self.__dict__["ready"]

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out: torch.Tensor = self.lin(x)
        return out


def _loop(make_model: Any, with_metric: bool) -> tuple[int, float]:
    """A plain loop over 100 batches that keeps a MeanMetric of its loss; Ravex's max_steps ends it."""
    torch.manual_seed(0)
    model = make_model()
    metric = torchmetrics.MeanMetric() if with_metric else None
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    loader = torch.utils.data.DataLoader(torch.utils.data.TensorDataset(torch.randn(400, 4)), batch_size=4)
    steps = 0
    for (x,) in loader:
        loss = model(x).pow(2).mean()
        loss.backward()
        opt.step()
        opt.zero_grad()
        if metric is not None:
            metric.update(loss.detach())
        steps += 1
    return steps, float(metric.compute()) if metric is not None else 0.0


@pytest.mark.parametrize("case", ["torchmetrics", "hash_raises_in_init"])
def test_a_module_that_hashes_oddly_leaves_ravex_on(env: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture,
                                                    case: str) -> None:
    monkeypatch.setenv("RAVEX_MAX_STEPS", "6")
    make = (lambda: torch.nn.Linear(4, 1)) if case == "torchmetrics" else Touchy

    @ravex.train_loop
    def train() -> tuple[int, float]:
        return _loop(make, with_metric=case == "torchmetrics")

    with said(caplog):
        steps, _ = train()
    assert ravex_errors(caplog) == []
    assert steps == 6, "max_steps was not kept"
    assert completed_steps(env) == [2, 4, 6]


# ---------------------------------------------------------------- frameworks reached late


def _fresh(code: str, tmp: Path) -> subprocess.CompletedProcess[str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("RAVEX_")}
    env.update(RAVEX_STORAGE_PATH=str(tmp / "store"), HF_HUB_OFFLINE="1", OMP_NUM_THREADS="1", PYTHONPATH=str(TESTS))
    return subprocess.run([sys.executable, "-P", "-c", code], capture_output=True, text=True, env=env, cwd=tmp, timeout=180, check=False)


def test_a_lazily_loaded_trainer_and_a_late_accelerate_are_hooked_at_first_use(tmp_path: Path) -> None:
    code = r'''
import json, sys, torch, ravex, transformers
assert "transformers.trainer" not in sys.modules and "accelerate" not in sys.modules
seen = {}

@ravex.train_loop
def train():
    model = torch.nn.Linear(2, 2)                    # the model first, as a script builds it
    trainer_cls = transformers.Trainer               # transformers loads transformers.trainer now
    seen["trainer"] = hasattr(trainer_cls.__init__, "__wrapped__") and hasattr(trainer_cls.train, "__wrapped__")
    import accelerate.data_loader                    # (already imported by transformers.trainer)
    seen["accelerate"] = hasattr(accelerate.data_loader.DataLoaderShard.__iter__, "__wrapped__")
    class Mine(trainer_cls):                         # a subclass defined inside the call
        pass
    seen["subclass"] = hasattr(Mine.__init__, "__wrapped__")
    seen["module_loader"] = type(sys.modules["transformers.trainer"].__loader__).__name__

train()
seen["after"] = hasattr(transformers.Trainer.__init__, "__wrapped__")
seen["finders"] = [type(f).__name__ for f in sys.meta_path]
print(json.dumps(seen))
'''
    res = _fresh(code, tmp_path)
    assert res.returncode == 0, res.stderr
    seen = json.loads(res.stdout.splitlines()[-1])
    assert seen["trainer"] and seen["accelerate"] and seen["subclass"], seen
    assert seen["module_loader"] == "SourceFileLoader", "the module keeps its own loader"
    assert not seen["after"], "the patches outlived the call"
    assert "_Finder" not in seen["finders"], "the import finder outlived the call"
    assert "could not be hooked" not in res.stderr


def test_a_framework_that_cannot_be_hooked_is_said_once_at_error(env: Path, monkeypatch: pytest.MonkeyPatch,
                                                                 caplog: pytest.LogCaptureFixture) -> None:
    import transformers.trainer

    monkeypatch.delattr(transformers.trainer.Trainer, "_load_rng_state")  # as a transformers version without it

    @ravex.train_loop
    def train() -> None:
        torch.nn.Linear(2, 2)  # each module built checks the frameworks again
        torch.nn.Linear(2, 2)

    with said(caplog):
        train()
    errors = [m for m in ravex_errors(caplog) if "could not be hooked" in m]
    assert len(errors) == 1, ravex_errors(caplog)
    assert "transformers is imported but could not be hooked (RavexError: this transformers version has no _load_rng_state)" in errors[0]
    assert "a resumed run trains its whole budget again" in errors[0]


# ---------------------------------------------------------------- a Lightning restore that does not fit


def _lightning_fit(steps: int, counter: Any) -> tuple[Any, Any]:
    import lightning as L
    from _lightning_model import Tiny, loader

    torch.manual_seed(0)
    module = Tiny(groups=1)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        t = L.Trainer(max_steps=steps, accelerator="cpu", logger=False, enable_progress_bar=False, enable_checkpointing=False,
                      enable_model_summary=False, callbacks=[counter])
        t.fit(module, loader())
    return t, module


def _picky() -> Any:
    from _lightning_model import Counter

    class Picky(Counter):  # type: ignore[misc]  # a callback whose state may change shape between two runs
        refuse = False
        state_key = "Picky"

        def load_state_dict(self, state_dict: dict[str, Any]) -> None:
            if Picky.refuse:
                raise KeyError("count")
            super().load_state_dict(state_dict)

    return Picky


@pytest.mark.parametrize("broken", ["none", "fit_loop", "callback"])
def test_a_lightning_state_that_does_not_load_is_a_warning_and_a_fresh_start(env: Path, monkeypatch: pytest.MonkeyPatch,
                                                                              caplog: pytest.LogCaptureFixture, broken: str) -> None:
    from lightning.pytorch.loops.fit_loop import _FitLoop

    picky = _picky()
    train = ravex.train_loop(_lightning_fit)
    train(4, picky())
    assert completed_steps(env)[-1] == 4

    if broken == "fit_loop":  # a state saved by another Lightning version: a progress laid out otherwise
        load = _FitLoop.load_state_dict

        def older(self: Any, state_dict: dict[str, Any], *a: Any, **k: Any) -> None:
            load(self, {**state_dict, "epoch_progress": {"total": state_dict["epoch_progress"]["total"]}}, *a, **k)

        monkeypatch.setattr(_FitLoop, "load_state_dict", older)

    elif broken == "callback":
        picky.refuse = True  # its state changed shape since the run was saved

    counter = picky()
    with said(caplog):
        t, _ = train(6, counter)  # raises nothing into fit
    warned = [r.getMessage() for r in caplog.records if r.name == "ravex" and r.levelno == logging.WARNING]
    assert ravex_errors(caplog) == []
    if broken != "callback":  # its state (a tensor in it) put back
        assert not any("could not be loaded" in m and "callback" in m for m in warned), warned
        # its restored count: 4 batches before, then 2 (resumed) or 6 (the fit loop started afresh)
        assert counter.count == (6 if broken == "none" else 10) and counter.total.dtype == torch.float32
    if broken == "none":
        assert t.global_step == 6 and completed_steps(env)[-1] == 6 and len(warned) == 1, warned
    elif broken == "fit_loop":
        assert any("Lightning's fit loop state saved in this checkpoint could not be loaded" in m and "starts at step 0" in m
                   for m in warned), warned
        assert t.global_step == 6  # the loop started fresh: its own budget, from the restored weights
    else:
        assert any("the state of callback Picky" in m and "could not be loaded (KeyError: 'count'); that callback starts fresh" in m
                   for m in warned), warned
        assert t.global_step == 6 and completed_steps(env)[-1] == 6  # the rest resumed: steps 5 and 6 trained


def _hf_fit(out: Path, steps: int) -> Any:
    import transformers
    from _hf_train import Tokens

    torch.manual_seed(0)
    model = transformers.GPT2LMHeadModel(transformers.GPT2Config(n_layer=1, n_embd=8, n_head=2, vocab_size=64, n_positions=16))
    args = transformers.TrainingArguments(output_dir=str(out), report_to=[], max_steps=steps, per_device_train_batch_size=4, use_cpu=True,
                                          disable_tqdm=True, save_strategy="no", logging_steps=1)
    trainer = transformers.Trainer(model=model, args=args, train_dataset=Tokens())
    trainer.train()
    return trainer


def test_an_hf_trainer_state_that_does_not_load_is_a_warning_and_a_fresh_start(env: Path, monkeypatch: pytest.MonkeyPatch,
                                                                                caplog: pytest.LogCaptureFixture) -> None:
    import transformers.trainer

    train = ravex.train_loop(_hf_fit)
    train(env.parent / "hf", 4)
    assert completed_steps(env)[-1] == 4

    class Older(transformers.trainer.TrainerState):  # type: ignore[misc]  # another version's: a field this one lacks
        def __init__(self, *args: Any, total_flos: float | None = None, **kwargs: Any) -> None:
            if total_flos is not None:
                raise TypeError("TrainerState.__init__() got an unexpected keyword argument 'total_flos'")
            super().__init__(*args, **kwargs)

    monkeypatch.setattr(transformers.trainer, "TrainerState", Older)
    with said(caplog):
        trainer = train(env.parent / "hf", 6)  # raises nothing into train()
    warned = [r.getMessage() for r in caplog.records if r.name == "ravex" and r.levelno == logging.WARNING]
    assert ravex_errors(caplog) == []
    assert any("the HF Trainer's progress saved in this checkpoint could not be loaded (TypeError" in m and "starts at step 0" in m
               for m in warned), warned
    assert trainer.state.global_step == 6  # its own budget, from the restored weights


# ---------------------------------------------------------------- recipes: secrets and code stay out


class WithSecrets(torch.nn.Module):
    def __init__(self, width: int = 4, token: str | None = None, api_key: str = "", options: dict[str, Any] | None = None,
                 bos_token_id: int = 0) -> None:
        super().__init__()
        self.lin = torch.nn.Linear(width, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out: torch.Tensor = self.lin(x)
        return out


def test_a_secret_argument_is_never_recorded_or_shown(env: Path, caplog: pytest.LogCaptureFixture) -> None:
    secret = "hf_SeCrEt0123456789"

    @ravex.train_loop
    def train() -> None:
        model = WithSecrets(width=4, token=secret, api_key=secret, options={"db_password": secret, "depth": 2}, bos_token_id=7)
        opt = torch.optim.SGD(model.parameters(), lr=0.1)
        for (x,) in torch.utils.data.DataLoader(torch.utils.data.TensorDataset(torch.randn(8, 4)), batch_size=2):
            model(x).sum().backward()
            opt.step()

    with said(caplog):
        train()
    every_byte = b"".join(p.read_bytes() for p in env.rglob("*") if p.is_file())
    assert secret.encode() not in every_byte
    entry = native.read(env).objects["recipes"]["modules"]["model"]
    assert entry["kwargs"] == {"width": 4, "options": {"depth": 2}, "bos_token_id": 7}  # a token's id is no secret
    assert entry["omitted"] == ["token", "api_key", "options['db_password']"]
    assert any("leaves out token, api_key, options['db_password']" in r.getMessage() for r in caplog.records)
    shown = run_ravex("inspect", env)
    assert shown.returncode == 0, shown.stderr
    assert "<not recorded: token, api_key, options['db_password']>" in shown.stdout and secret not in shown.stdout


def test_inspect_hides_a_secret_a_crafted_recipe_holds(tmp_path: Path) -> None:
    from test_recipe import _crafted

    store = _crafted(tmp_path, "_recipe_models.Net", {"width": 4, "api_key": "sk-live-123", "extra": {"password": "hunter2"}}, kind="class")
    shown = run_ravex("inspect", store)
    assert shown.returncode == 0, shown.stderr
    assert "sk-live-123" not in shown.stdout and "hunter2" not in shown.stdout
    assert "api_key=<hidden>" in shown.stdout and "'password': <hidden>" in shown.stdout


def test_a_config_that_would_fetch_or_import_code_is_rebuilt_without_it(tmp_path: Path) -> None:
    """A crafted store: a GPT-2 config whose fields would make transformers load a kernel from the
    Hub or remote code. Rebuilt in a fresh interpreter with the network watched: nothing is
    connected to, no kernels package imported, the fields dropped and said."""
    from test_recipe import _crafted
    from transformers import GPT2Config

    value = json.loads(GPT2Config(n_layer=1, n_embd=8, n_head=2, vocab_size=16, n_positions=8).to_json_string(use_diff=False))
    value.update(attn_implementation="kernels-community/flash-attn", use_kernels=True, kernel_config={"kernel_mapping": {}},
                 trust_remote_code=True, auto_map={"AutoModel": "evil/repo--modeling_evil.EvilModel"})
    config = {"__recipe__": "transformers.config", "class": "transformers.models.gpt2.configuration_gpt2.GPT2Config", "value": value}
    store = _crafted(tmp_path, "transformers.models.gpt2.modeling_gpt2.GPT2LMHeadModel",
                     {"config": config, "attn_implementation": "kernels-community/vllm-flash-attn3"}, kind="class")
    code = r'''
import json, pathlib, socket, sys
tried = []
def connect(self, address, *a, **k):
    tried.append(repr(address))
    raise OSError("network blocked by the test")
socket.socket.connect = connect
socket.create_connection = lambda address, *a, **k: connect(None, address)
from ravex_convert.formats.native import reader
from ravex_runtime.rebuild import build
try:  # the model is built as load_model builds it (the crafted store holds no GPT-2 weights to load)
    model, _ = build(reader.read(pathlib.Path(sys.argv[1])).objects["recipes"], "model", "crafted", trust=["transformers"])
    out = {"built": type(model).__name__, "attn": model.config._attn_implementation,
           "fields": sorted(k for k in ("use_kernels", "kernel_config", "trust_remote_code", "auto_map") if hasattr(model.config, k))}
except Exception as exc:
    out = {"error": f"{type(exc).__name__}: {exc}"}
out["tried"] = tried
out["kernels"] = sorted(m for m in sys.modules if m == "kernels" or m.startswith("kernels."))
print(json.dumps(out))
'''
    env = {k: v for k, v in os.environ.items() if k not in ("HF_HUB_OFFLINE", "TRANSFORMERS_OFFLINE")}
    env.update(OMP_NUM_THREADS="1", PYTHONPATH=str(TESTS))
    res = subprocess.run([sys.executable, "-P", "-c", code, str(store)], capture_output=True, text=True, env=env, timeout=180, check=False)
    assert res.returncode == 0, res.stderr
    out = json.loads(res.stdout.splitlines()[-1])
    assert out["tried"] == [] and out["kernels"] == [], out
    assert out.get("built") == "GPT2LMHeadModel", out
    assert out["attn"] in ("eager", "sdpa") and out["fields"] == [], out
    assert "attn_implementation='kernels-community/flash-attn'" in res.stderr and "use_kernels=True" in res.stderr
    assert "attn_implementation='kernels-community/vllm-flash-attn3'" in res.stderr
