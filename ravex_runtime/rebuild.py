"""Rebuilding a module from a checkpoint's recipe: ``ravex.load_model`` (issue 34).

A recipe is data a checkpoint carries, and it names code: it is hostile until trusted. In order,
before anything is called:

1. the recipe object and the entry are checked (``ravex_convert/recipes.py``: dotted paths of
   identifiers, no ``__`` part, kwargs keyed by argument names, a known ``weights`` prefix);
2. every dotted path it names (``call``, and each typed argument's ``class``) must lie in a
   package of ``trust``, else :class:`UntrustedRecipeError` -- nothing has been imported yet;
3. the module is imported and the last name looked up in it (no walk through other objects);
   what it is must be defined in a trusted package too (a re-export from another is refused),
   and be a ``torch.nn.Module`` subclass or a Python function annotated to return one
   (``recipe.callable_problem``: checked before the call, so ``os.system`` or ``os.makedirs``
   is never called, even with ``trust=["os"]``);
4. the recorded arguments are decoded (only data; typed ones through the argument registry)
   and bound to its signature; it is called, and what it returns must be a module.

The weights are then read (checksums verified; only the module's own tensors) and loaded, every
name and shape checked first. The same steps rebuild a model for another run's start (``init_from``).
"""

from __future__ import annotations

import importlib
import inspect
import logging
import types
from collections.abc import Iterable
from pathlib import Path
from typing import Any

import torch

from ravex_convert.errors import RavexError
from ravex_convert.model import Checkpoint
from ravex_convert.recipes import KEY, check_entry, check_version, code_paths

from .errors import RecipeError, UntrustedRecipeError
from .recipe import Decoding, NotData, callable_problem, decode, without_code_fields

__all__ = ["build", "load_model", "trusted_packages"]

log = logging.getLogger("ravex")

_NO_RECIPE_HINT = "build the model yourself and load its weights with ravex.load_weights(model, path)"


def trusted_packages(trust: Iterable[str] | str) -> frozenset[str]:
    """``trust`` as a set of top-level package names (one string is one package)."""
    names = [trust] if isinstance(trust, str) else list(trust)
    for t in names:
        if not isinstance(t, str) or not t.isidentifier() or t.startswith("__"):
            raise RavexError(f"trust={names!r}: {t!r} is not a top-level package name",
                             hint="trust names top-level packages, e.g. trust=['my_project'] (importing a subpackage runs its parents' code too)")
    return frozenset(names)


def _top(path: str) -> str:
    return path.split(".", 1)[0]


def _untrusted(path: str, what: str) -> UntrustedRecipeError:
    return UntrustedRecipeError(f"{what} names {path}, code of the package {_top(path)!r}, which is not trusted; nothing was imported",
                                hint=f"if you trust the code of {_top(path)!r} (the checkpoint's recipe runs it), pass trust=[{_top(path)!r}]")


def _load(path: str, trust: frozenset[str], what: str) -> Any:
    """The object ``path`` names: its module imported (its package trusted), the last name looked up there."""
    if _top(path) not in trust:
        raise _untrusted(path, what)
    module_name, _, attr = path.rpartition(".")
    try:
        module = importlib.import_module(module_name)
    except ImportError as exc:
        raise RecipeError(f"{what} names {path}, but the module {module_name} cannot be imported: {exc}",
                          hint="install the package that defines it, or the version the run was trained with (the module may have moved)") from None
    obj = getattr(module, attr, None)
    if obj is None:
        raise RecipeError(f"{what} names {path}, but {module_name} has no {attr!r} (renamed or removed since the checkpoint was written)",
                          hint=f"install the version of {_top(path)!r} the run was trained with, or {_NO_RECIPE_HINT}")
    if isinstance(obj, types.ModuleType):
        return obj  # callable_problem refuses it
    home = getattr(obj, "__module__", None)
    if not isinstance(home, str) or _top(home) not in trust:
        raise UntrustedRecipeError(f"{what} names {path}, which is defined in {home!r}, a package that is not trusted",
                                   hint=f"pass trust=[..., {_top(home) if isinstance(home, str) else '?'!r}] if you trust that code too")
    return obj


