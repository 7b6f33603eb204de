"""Recipes recorded: how to rebuild a tracked model from its checkpoint, as data (issue 34).

While a decorated function runs, the patched ``torch.nn.Module.__init__`` hands every module it
constructs to :meth:`Recorder.constructed`, with the frame that called it. ``Module.__init__``
runs when the class's own ``__init__`` calls ``super().__init__()``; the frames above it that are
``__init__`` methods of the same object lead to the outermost one, the class's own, whose
arguments are read there, by name (Python bound them: positional arguments have their names),
and turned into data at once: a deep copy, before the rest of ``__init__`` can change them.
(Arguments are read when ``super().__init__()`` runs: its first line by convention; a body that
reassigns an argument before it is recorded with the new value.)

What is data: None, bool, int, float, str, lists, dicts keyed by str, and the types of the
argument registry (:func:`register`): tuples, ``torch.dtype``, ``torch.device`` and a Hugging
Face config (``PreTrainedConfig``: its class and its ``config.json`` form, all fields). A module whose own
``ravex_recipe()`` method names a factory and its keyword arguments is recorded from that
instead. Anything else (a class defined in ``__main__`` or inside a function, a module or a
tensor as an argument, a positional-only parameter, ``*args``) leaves the module without a
recipe: :meth:`Recorder.recipes` says why, once, as a warning; training goes on.

The recipe object written into each checkpoint (``objects["recipes"]``) is specified in
docs/format.md (13.1) and shared with readers in ``ravex_convert/recipes.py``; rebuilding is
``rebuild.py``'s.

Adding an argument type::

    from ravex_runtime.recipe import ArgType, register

    register(ArgType(
        "my_project.Units",                       # the tag in the recipe
        match=lambda v: isinstance(v, Units),
        encode=lambda v, enc: {"value": str(v)},  # JSON fields; enc(x) encodes a value inside it
        decode=lambda fields, ctx: Units(fields["value"]),
    ))

Register it before the run builds its model and before ``ravex.load_model`` (the process that
loads must know the tag too). A field named ``class`` is a dotted path of code: the loader checks
it against ``trust`` before anything is imported, and ``ctx.load(path)`` imports it.
"""

from __future__ import annotations

import inspect
import json
import logging
import sys
import types
import weakref
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, cast

import torch

from ravex_convert.recipes import FORMAT_VERSION, TAG, secret_name, valid_path

from .state import Tracked

__all__ = ["ArgType", "Built", "Decoding", "Recorder", "arg_types", "callable_problem", "encode", "encode_kwargs", "register", "unregister",
           "without_code_fields"]

log = logging.getLogger("ravex")

_HINT = ("give the class a ravex_recipe() method that returns (factory, keyword arguments): an importable function or class and "
         "JSON-like arguments (docs/runtime.md, 'Rebuilding a model')")


class NotData(Exception):
    """An argument that cannot be recorded; the message names it."""


@dataclass(frozen=True)
class Decoding:
    """What decoding a typed argument may use: ``load(path)`` imports code the recipe names (under
    the caller's trust), ``map_location`` is where the model is built (a recorded ``torch.device``
    becomes it)."""

    load: Callable[[str], Any]
    map_location: Any = None


@dataclass(frozen=True)
class ArgType:
    """A type of constructor argument recorded beyond JSON, as ``{"__recipe__": tag, **fields}``.

    ``match(value)``: the value is of this type; ``encode(value, enc)``: its fields, JSON (``enc``
    encodes a value inside it, deep-copying); ``decode(fields, ctx)``: the value again, from fields
    already decoded (a :class:`Decoding`). A field ``class`` is a dotted path of code."""

    tag: str
    match: Callable[[Any], bool]
    encode: Callable[[Any, Callable[[Any], Any]], dict[str, Any]]
    decode: Callable[[dict[str, Any], Decoding], Any]


_TYPES: dict[str, ArgType] = {}


