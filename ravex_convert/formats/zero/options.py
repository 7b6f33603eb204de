"""The options of a DeepSpeed ZeRO output (light: the registry and the CLI import it, not the writer)."""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from dataclasses import dataclass
from typing import ClassVar

from ...errors import RavexError
from ...info import CheckpointInfo
from ..options import Flag, WriteOptions, option, parse_names

__all__ = ["BUFFERS", "PRECISION", "ZERO_STAGE", "ZeroOptions"]

ZERO_STAGE = Flag("--zero-stage", type=int, range=(1, 3),
                  help="zero: the ZeRO stage of the output (required for --to zero; reshard keeps the source's).")
PRECISION = Flag("--precision", choices=("fp32", "bf16"), help="zero: the precision the resumed DeepSpeed run uses (default: the source's).")
BUFFERS = Flag("--buffers", metavar="NAMES", parse=parse_names,
               help="zero, stage 3: the model's persistent buffer names, comma-separated, where the source does not mark them (DCP, torch_save).")


@dataclass(frozen=True)
class ZeroOptions(WriteOptions):
    """``zero_stage``: 1, 2 or 3 (required; a reshard keeps the source's).
    ``precision``: ``"fp32"`` or ``"bf16"``, the precision the resumed DeepSpeed
    run uses (None: the source's). ``buffers``: the model's persistent buffer
    names, where the source does not mark them (a list, or ``"a,b"``).
    The ZeRO writer merges ``--hyperparameters`` itself."""

    merges_hyperparameters: ClassVar[bool] = True
    zero_stage: int | None = option(None, ZERO_STAGE)
    precision: str | None = option(None, PRECISION)
    buffers: Sequence[str] | None = option(None, BUFFERS)

    def check(self) -> None:
        if self.zero_stage not in (1, 2, 3):
            raise RavexError(f"--to zero needs --zero-stage 1, 2 or 3 (got {self.zero_stage})", hint="choose the stage the resumed run will use")

    def for_reshard(self, source: CheckpointInfo) -> ZeroOptions:
        if self.zero_stage is not None:
            return self
        # keep the stage the run used (BF16_Optimizer runs ZeRO-1)
        return dataclasses.replace(self, zero_stage=source.zero_stage)
