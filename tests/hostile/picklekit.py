"""Writing pickles opcode by opcode, and rewriting values inside real ones.

The corpus needs pickles no well-behaved pickler writes (a tensor whose stride
reaches past its storage, a REDUCE of ``os.system``), and small edits to real
ones (a DCP ``relative_path``) that keep every other byte as torch wrote it.
"""

from __future__ import annotations

import pickletools
import struct
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any


@dataclass(frozen=True)
class Global:
    module: str
    name: str


@dataclass(frozen=True)
class Reduce:
    func: Any
    args: tuple[Any, ...]


@dataclass(frozen=True)
class PersId:
    value: Any


@dataclass(frozen=True)
class Raw:
    """Opcodes written as given."""

    data: bytes


def _int(v: int) -> bytes:
    if 0 <= v < 256:
        return b"K" + bytes([v])
    if 0 <= v < 65536:
        return b"M" + struct.pack("<H", v)
    if -(2**31) <= v < 2**31:
        return b"J" + struct.pack("<i", v)
    n = (v.bit_length() + 8) // 8
    return b"\x8a" + bytes([n]) + v.to_bytes(n, "little", signed=True)


def _emit(v: Any, out: list[bytes]) -> None:
    if isinstance(v, Raw):
        out.append(v.data)
    elif v is None:
        out.append(b"N")
    elif v is True:
        out.append(b"\x88")
    elif v is False:
        out.append(b"\x89")
    elif isinstance(v, int):
        out.append(_int(v))
    elif isinstance(v, float):
        out.append(b"G" + struct.pack(">d", v))
    elif isinstance(v, str):
        b = v.encode("utf-8", "surrogatepass")
        out.append(b"X" + struct.pack("<I", len(b)) + b)
    elif isinstance(v, bytes):
        out.append(b"C" + bytes([len(v)]) + v if len(v) < 256 else b"B" + struct.pack("<I", len(v)) + v)
    elif isinstance(v, Global):
        out.append(b"c" + v.module.encode() + b"\n" + v.name.encode() + b"\n")
    elif isinstance(v, Reduce):
        _emit(v.func, out)
        _emit(tuple(v.args), out)
        out.append(b"R")
    elif isinstance(v, PersId):
        _emit(v.value, out)
        out.append(b"Q")
    elif isinstance(v, tuple):
        if not v:
            out.append(b")")
        else:
            out.append(b"(")
            for x in v:
                _emit(x, out)
            out.append(b"t")
    elif isinstance(v, list):
        out.append(b"]")
        if v:
            out.append(b"(")
            for x in v:
                _emit(x, out)
            out.append(b"e")
    elif isinstance(v, dict):
        out.append(b"}")
        if v:
            out.append(b"(")
            for k, x in v.items():
                _emit(k, out)
                _emit(x, out)
            out.append(b"u")
    else:
        raise TypeError(f"cannot emit {type(v).__name__}")


def dumps(v: Any) -> bytes:
    """Protocol-2 opcodes for ``v`` (no memo: every value written out)."""
    out: list[bytes] = [b"\x80\x02"]
    _emit(v, out)
    out.append(b".")
    return b"".join(out)


def tensor(key: str, dtype_storage: str, numel: int, offset: int, size: tuple[int, ...], stride: tuple[int, ...]) -> Reduce:
    """What ``torch.save`` writes for one tensor (``_rebuild_tensor_v2``)."""
    storage = PersId(("storage", Global("torch", dtype_storage), key, "cpu", numel))
    return Reduce(Global("torch._utils", "_rebuild_tensor_v2"),
                  (storage, offset, tuple(size), tuple(stride), False, Reduce(Global("collections", "OrderedDict"), ())))


def code_reduce(command: str) -> Reduce:
    """``os.system(command)`` on load."""
    return Reduce(Global("os", "system"), (command,))


def billion_laughs(levels: int = 9, fanout: int = 10) -> bytes:
    """A few hundred bytes whose object graph is ``fanout ** levels`` references
    deep: each level is a list holding the previous one ``fanout`` times (memo)."""
    out = [b"\x80\x02", b"X" + struct.pack("<I", 3) + b"lol", b"q\x00"]
    for i in range(levels):
        out.append(b"]" + b"(" + b"h" + bytes([i]) * 1 + (b"h" + bytes([i])) * (fanout - 1) + b"e")
        out.append(b"q" + bytes([i + 1]))
    out.append(b".")
    return b"".join(out)


def deep_nesting(depth: int) -> bytes:
    """Lists nested ``depth`` deep."""
    return b"\x80\x02" + b"]" * depth + b"a" * (depth - 1) + b"."


def _encode_str(s: str) -> bytes:
    b = s.encode("utf-8", "surrogatepass")
    return b"\x8c" + bytes([len(b)]) + b if len(b) < 256 else b"X" + struct.pack("<I", len(b)) + b


_STR_OPS = {"SHORT_BINUNICODE", "BINUNICODE", "UNICODE", "BINUNICODE8"}
_INT_OPS = {"BININT", "BININT1", "BININT2", "LONG1", "LONG4", "INT", "LONG"}
_GET_OPS = {"BINGET", "LONG_BINGET", "GET"}


def rewrite(data: bytes, edit: Callable[[str, Any, str | None], bytes | None]) -> bytes:
    """Re-emit a pickle's opcodes, letting ``edit(opname, arg, pushed)`` replace
    any one (return its new bytes, or None to keep it). ``pushed`` is the string
    the op puts on the stack, memo references resolved (None if it pushes no
    string), so "the int after the key 'length'" can be found in a memoised
    pickle. FRAME opcodes are dropped (framing is optional; edits change sizes)."""
    ops = list(pickletools.genops(data))
    memo: dict[int, Any] = {}
    top: Any = None
    out: list[bytes] = []
    for i, (op, arg, pos) in enumerate(ops):
        end = ops[i + 1][2] if i + 1 < len(ops) else len(data)
        pushed: str | None = None
        if op.name in _STR_OPS:
            top = pushed = arg
        elif op.name == "MEMOIZE":
            memo[len(memo)] = top
        elif op.name in ("BINPUT", "LONG_BINPUT", "PUT"):
            memo[int(arg)] = top
        elif op.name in _GET_OPS:
            top = memo.get(int(arg))
            pushed = top if isinstance(top, str) else None
        else:
            top = None
        if op.name == "FRAME":
            continue
        new = edit(op.name, arg, pushed)
        out.append(data[pos:end] if new is None else new)
    return b"".join(out)


def replace_strings(data: bytes, mapping: dict[str, str]) -> bytes:
    """Every string op (not memo references) whose value is a key of ``mapping`` gets the new value."""
    return rewrite(data, lambda name, arg, pushed: _encode_str(mapping[arg]) if name in _STR_OPS and arg in mapping else None)


def replace_int_after(data: bytes, key: str, value: int, *, nth: int | None = None) -> bytes:
    """The int op right after the string ``key`` (each one, or only the ``nth``) becomes ``value``."""
    state = {"armed": False, "seen": 0}

    def edit(name: str, arg: Any, pushed: str | None) -> bytes | None:
        if name in _INT_OPS and state["armed"]:
            state["armed"] = False
            k = state["seen"]
            state["seen"] = k + 1
            return _int(value) if nth is None or k == nth else None
        if name in _STR_OPS or name in _GET_OPS:
            state["armed"] = pushed == key
        return None

    return rewrite(data, edit)
