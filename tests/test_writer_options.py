"""A writer declares its own options, and convert and the CLI take them from the
registry: a new writable format is one module plus its registration line.

The fake formats here are registered for one test each (``registry.registered``)
and gone afterwards (conftest fails a test that leaves the registry changed).
"""

from __future__ import annotations

import json
import struct
from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
from click.testing import CliRunner
from conftest import DATA

import ravex_convert
from ravex.cli import main
from ravex_convert import ConvertOptions
from ravex_convert.convert import materialize
from ravex_convert.errors import CorruptCheckpointError, RavexError
from ravex_convert.formats import registry
from ravex_convert.formats.dcp.options import DcpOptions
from ravex_convert.formats.options import Flag, WriteOptions, option, parse_size
from ravex_convert.formats.zero.options import ZeroOptions
from ravex_convert.info import CheckpointInfo
from ravex_convert.model import MODEL, Box, Checkpoint, Chunk, LogicalTensor

SRC = DATA / "safetensors_single" / "checkpoint" / "model.safetensors"

# ---------------------------------------------------------------- a fake writable format: one module's worth, one registration

GREETING = Flag("--greeting", metavar="WORD", help="fakew: the word the output starts with.")
COPIES = Flag("--copies", type=int, range=(1, 4), help="fakew: how many times each tensor is written.")


@dataclass(frozen=True)
class FakeOptions(WriteOptions):
    greeting: str = option("hello", GREETING)
    copies: int = option(1, COPIES)


def _write_fake(ckpt: Checkpoint, dst: Path, opts: Any, progress: Any = None, *, greeting: str, copies: int) -> dict[str, Any]:
    tensors = {n: list(struct.unpack(f"<{t.numel}f", materialize(t))) * copies for n, t in ckpt.tensors.items() if t.dtype == "float32"}
    dst.write_text(json.dumps({"greeting": greeting, "world_size": opts.world_size, "tensors": tensors}))
    return {"tensors": len(tensors), "bytes": dst.stat().st_size, "files": [dst.name]}


def _never(path: Path) -> list[str] | None:
    return None


def _no_read(path: Path) -> Checkpoint:
    raise AssertionError("not read")


def _no_describe(path: Path, reasons: list[str]) -> CheckpointInfo:
    raise AssertionError("not described")


FAKEW = registry.Format("fakew", _never, _no_read, _no_describe, title="fake outputs", writer=_write_fake, write_options=FakeOptions,
                        suffixes=(".fakew",), listed=50)


@pytest.fixture
def fakew() -> Iterator[registry.Format]:
    with registry.registered(FAKEW) as fmt:
        yield fmt


def _cli(*args: str | Path) -> Any:
    return CliRunner().invoke(main, [str(a) for a in args])


def test_a_registered_writer_is_a_target_with_its_options_in_help(fakew: registry.Format) -> None:
    res = _cli("convert", "--help")
    assert res.exit_code == 0, res.output
    assert "fakew" in res.output.split("--to [", 1)[1].split("]", 1)[0]
    assert "--greeting WORD" in res.output and "fakew: the word the output starts with." in res.output
    assert "--copies INTEGER RANGE" in res.output and "1<=x<=4" in res.output
    assert "fakew" in registry.targets() and "fakew" not in registry.reshardable()
    assert "--greeting" not in _cli("reshard", "--help").output  # not a format reshard writes


