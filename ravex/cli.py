"""The ``ravex`` command: argument parsing and rendering only.

Each command's work is a plain function in the layer it belongs to
(``ravex_convert.inspect`` ...). Data goes to stdout (``--json`` for scripts);
errors and progress go to stderr through one rich console. Exit codes: 0
success, 1 "difference found" (verify), 2 or more for errors (see
``ravex_convert.errors``).
"""

from __future__ import annotations

import contextlib
import functools
import json
import os
import sys
import traceback
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import TYPE_CHECKING, Any, NoReturn

import click

import ravex_convert
from ravex_convert import _core, _dist
from ravex_convert.errors import INTERNAL_EXIT, CorruptCheckpointError, RavexError, from_os_error
from ravex_convert.formats import registry
from ravex_convert.formats.options import Flag
from ravex_convert.info import CheckpointInfo
from ravex_convert.recipes import KEY as RECIPES
from ravex_convert.recipes import shown as shown_recipes
from ravex_convert.ties import parse_tie

if TYPE_CHECKING:
    from rich.console import Console


def _say(line: str, *, stderr: bool = False) -> None:
    """One plain line: no markup, no wrapping (rich is imported only for tables and the progress bar)."""
    click.echo(line, err=stderr)


@functools.cache
def _console(stderr: bool = False) -> Console:
    from rich.console import Console

    return Console(stderr=stderr, highlight=False, soft_wrap=True)


def _fail(exc: RavexError) -> NoReturn:
    who = f"[rank {_dist.rank()}] " if _dist.launched() else ""  # under torchrun every rank says what stopped it
    _say(f"{who}error: {exc.message}", stderr=True)
    if exc.hint:
        _say(f"{who}hint: {exc.hint}", stderr=True)
    sys.exit(exc.exit_code)


_REPORT = ("this is a bug in Ravex, not a problem Ravex found in your checkpoint: please report it with the command you ran and "
           "`ravex --version`" )


def _internal(exc: BaseException, what: str) -> NoReturn:
    """An exception no code path expected: say so plainly, and show the
    traceback only when asked (RAVEX_DEBUG=1)."""
    if os.environ.get("RAVEX_DEBUG", "") not in ("", "0"):
        traceback.print_exception(exc, file=sys.stderr)
    text = str(exc).split("\n")[0] or "(no message)"
    if isinstance(exc, _core.InternalError):
        _say(f"error: internal error in Ravex's core while {what}: {text}", stderr=True)
    else:
        _say(f"error: internal error while {what}: {type(exc).__name__}: {text}", stderr=True)
    _say(f"hint: {_REPORT}" + ("" if os.environ.get("RAVEX_DEBUG") else "; RAVEX_DEBUG=1 prints the traceback"), stderr=True)
    sys.exit(INTERNAL_EXIT)


def _handled(f: Callable[..., Any]) -> Callable[..., Any]:
    """Every failure of a command as ``error:`` / ``hint:`` lines and an exit
    code, never a traceback: Ravex's own errors with theirs, OS errors naming
    the file, anything unexpected as an internal error (exit 70)."""

    @functools.wraps(f)
    def run(*args: Any, **kwargs: Any) -> Any:
        paths = [str(kwargs[k]) for k in ("src", "path", "a", "b") if kwargs.get(k)]
        what = f"running `ravex {f.__name__.removesuffix('_cmd')}`" + (f" on {' and '.join(paths)}" if paths else "")
        try:
            return f(*args, **kwargs)
        except (click.exceptions.ClickException, click.exceptions.Exit, click.exceptions.Abort):
            raise
        except RavexError as exc:
            _fail(exc)
        except RecursionError:
            _fail(CorruptCheckpointError(f"{' or '.join(paths) or 'the input'}: data nested deeper than Ravex follows (Python's recursion limit) "
                                         f"while {what}", hint="the file is damaged or was built to exhaust its reader; "
                                         "a checkpoint saved by a training run does not nest this deep"))
        except OSError as exc:
            _fail(from_os_error(exc))
        except _core.CorruptSourceError as exc:
            # bad source bytes that reached the core without a reader catching them first
            first, _, hint = str(exc).partition("\nhint: ")
            _fail(CorruptCheckpointError(f"{exc.path or ' or '.join(paths) or 'the source'}: the file does not hold what the checkpoint's metadata says "
                                         f"({first})", hint=hint or "a file is truncated or damaged; copy the checkpoint again"))
        except MemoryError:
            _fail(RavexError(f"out of memory while {what}", hint="free memory or run on a larger machine; a checkpoint whose metadata "
                             "declares sizes far beyond its files is damaged"))
        except KeyboardInterrupt:
            _say("error: interrupted; nothing was left at the destination under its name", stderr=True)
            sys.exit(130)
        except Exception as exc:  # noqa: BLE001 - the last resort: a bug, said plainly
            _internal(exc, what)

    return run