def register(t: ArgType) -> None:
    """Record (and rebuild) arguments of one more type. A tag already registered is replaced."""
    if t.tag in ("", TAG) or not isinstance(t.tag, str):
        raise ValueError(f"an argument type needs a tag of its own, not {t.tag!r}")
    _TYPES[t.tag] = t


def unregister(tag: str) -> None:
    _TYPES.pop(tag, None)


def arg_types() -> dict[str, ArgType]:
    return dict(_TYPES)


def _path_of(obj: Any) -> str:
    return f"{getattr(obj, '__module__', '?')}.{getattr(obj, '__qualname__', '?')}"


def _where_defined(obj: Any) -> str | None:
    """Why a loader could not import ``obj`` (a class or function) by its own module and name; None when it can."""
    mod, qual = getattr(obj, "__module__", None), getattr(obj, "__qualname__", "?")
    if mod in ("__main__", "__mp_main__"):
        return f"{qual} is defined in the script (__main__), which a loader cannot import"
    if "<locals>" in qual:
        return f"{qual.replace('.<locals>', '')} is defined inside a function, which a loader cannot import"
    if "." in qual:
        return f"{qual} is nested in a class; a recipe names a module-level class or function"
    if not isinstance(mod, str) or not valid_path(f"{mod}.{qual}"):
        return f"{_path_of(obj)} is not a plain dotted path (identifiers, no part starting with '__')"
    if getattr(sys.modules.get(mod), qual, None) is not obj:
        return f"{mod} has no {qual} that is this one (renamed or shadowed after it was defined)"
    return None


def _is_hf_config(v: Any) -> bool:
    """A Hugging Face config (without importing transformers: by its base class)."""
    return any(c.__module__ == "transformers.configuration_utils" and c.__name__ in ("PreTrainedConfig", "PretrainedConfig")
               for c in type(v).__mro__)


def _encode_hf_config(v: Any, enc: Callable[[Any], Any]) -> dict[str, Any]:
    why = _where_defined(type(v))
    if why is not None:
        raise NotData(f"a {type(v).__name__} config whose class cannot be imported: {why}")
    # the config as its config.json holds it (Hugging Face's own JSON form: id2label's keys as strings), which from_dict reads
    return {"class": _path_of(type(v)), "value": enc(json.loads(v.to_json_string(use_diff=False)))}


# Fields of a Hugging Face config that make transformers fetch or import code when a model is
# built from it: a kernel from the Hub (an attention implementation naming a repository, or a
# flash-attention one that falls back to a Hub kernel when flash_attn is missing), remote code.
_CODE_FIELDS = ("use_kernels", "kernel_config", "trust_remote_code", "auto_map", "custom_pipelines")
_ATTN_FIELDS = ("attn_implementation", "_attn_implementation", "_attn_implementation_internal")
_BUILTIN_ATTN = (None, "eager", "sdpa", "flex_attention", "paged|eager")


def without_code_fields(value: Any, where: str = "") -> tuple[Any, list[str]]:
    """A copy of a recorded config (or keyword arguments) without the fields that make
    transformers fetch or import code, at any depth (sub-configs), and the paths of those dropped."""
    if isinstance(value, list):
        out_list, dropped = [], []
        for i, x in enumerate(value):
            v, d = without_code_fields(x, f"{where}[{i}]")
            out_list.append(v)
            dropped += d
        return out_list, dropped
    if not isinstance(value, dict):
        return value, []
    out: dict[str, Any] = {}
    dropped = []
    for k, x in value.items():
        path = f"{where}.{k}" if where else str(k)
        if k in _CODE_FIELDS or (k in _ATTN_FIELDS and not (x in _BUILTIN_ATTN if not isinstance(x, dict) else
                                                             all(v in _BUILTIN_ATTN for v in x.values()))):
            dropped.append(f"{path}={x!r}")
            continue
        out[k], d = without_code_fields(x, path)
        dropped += d
    return out, dropped


