"""The options of a DCP output (light: the registry and the CLI import it, not the writer)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

from ..options import LAYOUT, Flag, WriteOptions, option

__all__ = ["METADATA_FORM", "DcpOptions"]

METADATA_FORM = Flag("--metadata-form", choices=("current", "compat"), show_default=True,
                     help="dcp: 'current' .metadata (torch >= 2.15 reads it) or 'compat' (also torch < 2.15).")


@dataclass(frozen=True)
class DcpOptions(WriteOptions):
    """``metadata_form``: ``"current"`` (the ``.metadata`` torch >= 2.15 writes) or
    ``"compat"`` (one torch < 2.15 unpickles too). ``layout``: ``"source"`` (None:
    the source's nesting where it had one, else the portable ``{"model", "optim"}``),
    ``"portable"``, or ``"torchtitan"`` (``model`` and a flattened ``optimizer``)."""

    needs_param_groups: ClassVar[str | None] = "dcp.load stops with 'Missing key in checkpoint state_dict: optim.param_groups.{g}.{key}'"
    metadata_form: str = option("current", METADATA_FORM)
    layout: str | None = option(None, LAYOUT)
