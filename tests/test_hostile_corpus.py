"""Ravex on a corpus of damaged and hostile checkpoints (issue 11).

Each case (tests/hostile/make_corpus.py) is one copy of a fixture with one
thing wrong. For each, ``inspect`` and ``convert --to safetensors`` run in an
isolated child (tests/hostile/runner.py) and the outcome must be one of:

- a :class:`RavexError` subclass whose message names a file of the checkpoint
  and which has a hint (on the CLI: ``error:``/``hint:``, exit code >= 2, no
  traceback);
- success, where the damage does not matter: the output is byte-identical to
  what the undamaged source gives (for ``inspect``: the same description), or
  the case is listed in ``UNDETECTABLE`` with the reason the format cannot
  tell.

Never a bare Python exception, a crash, a run over the time limit, a file
written outside DST (or a change to SRC), or a half-written DST left behind
on error. Set ``RAVEX_HOSTILE_REPORT=<file>`` to get one JSON line per case.
"""

from __future__ import annotations

import hashlib
import json
import os
import re
import subprocess
from pathlib import Path
from typing import Any

import pytest
from conftest import REPO, ravex_bin
from hostile import runner
from hostile.make_corpus import PWNED, Case, base_paths, build, cases

pytestmark = pytest.mark.slow

CASES = cases()

# Damage a format cannot detect, by case name, with the reason. Success with an
# output that differs from the undamaged source's is accepted only for these.
UNDETECTABLE: dict[str, str] = {
    **{f"st_single/flip-data-{i}": "safetensors stores no checksum: a flipped bit in tensor bytes is a valid file" for i in range(3)},
    **{f"st_sharded/flip-data-{i}": "safetensors stores no checksum: a flipped bit in tensor bytes is a valid file" for i in range(2)},
    **{f"st_single/flip-header-{i}": "safetensors stores no checksum: a flip in the JSON header that still parses (a name, a metadata value) "
       "gives a valid, different file" for i in range(4)},
    **{f"dcp/flip-metadata-{i}": "DCP's .metadata is a bare pickle with no checksum: a flip that still unpickles (a name, a value) "
       "gives a valid, different checkpoint" for i in range(5)},
}

# Cases also run through the `ravex` command (slower: a fresh interpreter each):
# every path trick and foreign pickle, and every 6th of the rest.
CLI_SAMPLE = {c.name for i, c in enumerate(CASES) if c.kind in ("path", "code") or i % 6 == 0}

_INSPECT_IGNORED = ("path", "files", "bytes_on_disk", "reasons", "notes")


def _tree(root: Path) -> dict[str, str]:
    """Every entry under ``root``: file -> sha256, symlink -> its target, dir -> 'dir'."""
    out: dict[str, str] = {}
    if not root.exists():
        return out
    for p in sorted(root.rglob("*")):
        rel = str(p.relative_to(root))
        if p.is_symlink():
            out[rel] = "link:" + os.readlink(p)
        elif p.is_dir():
            out[rel] = "dir"
        else:
            out[rel] = hashlib.sha256(p.read_bytes()).hexdigest()
    return out


def _inspect_view(info: dict[str, Any]) -> dict[str, Any]:
    return {k: v for k, v in info.items() if k not in _INSPECT_IGNORED}


def _names_a_file(text: str, work: Path, src_tree: dict[str, str]) -> bool:
    if str(work) in text:
        return True
    names = {Path(rel).name for rel in src_tree} | {"src"}
    return any(re.search(rf"(^|[\s/'\"(]){re.escape(n)}($|[\s:'\",)])", text) for n in names if len(n) > 2)


