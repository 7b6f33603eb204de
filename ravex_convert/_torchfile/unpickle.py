"""A restricted unpickler that reads checkpoint pickles without torch and without
running code from them.

``pickle`` executes whatever callable a pickle names. Checkpoints are pickles
written by torch, DeepSpeed and DCP, and users hand us files from anywhere, so
this unpickler allows a fixed list of globals and maps each to a plain record:
tensors become :class:`TensorRef` (where the bytes are, not the bytes), torch
dtypes become strings, DeepSpeed's and DCP's classes become :class:`Record`.
Any other global is refused with :class:`UnsafeCheckpointError` naming it and
the file. Nothing here imports torch.

Bounded work: a pickle is a program, and a few hundred bytes can describe a
structure of 10**9 shared references ("billion laughs") or a dict key whose hash
takes minutes. Loading is bounded three ways, each refused with
:class:`UnsafeCheckpointError` naming the file:

- size: at most :func:`max_pickle_bytes` bytes (default 64 MiB; real
  checkpoints' pickles are a few MB at most), ``RAVEX_MAX_PICKLE_BYTES``
  overrides it;
- fan-out: the structure, counted as the tree every reader walks (a shared
  object counted each time it is referenced), holds at most
  ``max(4 * 2**20, 4 * pickle bytes)`` objects (an honest pickle holds about
  one object per byte at most); ``RAVEX_MAX_PICKLE_OBJECTS`` overrides it;
  cycles are refused (no checkpoint has one, and every reader would loop);
- nesting: at most :data:`MAX_DEPTH` levels (the readers recurse), and no dict
  key or set member nested more than :data:`MAX_KEY_OBJECTS` objects deep
  (hashing one walks all of it, shared parts again each time).

The pure-Python ``pickle._Unpickler`` runs the pickle (so that building a dict
or set can check its keys first; the C unpickler also grows its memo to
whatever index a pickle names). It is slower than the C one (about 5x), which
costs milliseconds on checkpoint pickles.
"""

from __future__ import annotations

import collections
import io
import os
import pickle
import reprlib
import struct
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, ClassVar

from .._dtypes import DTYPE_SIZES, STORAGE_CLASSES
from ..errors import CorruptCheckpointError, RavexError, UnknownFormatError, UnsafeCheckpointError

__all__ = [
    "DTYPE_SIZES",
    "MAX_DEPTH",
    "MAX_KEY_OBJECTS",
    "DType",
    "Record",
    "StorageRef",
    "TensorRef",
    "max_pickle_bytes",
    "restricted_loads",
]

DEFAULT_MAX_PICKLE_BYTES = 64 * 2**20
MAX_DEPTH = 100  # containers nested deeper are refused: the readers recurse once per level
MAX_KEY_OBJECTS = 10_000  # objects in one dict key or set member (a tuple of tuples)
_MIN_MAX_OBJECTS = 4 * 2**20
_OBJECTS_PER_BYTE = 4


def _env_limit(name: str, default: int) -> int:
    raw = os.environ.get(name)
    if raw is None or raw.strip() == "":
        return default
    try:
        value = int(raw)
    except ValueError:
        value = -1
    if value <= 0:
        raise RavexError(f"{name}={raw!r} is not a positive whole number", hint=f"set {name} to a number of bytes or objects, or unset it")
    return value


def max_pickle_bytes() -> int:
    """The largest pickle Ravex unpickles: 64 MiB, or ``RAVEX_MAX_PICKLE_BYTES``."""
    return _env_limit("RAVEX_MAX_PICKLE_BYTES", DEFAULT_MAX_PICKLE_BYTES)


def _max_objects(nbytes: int) -> int:
    return _env_limit("RAVEX_MAX_PICKLE_OBJECTS", max(_MIN_MAX_OBJECTS, _OBJECTS_PER_BYTE * nbytes))


def _short(value: Any) -> str:
    """``repr`` of something a pickle built, cut short (a crafted one may be huge)."""
    r = reprlib.Repr()
    r.maxlevel, r.maxstring, r.maxother = 3, 60, 60
    return r.repr(value)

