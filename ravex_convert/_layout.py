"""Where the model and the optimizer sit in a checkpoint's state tree.

Ravex's portable layout is ``{"model": sd, "optim": {"state", "param_groups"}, ...}``.
Real checkpoints nest it elsewhere: PyTorch's DCP recipe saves
``{"app": AppState}`` whose ``state_dict()`` is ``{"model": ..., "optim": ...}``
(so the model sits at ``("app", "model")``); torchtitan saves ``"model"`` and
``"optimizer"``, the optimizer flattened by ``get_state_dict(...,
flatten_optimizer_state_dict=True)`` into ``"state.<fqn>.<name>"`` and
``"param_groups.<fqn>.<key>"`` entries; a plain ``torch.save`` keeps
``optimizer.state_dict()`` as torch gives it, keyed by position, and Lightning
keeps a list of them (``("optimizer_states", 0)``: an int in a path is a list
index). A reader records what it found as a
:class:`StateLayout` in ``Checkpoint.source["state_layout"]`` (JSON-able); the
writers that keep a state tree (DCP, torch_save) put the model and optimizer
back where the source had them, so the source's own loading code still works.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any

__all__ = ["SOURCE_KEY", "PathItem", "StateLayout", "by_position", "dotted", "layout_of", "merge", "optimizer_tree", "place", "regroup", "unflatten", "unflatten_optimizer"]

SOURCE_KEY = "state_layout"

PathItem = str | int


@dataclass(frozen=True)
class StateLayout:
    """``model``: the path of the model state dict (``()``: the top level);
    ``optim``: the path of the optimizer state dict (a str is a dict key, an
    int a list index); ``optim_flat``: the optimizer is in the flattened form of
    ``flatten_optimizer_state_dict``; ``optim_by_position``: its state is keyed
    by integer ids in param-group order, as torch's ``optimizer.state_dict()``
    writes it, rather than by parameter name; ``optim_names``: such a state's
    param groups also name their parameters (torch's ``param_names``), where
    the names had to be given (``--param-names``): the output then says them itself."""

    model: tuple[PathItem, ...] = ("model",)
    optim: tuple[PathItem, ...] = ("optim",)
    optim_flat: bool = False
    optim_by_position: bool = False
    optim_names: bool = False

    @property
    def portable(self) -> bool:
        """Ravex's own ``{"model", "optim"}`` layout, optimizer keyed by name."""
        return self == StateLayout()

    @property
    def has_list_index(self) -> bool:
        return any(isinstance(p, int) for p in (*self.model, *self.optim))

    def to_json(self) -> dict[str, Any]:
        doc: dict[str, Any] = {"model": list(self.model), "optim": list(self.optim), "optim_flat": self.optim_flat}
        for flag in ("optim_by_position", "optim_names"):  # only when set: the layouts recorded before them read back unchanged
            if getattr(self, flag):
                doc[flag] = True
        return doc

    @classmethod
    def from_json(cls, doc: Any) -> StateLayout:
        """The layout a reader recorded; the portable layout for anything else."""
        if not isinstance(doc, dict):
            return cls()

        def path(v: Any, default: tuple[PathItem, ...]) -> tuple[PathItem, ...]:
            if isinstance(v, (list, tuple)) and all(isinstance(p, (str, int)) and not isinstance(p, bool) for p in v):
                return tuple(v)
            return default

        return cls(path(doc.get("model"), ("model",)), path(doc.get("optim"), ("optim",)) or ("optim",), doc.get("optim_flat") is True,
                   doc.get("optim_by_position") is True, doc.get("optim_names") is True)

    def describe(self) -> dict[str, Any]:
        """For ``inspect``: the two paths as DCP keys (dot-joined)."""
        out = {"model": ".".join(map(str, self.model)) or "(top level)", "optimizer": ".".join(map(str, self.optim)),
               "optimizer_form": "flattened" if self.optim_flat else "nested"}
        if self.optim_by_position:
            out["optimizer_keys"] = "position"
        return out


def layout_of(source: dict[str, Any]) -> StateLayout:
    return StateLayout.from_json(source.get(SOURCE_KEY))


def optimizer_tree(layout: StateLayout, state: dict[str, dict[str, Any]], groups: list[Any]) -> dict[str, Any]:
    """The optimizer state dict in the layout's form (``state`` keyed by parameter name)."""
    if layout.optim_by_position:
        return by_position(state, groups, names=layout.optim_names)
    if not layout.optim_flat:
        return {"state": state, "param_groups": groups}
    out: dict[str, Any] = {}
    for fqn, per in state.items():
        for name, value in per.items():
            out[f"state.{fqn}.{name}"] = value
    for g in groups:
        if not isinstance(g, dict):
            continue
        for fqn in g.get("params", []):
            for k, v in g.items():
                if k != "params":
                    out[f"param_groups.{fqn}.{k}"] = v
    return out


def by_position(state: dict[str, dict[str, Any]], groups: list[Any], *, names: bool = False) -> dict[str, Any]:
    """The optimizer state dict as torch's ``optimizer.state_dict()`` writes it: each
    parameter an integer id, counted through the param groups in order, ``state``
    keyed by those ids in id order, each group's ``params`` its ids (last, as torch
    packs a group); with ``names``, each group's ``param_names`` too, as torch writes
    them for an optimizer built from ``named_parameters()`` (``load_state_dict``
    ignores them). Raises ValueError when a parameter with state is in no group
    (its position is unknown)."""
    ids: dict[Any, int] = {}
    packed: list[Any] = []
    for g in groups:
        if not isinstance(g, dict):
            packed.append(g)
            continue
        members = list(g.get("params", []))
        params = [ids.setdefault(fqn, len(ids)) for fqn in members]
        hyper = {k: v for k, v in g.items() if k != "params"}
        if names:
            hyper.setdefault("param_names", members)
        packed.append({**hyper, "params": params})
    lost = [fqn for fqn in state if fqn not in ids]
    if lost:
        raise ValueError(f"optimizer state for '{lost[0]}', which no param group lists")
    return {"state": {ids[fqn]: state[fqn] for fqn in sorted(state, key=ids.__getitem__)}, "param_groups": packed}


def regroup(per_param: dict[str, dict[str, Any]]) -> list[dict[str, Any]]:
    """get_state_dict stores each parameter's group hyper-parameters under its
    name; parameters whose hyper-parameters (and listed ``params``) agree are one
    group, in order of first appearance."""
    groups: list[dict[str, Any]] = []
    for fqn, hyper in per_param.items():
        listed = hyper.get("params")
        h = {k: v for k, v in hyper.items() if k != "params"}
        for g in groups:
            same_members = listed is None or g.get("_listed") == listed
            if same_members and {k: v for k, v in g.items() if k not in ("params", "_listed")} == h:
                g["params"].append(fqn)
                break
        else:
            groups.append({**h, "params": [fqn], "_listed": listed})
    for g in groups:
        g.pop("_listed")
    return groups


def unflatten_optimizer(flat: dict[str, Any]) -> dict[str, Any] | None:
    """The nested optimizer state dict (``state`` and ``param_groups`` keyed by parameter name)
    of one in ``flatten_optimizer_state_dict``'s form (``state.<fqn>.<name>``,
    ``param_groups.<fqn>.<key>``); None when ``flat`` is not in that form."""
    if not flat or not all(isinstance(k, str) and k.startswith(("state.", "param_groups.")) and k.count(".") >= 2 for k in flat):
        return None
    state: dict[str, dict[str, Any]] = {}
    per_param: dict[str, dict[str, Any]] = {}
    for k, v in flat.items():
        kind, _, rest = k.partition(".")
        fqn, _, name = rest.rpartition(".")
        (state if kind == "state" else per_param).setdefault(fqn, {})[name] = v
    return {"state": state, "param_groups": regroup(per_param)}


def merge(dst: Any, src: Any) -> Any:
    """``src`` merged into ``dst``: dicts key by key and lists item by item,
    recursively; where both hold a leaf, ``dst`` wins."""
    if isinstance(dst, dict) and isinstance(src, dict):
        for k, v in src.items():
            dst[k] = merge(dst[k], v) if k in dst else v
        return dst
    if isinstance(dst, list) and isinstance(src, list):
        for i, v in enumerate(src):
            if i < len(dst):
                dst[i] = merge(dst[i], v)
            else:
                dst.append(v)
        return dst
    return dst


def place(root: dict[str, Any], path: tuple[PathItem, ...], value: Any) -> None:
    """Put ``value`` at ``path`` in ``root``, merging with what is there already
    (``()``: merged into ``root`` itself). A str is a dict key; an int is a list
    index (the list made where there is none yet, earlier places held by empty
    dicts, as :func:`unflatten` holds them), or a dict key (as a string) where a
    dict is there already."""
    if not path:
        merge(root, value)
        return
    node: Any = root
    for i, p in enumerate(path):
        key: PathItem
        if isinstance(node, list) and isinstance(p, int):
            key, present = p, p < len(node)
            while len(node) <= p:
                node.append({})
        else:
            key = str(p)
            present = key in node
        if i == len(path) - 1:
            node[key] = merge(node[key], value) if present else value
            return
        nxt = node[key] if present else None
        index_next = isinstance(path[i + 1], int)
        if not isinstance(nxt, dict) and not (index_next and isinstance(nxt, list)):
            nxt = [] if index_next else {}
            node[key] = nxt
        node = nxt


def unflatten(leaves: Iterable[tuple[tuple[PathItem, ...], Any]]) -> dict[str, Any]:
    """The nested state from ``(path, value)`` leaves, as DCP nests it: an int in a
    path is a list index, a string a dict key. A list index that no leaf reaches
    (an empty dict, which DCP's flattening drops) comes back as an empty dict,
    which flattens to nothing again."""
    root: dict[str, Any] = {}
    for path, value in leaves:
        if not path:
            continue
        node: Any = root
        for i, p in enumerate(path):
            last = i == len(path) - 1
            nxt_is_list = not last and isinstance(path[i + 1], int)
            fresh: Any = value if last else ([] if nxt_is_list else {})
            if isinstance(node, list):
                idx = int(p)
                while len(node) <= idx:
                    node.append({})
                if last or not isinstance(node[idx], (dict, list)) or (node[idx] == {} and nxt_is_list):
                    node[idx] = fresh
                node = node[idx]
            else:
                key = str(p)
                if last or not isinstance(node.get(key), (dict, list)):
                    node[key] = fresh
                node = node[key]
    return root


def dotted(path: tuple[PathItem, ...]) -> str:
    """A path in a state tree as ``inspect`` shows it: ``"app.model"``, ``"(top level)"``."""
    return ".".join(map(str, path)) or "(top level)"
