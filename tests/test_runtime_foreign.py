"""resume_from naming another program's checkpoint, in one process: the fixtures' real DeepSpeed,
DCP, torch.save and safetensors checkpoints put into a plain decorated PyTorch script (the
fixtures' own model), checked against the true state recorded at save time; and every mismatch
stopping the run before its first step with the live objects untouched.
(Under torchrun, and against DeepSpeed's own continuation: integration/test_foreign_resume.py.)"""

from __future__ import annotations

import importlib.util
from pathlib import Path
from typing import Any

import pytest
import torch
from conftest import DATA, FIXTURES, said

import ravex
from ravex_convert.errors import RavexError
from ravex_runtime.errors import ResumeError

_spec = importlib.util.spec_from_file_location("ravex_fixture_model", FIXTURES / "model.py")
assert _spec is not None and _spec.loader is not None
M: Any = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(M)


def ckpt(name: str) -> str:
    return str(DATA / name / "checkpoint")


def true_state(name: str) -> dict[str, torch.Tensor]:
    from safetensors.torch import load_file

    return load_file(DATA / name / "reference" / "true_state.safetensors")


class Rows(torch.utils.data.Dataset[tuple[torch.Tensor, torch.Tensor, int]]):
    """Item i: row i % 6 of the fixtures' global batch of step i // 6 (integration/foreign_train.py)."""

    def __len__(self) -> int:
        return 8 * M.GLOBAL_BATCH

    def __getitem__(self, i: int) -> tuple[torch.Tensor, torch.Tensor, int]:
        x, y = M.global_batch(i // M.GLOBAL_BATCH)
        return x[i % M.GLOBAL_BATCH], y[i % M.GLOBAL_BATCH], i


def run(build: Any = None, make_opt: Any = None, make_sched: Any = None, steps: int = 1, seen: dict[str, Any] | None = None,
        scaler: bool = False) -> dict[str, Any]:
    """The decorated script: build (inside it, as scripts do), iterate (the restore happens at the
    first iteration), train ``steps`` steps; what it saw (in ``seen``, also when it raises)."""
    seen = {} if seen is None else seen
    seen.update(losses=[], samples=[])

    @ravex.train_loop
    def train() -> None:
        m = build() if build is not None else M.build_model()
        built = {k: v.clone() for k, v in m.state_dict().items()}
        seen["built"] = built
        opt = (make_opt or M.make_optimizer)(m)
        sched = (make_sched or M.make_scheduler)(opt)
        seen.update(model=m, opt=opt, sched=sched, scaler=torch.amp.GradScaler("cpu") if scaler else None)
        loader = torch.utils.data.DataLoader(Rows(), batch_size=M.GLOBAL_BATCH)
        for x, y, idx in loader:
            if "step0" not in seen:
                seen["step0"] = ravex.step()
                seen["restored"] = {k: v.clone() for k, v in m.state_dict().items()}
                seen["lr0"] = [g["lr"] for g in opt.param_groups]
            if len(seen["losses"]) >= steps:
                break
            loss = M.loss_fn(m(x), y)
            loss.backward()
            opt.step()
            opt.zero_grad()
            sched.step()
            seen["losses"].append(loss.item())
            seen["samples"].append(idx.tolist())

    train()
    return seen


def losses_next(name: str) -> list[float]:
    import json

    return list(json.loads((DATA / name / "reference" / "true_state.json").read_text())["losses_next"])


# ------------------------------------------------------------------ what is put in


@pytest.mark.parametrize("name", ["zero1_ws2_fp32", "zero2_ws3_fp32", "zero3_ws2_fp32", "zero3sg_ws2_fp32", "fsdp2_ws2", "torch_save"])
def test_resume_puts_in_the_true_state(env: Path, monkeypatch: pytest.MonkeyPatch, name: str) -> None:
    """Weights, Adam moments and steps bit-identical to the state recorded at save time; the step
    count, the LR and the data position continue from the saved run (DeepSpeed's global_samples,
    or the step count x the global batch); the first loss is DeepSpeed's own continuation's."""
    monkeypatch.setenv("RAVEX_RESUME_FROM", ckpt(name))
    seen = run(steps=1, scaler=True)  # a GradScaler starts fresh (DeepSpeed's loss scaler is another object)
    true = true_state(name)
    got = seen["restored"]
    for k, v in got.items():
        ref = true[f"model/{k}"]
        assert torch.equal(v.view(torch.uint8) if v.dim() else v, ref.view(torch.uint8) if ref.dim() else ref), k
    opt = seen["opt"]
    names = {id(p): n for n, p in seen["model"].named_parameters()}
    # after one more step the moments moved; the step counters say 3 + 1 everywhere
    for p, st in opt.state.items():
        assert float(st["step"]) == 4.0, names[id(p)]
    assert seen["step0"] == 3
    assert seen["lr0"] == [M.DECAY_LR * M.warmup(3), M.NO_DECAY_LR * M.warmup(3)]
    assert seen["samples"][0] == list(range(18, 24))
    assert abs(seen["losses"][0] - losses_next(name)[0]) <= 1e-5 * losses_next(name)[0]


def test_adam_moments_are_the_saved_ones(env: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Before any step: every exp_avg / exp_avg_sq in the live optimizer equals the true state's."""
    monkeypatch.setenv("RAVEX_RESUME_FROM", ckpt("zero3_ws2_fp32"))
    seen = run(steps=0)
    true = true_state("zero3_ws2_fp32")
    names = {id(p): n for n, p in seen["model"].named_parameters()}
    assert len(seen["opt"].state) == 37
    for p, st in seen["opt"].state.items():
        for k in ("exp_avg", "exp_avg_sq"):
            assert torch.equal(st[k], true[f"optim/{k}/{names[id(p)]}"]), (k, names[id(p)])
        assert st["step"].dtype == torch.float32 and float(st["step"]) == 3.0


def test_bf16_parameters_take_the_cast_master(env: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture) -> None:
    """Live bf16 parameters get DeepSpeed's fp32 master rounded as torch rounds it, said once."""
    monkeypatch.setenv("RAVEX_RESUME_FROM", ckpt("zero2_ws2_bf16"))
    with said(caplog):
        seen = run(build=lambda: M.build_model().to(torch.bfloat16), steps=0)
    true = true_state("zero2_ws2_bf16")
    for k, v in seen["restored"].items():
        assert v.dtype == torch.bfloat16, k  # model.to(bfloat16): the buffers too
        assert torch.equal(v, true[f"model/{k}"].to(v.dtype)), k
    assert sum("cast to this run's dtype" in r.getMessage() for r in caplog.records) == 1


def test_safetensors_is_a_weights_only_start(env: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture) -> None:
    """No optimizer state: the weights (the tied head filled by the tie), step 0, a fresh optimizer."""
    monkeypatch.setenv("RAVEX_RESUME_FROM", ckpt("safetensors_single") + "/model.safetensors")
    with said(caplog):
        seen = run(steps=1, scaler=True)
    true = true_state("safetensors_single")
    for k, v in seen["restored"].items():
        assert torch.equal(v, true[f"model/{k}"]), k
    assert seen["step0"] == 0 and seen["samples"][0] == list(range(6))
    assert any("weights only" in r.getMessage() for r in caplog.records)


def test_wrapper_prefix_is_matched(env: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture) -> None:
    """The live model's names carry a wrapper's prefix the checkpoint's lack: matched, and said."""

    class Wrapped(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.module = M.build_model()

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return self.module(x)  # type: ignore[no-any-return]

    monkeypatch.setenv("RAVEX_RESUME_FROM", ckpt("zero3_ws2_fp32"))
    with said(caplog):
        seen = run(build=Wrapped, make_opt=lambda m: M.make_optimizer(m.module), steps=1)
    assert seen["step0"] == 3
    assert torch.equal(seen["restored"]["module.embed.weight"], true_state("zero3_ws2_fp32")["model/embed.weight"])
    assert any("start with 'module.'" in r.getMessage() for r in caplog.records)


def test_live_settings_that_differ_are_reported_and_the_checkpoints_used(env: Path, monkeypatch: pytest.MonkeyPatch,
                                                                         caplog: pytest.LogCaptureFixture) -> None:
    def opt(m: torch.nn.Module) -> torch.optim.Optimizer:
        o = M.make_optimizer(m)
        o.param_groups[0]["weight_decay"] = 0.05
        return o

    monkeypatch.setenv("RAVEX_RESUME_FROM", ckpt("zero3_ws2_fp32"))
    with said(caplog):
        seen = run(make_opt=opt, steps=0)
    assert seen["opt"].param_groups[0]["weight_decay"] == M.DECAY_WD
    told = [r.getMessage() for r in caplog.records if "differ from the checkpoint" in r.getMessage()]
    assert len(told) == 1 and "group 0 weight_decay: 0.05 here, 0.1 in the checkpoint" in told[0], told


def test_another_kind_of_scheduler_takes_the_step_count(env: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture) -> None:
    """DeepSpeed saved a LambdaLR; the live run steps a StepLR: it continues at step 3, and that is said."""
    monkeypatch.setenv("RAVEX_RESUME_FROM", ckpt("zero1_ws2_fp32"))
    with said(caplog):
        seen = run(make_sched=lambda o: torch.optim.lr_scheduler.StepLR(o, step_size=2, gamma=0.5), steps=2)
    sched = seen["sched"]
    assert sched.last_epoch == 5
    # the checkpoint's lr at step 3 (1e-2), StepLR halves it at epochs 4 (4 % 2 == 0) and keeps it at 5
    assert seen["lr0"] == [M.DECAY_LR, M.NO_DECAY_LR]
    assert [g["lr"] for g in seen["opt"].param_groups] == [M.DECAY_LR / 2, M.NO_DECAY_LR / 2]
    assert any("StepLR) is set to step 3" in r.getMessage() and "another kind" in r.getMessage() for r in caplog.records)


def test_the_store_takes_over_after_the_first_checkpoint(env: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Started again with the same resume_from, the run goes on from its own newest checkpoint (which
    says where the run began); a store holding another run's checkpoints is refused."""
    monkeypatch.setenv("RAVEX_RESUME_FROM", ckpt("zero3_ws2_fp32"))
    first = run(steps=3)
    second = run(steps=1)
    assert second["step0"] == 6 and second["samples"][0] == list(range(36, 42))
    from ravex_runtime.loading import load_checkpoint

    c, _ = load_checkpoint(env)
    assert c.objects["extra"]["ravex_resumed_from"] == {"format": "zero", "path": ckpt("zero3_ws2_fp32"), "step": 3}
    from ravex_runtime.status import store_status

    rows = store_status(env)["checkpoints"]
    assert rows and all(r["began_from"] == {"format": "zero", "path": ckpt("zero3_ws2_fp32"), "step": 3} for r in rows)
    from conftest import run_ravex, run_without_torch

    told = run_without_torch("import sys; from ravex_runtime.status import store_status; "
                             "print(store_status(sys.argv[1])['checkpoints'][-1]['began_from']['format'])", str(env))
    assert told.strip() == "zero"  # `ravex status` reads it without importing torch
    shown = run_ravex("status", env)
    assert shown.returncode == 0 and f"the run began from the zero checkpoint {ckpt('zero3_ws2_fp32')} (step 3)" in shown.stdout, shown.stdout
    assert len(first["losses"]) == 3
    monkeypatch.setenv("RAVEX_RESUME_FROM", ckpt("zero1_ws2_fp32"))
    with pytest.raises(ResumeError, match="already holds checkpoints of a run that did not begin from") as e:
        run()
    assert "storage.path" in (e.value.hint or "")


# ------------------------------------------------------------------ mismatches: one error, before the first step, nothing touched


def refused(monkeypatch: pytest.MonkeyPatch, name: str, match: str, **kw: Any) -> ResumeError:
    monkeypatch.setenv("RAVEX_RESUME_FROM", ckpt(name))
    steps: list[int] = []
    opt = kw.pop("make_opt", M.make_optimizer)

    def counted(m: torch.nn.Module) -> torch.optim.Optimizer:
        o = opt(m)
        o.register_step_post_hook(lambda *a: steps.append(1))
        return o

    seen: dict[str, Any] = {}
    with pytest.raises(ResumeError, match=match) as e:
        run(make_opt=counted, seen=seen, **kw)
    assert not steps and not seen["losses"]  # no optimizer step was taken
    if "model" in seen:  # nothing was put in
        assert all(torch.equal(v, seen["built"][k]) for k, v in seen["model"].state_dict().items())
    return e.value


def test_a_missing_tensor_is_named(env: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    def build() -> torch.nn.Module:
        m = M.build_model()
        m.extra = torch.nn.Linear(2, 2)
        return m

    err = refused(monkeypatch, "zero3_ws2_fp32", r"2 of the model's tensors are not in it \(extra.bias, extra.weight\)", build=build)
    assert "DeepSpeed ZeRO checkpoint" in err.message and "build the model" in (err.hint or "")


def test_a_prefix_and_more_gets_the_prefix_hint(env: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    class Wrapped(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.module = M.build_model()
            self.extra = torch.nn.Linear(2, 2)

    err = refused(monkeypatch, "zero3_ws2_fp32", "not in it", build=Wrapped, make_opt=lambda m: M.make_optimizer(m.module))
    assert "wrapper prefix" in (err.hint or ""), err.hint


def test_a_shape_is_named(env: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    def build() -> torch.nn.Module:
        m = M.build_model()
        m.head.bias = torch.nn.Parameter(torch.zeros(M.VOCAB + 1))
        return m

    refused(monkeypatch, "zero3_ws2_fp32", r"tensor 'head.bias' is \[37\] float32 in the checkpoint, \[38\] float32 in this run", build=build)


def test_a_group_layout_that_cannot_be_mapped(env: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    err = refused(monkeypatch, "zero3_ws2_fp32", r"holds 2 parameter groups, this run's optimizer \(AdamW\) 1",
                  make_opt=lambda m: torch.optim.AdamW([p for p in m.parameters() if p.requires_grad], lr=1e-2))
    assert "group 0: 13 (embed.weight" in (err.hint or "") and "group 1: 24 (logit_gain" in (err.hint or ""), err.hint


def test_a_parameter_in_another_group(env: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    def opt(m: torch.nn.Module) -> torch.optim.Optimizer:
        g = M.param_groups(m)
        g[1]["params"].append(g[0]["params"].pop())
        return torch.optim.AdamW(g, lr=1e-2, foreach=False)

    refused(monkeypatch, "zero3_ws2_fp32", r"parameter group 0 holds other parameters .*only in the checkpoint: \['blocks.1.fc2.weight'\]",
            make_opt=opt)


def test_an_elastic_save_without_hyper_parameters(env: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    err = refused(monkeypatch, "zero2e_ws2_fp32", "elastic_checkpoint")
    assert "load_weights" in (err.hint or "")


def test_a_frozen_parameter_trained_here(env: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    def opt(m: torch.nn.Module) -> torch.optim.Optimizer:
        g = M.param_groups(m)
        m.pos_embed.requires_grad_(True)
        g[0]["params"].append(m.pos_embed)
        return torch.optim.AdamW(g, lr=1e-2, foreach=False)

    refused(monkeypatch, "zero3_ws2_fp32", r"parameter group 0 holds other parameters .*only here: \['pos_embed'\]", make_opt=opt)


def test_not_a_checkpoint_is_refused_at_the_start(env: Path, monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    (tmp_path / "junk").mkdir()
    (tmp_path / "junk" / "notes.txt").write_text("hello")
    monkeypatch.setenv("RAVEX_RESUME_FROM", str(tmp_path / "junk"))
    with pytest.raises(RavexError, match="not a checkpoint Ravex recognises") as e:
        run()
    assert "junk" in e.value.message


# ------------------------------------------------------------------ reading one rank's part


def test_read_parts_reads_a_box_of_a_zero_partition() -> None:
    """A rank's rows of a tensor ZeRO-3 flattened across two ranks' partitions: the same bytes as
    the whole tensor's rows."""
    from ravex_convert._engine import read_parts
    from ravex_convert.detect import read_checkpoint
    from ravex_convert.model import Box

    c = read_checkpoint(ckpt("zero3_ws2_fp32"))
    t = c.tensors["model/blocks.0.fc1.weight"]  # [29, 13]
    whole = torch.empty(t.shape)
    part = torch.empty(11, 13)
    read_parts([(t, t.whole(), whole.view(torch.uint8).numpy().data, None), (t, Box((15, 0), (11, 13)), part.view(torch.uint8).numpy().data, None)])
    assert torch.equal(part, whole[15:26])
    assert torch.equal(whole, true_state("zero3_ws2_fp32")["model/blocks.0.fc1.weight"])


def test_each_rank_checks_its_share_of_the_checksums(tmp_path: Path) -> None:
    """Under torchrun every rank reads the DeepSpeed checkpoint and checks the CRC-32s of every n-th
    storage: a flipped bit in any storage is found by exactly one of them."""
    import shutil

    from ravex_convert._torchfile.archive import open_archive
    from ravex_convert.errors import CorruptCheckpointError
    from ravex_convert.formats.zero import reader as zero

    root = tmp_path / "ckpt"
    shutil.copytree(ckpt("zero3_ws2_fp32"), root)
    files = sorted((root / "global_step3").glob("*_optim_states.pt"))
    for r in range(2):  # no damage: no share fails
        zero.read(root, crc_share=(r, 2))
    for f in files:
        archive = open_archive(f)
        # the two largest storages of each rank's file: its flat partitions (weights, moments)
        for key in sorted(archive.storage_sizes, key=lambda k: -archive.storage_sizes[k])[:2]:
            off = archive.storage_offsets[key] + 3
            data = bytearray(f.read_bytes())
            data[off] ^= 0x10
            f.write_bytes(bytes(data))
            failed = []
            for r in range(2):
                try:
                    zero.read(root, crc_share=(r, 2))
                except CorruptCheckpointError as exc:
                    assert "fails its CRC-32 check" in exc.message
                    failed.append(r)
            assert len(failed) == 1, (f.name, key, failed)
            with pytest.raises(CorruptCheckpointError):
                zero.read(root)
            data[off] ^= 0x10
            f.write_bytes(bytes(data))


def test_a_position_inside_a_batch_resumes_at_the_batch_it_begins(env: Path, monkeypatch: pytest.MonkeyPatch,
                                                                 caplog: pytest.LogCaptureFixture) -> None:
    """DeepSpeed trained on 18 samples; batches of 4 here: the run goes on with samples 16..19, and says so."""
    monkeypatch.setenv("RAVEX_RESUME_FROM", ckpt("zero3_ws2_fp32"))
    got: list[list[int]] = []

    @ravex.train_loop
    def train() -> None:
        m = M.build_model()
        opt = M.make_optimizer(m)
        sched = M.make_scheduler(opt)
        for _, _, idx in torch.utils.data.DataLoader(Rows(), batch_size=4):
            got.append(idx.tolist())
            break
        del sched

    with said(caplog):
        train()
    assert got == [[16, 17, 18, 19]]
    assert any("18 samples is not a whole number of batches of 4" in r.getMessage() for r in caplog.records), [r.getMessage() for r in caplog.records]


def test_deepspeeds_own_scheduler_state_gives_its_step_count(caplog: pytest.LogCaptureFixture) -> None:
    """DeepSpeed's WarmupLR and friends save ``last_batch_iteration`` (counting from -1): a live
    torch scheduler continues at that count + 1, with the checkpoint's learning rates."""
    from ravex_runtime.foreign import adapt, open_foreign
    from ravex_runtime.state import Tracked

    f = open_foreign(ckpt("zero3_ws2_fp32"))
    f.ckpt.objects["lr_scheduler"] = {"last_batch_iteration": 2}
    m = M.build_model()
    opt = M.make_optimizer(m)
    sched = M.make_scheduler(opt)
    with said(caplog):
        fitted = adapt(f, Tracked(models=[m], optimizers=[opt], schedulers=[sched]), 0)
    state = fitted.ckpt.objects["lr_scheduler"]
    assert (state["last_epoch"], state["_step_count"], state["_last_lr"]) == (3, 4, [M.DECAY_LR, M.NO_DECAY_LR])
    assert set(state) == set(sched.state_dict())
    assert any("LambdaLR) is set to step 3" in r.getMessage() for r in caplog.records)