# torch's legacy typed-storage classes, as torch.save names them in persistent ids
# (element sizes and names: the dtype table, _dtypes.py).
_STORAGE_DTYPES = {storage: name for name, storage in STORAGE_CLASSES.items()} | {"UntypedStorage": "uint8"}

_DTYPE_ALIASES = {"float": "float32", "double": "float64", "half": "float16", "long": "int64", "int": "int32", "short": "int16"}


@dataclass(frozen=True)
class DType:
    """A torch dtype named in a pickle (``torch.float32`` -> ``DType("float32")``)."""

    name: str

    def __str__(self) -> str:
        return self.name


@dataclass(frozen=True)
class StorageRef:
    """A storage of a torch.save archive: ``data/<key>`` inside the zip."""

    key: str
    dtype: str
    numel: int
    location: str


@dataclass
class TensorRef:
    """A tensor as a pickle describes it: a view into a storage."""

    storage: StorageRef
    storage_offset: int
    shape: tuple[int, ...]
    stride: tuple[int, ...]
    requires_grad: bool = False
    is_parameter: bool = False

    @property
    def dtype(self) -> str:
        return self.storage.dtype

    @property
    def numel(self) -> int:
        n = 1
        for s in self.shape:
            n *= s
        return n

    @property
    def nbytes(self) -> int:
        return self.numel * DTYPE_SIZES.get(self.dtype, 1)

    def is_contiguous(self) -> bool:
        expected = 1
        for size, stride in zip(reversed(self.shape), reversed(self.stride)):
            if size != 1 and stride != expected:
                return False
            expected *= size
        return True


@dataclass(eq=False)
class Record:
    """An allow-listed class instance, kept as data: its global name, the
    arguments it was built with, and the state pickle gave it."""

    cls: str
    args: tuple[Any, ...] = ()
    state: Any = None
    items: dict[Any, Any] = field(default_factory=dict)

    def get(self, name: str, default: Any = None) -> Any:
        if isinstance(self.state, dict):
            return self.state.get(name, default)
        return default


def _record_class(qualname: str) -> type:
    """A class standing in for an allow-listed class: instantiable the ways
    pickle instantiates (REDUCE with args, NEWOBJ, BUILD with any state)."""

    def __new__(cls: type, *args: Any, **kwargs: Any) -> Any:
        obj: Any = object.__new__(cls)
        obj.__dict__["_record"] = Record(qualname, tuple(args))
        return obj

    def __init__(self: Any, *args: Any, **kwargs: Any) -> None:
        pass

    def __setstate__(self: Any, state: Any) -> None:
        self.__dict__["_record"].state = state

    def __setitem__(self: Any, key: Any, value: Any) -> None:
        self.__dict__["_record"].items[key] = value

    return type(qualname.rsplit(".", 1)[-1], (_Placeholder,), {
        "__new__": __new__, "__init__": __init__, "__setstate__": __setstate__,
        "__setitem__": __setitem__, "_qualname": qualname,
    })


class _Placeholder:
    """Base of the stand-in classes; replaced by their :class:`Record` after loading."""

    _qualname = ""


def _ints(value: Any, what: str) -> tuple[int, ...]:
    if not isinstance(value, (tuple, list)) or not all(isinstance(v, int) and not isinstance(v, bool) for v in value):
        raise pickle.UnpicklingError(f"tensor {what} is {_short(value)}, not a tuple of integers")
    return tuple(value)


def _rebuild_tensor(storage: StorageRef, storage_offset: int, size: Any, stride: Any, *rest: Any) -> TensorRef:
    if not isinstance(storage, StorageRef):
        raise pickle.UnpicklingError("tensor rebuilt from something that is not a storage")
    if not isinstance(storage_offset, int) or isinstance(storage_offset, bool):
        raise pickle.UnpicklingError(f"tensor storage offset is {_short(storage_offset)}, not an integer")
    requires_grad = bool(rest[0]) if rest and isinstance(rest[0], (bool, int)) else False
    # Bounds (offset, strides and shape against the storage) are checked by the
    # archive reader, which knows the storage sizes and the tensor's name.
    return TensorRef(storage, storage_offset, _ints(size, "shape"), _ints(stride, "strides"), requires_grad)


