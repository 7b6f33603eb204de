"""Every fixture x every output format: what comes out, loaded by the real
libraries (torch.load(weights_only=True), safetensors), is bit-identical to the
true state recorded at save time, and to the reference tools' outputs wherever
those are right. Optimizer moments and steps survive where the format holds them."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
import torch
from conftest import DATA, fixture_dirs, run_ravex
from safetensors.torch import load_file

# Local disk only: the writers on object storage are the other writer files' (objdir, every
# backend) and tests/test_s3.py's (a real S3 server, every writer, bytes equal to these outputs).

FIXTURES = fixture_dirs()


def _src(name: str) -> Path:
    ckpt = DATA / name / "checkpoint"
    files = list(ckpt.iterdir())
    return files[0] if len(files) == 1 and files[0].is_file() else ckpt


def _true(name: str) -> tuple[dict[str, torch.Tensor], dict[str, Any]]:
    ref = DATA / name / "reference"
    return load_file(str(ref / "true_state.safetensors")), json.loads((ref / "true_state.json").read_text())


def _bits_equal(a: torch.Tensor, b: torch.Tensor) -> bool:
    if a.dtype != b.dtype or a.shape != b.shape:
        return False
    return bool(torch.equal(a.reshape(-1).view(torch.uint8), b.reshape(-1).view(torch.uint8)))


def _check_weights(name: str, weights: dict[str, torch.Tensor], *, all_names: bool) -> None:
    true, meta = _true(name)
    expected = {k[len("model/"):]: v for k, v in true.items() if k.startswith("model/")}
    tied_second = {pair[1] for pair in meta["tied_aliases"]}
    for fqn, value in expected.items():
        if fqn not in weights:
            # safetensors stores a tied tensor once (the alias is in its metadata);
            # a safetensors source dropped it before Ravex saw it
            assert not all_names and fqn in tied_second, f"{fqn} missing"
            continue
        assert _bits_equal(weights[fqn], value), fqn


@pytest.mark.parametrize("name", FIXTURES)
def test_to_safetensors(name: str, tmp_path: Path) -> None:
    dst = tmp_path / "out.safetensors"
    res = run_ravex("convert", _src(name), dst, "--to", "safetensors", "--quiet")
    assert res.returncode == 0, res.stderr
    weights = load_file(str(dst))
    _check_weights(name, weights, all_names=False)
    with open(dst, "rb") as f:
        n = int.from_bytes(f.read(8), "little")
        header = json.loads(f.read(n))
    if name != "safetensors_single" and name != "safetensors_sharded" and not name.startswith("fsdp2"):
        # the tied name is recorded so loaders can tie it again
        assert json.loads(header["__metadata__"]["ravex.aliases"]) == {"head.weight": "embed.weight"}


@pytest.mark.parametrize("name", [n for n in FIXTURES if n.startswith(("zero", "bf16opt"))])
def test_zero_to_fp32_reference_where_it_is_right(name: str, tmp_path: Path) -> None:
    ref_path = DATA / name / "reference" / "zero_to_fp32.safetensors"
    tools = json.loads((DATA / name / "reference" / "reference_tools.json").read_text())
    if not ref_path.exists():
        # BF16_Optimizer: DeepSpeed's tool refuses the checkpoint; the true state decides
        assert any("is not a zero checkpoint" in json.dumps(v) for v in tools.values())
        return
    report = next(v for k, v in tools.items() if k.startswith("deepspeed.utils.zero_to_fp32.get_fp32"))
    wrong = {m["tensor"] for m in report["vs_true_state"]["mismatches"]}
    dst = tmp_path / "out.safetensors"
    assert run_ravex("convert", _src(name), dst, "--to", "safetensors", "-q").returncode == 0
    ours, theirs = load_file(str(dst)), load_file(str(ref_path))
    compared = 0
    for fqn, value in theirs.items():
        if fqn in wrong or fqn not in ours:
            continue
        if value.dtype != ours[fqn].dtype:
            # zero_to_fp32 returns a frozen bf16 param in bf16 (not fp32): both
            # are the module's value; compare values
            assert torch.equal(value.float(), ours[fqn].float()), fqn
        else:
            assert _bits_equal(ours[fqn], value), fqn
        compared += 1
    assert compared >= len(theirs) - len(wrong) - 1  # head.weight: ours stores it once (alias)
    for fqn in wrong:  # where the tool is wrong (ZeRO-1 frozen param), Ravex has it, from the true state
        assert fqn in ours


def _names_file(name: str, tmp_path: Path) -> list[str]:
    """What a user knows and the file does not say: the parameter names in
    optimizer order (torch.save of optimizer.state_dict() keys them by position)."""
    if name != "torch_save":
        return []
    _, meta = _true(name)
    f = tmp_path / "names.txt"
    f.write_text("\n".join(p for g in meta["param_groups"] for p in g["params"]))
    return ["--param-names", str(f)]


def _hyper_args(name: str, tmp_path: Path) -> list[str]:
    """An elastic DeepSpeed save keeps no param-group hyper-parameters; torch_save
    and DCP outputs need them, so the user passes the run's (issue 11, point 10)."""
    if "e_ws" not in name:
        return []
    _, meta = _true(name)
    f = tmp_path / "hp.json"
    f.write_text(json.dumps([{k: v for k, v in g.items() if k != "params"} for g in meta["param_groups"]]))
    return ["--hyperparameters", str(f)]


