"""What ``inspect`` reports about a checkpoint: a plain, JSON-ready description.

The JSON form is a documented interface (docs/cli.md): scripts may rely on the
top-level keys ``format``, ``variant``, ``world_size``, ``zero_stage`` and
``step``; the others may grow.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

__all__ = ["CheckpointInfo", "FileInfo", "OptimizerInfo", "TensorInfo"]

# The formats themselves are listed by the registry (formats/registry.py: ``names()``).
NO_PARAM_MARKS = "parameters and buffers are not distinguished in a plain state dict; floating-point tensors are counted as parameters"


@dataclass
class TensorInfo:
    """A logical tensor: its full (global) shape, whatever the sharding."""

    name: str
    shape: tuple[int, ...]
    dtype: str
    kind: str = "param"  # param | frozen | buffer | optim | other

    @property
    def numel(self) -> int:
        n = 1
        for s in self.shape:
            n *= s
        return n

    def to_json(self) -> dict[str, Any]:
        return {"name": self.name, "shape": list(self.shape), "dtype": self.dtype, "kind": self.kind}


@dataclass
class FileInfo:
    path: str  # relative to the checkpoint's root
    bytes: int
    role: str  # model_states | optim_states | metadata | data | weights | manifest | ...
    rank: int | None = None

    def to_json(self) -> dict[str, Any]:
        return {"path": self.path, "bytes": self.bytes, "role": self.role, "rank": self.rank}


@dataclass
class OptimizerInfo:
    kind: str  # e.g. "Adam" when exp_avg/exp_avg_sq are present
    states: list[str]  # per-parameter state names (exp_avg, exp_avg_sq, step)
    param_groups: int | None = None
    master_dtype: str | None = None  # dtype of the fp32 master copy, where the format keeps one

    def to_json(self) -> dict[str, Any]:
        return {"kind": self.kind, "states": self.states, "param_groups": self.param_groups, "master_dtype": self.master_dtype}


@dataclass
class CheckpointInfo:
    """Everything ``ravex inspect`` says about one checkpoint."""

    format: str
    variant: str
    path: str
    world_size: int | None = None
    zero_stage: int | None = None
    step: int | None = None
    tag: str | None = None
    tensors: list[TensorInfo] = field(default_factory=list)
    files: list[FileInfo] = field(default_factory=list)
    optimizer: OptimizerInfo | None = None
    aliases: dict[str, str] = field(default_factory=dict)  # tied name -> the name it shares storage with
    reasons: list[str] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)
    extra: dict[str, Any] = field(default_factory=dict)

    @property
    def model_tensors(self) -> list[TensorInfo]:
        return [t for t in self.tensors if t.kind != "optim"]

    @property
    def num_params(self) -> int:
        return sum(t.numel for t in self.tensors if t.kind in ("param", "frozen"))

    @property
    def bytes_on_disk(self) -> int:
        return sum(f.bytes for f in self.files)

    @property
    def dtypes(self) -> list[str]:
        return sorted({t.dtype for t in self.model_tensors})

    def to_json(self, *, tensors: bool = False) -> dict[str, Any]:
        out: dict[str, Any] = {
            "format": self.format,
            "variant": self.variant,
            "path": self.path,
            "world_size": self.world_size,
            "zero_stage": self.zero_stage,
            "step": self.step,
            "tag": self.tag,
            "dtypes": self.dtypes,
            "num_tensors": len(self.model_tensors),
            "num_params": self.num_params,
            "bytes_on_disk": self.bytes_on_disk,
            "optimizer": None if self.optimizer is None else self.optimizer.to_json(),
            "aliases": self.aliases,
            "frozen": [t.name for t in self.tensors if t.kind == "frozen"],
            "files": [f.to_json() for f in self.files],
            "reasons": self.reasons,
            "notes": self.notes,
        }
        out.update(self.extra)
        if tensors:
            out["tensors"] = [t.to_json() for t in self.tensors]
        return out
