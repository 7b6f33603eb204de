"""A training state nested in a torch.save file, found as the DCP reader finds it.

``torch.distributed.checkpoint.format_utils.dcp_to_torch_save`` writes a DCP's
state tree as it was saved: the DCP recipe's ``{"app": AppState}`` becomes
``{"app": {"model": sd, "optim": osd, "progress": ...}, ...}``, the optimizer
keyed by parameter name as ``get_state_dict`` returns it, and Ravex's own
``--to torch_save --layout source`` of such a DCP writes the same tree. The DCP
reader already finds the model and the optimizer anywhere in a DCP's flattened
keys (its ``classify``); :func:`find` hands it the torch.save tree's leaves,
flattened as DCP flattens a state dict, so the file is read as the DCP it came
from is read.
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

from .._layout import PathItem, dotted
from .._torchfile.unpickle import TensorRef
from ..model import MODEL
from .dcp.reader import DcpMetadata, DcpTensor, classify

__all__ = ["Nested", "at", "dotted", "find", "pruned"]


@dataclass(frozen=True)
class Nested:
    """Where :func:`find` found the model and the optimizer."""

    model: tuple[PathItem, ...]  # the dict holding the model's entries (``()``: the top level)
    sd: dict[str, TensorRef]  # the model's entries, in the file's order
    optim: tuple[PathItem, ...] | None  # the optimizer state dict, None without one
    optim_flat: bool  # in flatten_optimizer_state_dict's form (torchtitan)


def _leaves(node: Any, path: tuple[PathItem, ...] = ()) -> Iterator[tuple[tuple[PathItem, ...], Any]]:
    """DCP's flattening of a state tree (``traverse_state_dict``): dicts are walked,
    and lists that hold a container; anything else is a leaf. A dict key that is
    neither a name nor a position (no state dict has one) is left out with what
    it holds. The unpickler refused cycles and deep nesting, so this ends."""
    if isinstance(node, dict) and node:
        for k, v in node.items():
            if isinstance(k, str) or (isinstance(k, int) and not isinstance(k, bool)):
                yield from _leaves(v, (*path, k))
    elif isinstance(node, list) and any(isinstance(v, (dict, list)) for v in node):
        for i, v in enumerate(node):
            yield from _leaves(v, (*path, i))
    elif path:
        yield path, node


def at(root: Any, path: tuple[PathItem, ...]) -> Any:
    """The node at ``path`` (a path :func:`find` returned: every step is there)."""
    for p in path:
        root = root[p]
    return root


def find(root: Any) -> Nested | None:
    """The model (and optimizer) of a state tree, wherever they sit, or None
    where the tree holds no model. The DCP reader's rules decide: the optimizer
    is a ``{"state", "param_groups"}`` dict (or its flattened form) anywhere, the
    model the dict of tensors whose names the optimizer's state names, else the
    one under a model-like key, else the top level's, else the only one."""
    refs: dict[str, TensorRef] = {}
    tensors: dict[str, DcpTensor] = {}
    objects: dict[str, tuple[PathItem, ...]] = {}
    for path, value in _leaves(root):
        key = repr(path)  # unique, where the dotted DCP key may not be
        if isinstance(value, TensorRef):
            refs[key] = value
            tensors[key] = DcpTensor(key, path, value.shape, value.dtype, [])
        else:
            objects[key] = path
    roles = classify(DcpMetadata(tensors, objects, {}, has_strides=False))
    if not roles.model_found:
        return None
    sd = {roles.names[k][len(MODEL):]: ref for k, ref in refs.items() if roles.names[k].startswith(MODEL)}
    # an optimizer that is the top level itself, around the model, is not one torch or DCP saves
    optim = roles.layout.optim if roles.optim_found and roles.layout.optim and isinstance(at(root, roles.layout.optim), dict) else None
    return Nested(roles.layout.model, sd, optim, roles.layout.optim_flat and optim is not None)


def pruned(node: Any, paths: list[tuple[PathItem, ...]]) -> Any:
    """``node`` without what sits at ``paths`` (None where that is ``node``
    itself); a dict or list that this empties goes too, and a list keeps its
    other items where they were (an empty dict holds a taken place, as
    :func:`~ravex_convert._layout.unflatten` holds one)."""
    if () in paths:
        return None
    if isinstance(node, dict):
        out = type(node)()
        for k, v in node.items():
            below = [p[1:] for p in paths if p[0] == k]
            if not below:
                out[k] = v
            elif (v2 := pruned(v, below)) is not None:
                out[k] = v2
        return out or None
    if isinstance(node, list):
        items = [pruned(v, below) if (below := [p[1:] for p in paths if p[0] == i]) else v for i, v in enumerate(node)]
        taken = {p[0] for p in paths}
        if all(i in taken and v is None for i, v in enumerate(items)):
            return None
        return [{} if i in taken and v is None else v for i, v in enumerate(items)]
    return node
