"""``ravex status [PATH]``: the checkpoints of a store and what a resume would pick.

A plain function returning data; the CLI renders it. Reads JSON metadata only
(and, for the resume pick, the checkpoint files' presence), never tensor data.
"""

from __future__ import annotations

import json
import stat
from pathlib import Path
from typing import Any

from ravex_convert.errors import NotFoundError

from .config import find_config_file, load_config

__all__ = ["store_status"]


def _dir_size(d: Path) -> int:
    """The bytes of the files in ``d`` itself: a symbolic link in it is not followed (it may lead
    out of the store), and counts as nothing."""
    total = 0
    if d.is_dir() and not d.is_symlink():
        for p in d.rglob("*"):
            st = p.lstat()
            if stat.S_ISREG(st.st_mode):
                total += st.st_size
    return total


# checkpoint.json is read for who wrote the checkpoint only up to this size (status stays quick).
_STATUS_JSON_LIMIT = 64 << 20


def _objects(meta: Path) -> dict[str, Any]:
    """A checkpoint's small state (``objects`` of its checkpoint.json); empty when it cannot be read."""
    try:
        if meta.stat().st_size > _STATUS_JSON_LIMIT:
            return {}
        doc = json.loads(meta.read_text(encoding="utf-8"))
    except (OSError, ValueError, RecursionError):
        return {}
    objs = doc.get("objects") if isinstance(doc, dict) else None
    return objs if isinstance(objs, dict) else {}


def _ranks(objs: dict[str, Any]) -> dict[str, Any] | None:
    """Who wrote a checkpoint of a run on many ranks: world size, mode, mesh, wrapper, which rank
    wrote which files (``objects.distributed``); None for one process, or when it cannot be read."""
    d = objs.get("distributed")
    if not isinstance(d, dict):
        return None
    return {k: d.get(k) for k in ("world_size", "mode", "mesh", "wrap", "written_by", "shared_storage")}


def _began_from(objs: dict[str, Any], key: str | None = None) -> dict[str, Any] | None:
    """The other program's checkpoint the run began from (``resume_from``), as it records it; with
    ``key`` INITIALISED_FROM, the checkpoint whose weights the run's model began from (``init_from``)."""
    from ravex_convert.objects import RESUMED_FROM  # not the runtime's foreign module: `ravex status` imports no torch

    extra = objs.get("extra")
    origin = extra.get(key or RESUMED_FROM) if isinstance(extra, dict) else None
    return {k: origin.get(k) for k in ("format", "path", "step")} if isinstance(origin, dict) else None


def store_status(path: str | Path | None = None) -> dict[str, Any]:
    """The store at ``path`` (default: ``storage.path`` of the configuration found from the working
    directory): ``store``, ``config`` (the file used, if any), ``checkpoints`` (index, step, bytes
    (logical), bytes_on_disk (files in its own directory), created_unix, complete, problem, run_id, ranks: who wrote it in a
    run on many ranks, else None; began_from: the other program's checkpoint the run began from, else None;
    initialised_from: the checkpoint whose weights the run's model began from, else None) and
    ``resume`` (the index a resume would pick, None when the store holds no complete checkpoint), and for
    a local store ``replicas`` (replica_area.status: its copies on other machines, the replicas kept
    beside it; None when there are none)."""
    from ravex_convert._paths import inside
    from ravex_convert.formats.native.reader import CHECKPOINT, MANIFEST, STORE_MARKER, read_manifest
    from ravex_convert.objects import INITIALISED_FROM
    from ravex_convert.storage import resolve

    where = resolve(path if path is not None else load_config().store)
    store = where.path
    if not (store / STORE_MARKER).is_file():
        raise NotFoundError(f"{store}: not a Ravex store (no {STORE_MARKER})",
                            hint="give the store directory (storage.path in ravex.yaml) or run where ravex.yaml is", path=store)
    # The readers' own checks: a manifest whose entry names a directory outside the store (an
    # absolute path, '..', a link leading out) is refused here as it is by inspect and a resume.
    manifest = read_manifest(store)
    rows: list[dict[str, Any]] = []
    resume: int | None = None
    for e in manifest["checkpoints"]:
        d = store / e["dir"]  # checked by read_manifest: checkpoints/<index>, inside the store
        meta = inside(store, f"{e['dir']}/{CHECKPOINT}", f"checkpoint {e['index']}: metadata", store / MANIFEST)
        problem = None
        if e.get("status") != "complete":
            problem = f"status {e.get('status')!r}"
        elif not meta.is_file():
            problem = f"{CHECKPOINT} missing"
        objs = _objects(meta) if problem is None else {}
        rows.append({"index": e.get("index"), "step": e.get("step"), "bytes": e.get("bytes"), "bytes_on_disk": _dir_size(d),
                     "created_unix": e.get("created_unix"), "complete": problem is None, "problem": problem, "run_id": e.get("run_id"),
                     "ranks": _ranks(objs), "began_from": _began_from(objs), "initialised_from": _began_from(objs, INITIALISED_FROM)})
        if problem is None:
            resume = e.get("index")
    cfg = find_config_file()
    out: dict[str, Any] = {"store": str(store), "config": str(cfg) if cfg else None, "checkpoints": rows, "resume": resume,
           "note": "a resume verifies checksums and falls back to the previous checkpoint when the newest is damaged"}
    if where.posix:
        from .replica_area import status as replica_status

        # replicate_every: where this store's copies are (and how old), and the replicas this machine holds
        out["replicas"] = replica_status(store)
    unfinished = getattr(where.storage, "unfinished", None)
    if unfinished is not None:
        # multipart uploads a killed writer left (invisible, billed, aborted by the next write to the store)
        out["unfinished_uploads"] = len(unfinished(where.key))
    return out
