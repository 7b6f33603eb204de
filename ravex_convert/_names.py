"""Matching two sets of tensor names that differ by a wrapper's prefix.

A model saved inside a wrapper carries the wrapper's prefix on every name: DDP's
``module.``, torch.compile's ``_orig_mod.``, both (``module._orig_mod.``), or an outer
module's attribute (``model.``). Two checkpoints of the same model (or a checkpoint and a
live model) then differ by that prefix alone. :func:`prefix_match` finds it when it is
the whole difference; :func:`prefix_hint` says so when it explains most of a larger one.
"""

from __future__ import annotations

__all__ = ["WRAPPER_PREFIXES", "prefix_hint", "prefix_match"]

WRAPPER_PREFIXES = ("module.", "_orig_mod.", "model.", "_fsdp_wrapped_module.")


def _common_prefix(names: list[str]) -> str:
    """The first name component all of ``names`` share, with its dot ('' when they do not)."""
    firsts = {n.split(".", 1)[0] for n in names}
    if len(firsts) == 1 and names and all("." in n for n in names):
        return firsts.pop() + "."
    return ""


def _prefixes(names: list[str]) -> list[str]:
    """'' and each common leading prefix of ``names`` (up to two components: module._orig_mod.)."""
    out, p = [""], ""
    for _ in range(2):
        nxt = _common_prefix([n[len(p):] for n in names])
        if not nxt:
            break
        p += nxt
        out.append(p)
    return out


def prefix_match(a: list[str], b: list[str]) -> tuple[str, str] | None:
    """``(pa, pb)``: every name of ``a`` starts with ``pa``, every one of ``b`` with ``pb``, and
    without them the two are the same names (``("", "")`` when they are already); None when no
    common prefix explains the difference."""
    if len(set(a)) != len(set(b)):
        return None
    for pa in _prefixes(a):
        for pb in _prefixes(b):
            if {n[len(pa):] for n in a} == {n[len(pb):] for n in b}:
                return pa, pb
    return None


def prefix_hint(a: list[str], b: list[str], a_is: str, b_is: str) -> str | None:
    """When most of one side's names are the other's behind a wrapper prefix, a sentence saying
    so (the difference is more than that prefix: :func:`prefix_match` found none)."""
    sa, sb = set(a), set(b)
    for p in WRAPPER_PREFIXES:
        for side, names, other in ((a_is, a, sb), (b_is, b, sa)):
            if other and sum(1 for n in names if n.startswith(p) and n[len(p):] in other) * 2 > len(other):
                return f"most of the {side} names start with '{p}' and match the other side's without it, but the names differ by more than that prefix"
    return None