def test_position_keyed_optimizer_is_not_guessed(tmp_path: Path) -> None:
    # buffers look like parameters in a plain state dict: the mapping is ambiguous
    res = run_ravex("convert", _src("torch_save"), tmp_path / "o.pt", "--to", "torch_save")
    assert res.returncode == 8
    assert "could be 'out_scale' or" in res.stderr and "--param-names" in res.stderr and "--weights-only" in res.stderr
    assert not (tmp_path / "o.pt").exists() and list(tmp_path.iterdir()) == []
    # the weights alone convert fine
    assert run_ravex("convert", _src("torch_save"), tmp_path / "w.pt", "--to", "torch_save", "--weights-only").returncode == 0


@pytest.mark.parametrize("name", FIXTURES)
def test_to_torch_save(name: str, tmp_path: Path) -> None:
    dst = tmp_path / "out.pt"
    if "e_ws" in name:  # refused without the hyper-parameters the save lacks
        res = run_ravex("convert", _src(name), dst, "--to", "torch_save", "--quiet")
        assert res.returncode == 8 and "--hyperparameters" in res.stderr and not dst.exists()
    res = run_ravex("convert", _src(name), dst, "--to", "torch_save", "--quiet", *_names_file(name, tmp_path), *_hyper_args(name, tmp_path))
    assert res.returncode == 0, res.stderr
    state = torch.load(dst, weights_only=True, map_location="cpu")
    _check_weights(name, state["model"], all_names=not name.startswith("safetensors"))
    import zipfile

    assert zipfile.ZipFile(dst).testzip() is None  # every entry's CRC-32 (gathered while copying) is right
    true, meta = _true(name)
    if "head.weight" in state["model"] and "embed.weight" in state["model"] and not name.startswith("fsdp2"):
        # tied: every name present, sharing one storage, as torch itself saves it
        assert state["model"]["head.weight"].untyped_storage().data_ptr() == state["model"]["embed.weight"].untyped_storage().data_ptr()
    moments = {k: v for k, v in true.items() if k.startswith("optim/")}
    if not moments:
        assert "optim" not in state or not state["optim"]["state"]
        return
    if name == "torch_save":
        # a torch.save source's own layout comes back: {"model", "optimizer" keyed by position, "step"}
        # (tests/test_lightning.py); named here through the --param-names order for the checks below
        assert set(state) == {"model", "optimizer", "step"}
        order = [p for g in meta["param_groups"] for p in g["params"]]
        osd = state["optimizer"]
        assert [p for g in osd["param_groups"] for p in g["params"]] == list(range(len(order))) == sorted(osd["state"])
        state["optim"] = {"state": {order[i]: per for i, per in osd["state"].items()},
                          "param_groups": [{**g, "params": [order[i] for i in g["params"]]} for g in osd["param_groups"]]}
    opt = state["optim"]["state"]
    for key, value in moments.items():
        _, sname, fqn = key.split("/", 2)
        if fqn not in opt and fqn in {p[1] for p in meta["tied_aliases"]}:
            continue  # optimizer state is keyed by the first tied name only
        assert _bits_equal(opt[fqn][sname], value), key
    for fqn, step in (meta.get("adam_step") or {}).items():
        if fqn in opt:
            assert float(opt[fqn]["step"]) == float(step), fqn
    groups = state["optim"]["param_groups"]
    assert [sorted(g["params"]) for g in groups] == [sorted(p for p in g["params"] if p in opt) for g in meta["param_groups"]]
    for g, want in zip(groups, meta["param_groups"]):
        # (elastic saves: the hyper-parameters passed with --hyperparameters)
        assert (g["lr"], g["weight_decay"], tuple(g["betas"]), g["eps"]) == (want["lr"], want["weight_decay"], tuple(want["betas"]), want["eps"])


