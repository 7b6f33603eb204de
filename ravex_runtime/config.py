"""Configuration: defaults < ``ravex.yaml`` (at or above the working directory) < ``RAVEX_*``.

Every key is documented in docs/configuration.md. Errors name the key and the
file (or environment variable) and are raised when the decorated function is
called, before any training happens.
"""

from __future__ import annotations

import dataclasses
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from ravex_convert.errors import RavexError
from ravex_convert.storage import settings as storage_settings

__all__ = ["CONFIG_FILE", "Config", "ConfigError", "enabled", "find_config_file", "load_config", "override"]

CONFIG_FILE = "ravex.yaml"


class ConfigError(RavexError):
    """A configuration key that is unknown, malformed or not supported yet."""


@dataclass
class Config:
    checkpoint_every: int = 100
    backend: str = "native"
    compression: str = "none"
    storage_type: str = "local"
    storage_path: Path | str = Path("ravex_checkpoints")  # a path, or a bucket's URL (the storage layer's spelling)
    keep_last: int | None = 3
    max_steps: int | None = None
    resume_from: str | int | None = None
    init_from: str | None = None  # a new run's model starts from this checkpoint's weights, nothing else of it
    fresh: bool = False
    log_file: Path | None = None
    sharded_checkpoints: str = "gather"
    # every N-th checkpoint copied to a rank on another machine (no shared storage; replica.py)
    replicate_every: int | None = None
    source: str = "defaults"  # the file the configuration came from, for messages
    # a store in a bucket spelled out (storage.type, with these; storage.path may say the same)
    storage_bucket: str | None = None
    storage_prefix: str | None = None
    storage_endpoint: str | None = None
    storage_region: str | None = None

    @property
    def store(self) -> str | Path:
        """The store as the storage layer takes it (``ravex_convert.storage.resolve``): the path,
        or the path spelled for its backend."""
        return storage_settings.spelling(self.storage_type, self.storage_path)


# key -> (kind, later-work?)  kinds: int+ (positive int), int+? (positive int or null), choice, path, bool, resume
_KEYS: dict[str, str] = {
    "checkpoint_every": "int+",
    "backend": "backend",
    "compression": "compression",
    **storage_settings.KEYS,  # checked by the storage layer
    "keep_last": "int+?",
    "max_steps": "int+?",
    "resume_from": "resume",
    "init_from": "init",
    "fresh": "bool",
    "log_file": "path?",
    "sharded_checkpoints": "sharded_checkpoints",
    "replicate_every": "int+?",
}
_LATER: set[str] = set()
_CHOICES = {"backend": ("native", "torch_save"), "compression": ("none", "zstd"), "sharded_checkpoints": ("gather", "per_rank")}
_ENV = {"RAVEX_" + k.upper().replace(".", "_"): k for k in [*_KEYS, *_LATER]}
# not settings, but Ravex's own: the on/off switch, the set-up scripts' venv path, the storage
# layer's own variables (the test suite's switch, the S3 client's), and the converter's switches
# and limits, which a run reading checkpoints obeys too (an error's hint may tell a user to set one)
_ENV_OTHER = {"RAVEX_ENABLED", "RAVEX_VENV", "RAVEX_DEBUG", "RAVEX_NO_CRC", "RAVEX_DIRECT_IO",
              "RAVEX_MAX_PICKLE_BYTES", "RAVEX_MAX_PICKLE_OBJECTS", "RAVEX_MAX_JSON_DEPTH", "RAVEX_MAX_CHUNKS_PER_TENSOR",
              "RAVEX_MAX_EXPANSION", *storage_settings.ENV}


def enabled() -> bool:
    """False when ``RAVEX_ENABLED`` is 0/false/no/off."""
    return os.environ.get("RAVEX_ENABLED", "1").strip().lower() not in ("0", "false", "no", "off")


def find_config_file(start: Path | None = None) -> Path | None:
    """``ravex.yaml`` in ``start`` (default: the working directory) or the nearest directory above it."""
    here = (start or Path.cwd()).resolve()
    for d in (here, *here.parents):
        p = d / CONFIG_FILE
        if p.is_file():
            return p
    return None


def _flatten(doc: dict[str, Any], where: str) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for k, v in doc.items():
        if not isinstance(k, str):
            raise ConfigError(f"{where}: key {k!r} is not a string", hint="keys are names such as checkpoint_every or storage")
        if k == "storage":
            if not isinstance(v, dict):
                raise ConfigError(f"{where}: 'storage' must be a mapping with 'type' and 'path'", hint="storage:\n  type: local\n  path: checkpoints")
            for sk, sv in v.items():
                out[f"storage.{sk}"] = sv
        else:
            out[k] = v
    return out


def _parse_env(key: str, raw: str) -> Any:
    """Environment values are text: YAML scalars give them types (``10`` -> 10, ``true`` -> True)."""
    import yaml  # type: ignore[import-untyped]

    try:
        return yaml.safe_load(raw) if raw.strip() else None
    except yaml.YAMLError:
        return raw


