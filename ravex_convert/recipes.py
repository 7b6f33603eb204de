"""The recipe object of a checkpoint: how to rebuild its model, as data (docs/format.md, 13.1).

The runtime records it (``ravex_runtime/recipe.py``) and rebuilds from it
(``ravex_runtime/rebuild.py``, ``ravex.load_model``); this module is the part every reader
shares and needs no torch: the object's shape, the checks a reader makes before it acts on
one, and the one-line form ``ravex inspect`` shows.

A recipe names code (``call``, and the classes inside some arguments); nothing here imports
it. :func:`code_paths` lists every name a recipe would import, for the trust check that comes
before any import.

An argument whose name says it is a secret (:func:`secret_name`: ``token``, ``api_key``,
``password``, ``secret``, ``credentials``, ``*_key``, ...) is never recorded: the entry lists
its name under ``omitted``. A recipe is shown with the value of any such name hidden, whoever
wrote it.
"""

from __future__ import annotations

import re
from typing import Any

from .errors import CorruptCheckpointError, RavexError

__all__ = [
    "FORMAT_VERSION", "HIDDEN", "KEY", "KINDS", "TAG", "check_entry", "check_version", "code_paths", "secret_name", "show", "show_value", "shown",
    "valid", "valid_path", "weights_ok",
]

KEY = "recipes"  # objects[KEY]
FORMAT_VERSION = 1
TAG = "__recipe__"  # an argument of a type JSON has not: {"__recipe__": <type>, ...}
KINDS = ("class", "factory")
# Where a module's tensors are in the checkpoint: the model's, another outermost module's, a module tracked by name.
_WEIGHTS = re.compile(r"model/|obj/model\.[1-9][0-9]*/|obj/tracked/[^/]+/")
_PART = r"[A-Za-z_][A-Za-z0-9_]*"
_PATH = re.compile(rf"{_PART}(\.{_PART})+")
_SHOWN_ITEMS = 8  # of a config's fields, in the one-line form
_SIZING = re.compile(r"^(n_|num_)|layer|head|embd|hidden|intermediate|vocab|position")
# Names that say a secret by their last word (token, use_auth_token, hf_token, db_password,
# client_secret, credentials, api_key, secret_key, aws_access_key): never recorded, never shown.
# bos_token_id, token_type_ids and key_dim name no secret.
_SECRET = re.compile(r"(^|_)(token|auth|password|passwd|passphrase|secret|credentials?|apikey|key)$", re.IGNORECASE)
HIDDEN = "<hidden>"  # how a secret argument's value is shown


_TOKENIZER = re.compile(r"(^|_)(pad|bos|eos|unk|sep|cls|mask)_token$")  # a tokenizer's special tokens: text, not secrets


def secret_name(name: Any) -> bool:
    """An argument (or a dict key) whose name says it holds a secret."""
    return isinstance(name, str) and _SECRET.search(name) is not None and _TOKENIZER.search(name) is None


def valid(v: Any) -> bool:
    """``objects["recipes"]`` has the recipe object's shape: a positive integer ``format_version``
    and a ``modules`` object (objects.py's check; each entry is checked when it is used)."""
    return (isinstance(v, dict) and isinstance(v.get("format_version"), int) and not isinstance(v.get("format_version"), bool)
            and v["format_version"] >= 1 and isinstance(v.get("modules"), dict))


def valid_path(path: Any) -> bool:
    """A dotted path a recipe may name: identifiers only, a module and one name at least, and no
    part that starts with ``__`` (no ``__main__``, no ``__builtins__``, no ``__class__`` walk)."""
    return isinstance(path, str) and _PATH.fullmatch(path) is not None and not any(p.startswith("__") for p in path.split("."))


def weights_ok(prefix: Any) -> bool:
    return isinstance(prefix, str) and _WEIGHTS.fullmatch(prefix) is not None


def _bad(where: str, why: str) -> CorruptCheckpointError:
    return CorruptCheckpointError(f"{where}: {why}", hint="the recipe is damaged or was not written by Ravex; build the model yourself and "
                                                          "use ravex.load_weights(model, path)")