def test_dcp_to_torch_save_reference_agrees(tmp_path: Path) -> None:
    # PyTorch's own dcp_to_torch_save is right on these fixtures: Ravex matches it bit for bit
    for name in ("fsdp2_ws2", "fsdp2_ws3"):
        dst = tmp_path / f"{name}.pt"
        assert run_ravex("convert", _src(name), dst, "--to", "torch_save", "-q").returncode == 0
        ours = torch.load(dst, weights_only=True)
        theirs = torch.load(DATA / name / "reference" / "dcp_to_torch_save.pt", weights_only=True)
        assert sorted(ours["model"]) == sorted(theirs["model"])
        for k, v in theirs["model"].items():
            assert _bits_equal(ours["model"][k], v), k
        for fqn, per in theirs["optim"]["state"].items():
            for s, v in per.items():
                assert _bits_equal(ours["optim"]["state"][fqn][s], v), (fqn, s)


@pytest.mark.parametrize("name", ["zero3_ws3_bf16", "fsdp2_ws2", "torch_save"])
def test_round_trip_through_torch_save_is_identical(name: str, tmp_path: Path) -> None:
    a = tmp_path / "a.pt"
    b = tmp_path / "b.pt"
    names = _names_file(name, tmp_path)
    assert run_ravex("convert", _src(name), a, "--to", "torch_save", "-q", *names).returncode == 0
    assert run_ravex("convert", a, b, "--to", "torch_save", "-q").returncode == 0
    res = run_ravex("verify", _src(name), b, "--weights-only") if names else run_ravex("verify", _src(name), b)
    assert res.returncode == 0, res.stdout + res.stderr
    assert "identical" in res.stdout
    # the same input gives the same bytes
    c = tmp_path / "c.pt"
    assert run_ravex("convert", a, c, "--to", "torch_save", "-q").returncode == 0
    assert b.read_bytes() == c.read_bytes()


def test_verify_catches_one_changed_element(tmp_path: Path) -> None:
    src = _src("zero2_ws3_fp32")
    out = tmp_path / "w.safetensors"
    assert run_ravex("convert", src, out, "--to", "safetensors", "-q").returncode == 0
    weights = load_file(str(out))
    from safetensors.torch import save_file

    with open(out, "rb") as f:
        metadata = json.loads(f.read(int.from_bytes(f.read(8), "little")))["__metadata__"]
    weights["blocks.1.fc1.weight"][3, 7] = torch.nextafter(weights["blocks.1.fc1.weight"][3, 7], torch.tensor(1e9))
    save_file(weights, str(tmp_path / "changed.safetensors"), metadata=metadata)  # keeps the tied-name record
    res = run_ravex("verify", out, tmp_path / "changed.safetensors")
    assert res.returncode == 1
    assert "blocks.1.fc1.weight: 1 of 377 elements differ" in res.stdout and "[3, 7]" in res.stdout
    res = run_ravex("verify", out, tmp_path / "changed.safetensors", "--json")
    doc = json.loads(res.stdout)
    assert doc["identical"] is False and doc["differing_tensors"] == 1
    # within a tolerance they agree
    assert run_ravex("verify", out, tmp_path / "changed.safetensors", "--atol", "1e-6").returncode == 0


def test_load_state_dict_python_api() -> None:
    import ravex_convert

    weights = ravex_convert.load_state_dict(DATA / "zero3_ws2_bf16" / "checkpoint")
    true, _ = _true("zero3_ws2_bf16")
    for key, value in true.items():
        if key.startswith("model/"):
            assert _bits_equal(weights[key[len("model/"):]], value), key
    # tied names share one tensor, as in the model
    assert weights["head.weight"] is weights["embed.weight"]
    full = ravex_convert.load_state_dict(DATA / "fsdp2_ws2" / "checkpoint", optimizer=True)
    assert _bits_equal(full["optim"]["state"]["embed.weight"]["exp_avg"], load_file(str(DATA / "fsdp2_ws2" / "reference" / "true_state.safetensors"))["optim/exp_avg/embed.weight"])