def _rebuild_parameter(data: Any, requires_grad: Any = False, *rest: Any) -> Any:
    if isinstance(data, TensorRef):
        data.requires_grad = bool(requires_grad)
        data.is_parameter = True
    return data


def _rebuild_from_type_v2(func: Callable[..., Any], new_type: Any, args: Any, state: Any) -> Any:
    # torch uses this for tensor subclasses (nn.Parameter among them): rebuild the
    # plain tensor; the subclass itself is only kept as a flag.
    obj = func(*args)
    if isinstance(obj, TensorRef) and getattr(new_type, "_qualname", "") == "torch.nn.parameter.Parameter":
        obj.is_parameter = True
    return obj


def _reconstructor(cls: Any, base: Any, state: Any) -> Any:
    if isinstance(cls, type) and issubclass(cls, _Placeholder):
        return cls.__new__(cls)
    raise pickle.UnpicklingError(f"copyreg._reconstructor of a class that is not allowed: {_short(cls)}")


def _check_key(key: Any) -> None:
    """Refuse a dict key / set member whose hash would take unbounded time: a
    tuple's hash hashes every element, shared ones again each time."""
    if type(key) in _FLAT_KEYS:
        return
    budget = MAX_KEY_OBJECTS
    stack = [key]
    while stack:
        x = stack.pop()
        budget -= 1
        if budget < 0:
            raise _LimitError(f"a dict key or set member holds more than {MAX_KEY_OBJECTS} nested objects (a crafted pickle)")
        if isinstance(x, (tuple, frozenset)):
            stack.extend(x)
        elif isinstance(x, slice):
            stack.extend((x.start, x.stop, x.step))


_FLAT_KEYS = {str, int, float, bool, bytes, type(None)}


def _pairs(args: tuple[Any, ...], kwargs: dict[str, Any]) -> None:
    """Check the keys a dict-like constructor is about to hash."""
    for a in args:
        if isinstance(a, dict):
            for k in a:
                _check_key(k)
        elif isinstance(a, (list, tuple)):
            for item in a:
                if isinstance(item, (list, tuple)) and item:
                    _check_key(item[0])
                else:
                    _check_key(item)


def _ordered_dict(*args: Any) -> collections.OrderedDict[Any, Any]:
    _pairs(args, {})
    return collections.OrderedDict(*args)


def _defaultdict(*args: Any) -> collections.defaultdict[Any, Any]:
    _pairs(args[1:], {})
    return collections.defaultdict(*args)


def _dict(*args: Any) -> dict[Any, Any]:
    _pairs(args, {})
    return dict(*args)


def _set(*args: Any) -> set[Any]:
    for a in args:
        for item in a if isinstance(a, (list, tuple, set, frozenset)) else ():
            _check_key(item)
    return set(*args)


def _frozenset(*args: Any) -> frozenset[Any]:
    return frozenset(_set(*args))


def _codecs_encode(text: str, encoding: str = "utf-8") -> bytes:
    # how pickle protocol 2 spells a bytes object
    if not isinstance(text, str) or encoding not in ("latin1", "latin-1"):
        raise pickle.UnpicklingError(f"_codecs.encode of {_short(text)} with encoding {_short(encoding)}")
    return text.encode("latin-1")


def _layout(name: str) -> str:
    return str(name)


def _path(*parts: Any) -> str:
    # A path pickled into metadata (DCP's checkpoint_id): kept as text, never opened.
    if not all(isinstance(p, str) for p in parts):
        raise pickle.UnpicklingError(f"a pathlib path made of {_short(parts)}, not of strings")
    return "/".join(parts)


def _torch_size(items: Any = ()) -> tuple[int, ...]:
    return tuple(items)