def build(recipes: Any, name: str, where: str, *, trust: Iterable[str] | str = (), map_location: Any = None) -> tuple[torch.nn.Module, str]:
    """The module ``name``'s recipe builds (the checks in the module's docstring), and the prefix of
    its tensors in the checkpoint (``model/``). Nothing is imported before the trust check passes."""
    trusted = trusted_packages(trust)
    if recipes is None:
        raise RecipeError(f"{where} holds no recipe (written by a Ravex before recipes, or by a program that records none)", hint=_NO_RECIPE_HINT)
    check_version(recipes, where)
    modules = recipes["modules"]
    if name not in modules:
        raise RecipeError(f"{where} has no recipe for {name!r}; it has: {', '.join(map(repr, modules)) or 'none'}",
                          hint="pass name= one of those (an EMA tracked with ravex.track(ema, name='ema') is name='ema')")
    entry = modules[name]
    check_entry(name, entry, where)
    if "unavailable" in entry:
        raise RecipeError(f"{where}: no recipe was recorded for {name!r}: {entry['unavailable']}",
                          hint="give its class a ravex_recipe() method (docs/runtime.md, 'Rebuilding a model') and train again, or " + _NO_RECIPE_HINT)
    call, what = entry["call"], f"the recipe of {name!r} in {where}"
    for path in [call, *code_paths(entry["kwargs"])]:  # every package the recipe needs, before the first import
        if _top(path) not in trusted:
            raise _untrusted(path, what)
    target = _load(call, trusted, what)
    why = callable_problem(target, call)
    if why is not None:
        raise RecipeError(f"{what}: {why}; it was not called",
                          hint="a recipe names a torch.nn.Module subclass, or a function annotated to return one (docs/security.md)")
    ctx = Decoding(load=lambda p: _load(p, trusted, what), map_location=map_location)
    recorded = entry["kwargs"]
    if _top(call) == "transformers":  # a model class of transformers called with keyword arguments of its own
        recorded, dropped = without_code_fields(recorded)
        if dropped:
            log.warning("ravex: %s: left out %s: a recipe is data, and these make transformers fetch or import code", what, ", ".join(dropped))
    try:
        kwargs = {k: decode(v, ctx, k) for k, v in recorded.items()}
    except NotData as exc:
        raise RecipeError(f"{what}: {exc}", hint=_NO_RECIPE_HINT) from None
    omitted = entry.get("omitted") or []
    try:
        inspect.signature(target).bind(**kwargs)
    except TypeError as exc:
        if omitted:
            raise RecipeError(f"{what}: {call}{_signature(target)} cannot be called without {', '.join(omitted)}, which the recipe "
                              f"left out (a secret is never recorded): {exc}", hint=_NO_RECIPE_HINT) from None
        raise RecipeError(f"{what}: the recorded arguments ({', '.join(kwargs)}) do not fit {call}{_signature(target)}: {exc}",
                          hint=f"{call} changed since the checkpoint was written: install the version the run was trained with, or "
                               + _NO_RECIPE_HINT) from None
    except ValueError:
        pass  # no signature to check against (a builtin's): the call says
    model = target(**kwargs)
    if not isinstance(model, torch.nn.Module):
        raise RecipeError(f"{what}: {call}(...) returned a {type(model).__name__}, not a torch.nn.Module",
                          hint="a recipe's factory must return the module it builds")
    return model, entry["weights"]


def _signature(obj: Any) -> str:
    try:
        return str(inspect.signature(obj))
    except (TypeError, ValueError):
        return "(...)"


def open_checkpoint(path: str | Path, index: int = -1) -> tuple[Checkpoint, Path]:
    """A native store's checkpoint, its metadata read and checked (no tensor yet), on any storage
    (a directory, ``objdir:PATH``, ``s3://BUCKET/PREFIX``: read where the storage layer has its bytes)."""
    from ravex_convert.formats.native import reader as native
    from ravex_convert.storage import resolve

    store = resolve(path).path
    return native.read(store, index), store


def load_model(path: str | Path, index: int = -1, *, name: str = "model", trust: Iterable[str] | str = (), map_location: Any = "cpu") -> torch.nn.Module:
    """``ravex.load_model``: see its docstring (api.py)."""
    from .loading import load_state, read_tensors

    ckpt, _ = open_checkpoint(path, index)
    where = f"checkpoint {ckpt.source.get('index')} (step {ckpt.step}) of {path}"
    model, prefix = build(ckpt.objects.get(KEY), name, where, trust=trust, map_location=map_location)
    tensors = read_tensors(ckpt, prefix, verify=True)
    sd = {n[len(prefix):]: t for n, t in tensors.items() if n.startswith(prefix)}
    load_state(model, sd, where, prefix=prefix, path=path)
    return model.to(map_location) if map_location is not None else model

