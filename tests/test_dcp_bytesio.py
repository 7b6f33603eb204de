"""A ``BytesIO`` saved whole into a DCP, as torchtitan's ``TrainState`` kept its loss history
(``global_avg_losses``: a torch.save of a list, in a BytesIO that DCP pickles whole). Ravex keeps
its bytes as data and never opens them; a reshard writes them back, and ``dcp.load`` into a
BytesIO gives torch's own bytes back. A BytesIO whose bytes are a pickle that would run code is
carried the same way, never run."""

from __future__ import annotations

import io
import pickle
import warnings
from pathlib import Path
from typing import Any

import torch
import torch.distributed.checkpoint as dcp
from conftest import run_ravex

import ravex_convert


class Boom:
    def __reduce__(self) -> tuple[Any, ...]:
        return (print, ("this pickle ran",))  # what would show on stdout if anyone unpickled it


def save(path: Path, history: bytes) -> None:
    state = {"model": {"w": torch.arange(6.0).reshape(2, 3)}, "train_state": {"step": 7, "global_avg_losses": io.BytesIO(history)}}
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # DCP warns that no process group is up
        dcp.save(state, checkpoint_id=str(path))


def load_history(path: Path) -> bytes:
    target: dict[str, Any] = {"model": {"w": torch.zeros(2, 3)}, "train_state": {"step": 0, "global_avg_losses": io.BytesIO()}}
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        dcp.load(target, checkpoint_id=str(path))
    assert target["train_state"]["step"] == 7 and torch.equal(target["model"]["w"], torch.arange(6.0).reshape(2, 3))
    return bytes(target["train_state"]["global_avg_losses"].getvalue())


def test_a_bytesio_is_read_as_data_and_written_back(tmp_path: Path) -> None:
    buf = io.BytesIO()
    torch.save([1.5, 0.25, 0.125], buf)
    save(tmp_path / "src", buf.getvalue())
    ckpt = ravex_convert.read_checkpoint(tmp_path / "src")
    assert ckpt.step == 7
    res = run_ravex("reshard", tmp_path / "src", tmp_path / "out", "--world-size", "2")
    assert res.returncode == 0, res.stderr
    assert load_history(tmp_path / "out") == load_history(tmp_path / "src") == buf.getvalue()


def test_a_bytesio_holding_a_code_pickle_is_carried_never_run(tmp_path: Path) -> None:
    evil = pickle.dumps(Boom())
    save(tmp_path / "src", evil)
    for args in (("inspect", tmp_path / "src"), ("reshard", tmp_path / "src", tmp_path / "out", "--world-size", "2")):
        res = run_ravex(*args)
        assert res.returncode == 0, res.stderr
        assert "this pickle ran" not in res.stdout + res.stderr
    assert load_history(tmp_path / "out") == evil