def _dtype(name: str) -> DType:
    return DType(_DTYPE_ALIASES.get(name, name))


def _storage_type(name: str) -> type:
    return type(name, (_StorageType,), {"dtype": _STORAGE_DTYPES[name]})


class _StorageType:
    dtype = "uint8"


_TORCH_DTYPE_NAMES = set(DTYPE_SIZES) | {"float", "double", "half", "long", "int", "short", "cfloat", "cdouble"}

# Globals a checkpoint pickle may name, and what stands in for each.
_RECORD_CLASSES = [
    # DeepSpeed: loss scalers, the ZeRO stage enum, fragment addresses.
    "deepspeed.runtime.fp16.loss_scaler.LossScaler",
    "deepspeed.runtime.fp16.loss_scaler.DynamicLossScaler",
    "deepspeed.runtime.zero.config.ZeroStageEnum",
    "deepspeed.utils.tensor_fragment.fragment_address",
    "deepspeed.runtime.zero.stage3.ZeroParamStatus",
    # DCP's metadata classes.
    "torch.distributed.checkpoint.metadata.Metadata",
    "torch.distributed.checkpoint.metadata.TensorStorageMetadata",
    "torch.distributed.checkpoint.metadata.BytesStorageMetadata",
    "torch.distributed.checkpoint.metadata.ChunkStorageMetadata",
    "torch.distributed.checkpoint.metadata.TensorProperties",
    "torch.distributed.checkpoint.metadata.MetadataIndex",
    "torch.distributed.checkpoint.metadata.StorageMeta",
    "torch.distributed.checkpoint.filesystem._StorageInfo",
    "torch.distributed.checkpoint.planner.WriteItemType",
    "torch.distributed.checkpoint.metadata._MEM_FORMAT_ENCODING",
    # torch enums that ride along in metadata.
    "torch.memory_format",
    "torch.layout",
    "argparse.Namespace",
    "torch.nn.parameter.Parameter",
    # A BytesIO saved whole (torchtitan's TrainState kept its loss history so): its bytes are kept,
    # never opened as a pickle of their own.
    "_io.BytesIO",
    # _rebuild_from_type_v2 names the tensor class; DeepSpeed's ZeRO-3 fp32
    # partitions are plain tensors carrying attributes (ds_id) this way.
    "torch.Tensor",
]

_FUNCTIONS: dict[tuple[str, str], Any] = {
    ("torch._utils", "_rebuild_tensor_v2"): _rebuild_tensor,
    ("torch._utils", "_rebuild_tensor"): _rebuild_tensor,
    ("torch._utils", "_rebuild_parameter"): _rebuild_parameter,
    ("torch._utils", "_rebuild_parameter_with_state"): _rebuild_parameter,
    ("torch._tensor", "_rebuild_from_type_v2"): _rebuild_from_type_v2,
    ("collections", "OrderedDict"): _ordered_dict,
    ("collections", "defaultdict"): _defaultdict,
    ("copyreg", "_reconstructor"): _reconstructor,
    ("builtins", "object"): object,
    ("builtins", "set"): _set,
    ("builtins", "frozenset"): _frozenset,
    ("builtins", "slice"): slice,
    ("builtins", "complex"): complex,
    ("builtins", "tuple"): tuple,
    ("builtins", "list"): list,
    ("builtins", "dict"): _dict,
    ("torch", "Size"): _torch_size,
    ("torch.serialization", "_get_layout"): _layout,
    ("_codecs", "encode"): _codecs_encode,
    ("pathlib", "PosixPath"): _path,
    ("pathlib", "PurePosixPath"): _path,
    ("pathlib", "WindowsPath"): _path,
    ("pathlib", "PureWindowsPath"): _path,
}


class _LimitError(Exception):
    """A bound of the module docstring was hit; ``restricted_loads`` names the file."""


_PURE = pickle._Unpickler  # the pure-Python one: its opcodes can be overridden