def _value(key: str, value: Any, where: str, base: Path) -> Any:
    kind = _KEYS[key]
    name = f"{where}: {key}"

    def bad(expect: str) -> ConfigError:
        return ConfigError(f"{name} is {value!r}, {expect}", hint="see docs/configuration.md for every key and its default")

    if kind in ("int+", "int+?"):
        if value is None and kind == "int+?":
            return None
        if not isinstance(value, int) or isinstance(value, bool) or value < 1:
            raise bad("expected a positive integer" + (" or null" if kind == "int+?" else ""))
        return value
    if key in storage_settings.KEYS:
        return storage_settings.value(key, value, bad, base)
    if kind in ("backend", "compression", "sharded_checkpoints"):
        choices = _CHOICES[kind]
        if value not in choices:
            raise bad(f"expected one of {', '.join(choices)}")
        return value
    if kind in ("path", "path?"):
        if value is None and kind == "path?":
            return None
        if not isinstance(value, str) or not value:
            raise bad("expected a path")
        p = Path(os.path.expanduser(value))
        return p if p.is_absolute() else base / p
    if kind == "bool":
        if not isinstance(value, bool):
            raise bad("expected true or false")
        return value
    if kind == "init" and not (value is None or (isinstance(value, str) and value)):
        raise bad("expected the path of a checkpoint or a store (init_from takes no index: it names another run)")
    # resume: a checkpoint directory / store path, or a store index
    if value is None or (isinstance(value, int) and not isinstance(value, bool)):
        return value
    if isinstance(value, str) and value:
        return storage_settings.checkpoint_path(value, base)
    raise bad("expected a store index (e.g. -2) or a checkpoint path")


def _apply(cfg: Config, values: dict[str, Any], where: str, base: Path, env: bool) -> None:
    for key, raw in values.items():
        storage_settings.check_key(key, where, ConfigError)
        if key in _LATER or (key.startswith("storage.") and key[len("storage."):] in _LATER):
            raise ConfigError(f"{where}: {key} is not supported yet (local storage only)", hint=f"remove {key}")
        if key not in _KEYS:
            known = ", ".join(_KEYS)
            raise ConfigError(f"{where}: unknown key {key!r}", hint=f"known keys: {known}")
        value = _value(key, _parse_env(key, raw) if env else raw, where, base)
        setattr(cfg, key.replace(".", "_"), value)
        cfg.storage_type = storage_settings.type_of(key, raw, cfg.storage_type)


def override(cfg: Config, given: dict[str, Any], where: str) -> Config:
    """A copy of ``cfg`` with the settings ``given`` (keys as in ``ravex.yaml``, values as in Python),
    checked as the file's are; errors name ``where``. ``cfg`` itself when nothing is given."""
    if not given:
        return cfg
    cfg = dataclasses.replace(cfg)
    _apply(cfg, given, where, Path.cwd(), env=False)
    return cfg


def load_config(cwd: Path | None = None, environ: dict[str, str] | None = None) -> Config:
    """The effective configuration for a run started in ``cwd``."""
    import yaml

    environ = dict(os.environ if environ is None else environ)
    cwd = (cwd or Path.cwd()).resolve()
    cfg = Config(storage_path=cwd / "ravex_checkpoints")
    path = find_config_file(cwd)
    if path is not None:
        try:
            doc = yaml.safe_load(path.read_text(encoding="utf-8"))
        except (OSError, UnicodeDecodeError, yaml.YAMLError) as exc:
            raise ConfigError(f"{path}: cannot be read as YAML: {exc}", hint="fix the file or remove it", path=path) from None
        if doc is None:
            doc = {}
        if not isinstance(doc, dict):
            raise ConfigError(f"{path}: expected a mapping of keys to values, found {type(doc).__name__}", hint="e.g. checkpoint_every: 100", path=path)
        cfg.storage_path = path.parent / "ravex_checkpoints"
        cfg.source = str(path)
        _apply(cfg, _flatten(doc, str(path)), str(path), path.parent, env=False)
    for var in sorted(environ):
        if not var.startswith("RAVEX_") or var in _ENV_OTHER:
            continue
        if var not in _ENV:
            raise ConfigError(f"environment variable {var}: not a Ravex setting",
                              hint=f"known: {', '.join(sorted([*_ENV, *_ENV_OTHER]))}; unset it")
        _apply(cfg, {_ENV[var]: environ[var]}, f"environment variable {var}", cwd, env=True)
    storage_settings.locate(cfg, ConfigError)
    if cfg.replicate_every is not None and (cfg.storage_type != "local" or cfg.backend != "native"):
        raise ConfigError(f"{cfg.source}: replicate_every copies a native store on each machine's own disk; this run has "
                          f"storage.type {cfg.storage_type}, backend {cfg.backend} (with the environment's RAVEX_*)",
                          hint="object storage is already reachable from every machine: remove replicate_every; "
                               "or use storage.type: local with backend: native")
    if cfg.init_from is not None and cfg.resume_from is not None:
        raise ConfigError(f"{cfg.source}: both resume_from and init_from are set (with the environment's RAVEX_*)",
                          hint="resume_from continues a run (its optimizer, schedulers, step and data position); init_from starts a new one "
                               "from a checkpoint's weights only: keep one")
    return cfg