@pytest.mark.parametrize("name", FIXTURES)
def test_to_native_and_back(name: str, tmp_path: Path) -> None:
    # every fixture into a Ravex store (world size 1 and 2), then out again as
    # torch_save: bit-identical to the source all the way (ravex verify agrees)
    store = tmp_path / "store"
    names = _names_file(name, tmp_path)
    res = run_ravex("convert", _src(name), store, "--to", "native", "-q", *names)
    assert res.returncode == 0, res.stderr
    res = run_ravex("convert", _src(name), store, "--to", "native", "--world-size", "2", "--compression", "zstd", "-q", *names)
    assert res.returncode == 0, res.stderr  # appended as checkpoint 1
    weights_only = ["--weights-only"] if names else []
    for index in ("0", "1"):
        out = tmp_path / f"back{index}.pt"
        assert run_ravex("convert", store, out, "--to", "torch_save", "--index", index, "-q", *_hyper_args(name, tmp_path)).returncode == 0
        res = run_ravex("verify", _src(name), out, *weights_only)
        assert res.returncode == 0, res.stdout + res.stderr
    res = run_ravex("verify", _src(name), store, *weights_only)
    assert res.returncode == 0, res.stdout + res.stderr
    if names:  # with the names given, the optimizer state goes through too
        full = tmp_path / "full.pt"
        assert run_ravex("convert", store, full, "--to", "torch_save", "-q").returncode == 0
        _check_weights(name, torch.load(full, weights_only=True)["model"], all_names=True)


def test_dcp_reshard_and_round_trip(tmp_path: Path) -> None:
    # ZeRO ws2 -> DCP ws3 -> DCP ws1 (reshard) -> native ws1 -> ZeRO ws3 -> safetensors:
    # every hop bit-identical to the start (weights and optimizer state)
    src = _src("zero2_ws2_bf16")
    dcp3, dcp1, store, st = tmp_path / "dcp3", tmp_path / "dcp1", tmp_path / "store", tmp_path / "w.safetensors"
    zero3 = tmp_path / "zero3"
    assert run_ravex("convert", src, dcp3, "--to", "dcp", "--world-size", "3", "-q").returncode == 0
    info = json.loads(run_ravex("inspect", dcp3, "--json").stdout)
    assert (info["format"], info["world_size"]) == ("dcp", 3)
    res = run_ravex("reshard", dcp3, dcp1, "--world-size", "1", "-q")
    assert res.returncode == 0, res.stderr
    assert json.loads(run_ravex("inspect", dcp1, "--json").stdout)["world_size"] == 1
    assert run_ravex("convert", dcp1, store, "--to", "native", "-q").returncode == 0
    # ZeRO-3 partitions frozen parameters but not buffers; DCP does not record
    # which is which, so the user names the buffers (and Ravex refuses without)
    res = run_ravex("convert", store, zero3, "--to", "zero", "--world-size", "3", "--zero-stage", "3")
    assert res.returncode == 8 and "--buffers" in res.stderr
    buffers = ",".join(_true("zero2_ws2_bf16")[1]["persistent_buffers"])
    res = run_ravex("convert", store, zero3, "--to", "zero", "--world-size", "3", "--zero-stage", "3", "--buffers", buffers, "-q")
    assert res.returncode == 0, res.stderr
    info = json.loads(run_ravex("inspect", zero3, "--json").stdout)
    assert (info["format"], info["variant"], info["world_size"], info["zero_stage"]) == ("zero", "zero3", 3, 3)
    assert run_ravex("convert", zero3, st, "--to", "safetensors", "-q").returncode == 0
    for hop in (dcp3, dcp1, store, zero3):
        res = run_ravex("verify", src, hop)
        assert res.returncode == 0, (hop, res.stdout, res.stderr)
    assert run_ravex("verify", src, st, "--weights-only").returncode == 0


def test_reshard_needs_ranks(tmp_path: Path) -> None:
    res = run_ravex("reshard", _src("safetensors_single"), tmp_path / "x", "--world-size", "2")
    assert res.returncode == 2
    assert "has no ranks to reshard" in res.stderr and "ravex convert" in res.stderr


@pytest.mark.parametrize(("name", "stage", "ws"), [("zero2_ws2_fp32", None, "3"), ("zero3_ws2_bf16", "1", "3"), ("bf16opt_ws2", None, "3")])
def test_zero_reshard(name: str, stage: str | None, ws: str, tmp_path: Path) -> None:
    dst = tmp_path / "out"
    args = ["--zero-stage", stage] if stage else []
    res = run_ravex("reshard", _src(name), dst, "--world-size", ws, "-q", *args)
    assert res.returncode == 0, res.stderr
    info = json.loads(run_ravex("inspect", dst, "--json").stdout)
    src_info = json.loads(run_ravex("inspect", _src(name), "--json").stdout)
    assert info["world_size"] == int(ws)
    assert info["zero_stage"] == (int(stage) if stage else src_info["zero_stage"])
    res = run_ravex("verify", _src(name), dst)
    assert res.returncode == 0, res.stdout + res.stderr


