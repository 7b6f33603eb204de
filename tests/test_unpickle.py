"""The restricted unpickler: allowed classes become records, anything else is refused
before it can run."""

from __future__ import annotations

import os
import pickle
import zipfile
from pathlib import Path

import pytest
from conftest import run_ravex

from ravex_convert._torchfile.unpickle import DType, Record, restricted_loads
from ravex_convert.errors import CorruptCheckpointError, UnsafeCheckpointError


class _Evil:
    def __init__(self, target: str):
        self.target = target

    def __reduce__(self):  # type: ignore[no-untyped-def]
        return (os.system, (f"touch {self.target}",))


def _evil_pt(path: Path, target: Path) -> None:
    """A torch.save-shaped zip whose pickle would create ``target`` if executed."""
    payload = pickle.dumps({"model": {"w": _Evil(str(target))}}, protocol=2)
    with zipfile.ZipFile(path, "w", zipfile.ZIP_STORED) as z:
        z.writestr("archive/data.pkl", payload)
        z.writestr("archive/byteorder", "little")
        z.writestr("archive/version", "3\n")


def test_code_in_pickle_is_refused_and_not_run(tmp_path: Path) -> None:
    target = tmp_path / "pwned"
    with pytest.raises(UnsafeCheckpointError) as exc:
        restricted_loads(pickle.dumps(_Evil(str(target))), "evil.pkl")
    assert "'posix.system'" in str(exc.value) or "'os.system'" in str(exc.value)
    assert "evil.pkl" in str(exc.value)
    assert not target.exists()


def test_cli_refuses_evil_torch_save_file(tmp_path: Path) -> None:
    target = tmp_path / "pwned"
    pt = tmp_path / "model.pt"
    _evil_pt(pt, target)
    res = run_ravex("inspect", pt)
    assert res.returncode == UnsafeCheckpointError.exit_code == 7
    assert "does not allow" in res.stderr and "model.pt" in res.stderr
    assert "system" in res.stderr
    assert "hint:" in res.stderr
    assert res.stdout == ""
    assert not target.exists()


def test_allowed_classes_become_records() -> None:
    import collections

    data = pickle.dumps(collections.OrderedDict(a=(1, 2), b={3}), protocol=4)
    assert restricted_loads(data, "x") == collections.OrderedDict(a=(1, 2), b={3})
    # torch.float32 is pickled as a global; it comes back as a plain DType.
    fake = b"\x80\x02ctorch\nbfloat16\nq\x00."
    assert restricted_loads(fake, "x") == DType("bfloat16")
    enum = b"\x80\x02cdeepspeed.runtime.zero.config\nZeroStageEnum\nK\x02\x85R."
    rec = restricted_loads(enum, "x")
    assert isinstance(rec, Record) and rec.cls.endswith("ZeroStageEnum") and rec.args == (2,)


def test_garbage_is_corrupt_not_crash() -> None:
    with pytest.raises(CorruptCheckpointError, match="cannot be read"):
        restricted_loads(b"\x80\x04not a pickle at all", "junk.pkl")
