"""A run's ``storage.*`` settings (docs/configuration.md), checked where the backends are known.

The runtime's configuration (``ravex_runtime/config.py``) reads ``ravex.yaml`` and ``RAVEX_*``
and hands every ``storage.*`` key here: which backends exist, how a path names one
(``objdir:PATH``, ``s3://BUCKET/PREFIX``), what ``storage.bucket``, ``storage.prefix``,
``storage.endpoint`` and ``storage.region`` mean, and that no credential is ever read from a
configuration file. Nothing here talks to a server or loads a client.
"""

from __future__ import annotations

import os
from collections.abc import Callable
from pathlib import Path
from typing import Any

from ..errors import RavexError
from . import s3conf

__all__ = ["ENV", "KEYS", "check_key", "checkpoint_path", "locate", "spelling", "type_of", "value"]

# key -> kind
KEYS = {"storage.type": "storage_type", "storage.path": "path", "storage.bucket": "bucket", "storage.prefix": "prefix",
        "storage.endpoint": "endpoint", "storage.region": "region"}
TYPES = ("local", "objdir", "s3", "r2")
_BUCKETS = ("s3", "r2")
_OBJDIR = "objdir:"
# environment variables the storage layer reads itself (not settings of a run): the test suite's
# switch (RAVEX_STORAGE=objdir: every plain path through the objdir backend) and the S3 client's
ENV = ("RAVEX_STORAGE", *s3conf.ENV)
# never read from ravex.yaml (a file that is copied around and committed): the environment only
_CREDENTIALS = {"access_key", "secret_key", "access_key_id", "secret_access_key", "session_token", "token", "password", "credentials"}


def check_key(key: str, where: str, error: type[RavexError]) -> None:
    """Refuse a credential among the ``storage.*`` keys."""
    if key.startswith("storage.") and key[len("storage."):].lower() in _CREDENTIALS:
        raise error(f"{where}: {key}: Ravex never reads credentials from its configuration",
                    hint=f"remove {key}; set AWS_ACCESS_KEY_ID / AWS_SECRET_ACCESS_KEY (or RAVEX_S3_ACCESS_KEY / "
                         "RAVEX_S3_SECRET_KEY) in the job's environment")


def value(key: str, given: Any, bad: Callable[[str], Exception], base: Path) -> Any:
    """The value of ``storage.*`` key ``key``, checked (``bad(expected)``: the error to raise)."""
    kind = KEYS[key]
    if kind in ("bucket", "prefix", "endpoint", "region"):
        if given is None:
            return None
        if not isinstance(given, str) or not given.strip():
            raise bad(f"expected a {kind} name")
        if kind == "endpoint" and not given.startswith(("http://", "https://")):
            raise bad("expected a URL (https://..., or http://... for a server you run)")
        return given.strip().strip("/") if kind == "prefix" else given.strip()
    if kind == "storage_type":
        if given not in TYPES:
            raise bad(f"expected one of {', '.join(TYPES)}")
        return given
    if not isinstance(given, str) or not given:
        raise bad("expected a path")
    text = given
    if given.startswith(s3conf.SCHEME):
        try:
            s3conf.split(given)
        except RavexError as exc:
            raise bad(f"not an S3 location ({exc.message})") from None
        return given
    if given.startswith(_OBJDIR):
        text = given[len(_OBJDIR):].removeprefix("//")  # objdir:PATH, objdir:///abs/path: see type_of
        if not text:
            raise bad("expected objdir:PATH, PATH naming the store in its bucket (the directory above it)")
    p = Path(os.path.expanduser(text))
    return p if p.is_absolute() else base / p


def type_of(key: str, raw: Any, current: str) -> str:
    """``storage.type`` once ``key`` was set to ``raw``: a path spelled for a backend names it, as the CLI takes it."""
    if key == "storage.path" and isinstance(raw, str):
        if raw.startswith(_OBJDIR):
            return "objdir"  # the object-store-semantics backend
        if raw.startswith(s3conf.SCHEME) and current not in _BUCKETS:
            return "s3"
    return current


def locate(cfg: Any, error: type[RavexError]) -> None:
    """``storage.type: s3`` (or ``r2``) with ``bucket`` and ``prefix``: the store's s3:// path in
    ``cfg.storage_path``, and the endpoint and region the client uses; refused where the pieces do
    not fit together. ``cfg``: the run's configuration (its ``storage_*`` fields)."""
    spelled = cfg.storage_bucket is not None or cfg.storage_prefix is not None
    where = cfg.source if cfg.source != "defaults" else "the environment (RAVEX_STORAGE_*)"
    if cfg.storage_type not in _BUCKETS:
        extra = [k for k, v in (("bucket", cfg.storage_bucket), ("prefix", cfg.storage_prefix), ("endpoint", cfg.storage_endpoint),
                                ("region", cfg.storage_region)) if v is not None]
        if extra:
            raise error(f"{where}: storage.{extra[0]} is set but storage.type is {cfg.storage_type}",
                        hint="set storage.type: s3 (or r2), or remove it")
        return
    if spelled:
        if not cfg.storage_bucket:
            raise error(f"{where}: storage.type is {cfg.storage_type} but storage.bucket is not set",
                        hint="storage:\n  type: s3\n  bucket: my-bucket\n  prefix: runs/exp7   (or path: s3://my-bucket/runs/exp7)")
        url = f"{s3conf.SCHEME}{cfg.storage_bucket}/{cfg.storage_prefix or 'ravex_checkpoints'}"
        try:
            s3conf.split(url)
        except RavexError as exc:
            raise error(f"{where}: storage.bucket / storage.prefix: {exc.message}", hint=exc.hint or "") from None
        cfg.storage_path = url
    elif not str(cfg.storage_path).startswith(s3conf.SCHEME):
        raise error(f"{where}: storage.type is {cfg.storage_type} but storage.path is {cfg.storage_path}",
                    hint="give storage.path: s3://BUCKET/PREFIX, or storage.bucket and storage.prefix")
    if cfg.storage_type == "r2" and not (cfg.storage_endpoint or os.environ.get("AWS_ENDPOINT_URL") or os.environ.get("RAVEX_S3_ENDPOINT")):
        raise error(f"{where}: storage.type is r2 but no endpoint is given",
                    hint="set storage.endpoint: https://<account id>.r2.cloudflarestorage.com (or AWS_ENDPOINT_URL)")
    s3conf.configure(s3conf.split(str(cfg.storage_path))[0], endpoint=cfg.storage_endpoint,
                     region=cfg.storage_region or ("auto" if cfg.storage_type == "r2" else None))


def spelling(storage_type: str, path: str | Path) -> str | Path:
    """The store as the storage layer takes it (``resolve``): the path, ``objdir:PATH``
    (object-store semantics), or ``s3://bucket/prefix``."""
    if storage_type in _BUCKETS:
        return str(path)
    return f"{_OBJDIR}{path}" if storage_type == "objdir" else path


def checkpoint_path(given: str, base: Path) -> str:
    """A checkpoint or a store a run reads (``resume_from``, ``init_from``), as given, made absolute
    against ``base``; a checkpoint on the objdir backend is read through its local view (the same
    bytes as ranged GETs), one in a bucket by its URL."""
    if given.startswith(s3conf.SCHEME):
        return given
    p = Path(os.path.expanduser(given.removeprefix(_OBJDIR).removeprefix("//") if given.startswith(_OBJDIR) else given))
    return str(p if p.is_absolute() else base / p)