def test_the_cli_option_reaches_the_writer(fakew: registry.Format, tmp_path: Path) -> None:
    res = _cli("convert", SRC, tmp_path / "out", "--to", "fakew", "--greeting", "hi", "--copies", "2", "--world-size", "3", "--json")
    assert res.exit_code == 0, res.output
    assert json.loads(res.stdout)["to"] == "fakew"
    written = json.loads((tmp_path / "out").read_text())
    assert (written["greeting"], written["world_size"]) == ("hi", 3)
    expected = ravex_convert.load_state_dict(SRC)
    for name, t in expected.items():
        assert written["tensors"][MODEL + name] == t.flatten().tolist() * 2
    # left out: the option's default; and the format is chosen from the name it declares
    res = _cli("convert", SRC, tmp_path / "out.fakew")
    assert res.exit_code == 0, res.output
    assert json.loads((tmp_path / "out.fakew").read_text())["greeting"] == "hello"
    assert "writing fakew (no --to given; chosen from the name out.fakew)" in res.stderr
    # the click type checks the range before anything runs
    res = _cli("convert", SRC, tmp_path / "x", "--to", "fakew", "--copies", "9")
    assert res.exit_code == 2 and "--copies" in res.output


def test_an_option_of_another_format_is_refused(fakew: registry.Format, tmp_path: Path) -> None:
    res = _cli("convert", SRC, tmp_path / "out.safetensors", "--greeting", "hi")
    assert res.exit_code == 2
    assert "error: --greeting hi applies to fakew outputs, not safetensors" in res.stderr
    assert "hint: leave --greeting out, or write --to fakew" in res.stderr
    assert not (tmp_path / "out.safetensors").exists()
    # and the other way: a built-in format's flag for the fake one
    res = _cli("convert", SRC, tmp_path / "out", "--to", "fakew", "--compression", "zstd")
    assert res.exit_code == 2 and "error: --compression zstd applies to native outputs, not fakew" in res.stderr


def test_the_python_api_takes_the_options_object_or_its_fields(fakew: registry.Format, tmp_path: Path) -> None:
    ravex_convert.convert(SRC, tmp_path / "a", "fakew", writer=FakeOptions(greeting="obj"))
    ravex_convert.convert(SRC, tmp_path / "b", "fakew", ConvertOptions(world_size=2), writer={"greeting": "dict"})
    assert [json.loads((tmp_path / n).read_text())["greeting"] for n in "ab"] == ["obj", "dict"]
    with pytest.raises(RavexError, match="DcpOptions are not the options of a fakew output"):
        ravex_convert.convert(SRC, tmp_path / "c", "fakew", writer=DcpOptions())
    with pytest.raises(RavexError, match="'colour' is not an option of any format Ravex writes"):
        ravex_convert.convert(SRC, tmp_path / "d", "fakew", writer={"colour": "red"})


def test_a_format_registered_in_a_test_is_gone_after_it() -> None:
    # (fakew was registered by the tests above, each for its own duration)
    assert "fakew" not in registry.targets()
    res = _cli("convert", "--help")
    assert "--greeting" not in res.output and "fakew" not in res.output
    with registry.registered(FAKEW):
        assert "--greeting" in _cli("convert", "--help").output
    assert "--greeting" not in _cli("convert", "--help").output


def test_builtin_options_come_from_each_format() -> None:
    flags = {f.name: [fl.name for _, fl, _ in f.write_options.flags()] for f in registry.formats() if f.writes}
    assert flags == {
        "native": ["--compression"], "dcp": ["--metadata-form", "--layout"], "hf_trainer": ["--max-shard-size", "--zero-stage", "--precision"],
        "zero": ["--zero-stage", "--precision", "--buffers"], "accelerate": [], "safetensors": ["--max-shard-size"], "torch_save": ["--layout"],
    }
    # a flag two formats take is one Flag, declared once
    layouts = {fl for f in registry.formats() for _, fl, _ in f.write_options.flags() if fl.name == "--layout"}
    assert len(layouts) == 1
    # values are parsed where the options are made
    assert registry.get("safetensors").write_options(max_shard_size="5GB").max_shard_size == parse_size("5GB") == 5 * 1000**3  # type: ignore[call-arg]
    assert ZeroOptions(buffers="a, b").buffers == ["a", "b"]  # type: ignore[arg-type]
    with pytest.raises(RavexError, match="--to zero needs --zero-stage 1, 2 or 3"):
        ZeroOptions().check()


