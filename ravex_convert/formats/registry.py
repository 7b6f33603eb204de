"""The formats Ravex knows, each registered once, in detection order.

Detection, ``inspect``, ``read_checkpoint``, convert's targets and options,
reshard, verify and the ``ravex`` command iterate :func:`formats`; none of them
names a format. A new layout (an HF Trainer ``checkpoint-N``, Accelerate's
``save_state``, a Lightning ``.ckpt``) is one module with ``sniff``, ``read``
and ``describe`` (and ``write`` with its :class:`~.options.WriteOptions`, for a
format Ravex writes), plus one :func:`register` line in :data:`_BUILTIN` below
(docs/architecture.md, "How a format plugs in").

Order matters because layouts nest: a native store or a DCP directory may hold
safetensors or ``.pt`` files, and a ZeRO root holds ``.pt`` files, so the
outer layout is asked first and the first sniffer that sees its layout wins.

Importing this module imports every format's reader (none imports torch) but
no writer: ``Format.write`` imports its module on first use, so ``ravex
inspect`` stays light.
"""

from __future__ import annotations

import contextlib
import importlib
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from ..errors import RavexError
from ..info import CheckpointInfo
from ..model import Checkpoint
from . import accelerate, hf_trainer, safetensors, torch_save
from .dcp import reader as dcp
from .dcp.options import DcpOptions
from .native import reader as native
from .native.options import NativeOptions
from .options import WriteOptions
from .zero import reader as zero
from .zero.options import ZeroOptions

__all__ = ["OPTIONS", "Format", "by_suffix", "formats", "get", "names", "register", "registered", "reshardable", "targets", "unregister"]

# The keyword options ``read`` and ``describe`` may take, with the value that
# means "not given". A format lists those it takes in ``Format.options``; the
# others are not passed to it.
OPTIONS: dict[str, Any] = {
    "tag": None,  # which checkpoint of a directory holding several (DeepSpeed tags)
    "index": -1,  # which checkpoint of a store (-1: the newest complete one)
    "param_names": None,  # the parameter names in optimizer order, for position-keyed optimizer state
    "crc_share": None,  # (r, n): read by every rank of a job, each checks every n-th stored checksum from the r-th (read only)
}