def _decode_hf_config(fields: dict[str, Any], ctx: Decoding) -> Any:
    cls = ctx.load(fields["class"])
    if not (isinstance(cls, type) and any(c.__module__ == "transformers.configuration_utils" and c.__name__ in ("PreTrainedConfig", "PretrainedConfig")
                                          for c in cls.__mro__)):
        raise NotData(f"{fields['class']} is not a Hugging Face config class")
    value, dropped = without_code_fields(fields["value"])
    if dropped:
        log.warning("ravex: the recorded %s leaves out %s: a recipe is data, and these make transformers fetch or import code "
                    "(a kernel from the Hub, remote code); the model is built with transformers' defaults for them",
                    str(fields["class"]).rpartition(".")[2], ", ".join(dropped))
    return cast(Any, cls).from_dict(value)


def _decode_dtype(fields: dict[str, Any], ctx: Decoding) -> Any:
    dt = getattr(torch, str(fields.get("value")), None)
    if not isinstance(dt, torch.dtype):
        raise NotData(f"{fields.get('value')!r} is not a torch dtype")
    return dt


def _decode_device(fields: dict[str, Any], ctx: Decoding) -> Any:
    return torch.device(ctx.map_location if ctx.map_location is not None else str(fields.get("value")))


def _decode_tuple(fields: dict[str, Any], ctx: Decoding) -> Any:
    if not isinstance(fields.get("items"), list):
        raise NotData("a tuple without a list of items")
    return tuple(fields["items"])


for _t in (
    ArgType("tuple", lambda v: type(v) is tuple, lambda v, enc: {"items": [enc(x) for x in v]}, _decode_tuple),
    ArgType("torch.dtype", lambda v: isinstance(v, torch.dtype), lambda v, enc: {"value": str(v).removeprefix("torch.")}, _decode_dtype),
    ArgType("torch.device", lambda v: isinstance(v, torch.device), lambda v, enc: {"value": str(v)}, _decode_device),
    ArgType("transformers.config", _is_hf_config, _encode_hf_config, _decode_hf_config),
):
    register(_t)


def _what(v: Any) -> str:
    if isinstance(v, torch.nn.Module):
        return f"a {type(v).__name__} module (a live object)"
    if isinstance(v, torch.Tensor):
        return "a tensor"
    if isinstance(v, dict):
        return "a dict with keys that are not all strings (or one named '__recipe__')"
    return f"a {type(v).__module__}.{type(v).__qualname__}" if type(v).__module__ != "builtins" else f"a {type(v).__name__}"


def encode(value: Any, where: str, omitted: list[str] | None = None) -> Any:
    """``value`` as recipe data: a new JSON structure (nothing shared with ``value``), typed
    arguments tagged. :class:`NotData` naming ``where`` for what is not data. A dict's entry
    whose key says it is a secret is left out, its path added to ``omitted``."""
    if value is None or type(value) in (bool, int, float, str):
        return value
    if type(value) is list:
        return [encode(x, f"{where}[{i}]", omitted) for i, x in enumerate(value)]
    if type(value) is dict and all(isinstance(k, str) for k in value) and TAG not in value:
        out = {}
        for k, x in value.items():
            if secret_name(k):
                if omitted is not None:
                    omitted.append(f"{where}[{k!r}]")
                continue
            out[k] = encode(x, f"{where}[{k!r}]", omitted)
        return out
    for t in _TYPES.values():
        if t.match(value):
            return {TAG: t.tag, **t.encode(value, lambda x: encode(x, where, omitted))}
    raise NotData(f"argument {where!r} is {_what(value)}, not data")


def encode_kwargs(kwargs: dict[str, Any]) -> tuple[dict[str, Any], list[str]]:
    """Keyword arguments as recipe data, and the names of those left out because they say they are
    secrets (an argument, or a key inside one): a secret is never written into a checkpoint."""
    omitted: list[str] = []
    out: dict[str, Any] = {}
    for k, v in kwargs.items():
        if secret_name(k):
            omitted.append(k)
        else:
            out[k] = encode(v, k, omitted)
    return out, omitted


