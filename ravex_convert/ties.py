"""Tied names: one tensor under two names (a language model's output head that *is* its input
embedding).

Some sources record the tie: a torch.save state dict holds both names over one storage,
DeepSpeed lists ``shared_params``, Ravex's safetensors lists ``ravex.aliases``. Others store
the tensor once and leave the tie to the model's code: Hugging Face's ``save_pretrained`` and
Accelerate write ``model.embed_tokens.weight`` and no ``lm_head.weight``, and the
``config.json`` beside the weights says ``"tie_word_embeddings": true``. A strict loader of
the output then misses a name. Here:

- :func:`apply_ties` declares ties the source never recorded (``--tie ALIAS=TARGET``);
- :func:`config_ties` reads them from a Hugging Face ``config.json`` beside the weights,
  where one input embedding is there to tie the missing head to;
- :func:`materialize` writes every tied name as a tensor of its own (``--materialize-ties``),
  for targets whose strict loaders need every name and know nothing of ties.
"""

from __future__ import annotations

import json
from collections.abc import Iterable, Mapping
from pathlib import Path

from .errors import LayoutMismatchError, RavexError
from .model import MODEL, Checkpoint

__all__ = ["apply_ties", "config_ties", "materialize", "parse_tie"]

# Where Hugging Face models keep the input embedding a tied ``lm_head.weight`` shares.
_EMBEDDINGS = ("embed_tokens.weight", "wte.weight", "word_embeddings.weight", "embed_in.weight", "tok_embeddings.weight")
_HEAD = "lm_head.weight"
_CONFIG_LIMIT = 1 << 20


def parse_tie(text: str) -> tuple[str, str]:
    """``ALIAS=TARGET`` -> (alias, target)."""
    alias, sep, target = text.partition("=")
    alias, target = alias.strip(), target.strip()
    if not sep or not alias or not target or alias == target:
        raise RavexError(f"--tie {text!r}: expected ALIAS=TARGET, two different parameter names",
                         hint="e.g. --tie lm_head.weight=model.embed_tokens.weight")
    return alias, target


def apply_ties(ckpt: Checkpoint, ties: Mapping[str, str], where: str = "--tie") -> None:
    """Declare each ``alias -> target`` tie in ``ckpt`` (model names, without ``model/``): the
    alias is read as the target's tensor. The target must be in the checkpoint, and the alias not
    stored as a tensor of its own (then it is no tie the source lost)."""
    for alias, target in ties.items():
        a, t = MODEL + alias, MODEL + target
        if t not in ckpt.tensors and t not in ckpt.aliases:
            close = [n[len(MODEL):] for n in ckpt.tensors if n.startswith(MODEL) and n.endswith(target.rsplit(".", 1)[-1])][:3]
            raise LayoutMismatchError(f"{where} {alias}={target}: the checkpoint has no tensor '{target}'",
                                      hint=f"name a tensor it holds{' (e.g. ' + ', '.join(close) + ')' if close else ''}; `ravex inspect` lists them",
                                      path=ckpt.path)
        if a in ckpt.tensors:
            raise LayoutMismatchError(f"{where} {alias}={target}: the checkpoint stores '{alias}' as a tensor of its own",
                                      hint=f"leave out --tie {alias}=...: it is no tie the source lost", path=ckpt.path)
        if ckpt.aliases.get(a) not in (None, ckpt.aliases.get(t, t)):
            raise LayoutMismatchError(f"{where} {alias}={target}: the checkpoint already ties '{alias}' to '{ckpt.aliases[a][len(MODEL):]}'",
                                      hint="leave that --tie out", path=ckpt.path)
        ckpt.aliases[a] = ckpt.aliases.get(t, t)


def config_ties(ckpt: Checkpoint, directory: Path) -> None:
    """A Hugging Face ``config.json`` in ``directory`` that says ``"tie_word_embeddings": true``
    while the weights hold no ``lm_head.weight``: tie it to the one input embedding of its shape
    there is, and say so; where that is not one tensor, say what to pass instead."""
    cfg = directory / "config.json"
    try:
        if not cfg.is_file() or cfg.stat().st_size > _CONFIG_LIMIT:
            return
        doc = json.loads(cfg.read_text(encoding="utf-8"))
    except (OSError, ValueError, RecursionError):
        return
    if not isinstance(doc, dict) or doc.get("tie_word_embeddings") is not True:
        return
    names = [n[len(MODEL):] for n in ckpt.tensors if n.startswith(MODEL)]
    heads = [n for n in names if n == _HEAD or n.endswith("." + _HEAD)]
    if heads or MODEL + _HEAD in ckpt.aliases:
        return
    found = [n for n in names if n.endswith(_EMBEDDINGS)]
    if len(found) == 1 and len(ckpt.tensors[MODEL + found[0]].shape) == 2:
        ckpt.aliases[MODEL + _HEAD] = MODEL + found[0]
        ckpt.notes.append(f"config.json says tie_word_embeddings: '{_HEAD}' is read as '{found[0]}', which the files store once")
    else:
        ckpt.notes.append(f"config.json says tie_word_embeddings, but the files hold no '{_HEAD}' and "
                          f"{'no' if not found else len(found)} input embedding{'s' if len(found) != 1 else ''} to tie it to: "
                          f"pass --tie {_HEAD}=<the embedding's name>")


def materialize(ckpt: Checkpoint, names: Iterable[str] | None = None) -> list[str]:
    """Every tied model name (or those in ``names``) as a tensor of its own, reading the same bytes
    as the one it is tied to: written as a copy by every writer. The names made, sorted."""
    made = []
    for a in sorted(n for n in ckpt.aliases if n.startswith(MODEL) and (names is None or n in names)):
        ckpt.add(ckpt.resolve(a).renamed(a))
        del ckpt.aliases[a]
        made.append(a[len(MODEL):])
    return made