@dataclass(frozen=True)
class Format:
    """One checkpoint format: the same small surface for every one.

    Args:
        name: what ``--to``, ``Checkpoint.format`` and ``inspect`` call it.
        sniff: ``sniff(path)``: reasons (one short sentence each) when ``path``
            has this layout, else None; looks at names and small files only,
            never raises for "not mine".
        read: ``read(path, **options)``: the :class:`Checkpoint` (every logical
            tensor located in its files, nothing loaded).
        describe: ``describe(path, reasons, **options)``: what ``ravex
            inspect`` says, built from that same read (plus the few facts only
            the layout knows), in the time the metadata takes to read.
        title: the format in help and messages ("DeepSpeed ZeRO").
        looks_like: what a path of this format looks like, for the "not a
            checkpoint" hint.
        options: which of :data:`OPTIONS` ``read`` and ``describe`` take
            (``crc_share``, a job's split of the checksum work, is ``read``'s alone).
        writer: the format's write function, or ``"module:function"`` of a
            module in this package, imported when first used (writers are
            heavier than readers); None when the format is no ``--to`` target.
            It is called ``write(ckpt, dst, opts, progress=..., **keywords)``
            with the keywords its ``write_options`` give.
        write_options: the writer's own options, a
            :class:`~ravex_convert.formats.options.WriteOptions` subclass whose
            fields declare their command-line flags (``ravex convert`` and
            ``ravex reshard`` add them).
        suffixes: the ends of a DST name that ask for this format when
            ``--to`` is not given (``.safetensors``).
        pointers: files of a checkpoint directory the reader takes that
            ``inspect`` does not list as the checkpoint's own (``latest``, a
            store's manifest), so a conversion does not call them left out.
        reshardable: it has ranks that ``ravex reshard`` can change.
        verify_chunks: ``verify_chunks(ckpt, names)`` checks the stored
            checksums of those tensors' bytes (None: all) and returns how many
            chunks it checked, where the format records checksums that
            ``read`` does not check itself; ``convert``, ``verify`` and
            ``load_state_dict`` call it before any byte is used.
        listed: the format's place in the lists people read (``--to``
            choices, hints), which is not the detection order.
    """

    name: str
    sniff: Callable[[Path], list[str] | None]
    read: Callable[..., Checkpoint]
    describe: Callable[..., CheckpointInfo]
    title: str
    looks_like: str = ""
    options: frozenset[str] = frozenset()
    writer: Callable[..., dict[str, Any]] | str | None = None
    write_options: type[WriteOptions] = WriteOptions
    suffixes: tuple[str, ...] = ()
    pointers: tuple[str, ...] = ()
    reshardable: bool = False
    verify_chunks: Callable[[Checkpoint, Iterable[str] | None], int] | None = None
    listed: int = 100

    def __post_init__(self) -> None:
        unknown = set(self.options) - set(OPTIONS)
        if unknown:
            raise ValueError(f"format {self.name!r}: unknown options {sorted(unknown)} (known: {', '.join(OPTIONS)})")
        if not (isinstance(self.write_options, type) and issubclass(self.write_options, WriteOptions)):
            raise TypeError(f"format {self.name!r}: write_options must be a WriteOptions subclass")

    @property
    def writes(self) -> bool:
        """A ``--to`` target."""
        return self.writer is not None

    @property
    def write(self) -> Callable[..., dict[str, Any]]:
        """The format's own write function (convert.py calls each with its own options)."""
        if self.writer is None:
            raise RavexError(f"Ravex reads {self.title} but does not write it", hint=f"use one of {', '.join(targets())}")
        if callable(self.writer):
            return self.writer
        module, _, function = self.writer.partition(":")
        found: Callable[..., dict[str, Any]] = getattr(importlib.import_module(f"{__package__}.{module}"), function)
        return found

    def given(self, **options: Any) -> dict[str, Any]:
        """Of ``options``, those this format takes and that are not at their
        "not given" value: what to pass to ``read`` and ``describe``."""
        return {k: v for k, v in options.items() if k in self.options and v != OPTIONS[k]}


_REGISTRY: dict[str, Format] = {}


def register(fmt: Format, *, before: str | None = None) -> Format:
    """Add ``fmt`` to the registry: last in detection order, or just before the
    format named ``before`` (a layout that holds another's files must be asked
    first). A name is registered once; a writer's flag that another format
    declares too must be declared the same way."""
    if fmt.name in _REGISTRY:
        raise ValueError(f"format {fmt.name!r} is registered already")
    if before is not None and before not in _REGISTRY:
        raise ValueError(f"format {fmt.name!r}: no format {before!r} to register before")
    # one flag on the command line for every format that takes it: the same field, help, type and default
    for dest, flag, default in fmt.write_options.flags():
        for other in _REGISTRY.values():
            for dest2, flag2, default2 in other.write_options.flags():
                if flag2.name == flag.name and (dest2, flag2.help, flag2.type, default2) != (dest, flag.help, flag.type, default):
                    raise ValueError(f"format {fmt.name!r}: {flag.name} is declared by {other.name!r} already, differently "
                                     "(share its Flag, field name and default)")
    items = list(_REGISTRY.items())
    at = len(items) if before is None else [n for n, _ in items].index(before)
    items.insert(at, (fmt.name, fmt))
    _REGISTRY.clear()
    _REGISTRY.update(items)
    return fmt


def unregister(name: str) -> Format:
    """Remove a format (tests register a fake one and take it out again)."""
    return _REGISTRY.pop(name)


@contextlib.contextmanager
def registered(fmt: Format, *, before: str | None = None) -> Iterator[Format]:
    """``fmt`` registered for the ``with`` block only (as :func:`register`), and
    taken out again however the block ends: how a test adds a format."""
    register(fmt, before=before)
    try:
        yield fmt
    finally:
        if _REGISTRY.get(fmt.name) is fmt:
            unregister(fmt.name)