def test_zero_output_refusals(tmp_path: Path) -> None:
    res = run_ravex("convert", _src("zero2_ws2_fp32"), tmp_path / "a", "--to", "zero", "--world-size", "2")
    assert res.returncode == 2 and "--zero-stage" in res.stderr
    # weights without optimizer state cannot be a DeepSpeed training checkpoint
    res = run_ravex("convert", _src("safetensors_single"), tmp_path / "b", "--to", "zero", "--world-size", "2", "--zero-stage", "2")
    assert res.returncode == 8 and "hint:" in res.stderr
    assert sorted(p.name for p in tmp_path.iterdir()) == []


def test_bare_state_dict_converts_once(tmp_path: Path) -> None:
    # a plain torch.save(model.state_dict()): every entry is a weight, written once
    sd = {f"layer{i}.weight": torch.randn(3, 5) for i in range(4)}
    torch.save(sd, tmp_path / "sd.pt")
    assert run_ravex("convert", tmp_path / "sd.pt", tmp_path / "out.pt", "--to", "torch_save", "-q").returncode == 0
    out = torch.load(tmp_path / "out.pt", weights_only=True)
    assert sorted(out) == ["model"]
    assert sorted(out["model"]) == sorted(sd)
    assert all(torch.equal(out["model"][k], v) for k, v in sd.items())


@pytest.mark.parametrize("to", ["safetensors", "torch_save", "native", "dcp", "zero"])
def test_no_sync_writes_the_same_checkpoint_without_waiting_for_the_disk(to: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    import os

    import ravex_convert

    calls: list[int] = []
    real = os.fsync

    def counted(fd: int) -> None:
        calls.append(fd)
        real(fd)

    monkeypatch.setattr(os, "fsync", counted)
    src = DATA / "zero2_ws2_fp32" / "checkpoint"
    kw: dict[str, Any] = {"zero_stage": 2} if to == "zero" else {}
    ravex_convert.convert(src, tmp_path / "synced", to, ravex_convert.ConvertOptions(world_size=2), writer=kw)
    synced = len(calls)
    calls.clear()
    result = ravex_convert.convert(src, tmp_path / "unsynced", to, ravex_convert.ConvertOptions(world_size=2, sync=False), writer=kw)
    assert synced > 0 and calls == [], (synced, calls)
    assert result["synced"] is False
    same = ravex_convert.verify(tmp_path / "synced", tmp_path / "unsynced")
    assert same.identical and same.compared > 0
    # and syncing is back on after the call (the runtime's store always syncs)
    ravex_convert.convert(src, tmp_path / "again", to, ravex_convert.ConvertOptions(world_size=2), writer=kw)
    assert calls


def test_no_sync_flag_on_the_command_line(tmp_path: Path) -> None:
    res = run_ravex("reshard", DATA / "fsdp2_ws2" / "checkpoint", tmp_path / "out", "--world-size", "3", "--no-sync", "--json")
    assert res.returncode == 0, res.stderr
    assert json.loads(res.stdout)["synced"] is False


@pytest.mark.parametrize("to", ["safetensors", "torch_save", "native", "dcp", "zero"])
def test_progress_is_told_the_total_before_the_bytes(to: str, tmp_path: Path) -> None:
    import ravex_convert

    events: list[tuple[str, int]] = []

    class Bar:
        def __call__(self, n: int) -> None:
            events.append(("done", n))

        def add_total(self, n: int) -> None:
            events.append(("total", n))

    kw: dict[str, Any] = {"zero_stage": 2} if to == "zero" else {}
    ravex_convert.convert(DATA / "zero2_ws2_fp32" / "checkpoint", tmp_path / "out", to, ravex_convert.ConvertOptions(world_size=2), writer=kw, progress=Bar())
    assert events and events[0][0] == "total", events
    # every job announces its bytes before it writes them, and writes exactly those
    announced = done = 0
    for kind, n in events:
        if kind == "total":
            assert done == announced, events
            announced += n
        else:
            done += n
            assert done <= announced, events
    assert done == announced > 0, events
    # a plain callable (no add_total) still works
    seen: list[int] = []
    ravex_convert.convert(DATA / "zero2_ws2_fp32" / "checkpoint", tmp_path / "out2", to, ravex_convert.ConvertOptions(world_size=2), writer=kw,
                          progress=seen.append)
    assert sum(seen) == done