def decode(value: Any, ctx: Decoding, where: str) -> Any:
    """The inverse of :func:`encode`. :class:`NotData` for an unknown tag or a field it refuses."""
    if isinstance(value, list):
        return [decode(x, ctx, where) for x in value]
    if not isinstance(value, dict):
        return value
    if TAG not in value:
        return {k: decode(x, ctx, where) for k, x in value.items()}
    t = _TYPES.get(value[TAG]) if isinstance(value[TAG], str) else None
    if t is None:
        raise NotData(f"argument {where!r} has the type {value[TAG]!r}, which this process has not registered "
                      "(ravex_runtime.recipe.register, before load_model; or upgrade Ravex)")
    fields = {k: (x if k == "class" else decode(x, ctx, where)) for k, x in value.items() if k != TAG}
    return t.decode(fields, ctx)


def _annotated_return(fn: types.FunctionType) -> Any:
    """The class a function's return annotation names, without evaluating code: a dotted name
    looked up in the function's own module namespace (a string under ``from __future__ import annotations``)."""
    ann = fn.__annotations__.get("return")
    if not isinstance(ann, str):
        return ann
    parts = ann.split(".")
    if not all(p.isidentifier() for p in parts):
        return None
    obj = fn.__globals__.get(parts[0])
    for p in parts[1:]:
        if not isinstance(obj, (types.ModuleType, type)):
            return None
        obj = getattr(obj, p, None)
    return obj


def callable_problem(obj: Any, path: str) -> str | None:
    """Why ``obj`` (what ``path`` names) may not be called to build a module; None when it may: a
    ``torch.nn.Module`` subclass, or a Python function whose return annotation names one (a
    factory says what it makes before it is called; ``os.system``, ``os.makedirs`` say nothing)."""
    if isinstance(obj, type):
        return None if issubclass(obj, torch.nn.Module) else f"{path} is a class that is not a torch.nn.Module subclass"
    if isinstance(obj, types.FunctionType):
        ret = _annotated_return(obj)
        if isinstance(ret, type) and issubclass(ret, torch.nn.Module):
            return None
        return (f"{path} is a function whose return annotation does not name a torch.nn.Module subclass "
                f"({obj.__annotations__.get('return', 'none')!r}); a factory must declare the module it returns")
    what = "module" if isinstance(obj, types.ModuleType) else type(obj).__name__
    return f"{path} is a {what}, neither a torch.nn.Module subclass nor a Python function"


@dataclass(frozen=True)
class Built:
    """A recipe: ``call`` (a class or factory's dotted path) with ``kwargs`` (encoded)."""

    call: str
    kind: str
    kwargs: dict[str, Any] = field(default_factory=dict)
    source: str = "constructor"
    omitted: tuple[str, ...] = ()  # arguments left out because their names say secret

    def entry(self, weights: str) -> dict[str, Any]:
        out = {"weights": weights, "call": self.call, "kind": self.kind, "kwargs": self.kwargs, "from": self.source}
        if self.omitted:
            out["omitted"] = list(self.omitted)
        return out


def _declared(m: torch.nn.Module) -> Built | str:
    """The recipe a module declares with ``ravex_recipe()``: ``(factory, kwargs)`` or
    ``{"factory": ..., "kwargs": ...}``; the factory a dotted path, a class or a function."""
    name = type(m).__name__
    try:
        out = m.ravex_recipe()  # type: ignore[operator]
    except Exception as exc:  # noqa: BLE001 - the user's method: its failure is reported, never raised into training
        return f"{name}.ravex_recipe() raised {type(exc).__name__}: {exc}"
    if isinstance(out, dict) and set(out) <= {"factory", "kwargs"}:
        factory, kwargs = out.get("factory"), out.get("kwargs", {})
    elif isinstance(out, tuple) and len(out) == 2:
        factory, kwargs = out
    else:
        return f"{name}.ravex_recipe() returned {type(out).__name__}, not (factory, keyword arguments)"
    if not isinstance(factory, str):
        why = _where_defined(factory)
        if why is not None:
            return f"{name}.ravex_recipe(): {why}"
        factory = _path_of(factory)
    if not valid_path(factory):
        return f"{name}.ravex_recipe(): {factory!r} is not a dotted path of identifiers (module.name; no part starting with '__')"
    if not isinstance(kwargs, dict) or not all(isinstance(k, str) and k.isidentifier() for k in kwargs):
        return f"{name}.ravex_recipe(): the keyword arguments are not a dict keyed by argument names"
    mod, _, attr = factory.rpartition(".")
    kind = "factory"
    if mod in sys.modules:  # the user's own code, already imported here: checked as the loader will check it
        target = getattr(sys.modules[mod], attr, None)
        why = callable_problem(target, factory) if target is not None else f"{mod} has no {attr}"
        if why is not None:
            return f"{name}.ravex_recipe(): {why}"
        kind = "class" if isinstance(target, type) else "factory"
    try:
        data, omitted = encode_kwargs(kwargs)
        return Built(factory, kind, data, "ravex_recipe", tuple(omitted))
    except NotData as exc:
        return f"{name}.ravex_recipe(): {exc}"