def _human_bytes(n: int) -> str:
    size = float(n)
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if size < 1024 or unit == "TiB":
            return f"{size:.0f} {unit}" if unit == "B" else f"{size:.1f} {unit}"
        size /= 1024
    return f"{n} B"


def _hyperparameters(path: str | None) -> list[Any] | None:
    """``--hyperparameters FILE.json``: the parsed list, or a sentence naming the file."""
    if not path:
        return None
    try:
        found: list[Any] = json.loads(Path(path).read_text())
    except (OSError, json.JSONDecodeError, RecursionError) as exc:
        why = "nested too deep" if isinstance(exc, RecursionError) else exc
        raise RavexError(f"{path}: not a readable JSON list of param-group dicts ({why})",
                         hint="write e.g. [{\"lr\": 0.01, \"weight_decay\": 0.1}, {\"lr\": 0.005, \"weight_decay\": 0.0}]") from None
    return found


def _writer_flags(fmts: list[registry.Format]) -> list[click.Option]:
    """One click option per flag the formats' writers declare (formats/options.py), in
    the order people read the formats; a flag two formats share once, with the
    choices of both."""
    seen: dict[str, tuple[str, Flag, Any, list[str]]] = {}
    for fmt in fmts:
        for dest, flag, default in fmt.write_options.flags():  # (declared alike: registry.register checks)
            choices = seen.setdefault(flag.name, (dest, flag, default, []))[3]
            choices += [c for c in flag.choices if c not in choices]
    out = []
    for dest, flag, default, choices in seen.values():
        kind: Any = (click.Choice(choices) if choices else click.IntRange(*flag.range) if flag.range else flag.type)
        out.append(click.Option([flag.name, dest], type=kind, default=default, metavar=flag.metavar, help=flag.help,
                                show_default=flag.show_default))
    return out


