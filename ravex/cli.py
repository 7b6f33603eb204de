"""The ``ravex`` command: argument parsing and rendering only.

Each command's work is a plain function in the layer it belongs to
(``ravex_convert.inspect`` ...). Data goes to stdout (``--json`` for scripts);
errors and progress go to stderr through one rich console. Exit codes: 0
success, 1 "difference found" (verify), 2 or more for errors (see
``ravex_convert.errors``).
"""

from __future__ import annotations

import json
import sys
from typing import Any, NoReturn

import click
from rich.console import Console
from rich.table import Table

import ravex_convert
from ravex_convert.errors import RavexError
from ravex_convert.info import CheckpointInfo

out = Console(highlight=False, soft_wrap=True)
err = Console(stderr=True, highlight=False, soft_wrap=True)


def _fail(exc: RavexError) -> NoReturn:
    err.print(f"error: {exc.message}", markup=False)
    if exc.hint:
        err.print(f"hint: {exc.hint}", markup=False)
    sys.exit(exc.exit_code)


def _human_bytes(n: int) -> str:
    size = float(n)
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if size < 1024 or unit == "TiB":
            return f"{size:.0f} {unit}" if unit == "B" else f"{size:.1f} {unit}"
        size /= 1024
    return f"{n} B"


@click.group(context_settings={"help_option_names": ["-h", "--help"]})
@click.version_option(ravex_convert.__version__, "--version", "-V", prog_name="ravex")
def main() -> None:
    """Ravex: inspect, convert, reshard and verify training checkpoints
    (DeepSpeed ZeRO, DCP/FSDP2, torch.save, safetensors, Ravex stores)."""


@main.command("inspect")
@click.argument("path", type=click.Path(path_type=str))
@click.option("--json", "as_json", is_flag=True, help="Print JSON for scripts (keys: format, variant, world_size, zero_stage, step, ...).")
@click.option("--tensors", is_flag=True, help="Also list every logical tensor with its global shape and dtype.")
@click.option("--tag", default=None, help="DeepSpeed tag to read when the root holds several (default: the one 'latest' names).")
@click.option("--index", default=-1, show_default=True, help="Checkpoint of a Ravex store to read (-1: the newest complete one).")
def inspect_cmd(path: str, as_json: bool, tensors: bool, tag: str | None, index: int) -> None:
    """Say what the checkpoint at PATH is: format, stage, world size, step, tensors, files."""
    try:
        info = ravex_convert.inspect(path, tag=tag, index=index)
    except RavexError as exc:
        _fail(exc)
    if as_json:
        click.echo(json.dumps(info.to_json(tensors=tensors), indent=2))
        return
    _render(info, tensors)


def _render(info: CheckpointInfo, tensors: bool) -> None:
    summary = Table.grid(padding=(0, 2))
    summary.add_column(style="bold")
    summary.add_column()
    rows: list[tuple[str, Any]] = [
        ("path", info.path),
        ("format", f"{info.format} ({info.variant})"),
    ]
    if info.zero_stage is not None:
        rows.append(("zero stage", info.zero_stage))
    if "precision" in info.extra:
        rows.append(("precision", info.extra["precision"]))
    rows += [
        ("world size", info.world_size if info.world_size is not None else "unknown"),
        ("tag", info.tag) if info.tag else ("", ""),
        ("step", info.step if info.step is not None else "not recorded"),
        ("dtypes", ", ".join(info.dtypes) or "-"),
        ("tensors", f"{len(info.model_tensors)} ({info.num_params:,} parameters)"),
        ("on disk", f"{_human_bytes(info.bytes_on_disk)} in {len(info.files)} file(s)"),
    ]
    if info.optimizer is not None:
        opt = info.optimizer
        desc = f"{opt.kind}: {', '.join(opt.states) or 'no per-parameter state'}"
        if opt.param_groups is not None:
            desc += f"; {opt.param_groups} param group(s)"
        if opt.master_dtype:
            desc += f"; {opt.master_dtype} master weights"
        rows.append(("optimizer", desc))
    else:
        rows.append(("optimizer", "none (weights only)"))
    if info.aliases:
        rows.append(("tied", ", ".join(f"{a} -> {b}" for a, b in info.aliases.items())))
    frozen = [t.name for t in info.tensors if t.kind == "frozen"]
    if frozen:
        rows.append(("frozen", ", ".join(frozen)))
    if "metadata_form" in info.extra:
        rows.append(("metadata", info.extra["metadata_form"]))
    for k, v in rows:
        if k:
            summary.add_row(k, str(v))
    out.print(summary)

    files = Table(title="files", title_justify="left", show_edge=False)
    for col in ("file", "role", "rank", "size"):
        files.add_column(col, justify="right" if col in ("rank", "size") else "left")
    for f in info.files:
        files.add_row(f.path, f.role, "" if f.rank is None else str(f.rank), _human_bytes(f.bytes))
    out.print(files)
    if tensors:
        table = Table(title="tensors", title_justify="left", show_edge=False)
        for col in ("name", "kind", "dtype", "shape"):
            table.add_column(col)
        for t in info.tensors:
            table.add_row(t.name, t.kind, t.dtype, str(tuple(t.shape)))
        out.print(table)
    for note in info.notes:
        err.print(f"note: {note}", markup=False)
    err.print("detected because: " + "; ".join(info.reasons), markup=False)


if __name__ == "__main__":
    main()
