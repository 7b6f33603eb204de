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
    matched: list[str] = field(default_factory=list)  # how the two sides' names were matched, where it is not plain

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
                "only_in_b": self.only_in_b, "differing_tensors": len(self.differences), "matched": list(self.matched),
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
           param_names_a: list[str] | None = None, param_names_b: list[str] | None = None,
           param_names: list[str] | None = None) -> VerifyResult:
    """Compare every logical tensor of ``a`` and ``b``. The result lists each
    differing tensor (missing, other shape, or how many elements differ and
    where the first is); ``identical`` when there is none and at least one
    tensor was compared: a name on one side only is a difference, and two
    checkpoints with no tensor at all are not identical (nothing was shown to
    be equal) but differ by ``nothing_compared``.

    Names are matched by meaning: the optimizer's state by parameter name,
    wherever each format keeps it (``optim`` or ``optimizer``, nested or
    flattened); names that differ by a wrapper's prefix alone (``module.``,
    ``_orig_mod.``) are matched without it. ``matched`` says how, where that
    is not plain. Checksums a format records and its reader does not check
    (the registry's ``verify_chunks``: a native store's) are checked first.

    Args:
        a, b: the two checkpoints, any formats Ravex reads.
        weights_only: compare the model weights only, not the optimizer state.
        atol, rtol: absolute and relative tolerance (0, 0: bit-exact).
        tag_a, tag_b: the DeepSpeed tag to read on each side (None: the one ``latest`` names).
        index_a, index_b: the checkpoint of a Ravex store on each side (-1: the newest complete one).
        param_names: the parameter names in optimizer order, for each side
            whose optimizer state is keyed by position (a torch.save file);
            ``param_names_a`` / ``param_names_b`` for one side only.

    Returns:
        A :class:`VerifyResult` (``identical``, ``differences``, ``compared``, ``matched``, ...).

    Raises:
        RavexError: a side cannot be read, or its stored checksums do not match."""
    ca = read_checkpoint(a, tag=tag_a, index=index_a, param_names=param_names_a or _if_taken(a, param_names))
    cb = read_checkpoint(b, tag=tag_b, index=index_b, param_names=param_names_b or _if_taken(b, param_names))
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
    result.matched += [m for side, c in (("a", ca), ("b", cb)) if (m := _optimizer_said(side, c, weights_only))]
    b_named = _prefixed(names_a, names_b, result)  # b's names as a's: which name of b each one is
    result.tensors_a, result.tensors_b = len(names_a), len(names_b)
    if not names_a and not names_b:
        what = "model weights" if weights_only else "tensors (weights or optimizer state)"
        result.differences.append(Difference("(nothing)", "nothing_compared", f"neither {a} nor {b} holds any {what}: nothing was compared"))
        return result
    for name in names_a:
        if name not in b_named:
            result.differences.append(Difference(_display(name), "missing_in_b", f"only in {a}"))
            continue
        ta, tb = ca.resolve(name), cb.resolve(b_named[name])
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
    for name, in_b in b_named.items():
        if name not in set_a:
            result.differences.append(Difference(_display(in_b), "missing_in_a", f"only in {b}"))
    return result


def _if_taken(path: str | Path, names: list[str] | None) -> list[str] | None:
    """``names`` for a checkpoint whose format takes parameter names (position-keyed optimizer state), else None."""
    if names is None:
        return None
    from .detect import detect

    return names if "param_names" in registry.get(detect(path).format).options else None


def _fqn(name: str) -> str:
    return name[len(MODEL):] if name.startswith(MODEL) else name.split("/", 2)[2]


def _renamed(name: str, old: str, new: str) -> str:
    """``name`` with its parameter name's prefix ``old`` replaced by ``new``."""
    if name.startswith(MODEL):
        return MODEL + new + name[len(MODEL) + len(old):]
    _, state, fqn = name.split("/", 2)
    return f"{OPTIM}{state}/{new}{fqn[len(old):]}"


def _prefixed(names_a: list[str], names_b: list[str], result: VerifyResult) -> dict[str, str]:
    """b's names under a's: b's own, or, when the two sides' parameter names differ by a wrapper's
    prefix alone, with b's prefix replaced by a's (said in ``result.matched``)."""
    from ._names import prefix_match

    fa = sorted({_fqn(n) for n in names_a if n.startswith(MODEL)})
    fb = sorted({_fqn(n) for n in names_b if n.startswith(MODEL)})
    found = prefix_match(fa, fb) if set(fa) != set(fb) else None
    if found is None or found == ("", ""):
        return {n: n for n in names_b}
    pa, pb = found
    out = {}
    for n in names_b:
        f = _fqn(n)
        out[_renamed(n, pb, pa) if f.startswith(pb) else n] = n
    say = (f"b's parameter names start with '{pb}'" if pb else "b's have no prefix") + (f", a's with '{pa}'" if pa else ", a's have none")
    result.matched.append(f"{say}: matched without the prefix")
    return out


def _optimizer_said(side: str, c: Checkpoint, weights_only: bool) -> str | None:
    """Where a side kept its optimizer, when that is not Ravex's portable layout: compared by parameter name all the same."""
    from ._layout import SOURCE_KEY, StateLayout

    if weights_only or not any(n.startswith(OPTIM) for n in c.tensors) or SOURCE_KEY not in c.source:
        return None
    layout = StateLayout.from_json(c.source[SOURCE_KEY])
    if layout.optim == ("optim",) and not layout.optim_flat:
        return None
    where = ".".join(map(str, layout.optim))
    return f"{side}'s optimizer state is under '{where}'{' (flattened)' if layout.optim_flat else ''}: compared by parameter name"