class _WritingCommand(click.Command):
    """A command that writes a format: its ``--to`` choices (``convert``) and the
    writers' own options are the registry's when it runs, so a format registered
    after this module was imported is a target with its flags."""

    def __init__(self, *args: Any, writers: Callable[[], tuple[str, ...]], to_help: Callable[[], str] | None = None, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self._fixed = list(self.params)
        self._writers = writers
        self._to_help = to_help
        self._refresh()

    def _refresh(self) -> None:
        fmts = [registry.get(n) for n in self._writers()]
        params: list[click.Parameter] = []
        for p in self._fixed:
            if p.name == "to" and self._to_help is not None:
                p = click.Option(["--to", "to"], default=None, type=click.Choice([f.name for f in fmts]), help=self._to_help())
            params.append(p)
            if p.name == "world_size":
                params += _writer_flags(fmts)
        self.params = params
        self.writer_fields = {dest for f in fmts for dest, _, _ in f.write_options.flags()}

    def get_params(self, ctx: click.Context) -> list[click.Parameter]:
        self._refresh()
        return super().get_params(ctx)


def _to_help() -> str:
    named = [f"{', '.join(f.suffixes)}: {f.name}" for f in sorted(registry.formats(), key=lambda f: f.listed) if f.writes and f.suffixes]
    return f"Output format. Without it, taken from DST's name ({'; '.join(named)}) and said so."


def _writer_values(kwargs: dict[str, Any]) -> dict[str, Any]:
    """The writers' options out of a command's keyword arguments (what ``_WritingCommand`` added)."""
    fields: set[str] = getattr(click.get_current_context().command, "writer_fields", set())
    return {k: kwargs.pop(k) for k in list(kwargs) if k in fields}


_HYPERPARAMETERS_HELP = ("zero, dcp, torch_save: param-group hyper-parameters (a JSON list, one dict per group) where the source "
                         "lacks them (DeepSpeed elastic saves); for dcp, every key of the resuming optimizer's param groups.")


@click.group(context_settings={"help_option_names": ["-h", "--help"]})
@click.version_option(ravex_convert.__version__, "--version", "-V", prog_name="ravex")
def main() -> None:
    """Ravex: inspect, convert, reshard and verify training checkpoints
    (DeepSpeed ZeRO, DCP/FSDP2, torch.save, safetensors, Ravex stores)."""


@main.command("inspect")
@click.argument("path", type=click.Path(path_type=str, readable=False))
@click.option("--json", "as_json", is_flag=True, help="Print JSON for scripts (keys: format, variant, world_size, zero_stage, step, ...).")
@click.option("--tensors", is_flag=True, help="Also list every logical tensor with its global shape and dtype.")
@click.option("--tag", default=None, help="DeepSpeed tag to read when the root holds several (default: the one 'latest' names).")
@click.option("--index", default=-1, show_default=True, help="Checkpoint of a Ravex store to read (-1: the newest complete one).")
@_handled
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


_NO_SYNC_HELP = ("Return without waiting for DST to reach the disk, as cp does (faster). An OS crash or power cut soon after "
                 "can leave a DST that looks complete and is not: for scratch outputs.")


@main.command("convert", cls=_WritingCommand, writers=registry.targets, to_help=_to_help)
@click.argument("src", type=click.Path(path_type=str, readable=False))
@click.argument("dst", type=click.Path(path_type=str, readable=False))
@click.option("--to", "to", default=None)  # its choices and help: the registry's (_WritingCommand)
@click.option("--weights-only", is_flag=True, help="Leave the optimizer state and other training state out.")
@click.option("--dtype", type=click.Choice(["float32", "bfloat16", "float16", "float64"]), default=None,
              help="Cast floating-point weights on the way out (optimizer state is never cast).")
@click.option("--strip-prefix", multiple=True, metavar="PREFIX", help="Remove PREFIX from names (e.g. 'module.', '_orig_mod.'); repeatable.")
@click.option("--world-size", default=1, show_default=True, type=click.IntRange(1),
              help="dcp, native: number of ranks to shard into (dim 0, torch.chunk sizes, as FSDP2 does).")
@click.option("--hyperparameters", default=None, metavar="FILE.json", help=_HYPERPARAMETERS_HELP)
@click.option("--tag", default=None, help="DeepSpeed tag to read (default: the one 'latest' names).")
@click.option("--index", default=-1, show_default=True, help="Checkpoint of a Ravex store to read (-1: newest complete).")
@click.option("--param-names", "param_names_file", default=None, metavar="FILE",
              help="torch.save source with position-keyed optimizer state: the parameter names in optimizer order, one per line.")
@click.option("--tie", "ties", multiple=True, metavar="ALIAS=TARGET",
              help="A tie the source never recorded (it stores the tensor once): ALIAS is read as TARGET, e.g. lm_head.weight=model.embed_tokens.weight; repeatable.")
@click.option("--materialize-ties", is_flag=True, help="Write every tied name as a tensor of its own (for strict loaders that know nothing of ties).")
@click.option("--force", is_flag=True, help="Replace DST if it exists.")
@click.option("--dry-run", is_flag=True, help="Print the plan (tensors, bytes, copy runs) and write nothing.")
@click.option("--no-sync", is_flag=True, help=_NO_SYNC_HELP)
@click.option("--json", "as_json", is_flag=True, help="Print the result as JSON.")
@click.option("--quiet", "-q", is_flag=True, help="No progress bar.")
@_handled
def convert_cmd(src: str, dst: str, to: str | None, weights_only: bool, dtype: str | None, strip_prefix: tuple[str, ...], world_size: int,
                hyperparameters: str | None, tag: str | None, index: int, param_names_file: str | None, ties: tuple[str, ...],
                materialize_ties: bool, force: bool, dry_run: bool, no_sync: bool, as_json: bool, quiet: bool, **flags: Any) -> None:
    """Convert the checkpoint at SRC to another format at DST (bit-exact; weights as the fp32 master copy where SRC has one)."""
    try:
        writer = _writer_values(flags)
        options = ravex_convert.ConvertOptions(
            tag=tag, index=index, param_names=_read_names(param_names_file), ties=dict(parse_tie(t) for t in ties), weights_only=weights_only,
            dtype=dtype, strip_prefix=strip_prefix, materialize_ties=materialize_ties, world_size=world_size,
            hyperparameters=_hyperparameters(hyperparameters), force=force, dry_run=dry_run, sync=not no_sync, distributed=True)
        with _progress(quiet) as progress:
            result = ravex_convert.convert(src, dst, to, options, writer=writer, progress=progress)
    except RavexError as exc:
        _fail(exc)
    _report(result, dst, as_json)


def _report(result: dict[str, Any], dst: str, as_json: bool) -> None:
    if _dist.rank() != 0:
        return  # under torchrun rank 0 speaks for the output it committed
    to = result["to"]
    if as_json:
        click.echo(json.dumps(result, indent=2, default=str))
        return
    for note in result.get("notes", []):
        _say(f"note: {note}", stderr=True)
    if result.get("dry_run"):
        _say(f"plan: {result['source_format']} -> {to} at {dst}: {result['tensors']} tensors ({result['aliases']} aliases), "
             f"{_human_bytes(result['bytes_read'])} read from {result['source_files']} file(s), "
             f"{_human_bytes(result['bytes_written'])} written, {result['runs']} copy runs; nothing written (--dry-run)")
        return
    _say(f"wrote {dst} ({to}): {result.get('tensors')} tensors, {_human_bytes(int(result.get('bytes', result.get('bytes_written', 0))))} "
         f"in {result.get('seconds', 0):.2f} s")


@main.command("reshard", cls=_WritingCommand, writers=registry.reshardable)
@click.argument("src", type=click.Path(path_type=str, readable=False))
@click.argument("dst", type=click.Path(path_type=str, readable=False))
@click.option("--world-size", required=True, type=click.IntRange(1), help="The number of ranks to reshard to.")
@click.option("--hyperparameters", default=None, metavar="FILE.json", help=_HYPERPARAMETERS_HELP)
@click.option("--tag", default=None, help="DeepSpeed tag to read (default: the one 'latest' names).")
@click.option("--index", default=-1, show_default=True, help="Checkpoint of a Ravex store to read (-1: newest complete).")
@click.option("--tie", "ties", multiple=True, metavar="ALIAS=TARGET",
              help="A tie the source never recorded (it stores the tensor once): ALIAS is read as TARGET, e.g. lm_head.weight=model.embed_tokens.weight; repeatable.")
@click.option("--materialize-ties", is_flag=True, help="Write every tied name as a tensor of its own (for strict loaders that know nothing of ties).")
@click.option("--force", is_flag=True, help="Replace DST if it exists.")
@click.option("--dry-run", is_flag=True, help="Print the plan and write nothing.")
@click.option("--no-sync", is_flag=True, help=_NO_SYNC_HELP)
@click.option("--json", "as_json", is_flag=True, help="Print the result as JSON.")
@click.option("--quiet", "-q", is_flag=True, help="No progress bar.")
@_handled
def reshard_cmd(src: str, dst: str, world_size: int, hyperparameters: str | None, tag: str | None, index: int, ties: tuple[str, ...],
                materialize_ties: bool, force: bool, dry_run: bool, no_sync: bool, as_json: bool, quiet: bool, **flags: Any) -> None:
    """Change the number of ranks of SRC (DeepSpeed ZeRO, DCP, a Ravex store, an HF Trainer or Accelerate directory), model and optimizer state, keeping its format."""
    try:
        writer = _writer_values(flags)
        options = ravex_convert.ConvertOptions(tag=tag, index=index, ties=dict(parse_tie(t) for t in ties), materialize_ties=materialize_ties,
                                               hyperparameters=_hyperparameters(hyperparameters), force=force, dry_run=dry_run,
                                               sync=not no_sync, distributed=True)
        with _progress(quiet) as progress:
            result = ravex_convert.reshard(src, dst, world_size, options, writer=writer, progress=progress)
    except RavexError as exc:
        _fail(exc)
    _report(result, dst, as_json)


@main.command("verify")
@click.argument("a", type=click.Path(path_type=str, readable=False))
@click.argument("b", type=click.Path(path_type=str, readable=False))
@click.option("--weights-only", is_flag=True, help="Compare model weights only, not optimizer state.")
@click.option("--atol", default=0.0, show_default=True, help="Absolute tolerance (default: bit-exact).")
@click.option("--rtol", default=0.0, show_default=True, help="Relative tolerance (default: bit-exact).")
@click.option("--param-names", "param_names_file", default=None, metavar="FILE",
              help="A side whose optimizer state is keyed by position (torch.save): the parameter names in optimizer order, one per line.")
@click.option("--json", "as_json", is_flag=True, help="Print the result as JSON.")
@_handled
def verify_cmd(a: str, b: str, weights_only: bool, atol: float, rtol: float, param_names_file: str | None, as_json: bool) -> None:
    """Compare two checkpoints of any formats tensor by tensor. Exit 0: identical; 1: different (a name on one side only is a
    difference; two checkpoints without tensors are never identical); 2 or more: error. Optimizer state is matched by parameter
    name wherever each format keeps it; names that differ by a wrapper's prefix alone (module., _orig_mod.) are matched without it."""
    try:
        names = _read_names(param_names_file)
        result = ravex_convert.verify(a, b, weights_only=weights_only, atol=atol, rtol=rtol, param_names=names)
    except RavexError as exc:
        _fail(exc)
    if not as_json:
        for m in result.matched:
            _say(f"matched: {m}")
    if as_json:
        click.echo(json.dumps(result.to_json(), indent=2))
    elif result.identical:
        how = "bit-identical" if result.exact else f"equal within atol={atol}, rtol={rtol}"
        _say(f"identical: {result.compared} tensors, {result.elements:,} elements {how}")
    elif result.differences[0].kind == "nothing_compared":
        _say(f"nothing compared: {result.differences[0].detail}")
        _say("hint: a checkpoint without tensors is usually the wrong path or a conversion that lost them; `ravex inspect` shows what each holds",
             stderr=True)
    else:
        first = result.differences[0]
        where = f" (first at {first.first_index}, max |a-b| {first.max_abs_diff:.6g})" if first.first_index is not None and first.max_abs_diff is not None else ""
        counts = f"a: {result.tensors_a} tensors, b: {result.tensors_b}"
        if result.only_in_a or result.only_in_b:
            counts += f"; {result.only_in_a} only in a, {result.only_in_b} only in b"
        _say(f"different: {len(result.differences)} tensor(s) differ ({counts}); first: {first.name}: {first.detail}{where}")
    sys.exit(0 if result.identical else 1)


def _read_names(path: str | None) -> list[str] | None:
    if path is None:
        return None
    try:
        text = Path(path).read_text()
    except OSError as exc:
        raise RavexError(f"{path}: cannot be read ({exc.strerror})", hint="--param-names takes a text file, one parameter name per line") from None
    return [line.strip() for line in text.splitlines() if line.strip()]


@contextlib.contextmanager
def _progress(quiet: bool) -> Iterator[Callable[[int], None] | None]:
    """A rich progress bar on stderr (bytes, rate, ETA); none when quiet, not a
    terminal, or not rank 0 under torchrun (which shows rank 0's share)."""
    if quiet or not sys.stderr.isatty() or _dist.rank() != 0:
        yield None
        return
    from rich.progress import BarColumn, DownloadColumn, Progress, TimeRemainingColumn, TransferSpeedColumn

    with Progress("[progress.description]{task.description}", BarColumn(), DownloadColumn(), TransferSpeedColumn(),
                  TimeRemainingColumn(), console=_console(stderr=True), transient=True) as bar:
        yield _Bar(bar, bar.add_task("converting", total=None))


class _Bar:
    """The progress callback ``ravex_convert`` takes: bytes written, and the total each copy job adds."""

    def __init__(self, bar: Any, task: Any) -> None:
        self.bar, self.task, self.total = bar, task, 0

    def __call__(self, n: int) -> None:
        self.bar.advance(self.task, n)

    def add_total(self, n: int) -> None:
        self.total += n
        self.bar.update(self.task, total=self.total)


def _render(info: CheckpointInfo, tensors: bool) -> None:
    from rich.table import Table

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
    for name, line in shown_recipes(info.extra.get(RECIPES)):
        rows.append(("recipe" if name in ("model", "") else f"recipe {name}", line))
    frozen = [t.name for t in info.tensors if t.kind == "frozen"]
    if frozen:
        rows.append(("frozen", ", ".join(frozen)))
    if "metadata_form" in info.extra:
        rows.append(("metadata", info.extra["metadata_form"]))
    for k, v in rows:
        if k:
            summary.add_row(k, str(v))
    _console().print(summary)

    files = Table(title="files", title_justify="left", show_edge=False)
    for col in ("file", "role", "rank", "size"):
        files.add_column(col, justify="right" if col in ("rank", "size") else "left")
    for f in info.files:
        files.add_row(f.path, f.role, "" if f.rank is None else str(f.rank), _human_bytes(f.bytes))
    _console().print(files)
    if tensors:
        table = Table(title="tensors", title_justify="left", show_edge=False)
        for col in ("name", "kind", "dtype", "shape"):
            table.add_column(col)
        for t in info.tensors:
            table.add_row(t.name, t.kind, t.dtype, str(tuple(t.shape)))
        _console().print(table)
    for note in info.notes:
        _say(f"note: {note}", stderr=True)
    _say("detected because: " + "; ".join(info.reasons), stderr=True)


def _ranks_cell(r: dict[str, Any] | None) -> str:
    """``2 fsdp2``: how many ranks wrote a checkpoint, and how they trained; ``1`` alone."""
    return f"{r.get('world_size')} {r.get('wrap')}" if r else "1"


def _ranks_line(index: Any, r: dict[str, Any]) -> str:
    """Who wrote a checkpoint of a run on many ranks, in a sentence."""
    wrote = r.get("written_by") or {}
    who = "rank 0 wrote every file" if wrote == {"0": "all"} else f"{len(wrote)} ranks wrote their own files"
    mesh = f", mesh {r['mesh']}" if r.get("mesh") else ""
    shared = "" if r.get("shared_storage", True) else ", on storage not every rank sees"
    return f"checkpoint {index}: {r.get('world_size')} ranks ({r.get('wrap')}, {r.get('mode')}{mesh}); {who}{shared}"


def _replicas_lines(rep: dict[str, Any] | None) -> None:
    """``ravex status``: where the store's copies are (replicate_every) and how old, and the replicas kept here."""
    if not rep:
        return

    def age(s: Any) -> str:
        if not isinstance(s, (int, float)):
            return "age unknown"
        return f"{s:.0f} s ago" if s < 120 else f"{s / 60:.0f} min ago" if s < 7200 else f"{s / 3600:.1f} h ago"

    for c in rep.get("copies", []):
        behind = c.get("behind")
        newer = "" if behind is None else (", the newest" if behind == 0 else f", {behind} checkpoint(s) behind the store")
        _say(f"replica: checkpoint {c.get('index')} (step {c.get('step')}) on rank {c.get('holder_rank')} ({c.get('holder_host')}) "
             f"at {c.get('path')}, committed {age(c.get('age_s'))}{newer}")
    for h in rep.get("held", []):
        what = f"checkpoint {h.get('index')} (step {h.get('step')}), written {age(h.get('age_s'))}" if h.get("index") is not None else "no checkpoint"
        _say(f"held here: the replica of rank {h.get('rank')}'s store at {h.get('path')}: {what}")


@main.command("status")
@click.argument("path", required=False, type=click.Path(path_type=str, readable=False))
@click.option("--json", "as_json", is_flag=True, help="Print JSON for scripts (keys: store, checkpoints, resume).")
@_handled
def status_cmd(path: str | None, as_json: bool) -> None:
    """List the checkpoints of a Ravex store and say which one a resume would pick.

    PATH defaults to storage.path of the ravex.yaml found from the working directory."""
    import time

    from ravex_runtime.status import store_status

    try:
        st = store_status(path)
    except RavexError as exc:
        _fail(exc)
    if as_json:
        _say(json.dumps(st, indent=2))
        return
    from rich.table import Table

    table = Table(title=f"store {st['store']}", title_justify="left", show_edge=False)
    for col in ("index", "step", "size", "on disk", "time", "complete", "run", "ranks"):
        table.add_column(col, justify="right" if col in ("index", "step", "size", "on disk") else "left")
    for c in st["checkpoints"]:
        when = time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(c["created_unix"])) if isinstance(c["created_unix"], (int, float)) else "-"
        table.add_row(str(c["index"]), str(c["step"]), _human_bytes(int(c["bytes"] or 0)), _human_bytes(c["bytes_on_disk"]), when,
                      "yes" if c["complete"] else f"no ({c['problem']})", str(c["run_id"]), _ranks_cell(c.get("ranks")))
    _console().print(table)
    last = next((c for c in reversed(st["checkpoints"]) if c.get("ranks")), None)
    if last is not None:
        _say(_ranks_line(last["index"], last["ranks"]))
    began = next((c for c in reversed(st["checkpoints"]) if c.get("began_from")), None)
    if began is not None:
        b = began["began_from"]
        step = f" (step {b['step']})" if b.get("step") is not None else ""
        _say(f"checkpoint {began['index']}: the run began from the {b.get('format')} checkpoint {b.get('path')}{step} (resume_from)")
    init = next((c for c in reversed(st["checkpoints"]) if c.get("initialised_from")), None)
    if init is not None:
        b = init["initialised_from"]
        step = f" (step {b['step']})" if b.get("step") is not None else ""
        _say(f"checkpoint {init['index']}: the run's model began from the weights of the {b.get('format')} checkpoint {b.get('path')}{step} "
             "(init_from)")
    _replicas_lines(st.get("replicas"))
    resume = st["resume"]
    _say("resume would pick: " + (f"checkpoint {resume}" if resume is not None else "nothing (a run starts from the beginning)"))
    left = st.get("unfinished_uploads")
    if left:
        _say(f"note: {left} unfinished multipart upload(s) under the store (a writer was killed mid-upload); they are not "
             "checkpoints, the bucket bills their parts, and the next write to the store aborts them")

if __name__ == "__main__":
    main()
