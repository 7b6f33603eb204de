"""``verify``: do two checkpoints, of any formats, hold the same state?

Tensor by tensor (weights, and optimizer state unless ``weights_only``), each
compared by the Rust core in bounded memory: bit-exact by default, or within
``atol``/``rtol``. Tied names are followed to the tensor they share.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from . import _core
from ._engine import SourceTable
from .detect import read_checkpoint
from .errors import CorruptCheckpointError, RavexError
from .formats import registry
from .model import MODEL, OPTIM, Checkpoint, LogicalTensor

__all__ = ["Difference", "VerifyResult", "verify"]


@dataclass
class Difference:
    name: str
    kind: str  # "values" | "missing_in_a" | "missing_in_b" | "shape" | "nothing_compared"
    detail: str
    count: int = 0  # differing elements (values)
    first_index: list[int] | None = None  # of the first differing element
    max_abs_diff: float | None = None

    def to_json(self) -> dict[str, Any]:
        return {"name": self.name, "kind": self.kind, "detail": self.detail, "count": self.count,
                "first_index": self.first_index, "max_abs_diff": self.max_abs_diff}


@dataclass
class VerifyResult:
    a: str
    b: str
    compared: int = 0
    elements: int = 0
    differences: list[Difference] = field(default_factory=list)
    exact: bool = True
    tensors_a: int = 0  # names (tensors and tied names) on each side, of the kinds compared
    tensors_b: int = 0

    @property
    def identical(self) -> bool:
        """Every tensor of each side is in the other with the same values, and
        there was at least one: comparing nothing proves nothing."""
        return not self.differences and self.compared > 0

    @property
    def only_in_a(self) -> int:
        return sum(d.kind == "missing_in_b" for d in self.differences)

    @property
    def only_in_b(self) -> int:
        return sum(d.kind == "missing_in_a" for d in self.differences)

    def to_json(self) -> dict[str, Any]:
        return {"a": self.a, "b": self.b, "identical": self.identical, "exact": self.exact, "compared": self.compared,
                "elements": self.elements, "tensors_a": self.tensors_a, "tensors_b": self.tensors_b, "only_in_a": self.only_in_a,
                "only_in_b": self.only_in_b, "differing_tensors": len(self.differences),
                "differences": [d.to_json() for d in self.differences]}


def _names(ckpt: Checkpoint, weights_only: bool) -> list[str]:
    keep = (MODEL,) if weights_only else (MODEL, OPTIM)
    return [n for n in list(ckpt.tensors) + list(ckpt.aliases) if n.startswith(keep)]


def _unravel(index: int, shape: tuple[int, ...]) -> list[int]:
    out = []
    for s in reversed(shape):
        out.append(index % s if s else 0)
        index //= s if s else 1
    return list(reversed(out))


def _display(name: str) -> str:
    if name.startswith(MODEL):
        return name[len(MODEL):]
    _, state, fqn = name.split("/", 2)
    return f"optim.{state}/{fqn}"


def _compare(ta: LogicalTensor, tb: LogicalTensor, atol: float, rtol: float) -> tuple[int, int | None, float]:
    table = SourceTable()
    a = [table.chunk(c) for c in ta.chunks]
    b = [table.chunk(c) for c in tb.chunks]
    n, first, max_abs = _core.compare(table.sources, list(ta.shape), a, b, atol=atol, rtol=rtol, exact=(atol == 0 and rtol == 0))
    return int(n), first, float(max_abs)


def verify(a: str | Path, b: str | Path, *, weights_only: bool = False, atol: float = 0.0, rtol: float = 0.0,
           tag_a: str | None = None, tag_b: str | None = None, index_a: int = -1, index_b: int = -1,
           param_names_a: list[str] | None = None, param_names_b: list[str] | None = None) -> VerifyResult:
    """Compare every logical tensor of ``a`` and ``b``. The result lists each
    differing tensor (missing, other shape, or how many elements differ and
    where the first is); ``identical`` when there is none and at least one
    tensor was compared: a name on one side only is a difference, and two
    checkpoints with no tensor at all are not identical (nothing was shown to
    be equal) but differ by ``nothing_compared``."""
    ca = read_checkpoint(a, tag=tag_a, index=index_a, param_names=param_names_a)
    cb = read_checkpoint(b, tag=tag_b, index=index_b, param_names=param_names_b)
    for c in (ca, cb):
        if not weights_only and "optimizer_error" in c.source:
            raise c.source["optimizer_error"]
        check = registry.get(c.format).verify_chunks  # a format that records checksums read does not check (the native store)
        if check is not None:
            check(c, _names(c, weights_only))
    if not (math.isfinite(atol) and atol >= 0 and math.isfinite(rtol) and rtol >= 0):
        raise RavexError(f"--atol {atol} --rtol {rtol}: tolerances must be finite numbers >= 0", hint="e.g. --atol 1e-6 --rtol 0, or neither for bit-exact")
    result = VerifyResult(str(a), str(b), exact=(atol == 0 and rtol == 0))
    names_a, names_b = _names(ca, weights_only), _names(cb, weights_only)
    result.tensors_a, result.tensors_b = len(names_a), len(names_b)
    if not names_a and not names_b:
        what = "model weights" if weights_only else "tensors (weights or optimizer state)"
        result.differences.append(Difference("(nothing)", "nothing_compared", f"neither {a} nor {b} holds any {what}: nothing was compared"))
        return result
    set_b = set(names_b)
    for name in names_a:
        if name not in set_b:
            result.differences.append(Difference(_display(name), "missing_in_b", f"only in {a}"))
            continue
        ta, tb = ca.resolve(name), cb.resolve(name)
        if ta.shape != tb.shape:
            result.differences.append(Difference(_display(name), "shape", f"shape {list(ta.shape)} vs {list(tb.shape)}"))
            continue
        try:
            n, first, max_abs = _compare(ta, tb, atol, rtol)
        except _core.CorruptSourceError as exc:
            files = sorted({str(c.file) for c in ta.chunks + tb.chunks if c.file is not None})
            source = exc.path or ", ".join(files) or f"{a} or {b}"
            raise CorruptCheckpointError(f"{source}: tensor '{_display(name)}': the file does not hold what the checkpoint's metadata says "
                                         f"({str(exc).split(chr(10))[0]})", hint="a file is truncated or damaged; copy the checkpoint again",
                                         path=exc.path) from None
        result.compared += 1
        result.elements += ta.numel
        if n:
            where = _unravel(first, ta.shape) if first is not None else None
            dtypes = f" ({ta.dtype} vs {tb.dtype})" if ta.dtype != tb.dtype else ""
            result.differences.append(Difference(_display(name), "values", f"{n} of {ta.numel} elements differ{dtypes}", n, where, max_abs))
    set_a = set(names_a)
    for name in names_b:
        if name not in set_a:
            result.differences.append(Difference(_display(name), "missing_in_a", f"only in {b}"))
    return result