def _load_setitem(self: Any) -> None:
    stack = self.stack
    value = stack.pop()
    key = stack.pop()
    _check_key(key)
    stack[-1][key] = value


def _load_setitems(self: Any) -> None:
    items = self.pop_mark()
    target = self.stack[-1]
    for i in range(0, len(items), 2):
        _check_key(items[i])
        target[items[i]] = items[i + 1]


def _load_dict(self: Any) -> None:
    items = self.pop_mark()
    for i in range(0, len(items), 2):
        _check_key(items[i])
    self.append({items[i]: items[i + 1] for i in range(0, len(items), 2)})


def _load_additems(self: Any) -> None:
    items = self.pop_mark()
    for item in items:
        _check_key(item)
    target = self.stack[-1]
    if not isinstance(target, set):
        raise pickle.UnpicklingError("ADDITEMS on something that is not a set")
    target.update(items)


def _load_frozenset(self: Any) -> None:
    items = self.pop_mark()
    for item in items:
        _check_key(item)
    self.append(frozenset(items))


def _load_build(self: Any) -> None:
    # BUILD sets attributes from a dict: only on the stand-in classes (and a
    # real OrderedDict, torch's state-dict ``_metadata``), with string names.
    state = self.stack.pop()
    inst = self.stack[-1]
    setstate = getattr(inst, "__setstate__", None)
    if isinstance(inst, _Placeholder) and setstate is not None:
        setstate(state)
        return
    parts = list(state) if isinstance(state, tuple) and len(state) == 2 else [state]  # (__dict__, slots)
    for part in parts:
        if not part:
            continue
        if not isinstance(part, dict) or not all(isinstance(k, str) for k in part) or not hasattr(inst, "__dict__"):
            raise pickle.UnpicklingError(f"BUILD of a {type(inst).__name__} with state {_short(part)}")
        inst.__dict__.update(part)


def _charged(op: Callable[[Any], None]) -> Callable[[Any], None]:
    """An opcode that calls something (REDUCE, NEWOBJ, ...), charged for what the
    call built: ``tuple(x)`` or ``_codecs.encode(s)`` copy a memoized object in a
    few bytes of pickle, so without a budget their copies grow with the square
    of the pickle's size."""

    def run(self: Any) -> None:
        op(self)
        built = self.stack[-1]
        self.built += len(built) if isinstance(built, _SIZED) else 1
        if self.built > self.budget:
            raise _LimitError(f"the pickle's calls build more than {self.budget} objects (copies of shared ones)")

    return run


_SIZED = (str, bytes, bytearray, tuple, list, dict, set, frozenset)


def _load_bytearray8(self: Any) -> None:
    # pickle's own BYTEARRAY8 allocates the length it declares before reading: 12 bytes of pickle
    # could ask for gigabytes. No length may exceed the pickle itself.
    (n,) = struct.unpack("<Q", self.read(8))
    if n > self.size:
        raise pickle.UnpicklingError(f"BYTEARRAY8 declares {n} bytes; the whole pickle is {self.size}")
    b = bytearray(n)
    if self.readinto(b) != n:
        raise pickle.UnpicklingError("BYTEARRAY8 runs past the end of the pickle")
    self.append(b)


