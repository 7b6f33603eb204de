"""A restricted unpickler that reads checkpoint pickles without torch and without
running code from them.

``pickle`` executes whatever callable a pickle names. Checkpoints are pickles
written by torch, DeepSpeed and DCP, and users hand us files from anywhere, so
this unpickler allows a fixed list of globals and maps each to a plain record:
tensors become :class:`TensorRef` (where the bytes are, not the bytes), torch
dtypes become strings, DeepSpeed's and DCP's classes become :class:`Record`.
Any other global is refused with :class:`UnsafeCheckpointError` naming it and
the file. Nothing here imports torch.
"""

from __future__ import annotations

import collections
import io
import pickle
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from .errors import CorruptCheckpointError, UnknownFormatError, UnsafeCheckpointError

__all__ = ["DTYPE_SIZES", "DType", "Record", "StorageRef", "TensorRef", "restricted_loads"]

# Element sizes in bytes, keyed by the dtype names Ravex uses everywhere
# (torch's names without the "torch." prefix).
DTYPE_SIZES: dict[str, int] = {
    "float64": 8, "float32": 4, "float16": 2, "bfloat16": 2,
    "int64": 8, "int32": 4, "int16": 2, "int8": 1, "uint8": 1, "bool": 1,
    "complex64": 8, "complex128": 16,
    "float8_e4m3fn": 1, "float8_e5m2": 1,
}

# torch's legacy typed-storage classes, as torch.save names them in persistent ids.
_STORAGE_DTYPES = {
    "DoubleStorage": "float64", "FloatStorage": "float32", "HalfStorage": "float16",
    "BFloat16Storage": "bfloat16", "LongStorage": "int64", "IntStorage": "int32",
    "ShortStorage": "int16", "CharStorage": "int8", "ByteStorage": "uint8",
    "BoolStorage": "bool", "ComplexFloatStorage": "complex64",
    "ComplexDoubleStorage": "complex128", "UntypedStorage": "uint8",
    "Float8_e4m3fnStorage": "float8_e4m3fn", "Float8_e5m2Storage": "float8_e5m2",
}

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


def _rebuild_tensor(storage: StorageRef, storage_offset: int, size: Any, stride: Any, *rest: Any) -> TensorRef:
    if not isinstance(storage, StorageRef):
        raise pickle.UnpicklingError("tensor rebuilt from something that is not a storage")
    requires_grad = bool(rest[0]) if rest else False
    return TensorRef(storage, int(storage_offset), tuple(int(s) for s in size), tuple(int(s) for s in stride), requires_grad)


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
    raise pickle.UnpicklingError(f"copyreg._reconstructor of a class that is not allowed: {cls!r}")


def _ordered_dict(*args: Any) -> collections.OrderedDict[Any, Any]:
    return collections.OrderedDict(*args)


def _codecs_encode(text: str, encoding: str = "utf-8") -> bytes:
    # how pickle protocol 2 spells a bytes object
    if encoding not in ("latin1", "latin-1"):
        raise pickle.UnpicklingError(f"_codecs.encode with encoding {encoding!r}")
    return text.encode("latin-1")


def _layout(name: str) -> str:
    return str(name)


def _path(*parts: Any) -> str:
    # A path pickled into metadata (DCP's checkpoint_id): kept as text, never opened.
    return "/".join(str(p) for p in parts)


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
    ("collections", "defaultdict"): collections.defaultdict,
    ("copyreg", "_reconstructor"): _reconstructor,
    ("builtins", "object"): object,
    ("builtins", "set"): set,
    ("builtins", "frozenset"): frozenset,
    ("builtins", "slice"): slice,
    ("builtins", "complex"): complex,
    ("builtins", "tuple"): tuple,
    ("builtins", "list"): list,
    ("builtins", "dict"): dict,
    ("torch", "Size"): _torch_size,
    ("torch.serialization", "_get_layout"): _layout,
    ("_codecs", "encode"): _codecs_encode,
    ("pathlib", "PosixPath"): _path,
    ("pathlib", "PurePosixPath"): _path,
    ("pathlib", "WindowsPath"): _path,
    ("pathlib", "PureWindowsPath"): _path,
}


class _Unpickler(pickle.Unpickler):
    def __init__(self, data: bytes, source: str, storages: Callable[[tuple[Any, ...]], Any] | None):
        super().__init__(io.BytesIO(data))
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


def _replace_placeholders(obj: Any, seen: dict[int, Any] | None = None) -> Any:
    """Swap stand-in instances for their Record, recursively (containers are
    rebuilt in place so shared references stay shared)."""
    if seen is None:
        seen = {}
    oid = id(obj)
    if oid in seen:
        return seen[oid]
    if isinstance(obj, _Placeholder):
        rec = obj.__dict__["_record"]
        seen[oid] = rec
        rec.args = tuple(_replace_placeholders(a, seen) for a in rec.args)
        rec.state = _replace_placeholders(rec.state, seen)
        rec.items = {k: _replace_placeholders(v, seen) for k, v in rec.items.items()}
        return rec
    if isinstance(obj, type) and issubclass(obj, _Placeholder):
        return Record(obj._qualname)
    if isinstance(obj, dict):
        seen[oid] = obj
        items = [(_replace_placeholders(k, seen), _replace_placeholders(v, seen)) for k, v in obj.items()]
        obj.clear()
        obj.update(items)
        return obj
    if isinstance(obj, list):
        seen[oid] = obj
        obj[:] = [_replace_placeholders(v, seen) for v in obj]
        return obj
    if isinstance(obj, tuple):
        new = tuple(_replace_placeholders(v, seen) for v in obj)
        seen[oid] = new
        return new
    return obj


def restricted_loads(data: bytes, source: str | Path, storages: Callable[[tuple[Any, ...]], Any] | None = None) -> Any:
    """Unpickle ``data`` allowing only checkpoint classes. ``storages`` resolves
    torch.save persistent ids (``("storage", type, key, location, numel)``)."""
    src = str(source)
    try:
        obj = _Unpickler(data, src, storages).load()
    except (UnsafeCheckpointError, CorruptCheckpointError, UnknownFormatError):
        raise
    except Exception as exc:  # noqa: BLE001 -- pickle raises any type on garbage input
        raise CorruptCheckpointError(
            f"{src}: the pickle inside cannot be read ({type(exc).__name__}: {exc})",
            hint="the file is truncated or damaged; copy it again from where the run wrote it",
            path=src,
        ) from None
    return _replace_placeholders(obj)