def check_entry(name: str, entry: Any, where: str) -> None:
    """What a reader checks of ``modules[name]`` before it acts on it: :class:`CorruptCheckpointError`
    naming the field otherwise. An entry without a recipe (``unavailable``) passes: the caller says why."""
    at = f"{where}: recipe {name!r}"
    if not isinstance(entry, dict) or not weights_ok(entry.get("weights")):
        raise _bad(at, "'weights' is not one of 'model/', 'obj/model.<i>/', 'obj/tracked/<name>/'")
    if "unavailable" in entry:
        if not isinstance(entry["unavailable"], str):
            raise _bad(at, "'unavailable' is not a string")
        return
    if entry.get("kind") not in KINDS:
        raise _bad(at, f"'kind' is {entry.get('kind')!r}, not one of {', '.join(KINDS)}")
    if not valid_path(entry.get("call")):
        raise _bad(at, f"'call' {entry.get('call')!r} is not a dotted path of identifiers (no part may start with '__')")
    kwargs = entry.get("kwargs")
    if not isinstance(kwargs, dict) or not all(isinstance(k, str) and k.isidentifier() and not k.startswith("__") for k in kwargs):
        raise _bad(at, "'kwargs' is not an object keyed by argument names")
    omitted = entry.get("omitted", [])
    if not isinstance(omitted, list) or not all(isinstance(k, str) for k in omitted):
        raise _bad(at, "'omitted' is not a list of argument names")
    for path in code_paths(kwargs):
        if not valid_path(path):
            raise _bad(at, f"an argument names {path!r}, not a dotted path of identifiers")


def code_paths(value: Any) -> list[str]:
    """Every dotted path of code the arguments name (a typed argument's ``class``), in order."""
    out: list[str] = []
    if isinstance(value, dict):
        if TAG in value and "class" in value:
            out.append(value["class"] if isinstance(value["class"], str) else repr(value["class"]))
        for v in value.values():
            out.extend(code_paths(v))
    elif isinstance(value, list):
        for v in value:
            out.extend(code_paths(v))
    return out


def show_value(v: Any) -> str:
    """One argument as Python would spell it (typed ones by their type)."""
    if isinstance(v, dict) and TAG in v:
        tag = v[TAG]
        if tag == "tuple" and isinstance(v.get("items"), list):
            items = [show_value(x) for x in v["items"]]
            return f"({items[0]},)" if len(items) == 1 else f"({', '.join(items)})"
        if tag == "torch.dtype":
            return f"torch.{v.get('value')}"
        if tag == "torch.device":
            return f"torch.device({v.get('value')!r})"
        if tag == "transformers.config" and isinstance(v.get("value"), dict):
            fields = v["value"]
            cls = str(v.get("class", "?")).rpartition(".")[2]
            # the fields that size the model first (a config has dozens): model type, layers, heads, widths, vocabulary
            keys = [k for k in fields if (k == "model_type" or _SIZING.search(k)) and not secret_name(k)][:_SHOWN_ITEMS]
            shown = [f"{k}={show_value(fields[k])}" for k in keys]
            more = len(fields) - len(shown)
            return f"{cls}({', '.join(shown)}{', ...' if more > 0 else ''})"
        return f"<{tag}>"
    if isinstance(v, dict):
        return "{" + ", ".join(f"{k!r}: {HIDDEN if secret_name(k) else show_value(x)}" for k, x in v.items()) + "}"
    if isinstance(v, list):
        return "[" + ", ".join(show_value(x) for x in v) + "]"
    return repr(v)


def show(entry: Any) -> str:
    """``my_project.models.Net(width=48, depth=3, act='gelu')``; ``none: <why>`` without a recipe."""
    if not isinstance(entry, dict):
        return "damaged"
    if "unavailable" in entry:
        return f"none: {entry['unavailable']}"
    kwargs = entry["kwargs"] if isinstance(entry.get("kwargs"), dict) else {}
    args = [f"{k}={HIDDEN if secret_name(k) else show_value(v)}" for k, v in kwargs.items()]
    omitted = entry.get("omitted")
    if isinstance(omitted, list) and omitted:
        args.append(f"<not recorded: {', '.join(map(str, omitted))}>")
    return f"{entry.get('call')}({', '.join(args)})"


def shown(recipes: Any) -> list[tuple[str, str]]:
    """(name, one-line form) of each recipe, the model first; [] when there is no recipe object."""
    if not valid(recipes):
        return []
    if recipes["format_version"] > FORMAT_VERSION:
        return [("", f"format version {recipes['format_version']}: upgrade Ravex to read it")]
    return [(name, show(entry)) for name, entry in recipes["modules"].items()]


def check_version(recipes: Any, where: str) -> None:
    """A recipe object this Ravex can read, else an error (a newer one: upgrade)."""
    if not valid(recipes):
        raise _bad(where, "objects['recipes'] is not a recipe object (format_version, modules)")
    if recipes["format_version"] > FORMAT_VERSION:
        raise RavexError(f"{where}: the recipe object has format_version {recipes['format_version']}; this Ravex reads {FORMAT_VERSION}",
                         hint="a newer Ravex wrote it: upgrade Ravex")