@dataclass(frozen=True)
class _Clash(WriteOptions):
    compression: str = option("zstd", Flag("--compression", help="clash: another meaning."))


def test_a_flag_two_formats_declare_must_be_declared_alike() -> None:
    clash = registry.Format("clash", _never, _no_read, _no_describe, title="clash", writer=_write_fake, write_options=_Clash)
    with pytest.raises(ValueError, match="--compression is declared by 'native' already, differently"):
        registry.register(clash)
    assert "clash" not in registry.names()


# ---------------------------------------------------------------- checksums a format records are checked by convert too

MARKER = "summed.json"


def _summed_sniff(path: Path) -> list[str] | None:
    return [f"found {MARKER}"] if path.is_dir() and (path / MARKER).is_file() else None


def _summed_read(path: Path) -> Checkpoint:
    doc = json.loads((path / MARKER).read_text())
    ckpt = Checkpoint("summed", path, world_size=1, step=1)
    for name, values in doc["tensors"].items():
        data = struct.pack(f"<{len(values)}f", *values)
        ckpt.add(LogicalTensor(MODEL + name, (len(values),), "float32", [Chunk(Box((0,), (len(values),)), "float32", data=data)]))
    ckpt.source["sums"] = doc["sums"]
    return ckpt


def _summed_describe(path: Path, reasons: list[str]) -> CheckpointInfo:
    return CheckpointInfo("summed", "v1", str(path), world_size=1, reasons=reasons)


CHECKED: list[list[str]] = []


def _summed_verify(ckpt: Checkpoint, names: Iterable[str] | None) -> int:
    """Like the native store's: the recorded sum of each tensor's values, checked before use."""
    wanted = list(ckpt.tensors if names is None else names)
    CHECKED.append(wanted)
    for name in wanted:
        values = struct.unpack(f"<{ckpt.tensors[name].numel}f", materialize(ckpt.tensors[name]))
        if sum(values) != ckpt.source["sums"][name[len(MODEL):]]:
            raise CorruptCheckpointError(f"{ckpt.path}: tensor '{name}' does not match its recorded sum", hint="copy the checkpoint again")
    return len(wanted)


@pytest.fixture
def summed(tmp_path: Path) -> Iterator[Path]:
    d = tmp_path / "summed"
    d.mkdir()
    (d / MARKER).write_text(json.dumps({"tensors": {"w": [1.0, 2.0, 3.0]}, "sums": {"w": 6.0}}))
    fmt = registry.Format("summed", _summed_sniff, _summed_read, _summed_describe, title="summed checkpoints", verify_chunks=_summed_verify)
    CHECKED.clear()
    with registry.registered(fmt, before="safetensors"):
        yield d


def test_a_formats_checksums_are_checked_by_convert_load_and_verify(summed: Path, tmp_path: Path) -> None:
    ravex_convert.convert(summed, tmp_path / "good.safetensors")
    assert CHECKED == [["model/w"]]
    (summed / MARKER).write_text(json.dumps({"tensors": {"w": [1.0, 2.0, 4.0]}, "sums": {"w": 6.0}}))
    with pytest.raises(CorruptCheckpointError, match="tensor 'model/w' does not match its recorded sum"):
        ravex_convert.convert(summed, tmp_path / "bad.safetensors")
    assert not (tmp_path / "bad.safetensors").exists()
    res = _cli("convert", summed, tmp_path / "bad.pt")
    assert res.exit_code != 0 and "does not match its recorded sum" in res.stderr
    with pytest.raises(CorruptCheckpointError, match="does not match its recorded sum"):
        ravex_convert.load_state_dict(summed)
    with pytest.raises(CorruptCheckpointError, match="does not match its recorded sum"):
        ravex_convert.verify(summed, tmp_path / "good.safetensors")
    # a dry run reads no tensor bytes, so it checks none
    ravex_convert.convert(summed, tmp_path / "plan.pt", options=ConvertOptions(dry_run=True))