class Recorder:
    """The recipes of the modules a session sees built (weakly held), and the names given to modules
    with ``ravex.track(module, name=...)``. ``recording``: modules are being seen built (the
    decorator's patches are on); only then is a module without a recipe worth a warning."""

    def __init__(self) -> None:
        self.recording = False
        self._built: dict[int, tuple[weakref.ref[torch.nn.Module], Built | str]] = {}
        self._names: dict[int, tuple[weakref.ref[torch.nn.Module], str]] = {}
        self._classes: weakref.WeakKeyDictionary[type, tuple[str | None, list[tuple[str, Any]]]] = weakref.WeakKeyDictionary()
        self._warned: set[tuple[str, str]] = set()

    def constructed(self, m: torch.nn.Module, caller: types.FrameType | None) -> None:
        """``m``'s ``Module.__init__`` has run, called from ``caller``: record its recipe (or why it has none). Never raises."""
        key = id(m)
        known = self._built.get(key)
        if known is not None and known[0]() is m:
            return
        try:
            rec = self._record(m, caller)
        except Exception as exc:  # noqa: BLE001 - recording must never reach training code
            rec = f"its arguments could not be read ({type(exc).__name__}: {exc})"
        self._built[key] = (weakref.ref(m), rec)
        if len(self._built) > 4096 and len(self._built) % 1024 == 0:
            self._built = {k: v for k, v in self._built.items() if v[0]() is not None}  # modules built and dropped

    def name(self, m: torch.nn.Module, name: str) -> None:
        """``m`` was tracked as ``name`` (``ravex.track(m, name=...)``): its recipe goes by that name."""
        self._names[id(m)] = (weakref.ref(m), name)

    def _class(self, cls: type) -> tuple[str | None, list[tuple[str, Any]]]:
        """Per class, once: why it cannot have a recipe (or None), and its ``__init__``'s parameters after self."""
        if cls not in self._classes:
            why = _where_defined(cls)
            params: list[tuple[str, Any]] = []
            if why is None:
                try:
                    params = [(p.name, p.kind) for p in list(inspect.signature(cast(Any, cls).__init__).parameters.values())[1:]]
                except (TypeError, ValueError) as exc:
                    why = f"the signature of {cls.__qualname__}.__init__ cannot be read ({exc})"
            self._classes[cls] = (why, params)
        return self._classes[cls]

    def _record(self, m: torch.nn.Module, caller: types.FrameType | None) -> Built | str:
        cls = type(m)
        why, params = self._class(cls)
        if why is not None:
            return why
        path = _path_of(cls)
        # the outermost frame that is an __init__ of this object: the class's own
        outer, f = None, caller
        while f is not None and f.f_code.co_name == "__init__" and f.f_code.co_argcount >= 1:
            if f.f_locals.get(f.f_code.co_varnames[0]) is not m:
                break
            outer, f = f, f.f_back
        if f is not None and f.f_code.co_name == "__init__" and f.f_code.co_argcount >= 1:
            parent = f.f_locals.get(f.f_code.co_varnames[0])
            if isinstance(parent, torch.nn.Module):
                # a part of the module being built (its arguments are not copied: that costs, and the part is rebuilt with it)
                return f"{cls.__qualname__} was built inside {type(parent).__qualname__}.__init__, as a part of it"
        init = cast(Any, cls).__init__
        if outer is None:
            if init is torch.nn.Module.__init__:  # no __init__ of its own: built with no arguments
                return Built(path, "class")
            return f"the arguments of {cls.__qualname__}() were not seen (its __init__ does not call super().__init__() itself)"
        if outer.f_code is not getattr(init, "__code__", None):
            return f"the arguments of {cls.__qualname__}() were not seen (its __init__ is wrapped by a decorator)"
        local = outer.f_locals
        kwargs: dict[str, Any] = {}
        omitted: list[str] = []
        try:
            for pname, kind in params:
                if kind is inspect.Parameter.POSITIONAL_ONLY:
                    return f"{cls.__qualname__}.__init__ has a positional-only parameter {pname!r}"
                if pname not in local:
                    return f"{cls.__qualname__}.__init__ deleted its argument {pname!r} before super().__init__()"
                v = local[pname]
                if kind is inspect.Parameter.VAR_POSITIONAL:
                    if v:
                        return f"{cls.__qualname__}() was given positional arguments through *{pname}, which have no names"
                elif kind is inspect.Parameter.VAR_KEYWORD:
                    data, left = encode_kwargs(dict(v))
                    kwargs.update(data)
                    omitted.extend(left)
                else:
                    data, left = encode_kwargs({pname: v})
                    kwargs.update(data)
                    omitted.extend(left)
        except NotData as exc:
            return f"{cls.__qualname__}(): {exc}"
        return Built(path, "class", kwargs, omitted=tuple(omitted))

    def _recipe_of(self, m: torch.nn.Module) -> Built | str:
        if callable(getattr(m, "ravex_recipe", None)):
            return _declared(m)
        known = self._built.get(id(m))
        if known is not None and known[0]() is m:
            return known[1]
        return (f"{type(m).__qualname__} was not built inside the decorated function (built before it, or copied: "
                "copy.deepcopy calls no constructor)")

    def recipes(self, live: Tracked) -> dict[str, Any]:
        """The recipe object of a capture of ``live`` (docs/format.md 13.1): the model (``model``),
        each other outermost module (by the name it was tracked with, else ``model.<i>``) and each
        module tracked by name through a session. Says once, as a warning, why a module has none."""
        names = {k: n for k, (r, n) in self._names.items() if r() is not None}
        modules: dict[str, Any] = {}
        entries: list[tuple[str, torch.nn.Module, str]] = []
        for i, m in enumerate(live.models):
            entries.append(("model" if i == 0 else names.get(id(m), f"model.{i}"), m, "model/" if i == 0 else f"obj/model.{i}/"))
        for name, obj in live.named.items():
            if isinstance(obj, torch.nn.Module) and "/" not in name:
                entries.append((name, obj, f"obj/tracked/{name}/"))
        for name, m, weights in entries:
            if name in modules:
                continue
            rec = self._recipe_of(m)
            if isinstance(rec, Built):
                modules[name] = rec.entry(weights)
                said = (name, "omitted " + ",".join(rec.omitted))
                if rec.omitted and said not in self._warned and self.recording:
                    self._warned.add(said)
                    log.warning("ravex: the recipe of %r (%s) leaves out %s: the name says it is a secret, and a secret is never "
                                "written into a checkpoint; ravex.load_model rebuilds it with the default of each", name,
                                type(m).__qualname__, ", ".join(rec.omitted))
                continue
            modules[name] = {"weights": weights, "unavailable": rec}
            if (name, rec) not in self._warned and self.recording:
                self._warned.add((name, rec))
                log.warning("ravex: ravex.load_model cannot rebuild %r (%s) from this run's checkpoints: %s; training goes on. hint: %s",
                            name, type(m).__qualname__, rec, _HINT)
        return {"format_version": FORMAT_VERSION, "modules": modules}
