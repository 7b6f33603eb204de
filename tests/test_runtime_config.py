"""Configuration: defaults < ravex.yaml (found at or above the working directory) < RAVEX_*."""

from __future__ import annotations

from pathlib import Path

import pytest

from ravex_runtime.config import ConfigError, enabled, load_config


def test_defaults_without_a_file(tmp_path: Path) -> None:
    cfg = load_config(tmp_path, environ={})
    assert cfg.checkpoint_every == 100
    assert cfg.backend == "native"
    assert cfg.compression == "none"
    assert cfg.storage_type == "local"
    assert cfg.storage_path == tmp_path.resolve() / "ravex_checkpoints"
    assert cfg.keep_last == 3
    assert cfg.max_steps is None and cfg.resume_from is None and cfg.fresh is False and cfg.log_file is None


def test_file_above_the_working_directory_and_paths_relative_to_it(tmp_path: Path) -> None:
    (tmp_path / "ravex.yaml").write_text("checkpoint_every: 5\nstorage:\n  type: local\n  path: ckpts\nkeep_last: 2\nlog_file: logs/r.log\n")
    sub = tmp_path / "a" / "b"
    sub.mkdir(parents=True)
    cfg = load_config(sub, environ={})
    assert cfg.checkpoint_every == 5
    assert cfg.storage_path == tmp_path.resolve() / "ckpts"
    assert cfg.log_file == tmp_path.resolve() / "logs" / "r.log"
    assert cfg.keep_last == 2
    assert cfg.source == str(tmp_path.resolve() / "ravex.yaml")


def test_environment_overrides_the_file(tmp_path: Path) -> None:
    (tmp_path / "ravex.yaml").write_text("checkpoint_every: 5\ncompression: none\n")
    env = {"RAVEX_CHECKPOINT_EVERY": "7", "RAVEX_STORAGE_PATH": "/abs/store", "RAVEX_COMPRESSION": "zstd", "RAVEX_FRESH": "true",
           "RAVEX_MAX_STEPS": "40", "RAVEX_RESUME_FROM": "-2", "RAVEX_ENABLED": "1"}
    cfg = load_config(tmp_path, environ=env)
    assert (cfg.checkpoint_every, cfg.compression, cfg.fresh, cfg.max_steps, cfg.resume_from) == (7, "zstd", True, 40, -2)
    assert cfg.storage_path == Path("/abs/store")


@pytest.mark.parametrize(("text", "needle"), [
    ("checkpoint_every: 0\n", "checkpoint_every is 0, expected a positive integer"),
    ("checkpoint_evry: 3\n", "unknown key 'checkpoint_evry'"),
    ("backend: pickle\n", "backend is 'pickle', expected one of native, torch_save"),
    ("compression: lz4\n", "compression is 'lz4'"),
    ("storage:\n  type: s3\n", "storage.type is s3 but storage.path is"),
    ("storage:\n  type: r2\n  bucket: runs\n", "storage.type is r2 but no endpoint is given"),
    ("storage:\n  type: s3\n  prefix: runs\n", "storage.bucket is not set"),
    ("storage:\n  bucket: runs\n", "storage.bucket is set but storage.type is local"),
    ("storage:\n  type: s3\n  bucket: runs\n  secret_key: abc\n", "Ravex never reads credentials from its configuration"),
    ("storage:\n  path: s3://Bad_Bucket/x\n", "not an S3 location"),
    ("storage:\n  type: s3\n  bucket: b1\n  endpoint: ftp://x\n", "expected a URL"),
    ("replicate_every: 0\n", "replicate_every is 0, expected a positive integer or null"),
    ("replicate_every: 2\nstorage:\n  type: objdir\n", "replicate_every copies a native store on each machine's own disk"),
    ("sharded_checkpoints: all\n", "sharded_checkpoints is 'all', expected one of gather, per_rank"),
    ("replicate_every: 2\nbackend: torch_save\n", "backend torch_save"),
    ("fresh: yes please\n", "fresh is 'yes please', expected true or false"),
    ("keep_last: -1\n", "keep_last is -1"),
    ("- a\n- b\n", "expected a mapping"),
    ("storage: here\n", "'storage' must be a mapping"),
])
def test_bad_file_values_name_the_key_and_the_file(tmp_path: Path, text: str, needle: str) -> None:
    (tmp_path / "ravex.yaml").write_text(text)
    with pytest.raises(ConfigError) as info:
        load_config(tmp_path, environ={})
    assert needle in info.value.message
    assert str(tmp_path.resolve() / "ravex.yaml") in info.value.message
    assert info.value.hint


