"""What a writer declares about itself: its own options, as a small dataclass.

Each writable format registers one :class:`WriteOptions` subclass
(``Format.write_options``). Each of its fields is one option of the format's
write function, declared with :func:`option`: the default, and the
command-line flag that sets it (:class:`Flag`: name, type, help). ``ravex
convert`` and ``ravex reshard`` add the flags of every registered format, and
``convert`` hands the format's write function its own options; neither names a
format. Importing this module imports no writer and no torch.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field, fields
from typing import Any, ClassVar, Protocol

from .._output import Options
from ..errors import RavexError
from ..info import CheckpointInfo


class Named(Protocol):
    """What :meth:`WriteOptions.build` reads of a format (a registry ``Format``; a
    protocol, so that the registry, which imports this module, is not imported back)."""

    @property
    def name(self) -> str: ...

    @property
    def write_options(self) -> type[WriteOptions]: ...

__all__ = ["LAYOUT", "Flag", "WriteOptions", "either", "flag_of", "option", "parse_names", "parse_size"]


@dataclass(frozen=True)
class Flag:
    """How one writer option appears on the command line.

    ``name``: the flag (``--zero-stage``). ``help``: its line in ``--help``.
    ``type``: ``str`` or ``int``, what click parses the text into. ``choices``:
    the values it takes (none: any), ``range``: an inclusive integer range.
    ``metavar``: the placeholder in help. ``show_default``: print the default
    in help. ``parse``: turns a text (the flag's, or a Python caller's string)
    into the option's value (a size, a list of names) when the options are made.
    Two formats that take the same flag declare the same :class:`Flag`."""

    name: str
    help: str
    type: type = str
    choices: tuple[str, ...] = ()
    range: tuple[int, int] | None = None
    metavar: str | None = None
    show_default: bool = False
    parse: Callable[[str], Any] | None = None


def option(default: Any, flag: Flag, *, on_options: bool = False) -> Any:
    """A field of a :class:`WriteOptions`: its default and its flag. ``on_options``:
    the value travels on the writers' shared :class:`~ravex_convert._output.Options`
    (where the runtime's own writer sets it too), not as a keyword of ``write``."""
    return field(default=default, metadata={"flag": flag, "on_options": on_options})


def flag_of(f: dataclasses.Field[Any]) -> Flag | None:
    """The flag a field declares (None: a value only Python callers pass)."""
    found = f.metadata.get("flag")
    return found if isinstance(found, Flag) else None


@dataclass(frozen=True)
class WriteOptions:
    """A format's own write options; this base class is a format that has none.

    A subclass is a frozen dataclass whose fields are declared with
    :func:`option`; ``convert`` passes each field to the format's write function
    as a keyword of the same name (or on the shared ``Options``, see
    :func:`option`). Its class variables say what ``convert`` must know of the
    writer:

    ``weights_only``: the format holds weights only (the optimizer and training
    state are left out, and said so). ``merges_hyperparameters``: the writer
    takes ``--hyperparameters`` itself (as the keyword ``hyperparameters``) and
    checks them against what its loader needs. ``needs_param_groups``: the
    format's loader needs every param group's hyper-parameters, and this is what
    fails without them (``{g}``: the group, ``{key}``: the first missing key).
    """

    weights_only: ClassVar[bool] = False
    merges_hyperparameters: ClassVar[bool] = False
    needs_param_groups: ClassVar[str | None] = None

    def __post_init__(self) -> None:
        for f in fields(self):
            fl = flag_of(f)
            value = getattr(self, f.name)
            if fl is not None and fl.parse is not None and isinstance(value, str):
                object.__setattr__(self, f.name, fl.parse(value))

    def check(self) -> None:
        """Refuse options the writer cannot work with, before anything is read
        (called after :meth:`for_reshard`)."""

    @classmethod
    def flags(cls) -> Iterator[tuple[str, Flag, Any]]:
        """(field name, flag, default) of every field that has a flag, in declaration order."""
        for f in fields(cls):
            fl = flag_of(f)
            if fl is not None:
                yield f.name, fl, f.default

    def writer_args(self, opts: Options) -> tuple[Options, dict[str, Any]]:
        """The shared options and the keywords the format's write function takes."""
        shared = {f.name: getattr(self, f.name) for f in fields(self) if f.metadata.get("on_options")}
        keywords = {f.name: getattr(self, f.name) for f in fields(self) if not f.metadata.get("on_options")}
        return (dataclasses.replace(opts, **shared) if shared else opts), keywords

    def for_reshard(self, source: CheckpointInfo) -> WriteOptions:
        """These options for a reshard of ``source`` (what ``inspect`` says of it) into
        its own format: where an option was left out, the source's own value (a ZeRO
        run's stage)."""
        return self

    @classmethod
    def build(cls, fmt: Named, values: Mapping[str, Any], everyone: Sequence[Named]) -> WriteOptions:
        """The options of ``fmt`` from ``values`` (field name -> value, as the CLI
        parses every format's flags). A value for an option ``fmt`` does not take
        is refused unless it is that option's default; ``everyone`` (the formats
        to name in the refusal) are the formats that do take it."""
        own = {f.name for f in fields(cls)}
        mine: dict[str, Any] = {}
        for name, value in values.items():
            if name in own:
                mine[name] = value
                continue
            takers = [(g, f) for g in everyone for f in fields(g.write_options) if f.name == name]
            if not takers:
                raise RavexError(f"'{name}' is not an option of any format Ravex writes",
                                 hint=f"{fmt.name} takes {', '.join(sorted(own)) or 'no options of its own'}")
            if all(value == f.default for _, f in takers):
                continue
            fl = flag_of(takers[0][1])
            shown = fl.name if fl is not None else name
            if isinstance(value, (list, tuple)):
                value = ",".join(map(str, value))
            names = [g.name for g, _ in takers]
            raise RavexError(f"{shown} {value} applies to {either(names, 'and')} outputs, not {fmt.name}",
                             hint=f"leave {shown} out, or write --to {either(names)}")
        return cls(**mine)


def either(names: Sequence[str], last: str = "or") -> str:
    """``a, b or c``."""
    names = list(names)
    return names[0] if len(names) == 1 else f"{', '.join(names[:-1])} {last} {names[-1]}"


# ---------------------------------------------------------------- values the flags' text turns into

_UNITS = {"": 1, "B": 1, "K": 1 << 10, "KB": 1000, "KIB": 1 << 10, "M": 1 << 20, "MB": 1000**2, "MIB": 1 << 20,
          "G": 1 << 30, "GB": 1000**3, "GIB": 1 << 30, "T": 1 << 40, "TB": 1000**4, "TIB": 1 << 40}


def parse_size(text: str) -> int:
    """``"5GB"``, ``"500MiB"``, ``"1048576"`` -> bytes."""
    s = text.strip().upper().replace(" ", "")
    num = s.rstrip("KMGTIB")
    unit = s[len(num):]
    try:
        value = float(num)
    except ValueError:
        value = -1
    if value <= 0 or unit not in _UNITS:
        raise RavexError(f"'{text}' is not a size", hint="write it like 5GB, 500MiB or 1048576")
    return int(value * _UNITS[unit])


def parse_names(text: str) -> list[str] | None:
    """``"a, b,c"`` -> ``["a", "b", "c"]``; an empty text gives nothing."""
    return [n.strip() for n in text.split(",") if n.strip()] or None


# Two formats write the model and optimizer where the source had them, or in a layout asked for.
LAYOUT = Flag("--layout", choices=("source", "portable", "lightning", "torchtitan"),
              help="torch_save, dcp: where the model and optimizer go. 'source' (default): where SRC had them (a torch.save "
                   "source's own keys, a Lightning .ckpt's, a DCP source's nesting), else 'portable' {model, optim}; "
                   "'lightning' (torch_save): a Lightning .ckpt for LightningModule.load_from_checkpoint; 'torchtitan' (dcp): "
                   "'model' and a flattened 'optimizer', as torchtitan saves and loads.")