def formats() -> Iterator[Format]:
    """Every registered format, in detection order."""
    return iter(list(_REGISTRY.values()))


def get(name: str) -> Format:
    try:
        return _REGISTRY[name]
    except KeyError:
        raise RavexError(f"'{name}' is not a format Ravex knows", hint=f"the formats are {', '.join(names())}") from None


def names() -> tuple[str, ...]:
    """Every format's name, in the order people read them (``listed``)."""
    return tuple(f.name for f in sorted(_REGISTRY.values(), key=lambda f: f.listed))


def targets() -> tuple[str, ...]:
    """The formats ``ravex convert --to`` writes, in the order people read them."""
    return tuple(f.name for f in sorted(_REGISTRY.values(), key=lambda f: f.listed) if f.writes)


def by_suffix(suffix: str) -> str | None:
    """The format a DST name ending in ``suffix`` asks for (None: no format claims it)."""
    return next((f.name for f in _listed() if f.writes and suffix.lower() in f.suffixes), None)


def _listed() -> list[Format]:
    return sorted(_REGISTRY.values(), key=lambda f: f.listed)


def reshardable() -> tuple[str, ...]:
    """The formats ``ravex reshard`` works on, in the order people read them."""
    return tuple(f.name for f in sorted(_REGISTRY.values(), key=lambda f: f.listed) if f.reshardable)


# ---------------------------------------------------------------- the formats, in detection order
#
# A native store or a DCP directory may hold safetensors or .pt files, a ZeRO
# root holds .pt files, and a Trainer checkpoint of a DeepSpeed run holds a ZeRO
# root: the outer layouts come first.

_BUILTIN = (
    Format("native", native.sniff, native.read, native.describe, title="Ravex stores", looks_like="ravex-store.json",
           options=frozenset({"index"}), writer="native.writer:write", write_options=NativeOptions, pointers=(native.MANIFEST, native.STORE_MARKER, "lock"),
           reshardable=True, verify_chunks=native.verify_chunks, listed=2),
    Format("dcp", dcp.sniff, dcp.read, dcp.describe, title="DCP", looks_like=".metadata", writer="dcp.writer:write", write_options=DcpOptions,
           reshardable=True, listed=3),
    Format("hf_trainer", hf_trainer.sniff, hf_trainer.read, hf_trainer.describe, title="Hugging Face Trainer checkpoints",
           looks_like="checkpoint-N/ with trainer_state.json", options=frozenset({"param_names"}), writer="hf_trainer:write",
           write_options=hf_trainer.HfTrainerOptions, pointers=("latest",), reshardable=True, listed=5),
    Format("zero", zero.sniff, zero.read, zero.describe, title="DeepSpeed ZeRO", looks_like="a directory with 'latest' or *_optim_states.pt",
           options=frozenset({"tag", "crc_share"}), writer="zero.writer:write", write_options=ZeroOptions, pointers=("latest",),
           reshardable=True, listed=4),
    Format("accelerate", accelerate.sniff, accelerate.read, accelerate.describe, title="Accelerate save_state directories",
           looks_like="model.safetensors with optimizer.bin / random_states_0.pkl", options=frozenset({"param_names"}), reshardable=True,
           writer="accelerate:write", listed=6),
    Format("safetensors", safetensors.sniff, safetensors.read, safetensors.describe, title="safetensors", writer="safetensors:write",
           write_options=safetensors.SafetensorsOptions, suffixes=(".safetensors",), listed=0),
    Format("torch_save", torch_save.sniff, torch_save.read, torch_save.describe, title="torch.save files",
           options=frozenset({"param_names"}), writer="torch_save:write", write_options=torch_save.TorchSaveOptions,
           suffixes=(".pt", ".pth", ".bin"), listed=1),
)
for _fmt in _BUILTIN:
    register(_fmt)