def test_bad_environment_values_name_the_variable(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match="environment variable RAVEX_CHECKPOINT_EVERY: checkpoint_every is 'often'"):
        load_config(tmp_path, environ={"RAVEX_CHECKPOINT_EVERY": "often"})
    with pytest.raises(ConfigError, match="RAVEX_CHECKPOINT_EVRY: not a Ravex setting"):
        load_config(tmp_path, environ={"RAVEX_CHECKPOINT_EVRY": "3"})
    # the S3 client's own variables are not settings, and not refused; a misspelt one is
    load_config(tmp_path, environ={"RAVEX_S3_PART_MB": "16", "RAVEX_S3_ACCESS_KEY": "k", "RAVEX_S3_SECRET_KEY": "s"})
    with pytest.raises(ConfigError, match="RAVEX_S3_PARTS_MB: not a Ravex setting"):
        load_config(tmp_path, environ={"RAVEX_S3_PARTS_MB": "16"})
    with pytest.raises(ConfigError, match="storage.type is s3 but storage.path is"):
        load_config(tmp_path, environ={"RAVEX_STORAGE_TYPE": "s3"})
    with pytest.raises(ConfigError, match="RAVEX_STORAGE_PATH: storage.path is 'objdir://', expected objdir:PATH"):
        load_config(tmp_path, environ={"RAVEX_STORAGE_PATH": "objdir://"})


def test_a_store_in_a_bucket_is_spelled_as_a_path_or_as_bucket_and_prefix(tmp_path: Path) -> None:
    cfg = load_config(tmp_path, environ={"RAVEX_STORAGE_PATH": "s3://ckpts/runs/exp7"})
    assert (cfg.storage_type, cfg.store) == ("s3", "s3://ckpts/runs/exp7")
    (tmp_path / "ravex.yaml").write_text("storage:\n  type: r2\n  bucket: ckpts\n  prefix: runs/exp7/\n  endpoint: https://acct.r2.cloudflarestorage.com\n")
    cfg = load_config(tmp_path, environ={})
    assert (cfg.storage_type, cfg.store, cfg.storage_endpoint) == ("r2", "s3://ckpts/runs/exp7", "https://acct.r2.cloudflarestorage.com")
    cfg = load_config(tmp_path, environ={"RAVEX_STORAGE_TYPE": "s3", "RAVEX_STORAGE_BUCKET": "runs"})  # the reference's spelling
    assert cfg.store == "s3://runs/runs/exp7"


def test_an_objdir_store_is_object_storage_not_a_directory_named_objdir(tmp_path: Path) -> None:
    for spelled in ("objdir:///b/store", "objdir:/b/store"):
        cfg = load_config(tmp_path, environ={"RAVEX_STORAGE_PATH": spelled})
        assert (cfg.storage_type, cfg.storage_path, cfg.store) == ("objdir", Path("/b/store"), "objdir:/b/store")
    (tmp_path / "ravex.yaml").write_text("storage:\n  path: objdir:bucket/store\n")  # relative to the file, as a path is
    cfg = load_config(tmp_path, environ={})
    assert cfg.store == f"objdir:{tmp_path.resolve()}/bucket/store"
    (tmp_path / "ravex.yaml").write_text("storage:\n  type: objdir\n  path: bucket/store\n")
    assert load_config(tmp_path, environ={}).store == f"objdir:{tmp_path.resolve()}/bucket/store"
    assert load_config(tmp_path, environ={"RAVEX_STORAGE": "objdir"}).storage_type == "objdir"  # the test switch is not a setting
    (tmp_path / "ravex.yaml").unlink()
    assert load_config(tmp_path, environ={}).store == tmp_path.resolve() / "ravex_checkpoints"


def test_enabled_flag(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("RAVEX_ENABLED", raising=False)
    assert enabled()
    for off in ("0", "false", "off"):
        monkeypatch.setenv("RAVEX_ENABLED", off)
        assert not enabled()