class _Unpickler(_PURE):
    dispatch: ClassVar[dict[int, Callable[[Any], None]]] = dict(_PURE.dispatch)
    for _op in (pickle.REDUCE, pickle.NEWOBJ, pickle.NEWOBJ_EX, pickle.OBJ, pickle.INST):
        dispatch[_op[0]] = _charged(_PURE.dispatch[_op[0]])
    del _op
    dispatch[pickle.BYTEARRAY8[0]] = _load_bytearray8
    dispatch[pickle.SETITEM[0]] = _load_setitem
    dispatch[pickle.SETITEMS[0]] = _load_setitems
    dispatch[pickle.DICT[0]] = _load_dict
    dispatch[pickle.ADDITEMS[0]] = _load_additems
    dispatch[pickle.FROZENSET[0]] = _load_frozenset
    dispatch[pickle.BUILD[0]] = _load_build

    def __init__(self, data: bytes, source: str, storages: Callable[[tuple[Any, ...]], Any] | None, budget: int):
        super().__init__(io.BytesIO(data))
        self.size = len(data)
        self.built = 0
        self.budget = budget
        self._source = source
        self._storages = storages
        self._classes: dict[str, type] = {}

    def find_class(self, module: str, name: str) -> Any:
        key = (module, name)
        if key in _FUNCTIONS:
            return _FUNCTIONS[key]
        qualname = f"{module}.{name}"
        if module == "torch" and name in _STORAGE_DTYPES:
            return _storage_type(name)
        if module == "torch" and name in _TORCH_DTYPE_NAMES:
            return _dtype(name)
        if qualname in _RECORD_CLASSES or (module == "torch" and name in {"strided", "sparse_coo", "contiguous_format", "channels_last", "preserve_format"}):
            if qualname not in self._classes:
                self._classes[qualname] = _record_class(qualname)
            return self._classes[qualname]
        if module.startswith("torch.distributed.checkpoint"):
            # not code we refuse to run but a DCP class we have not met: newer torch
            raise UnknownFormatError(
                f"{self._source}: DCP metadata with the class '{qualname}', which this Ravex does not know "
                "(written by a newer torch than Ravex supports)",
                hint="convert it with the torch that wrote it (dcp_to_torch_save), or upgrade Ravex",
                path=self._source,
            )
        raise UnsafeCheckpointError(
            f"{self._source}: the pickle names the global '{qualname}', which Ravex does not allow "
            "(loading it could run code from the file)",
            hint="only checkpoints written by torch.save, DeepSpeed and torch.distributed.checkpoint are read; "
            "if you trust this file, load it with torch.load(weights_only=False) yourself and save a plain state dict",
            path=self._source,
        )

    def persistent_load(self, pid: Any) -> Any:
        if self._storages is None:
            raise pickle.UnpicklingError("persistent id in a pickle that should have none")
        return self._storages(pid)


class _Walk:
    """Swap stand-in instances for their Record, everywhere (containers are
    rebuilt in place so shared references stay shared), and bound what the
    pickle built: each object's size as a tree (a shared object counts every
    time it is referenced: what a reader walking it visits), its depth, cycles.
    Linear in the pickle's own objects: each is visited once and its tree size
    remembered."""

    def __init__(self, limit: int):
        self.limit = limit
        self.seen: dict[int, tuple[Any, Any, int]] = {}  # id -> (the object, kept alive; its replacement; tree size or -1 while open)

    def visit(self, obj: Any, depth: int) -> tuple[Any, int]:
        if type(obj) in _FLAT_KEYS:
            return obj, 1
        oid = id(obj)
        hit = self.seen.get(oid)
        if hit is not None:
            if hit[2] < 0:
                raise _LimitError("the pickle builds a cyclic structure (an object that contains itself); no checkpoint has one")
            return hit[1], hit[2]
        if depth > MAX_DEPTH:
            raise _LimitError(f"containers are nested more than {MAX_DEPTH} levels deep")
        if isinstance(obj, _Placeholder):
            rec = obj.__dict__["_record"]
            self.seen[oid] = (obj, rec, -1)
            args, n1 = self.seq(rec.args, depth)
            state, n2 = self.visit(rec.state, depth + 1)
            items, n3 = self.pairs(list(rec.items.items()), depth)
            rec.args, rec.state, rec.items = tuple(args), state, dict(items)
            return self.done(oid, obj, rec, 1 + n1 + n2 + n3)
        if isinstance(obj, type) and issubclass(obj, _Placeholder):
            return Record(obj._qualname), 1
        if isinstance(obj, dict):
            self.seen[oid] = (obj, obj, -1)
            items, n = self.pairs(list(obj.items()), depth)
            obj.clear()
            obj.update(items)
            return self.done(oid, obj, obj, 1 + n)
        if isinstance(obj, list):
            self.seen[oid] = (obj, obj, -1)
            values, n = self.seq(obj, depth)
            obj[:] = values
            return self.done(oid, obj, obj, 1 + n)
        if isinstance(obj, (tuple, set, frozenset)):
            self.seen[oid] = (obj, obj, -1)
            values, n = self.seq(obj, depth)
            new: Any
            if isinstance(obj, set):
                obj.clear()
                obj.update(values)
                new = obj
            else:
                new = type(obj)(values) if any(a is not b for a, b in zip(values, obj)) else obj
            return self.done(oid, obj, new, 1 + n)
        return obj, 1

    def seq(self, values: Any, depth: int) -> tuple[list[Any], int]:
        out: list[Any] = []
        total = 0
        for v in values:
            new, n = self.visit(v, depth + 1)
            out.append(new)
            total += n
            if total > self.limit:
                self.too_many()
        return out, total

    def pairs(self, items: list[tuple[Any, Any]], depth: int) -> tuple[list[tuple[Any, Any]], int]:
        out: list[tuple[Any, Any]] = []
        total = 0
        for k, v in items:
            k2, n1 = self.visit(k, depth + 1)
            v2, n2 = self.visit(v, depth + 1)
            out.append((k2, v2))
            total += n1 + n2
            if total > self.limit:
                self.too_many()
        return out, total

    def done(self, oid: int, obj: Any, new: Any, size: int) -> tuple[Any, int]:
        if size > self.limit:
            self.too_many()
        self.seen[oid] = (obj, new, size)
        return new, size

    def too_many(self) -> None:
        raise _LimitError(
            f"the pickle describes more than {self.limit} objects once shared references are followed "
            "(a few bytes can reference one object billions of times)"
        )


