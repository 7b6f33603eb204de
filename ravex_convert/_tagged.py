"""Tagged JSON: small state that JSON cannot say directly (docs/format.md section 13).

``encode`` turns Python values into JSON-ready values, ``decode`` back. Tuples,
sets, big ints, NaN/inf, bytes, dicts with non-string keys, dtypes and tensor
links become ``{"__ravex__": <tag>, ...}`` objects.
"""

from __future__ import annotations

import base64
import math
from typing import Any

from ._torchfile.unpickle import DType
from .errors import CorruptCheckpointError, RavexError
from .model import TensorLink

__all__ = ["TAG", "decode", "encode"]

TAG = "__ravex__"
_MAX_PLAIN_INT = 2**53 - 1
_FIELDS = {
    "int": {"value"}, "float": {"value"}, "dict": {"items"}, "tuple": {"items"}, "set": {"items"},
    "bytes": {"base64"}, "dtype": {"value"}, "tensor": {"name"},
}


def encode(value: Any, path: str = "objects") -> Any:
    """A JSON-ready form of ``value``; raises :class:`RavexError` naming ``path``
    for a value v1 cannot store."""
    if value is None or isinstance(value, (bool, str)):
        return value
    if isinstance(value, int):
        return value if -_MAX_PLAIN_INT <= value <= _MAX_PLAIN_INT else {TAG: "int", "value": str(value)}
    if isinstance(value, float):
        if math.isnan(value):
            return {TAG: "float", "value": "nan"}
        if math.isinf(value):
            return {TAG: "float", "value": "inf" if value > 0 else "-inf"}
        return value
    if isinstance(value, list):
        return [encode(v, f"{path}[{i}]") for i, v in enumerate(value)]
    if isinstance(value, tuple):
        return {TAG: "tuple", "items": [encode(v, f"{path}[{i}]") for i, v in enumerate(value)]}
    if isinstance(value, set):
        try:
            items = sorted(value)
        except TypeError:
            items = list(value)
        return {TAG: "set", "items": [encode(v, f"{path}{{}}") for v in items]}
    if isinstance(value, dict):
        if all(isinstance(k, str) for k in value) and TAG not in value:
            return {k: encode(v, f"{path}.{k}") for k, v in value.items()}
        return {TAG: "dict", "items": [[encode(k, f"{path}<key>"), encode(v, f"{path}[{k!r}]")] for k, v in value.items()]}
    if isinstance(value, (bytes, bytearray)):
        return {TAG: "bytes", "base64": base64.b64encode(bytes(value)).decode("ascii")}
    if isinstance(value, DType):
        return {TAG: "dtype", "value": value.name}
    if isinstance(value, TensorLink):
        return {TAG: "tensor", "name": value.name}
    raise RavexError(
        f"cannot store the value at {path} ({type(value).__name__}) in a Ravex store",
        hint="only plain Python data (numbers, strings, lists, dicts, tuples, bytes) and tensors can be stored; "
        "convert the object to its state_dict() first",
    )


def decode(value: Any, where: str = "objects") -> Any:
    """The Python value of an encoded one; unknown or malformed tags are errors."""
    if isinstance(value, list):
        return [decode(v, where) for v in value]
    if not isinstance(value, dict):
        return value
    if TAG not in value:
        return {k: decode(v, where) for k, v in value.items()}
    tag = value[TAG]
    if tag not in _FIELDS:
        raise RavexError(f"{where}: unknown tag {tag!r} in objects; a newer Ravex wrote this checkpoint", hint="upgrade Ravex")
    if set(value) - {TAG} != _FIELDS[tag]:
        raise CorruptCheckpointError(f"{where}: tagged object {tag!r} has fields {sorted(set(value) - {TAG})}, expected {sorted(_FIELDS[tag])}")
    try:
        if tag == "int":
            return int(value["value"])
        if tag == "float":
            return {"nan": math.nan, "inf": math.inf, "-inf": -math.inf}[value["value"]]
        if tag == "dict":
            return {_hashable(decode(k, where)): decode(v, where) for k, v in value["items"]}
        if tag == "tuple":
            return tuple(decode(v, where) for v in value["items"])
        if tag == "set":
            return {_hashable(decode(v, where)) for v in value["items"]}
        if tag == "bytes":
            return base64.b64decode(value["base64"], validate=True)
        if tag == "dtype":
            return DType(str(value["value"]))
        return TensorLink(str(value["name"]))
    except (KeyError, ValueError, TypeError) as exc:
        raise CorruptCheckpointError(f"{where}: malformed {tag!r} value ({exc})") from None


def _hashable(v: Any) -> Any:
    return tuple(v) if isinstance(v, list) else v