@pytest.fixture(scope="session")
def bases(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    return base_paths(tmp_path_factory.mktemp("hostile-bases"), ravex_bin())


_BASELINES: dict[str, dict[str, Any]] = {}


def _baseline(key: str, bases: dict[str, Path], tmp: Path) -> dict[str, Any]:
    """inspect and the safetensors output of the undamaged base (once per session)."""
    if key not in _BASELINES:
        c = Case(f"{key}/baseline", key, "baseline", lambda s, w: s / bases[key].name if bases[key].is_file() else s)
        work = tmp / f"baseline-{key}"
        src = build(c, work, bases)
        dst = work / "out" / "model.safetensors"
        ins, conv = runner.run("inspect", src), runner.run("convert", src, dst)
        assert ins.status == "ok" and conv.status == "ok", f"the undamaged base {key} fails: {ins.describe()} / {conv.describe()}"
        _BASELINES[key] = {"inspect": _inspect_view(ins.value), "output": dst.read_bytes()}
    return _BASELINES[key]


def _check_error(label: str, out: runner.Outcome, case: Case, work: Path, src_tree: dict[str, str], problems: list[str]) -> None:
    if out.status in ("exception", "crash", "timeout"):
        problems.append(f"{label}: {out.describe()}")
        return
    if out.status != "ravex_error":
        return
    if "File too large" in out.message or "Errno 27" in out.message:
        problems.append(f"{label}: ran into the test's {runner.FILE_SIZE_LIMIT >> 20} MiB file-size limit: what it writes is not bounded "
                        f"against what the source holds ({out.message[:120]!r})")
    if "MemoryError" in out.message:
        problems.append(f"{label}: ran out of the test's address space (memory not bounded): {out.message[:160]!r}")
    if not _names_a_file(out.message, work, src_tree):
        problems.append(f"{label}: the message names no file of the checkpoint: {out.message[:160]!r}")
    if not out.hint:
        problems.append(f"{label}: no hint ({out.error_class}: {out.message[:120]!r})")
    if out.exit_code is None or out.exit_code < 2:
        problems.append(f"{label}: exit code {out.exit_code}")
    if case.expect and out.error_class != case.expect:
        problems.append(f"{label}: {out.error_class} where {case.expect} is right ({out.message[:120]!r})")


def _check_cli(src: Path, work: Path, problems: list[str]) -> None:
    env = dict(os.environ, NO_COLOR="1", COLUMNS="200", RAYON_NUM_THREADS="1")
    dst = work / "out" / "cli.safetensors"
    for label, args in (("cli inspect", ["inspect", str(src)]), ("cli convert", ["convert", str(src), str(dst), "--to", "safetensors", "-q"])):
        try:
            res = subprocess.run([ravex_bin(), *args], capture_output=True, text=True, timeout=60, env=env, check=False)
        except subprocess.TimeoutExpired:
            problems.append(f"{label}: timeout (> 60 s)")
            continue
        if res.returncode < 0:
            problems.append(f"{label}: killed by signal {-res.returncode}")
        elif res.returncode == 1 or (res.returncode >= 2 and ("error:" not in res.stderr or "hint:" not in res.stderr)):
            problems.append(f"{label}: exit {res.returncode} without error:/hint: lines: {res.stderr[-300:]!r}")
        if "Traceback" in res.stderr:
            problems.append(f"{label}: traceback on stderr: {res.stderr.strip().splitlines()[-1][:200]!r}")
    if dst.exists():
        dst.unlink()


def _report(case: Case, problems: list[str], outcomes: dict[str, runner.Outcome]) -> None:
    path = os.environ.get("RAVEX_HOSTILE_REPORT")
    if path:
        with open(path, "a") as f:
            f.write(json.dumps({"case": case.name, "format": case.format, "kind": case.kind, "problems": problems,
                                "outcomes": {k: o.describe() for k, o in outcomes.items()},
                                "seconds": {k: round(o.seconds, 3) for k, o in outcomes.items()}}) + "\n")


@pytest.mark.parametrize("case", CASES, ids=[c.name for c in CASES])
def test_hostile_case(case: Case, bases: dict[str, Path], tmp_path: Path, tmp_path_factory: pytest.TempPathFactory) -> None:
    baseline = _baseline(case.base, bases, tmp_path_factory.getbasetemp()) if case.base else None
    work = tmp_path / "work"
    src = build(case, work, bases)
    src_before, outside_before = _tree(work / "src"), _tree(work / "outside")
    dst = work / "out" / "model.safetensors"
    outcomes = {"inspect": runner.run("inspect", src), "convert": runner.run("convert", src, dst)}
    problems: list[str] = []

    for label, out in outcomes.items():
        _check_error(label, out, case, work, src_before, problems)
        if out.status != "ok":
            continue
        if case.must_fail and label == "convert":
            problems.append(f"{label}: succeeded on input it must refuse ({case.kind})")
            continue
        if case.inspect_must_fail and label == "inspect":
            problems.append(f"{label}: succeeded on input it must refuse ({case.kind})")
            continue
        if baseline is None or case.must_fail:
            continue  # crafted input: nothing to compare with (inspect of metadata it does not check may differ)
        # inspect reads metadata only: where it succeeds it must say what it says of the undamaged source
        same = _inspect_view(out.value) == baseline["inspect"] if label == "inspect" else dst.read_bytes() == baseline["output"]
        if not same and case.name not in UNDETECTABLE:
            problems.append(f"{label}: succeeded with a result that differs from the undamaged source's (silently wrong)")

    # the filesystem: SRC untouched, nothing outside DST, no half-written DST
    if _tree(work / "src") != src_before:
        problems.append("SRC was modified")
    if (work / "outside" / PWNED).exists():
        problems.append("a pickle ran code (outside/PWNED was created)")
    elif _tree(work / "outside") != outside_before:
        problems.append("files outside the checkpoint and DST were changed")
    if sorted(p.name for p in work.iterdir()) != ["out", "outside", "src"]:
        problems.append(f"something was written beside SRC/DST: {sorted(p.name for p in work.iterdir())}")
    left = sorted(p.name for p in (work / "out").iterdir())
    if outcomes["convert"].status == "ok" and left != ["model.safetensors"]:
        problems.append(f"DST's directory holds {left} after success")
    if outcomes["convert"].status not in ("ok", "timeout") and left:
        problems.append(f"a failed convert left {left} behind")

    if case.name in CLI_SAMPLE:
        _check_cli(src, work, problems)
    _report(case, problems, outcomes)
    assert not problems, "\n".join(problems)


# Inputs the fuzzers found (fuzz/crashes/<harness>/<name>), kept as regressions:
# through the harness, only a RavexError may escape, and not one caused by
# running out of memory.
FUZZ_FINDINGS = sorted((REPO / "fuzz" / "crashes").glob("*/*"))


@pytest.mark.parametrize("finding", FUZZ_FINDINGS, ids=[f"{p.parent.name}/{p.name}" for p in FUZZ_FINDINGS])
def test_fuzz_finding(finding: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("RAVEX_FUZZ_TMP", str(tmp_path))
    out = runner.run("fuzz", finding, Path(finding.parent.name))
    assert out.status in ("ok", "ravex_error"), f"{out.describe()}\n{out.traceback}"
    assert "MemoryError" not in out.message, out.message