def restricted_loads(
    data: bytes, source: str | Path, storages: Callable[[tuple[Any, ...]], Any] | None = None, *, max_bytes: int | None = None
) -> Any:
    """Unpickle ``data`` allowing only checkpoint classes. ``storages`` resolves
    torch.save persistent ids (``("storage", type, key, location, numel)``).

    Refused with :class:`UnsafeCheckpointError`: a global not allowed, and a
    pickle past the bounds of the module docstring (size: ``RAVEX_MAX_PICKLE_BYTES``,
    default 64 MiB; objects: ``RAVEX_MAX_PICKLE_OBJECTS``, default
    ``max(4 Mi, 4 per byte)``; nesting: 100 levels). ``max_bytes`` replaces the
    size limit (a caller whose pickles are larger by nature, e.g. DCP
    metadata of a big run). Damaged bytes raise :class:`CorruptCheckpointError`."""
    src = str(source)
    limit_hint = "a checkpoint from an untrusted source may be crafted to exhaust memory or time; do not use it"
    cap = max_pickle_bytes() if max_bytes is None else max_bytes
    if len(data) > cap:
        raise UnsafeCheckpointError(
            f"{src}: the pickle is {len(data)} bytes, more than the {cap} bytes Ravex unpickles",
            hint=f"if the file is genuine, raise the limit: RAVEX_MAX_PICKLE_BYTES={len(data)}",
            path=src,
        )
    try:
        limit = _max_objects(len(data))
        obj = _Unpickler(data, src, storages, limit).load()
        return _Walk(limit).visit(obj, 0)[0]
    except (UnsafeCheckpointError, CorruptCheckpointError, UnknownFormatError):
        raise
    except _LimitError as exc:
        hint = limit_hint
        if "objects once shared" in str(exc):
            hint += "; if the file is genuine, raise the limit with RAVEX_MAX_PICKLE_OBJECTS"
        raise UnsafeCheckpointError(f"{src}: refused: {exc}", hint=hint, path=src) from None
    except Exception as exc:  # noqa: BLE001 -- pickle raises any type on garbage input
        raise CorruptCheckpointError(
            f"{src}: the pickle inside cannot be read ({type(exc).__name__}: {str(exc)[:200]})",
            hint="the file is truncated or damaged; copy it again from where the run wrote it",
            path=src,
        ) from None
