"""Plan -> execute per rank -> commit: how every writer's output is made.

A writer's ``plan_write`` returns a :class:`WritePlan`: the output's data
objects (:class:`OutFile`: size, the bytes Python knows before the copy, the
tensor regions the Rust executor copies in, and the bytes that can only be
computed after, such as zip CRC-32s), and the commit objects a coordinator
writes last (DCP ``.metadata``, ZeRO ``latest``, a safetensors index).

:func:`run` executes it. The data objects are shared out between the ranks of
the group by size (largest first, to the least loaded rank); each rank writes
its own through the storage layer; after every rank reports, rank 0 writes the
commit objects and publishes the output. In one process that is a loop over
the objects; under ``torchrun`` the same plan, built by every rank from the
same source metadata, runs on every rank, and the output is byte-identical.
"""

from __future__ import annotations

import os
import uuid
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from ._dist import ambient, local_size
from ._engine import CopyJob, Target
from ._torchfile.archive import check_deferred, deferring
from .errors import RavexError, from_os_error
from .model import LogicalTensor, Region
from .storage import Location, resolve

__all__ = ["OutFile", "WritePlan", "assign", "copy_job", "run"]


@dataclass
class OutFile:
    """One data object of an output."""

    rel: str  # relative to the output ("" for a single-file output)
    size: int  # bytes, preallocated; ``finish`` may write past it (a zip's central directory)
    small: list[tuple[int, bytes]] = field(default_factory=list)  # (offset, bytes) written before the copy
    fills: list[tuple[LogicalTensor, int, Region, str]] = field(default_factory=list)  # tensor, byte offset, region, dtype
    crc_ranges: list[tuple[int, int]] = field(default_factory=list)  # (offset, length) whose CRC-32 ``finish`` needs
    finish: Callable[[list[int]], list[tuple[int, bytes]]] | None = None  # CRCs of crc_ranges -> (offset, bytes) written last
    # Copy into a scratch file outside the output instead (``seal`` then writes the object
    # from it: a compressed file, whose size is known only after compressing).
    scratch: bool = False
    # Called with the copied bytes' local file, the output (to open further sinks) and the
    # xxh3-64 of each of ``hash_ranges`` (None where the copy could not hash it) before the sink
    # closes; what it returns reaches the coordinator's ``commit`` under ``rel``.
    seal: Callable[[Path | None, Any, list[int | None]], Any] | None = None
    hash_ranges: list[tuple[int, int]] = field(default_factory=list)  # (offset, length) whose xxh3-64 ``seal`` needs
    # The rank that must write this file (it alone holds the bytes), else any: see assign().
    rank: int | None = None
    # Fills ``small``, ``fills``, ``crc_ranges`` and ``finish`` when the file is about to be
    # written, by the rank that writes it: a plan of many items (DCP at scale) then holds one
    # entry per key, and each rank builds only its own files' records.
    build: Callable[[OutFile], None] | None = None

    def records(self) -> OutFile:
        """This file with its records built (once)."""
        if self.build is not None:
            build, self.build = self.build, None
            build(self)
        return self


Commit = list[tuple[str, bytes]] | Callable[[dict[str, Any]], list[tuple[str, bytes]]]


@dataclass
class WritePlan:
    directory: bool  # a directory of objects (else one file at DST)
    files: list[OutFile]
    # The objects the coordinator writes last, in order, or a function of every file's
    # ``seal`` result (``{rel: result}``) that returns them.
    commit: Commit = field(default_factory=list)
    summary: dict[str, Any] = field(default_factory=dict)
    threads: int = 0
    staging: str | None = None  # the name the output is built under, where a format's spec fixes it (native)
    # Run by the coordinator once the output is published (native: the manifest, the
    # store's commit point); it undoes the publication itself if it fails (run does not
    # abort a published output: on a backend without rename that would delete it).
    after: Callable[[dict[str, Any]], None] | None = None


def assign(files: list[OutFile], ranks: int) -> list[int]:
    """The rank that writes each file: largest first, to the least loaded rank
    (ties to the lower rank), so every rank derives the same assignment."""
    load = [0] * ranks
    owner = [0] * len(files)
    for i in sorted(range(len(files)), key=lambda i: (-files[i].size, i)):
        want = files[i].rank
        r = want if want is not None else min(range(ranks), key=lambda r: (load[r], r))
        if not 0 <= r < ranks:
            raise RavexError(f"{files[i].rel} is to be written by rank {r}, but the group has {ranks} rank(s)",
                             hint="write a checkpoint of a run on many ranks from the same ranks")
        owner[i] = r
        load[r] += files[i].size
    return owner


def copy_job(files: list[OutFile], paths: list[Any]) -> tuple[CopyJob, list[tuple[int, int, int]], list[tuple[int, int, int]]]:
    """The one executor job that fills ``files`` (written at ``paths``), each tensor
    added once with all its destinations, and the (target, offset, length) ranges
    whose CRC-32 the files' late records need and whose xxh3-64 their seals need."""
    job = CopyJob()
    per_tensor: dict[int, tuple[LogicalTensor, list[Target]]] = {}
    crc_ranges: list[tuple[int, int, int]] = []
    hash_ranges: list[tuple[int, int, int]] = []
    for f, path in zip(files, paths, strict=True):
        f.records()
        ti = job.target(path)
        for t, offset, region, dtype in f.fills:
            per_tensor.setdefault(id(t), (t, []))[1].append(Target(ti, offset, region, dtype))
        crc_ranges += [(ti, off, n) for off, n in f.crc_ranges]
        hash_ranges += [(ti, off, n) for off, n in f.hash_ranges]
    for t, targets in per_tensor.values():
        job.add(t, targets)
    return job, crc_ranges, hash_ranges


def _execute(plan: WritePlan, out: Any, mine: list[OutFile], progress: Any, threads: int) -> dict[str, Any]:
    """Write this rank's files: small records, the executor's copy (CRCs gathered
    on the way), the late records, the seal; each sink closed (durable) before
    returning. Returns each file's seal result."""
    sinks = []
    results: dict[str, Any] = {}
    try:
        for f in mine:
            f.records()
            sink = out.scratch(f.size) if f.scratch else out.sink(f.rel, f.size)
            sinks.append(sink)
            for offset, data in f.small:
                sink.pwrite(data, offset)
        job, crc_ranges, hash_ranges = copy_job(mine, [s.target for s in sinks])
        deferred = deferring()  # a conversion: the sources' CRC-32s are checked from this copy's reads
        # Durable files go around the page cache (O_DIRECT), but not where the copy is read back
        # before its sink closes (compression's scratch file; a spool uploaded on close): those
        # bytes are wanted in memory. A seal's xxh3 sums come from the copy itself.
        hot = any(f.scratch for f in mine) or not all(s.direct for s in sinks)
        job.run(progress=progress, sync=False, threads=threads, crc_ranges=crc_ranges or None, read_crcs=deferred,
                direct=False if hot else None, hash_ranges=hash_ranges or None)
        if deferred:
            check_deferred(job.sources, job.read_crcs)  # raises before any file is closed: nothing is committed
        at = hat = 0
        for f, sink in zip(mine, sinks):
            crcs = job.crcs[at:at + len(f.crc_ranges)]
            at += len(f.crc_ranges)
            hashes = job.hashes[hat:hat + len(f.hash_ranges)]
            hat += len(f.hash_ranges)
            for offset, data in (f.finish(crcs) if f.finish else []):
                sink.pwrite(data, offset)
            if f.seal is not None:
                results[f.rel] = f.seal(sink.path, out, hashes)
            if f.scratch:
                sink.abort()  # a scratch file is never an object
            else:
                sink.close()
        return results
    except BaseException:
        for s in sinks:
            s.abort()
        raise


def run(plan: WritePlan, dst: str | Path | Location, *, force: bool, progress: Any = None, group: Any = None) -> dict[str, Any]:
    """Execute ``plan`` at ``dst`` on every rank of ``group`` (default: the one
    :func:`~ravex_convert._dist.spread` set, else this process alone) and commit once. Returns the plan's summary (with
    ``ranks``: how many processes wrote)."""
    group = group or ambient()
    storage, key = resolve(dst)
    owners = assign(plan.files, group.size)
    token = group.broadcast(uuid.uuid4().hex[:12] if group.rank == 0 else None)
    out = None
    begun: Any = None
    refused: RavexError | None = None
    if group.rank == 0:
        try:
            out = storage.output(key, force=force, directory=plan.directory, token=token, create=True, staging=plan.staging,
                                 commit=tuple(rel for rel, _ in plan.commit) if isinstance(plan.commit, list) else ())
            begun = "ok"
        except RavexError as exc:
            refused = exc
        except OSError as exc:
            refused = from_os_error(exc, path=Path(key), writing=True)
        if refused is not None:
            if group.size == 1:
                raise refused
            begun = (refused.message, refused.hint)
    begun = group.broadcast(begun)
    if refused is not None:
        raise refused  # rank 0 says it in its own words; the others below
    if begun != "ok":
        raise RavexError(f"rank 0 could not begin the output: {begun[0]}", hint=begun[1])
    if out is None:
        out = storage.output(key, force=force, directory=plan.directory, token=token, create=False, staging=plan.staging)
    mine = [f for f, r in zip(plan.files, owners) if r == group.rank]
    failure: Any = None
    results: dict[str, Any] = {}
    try:
        # ranks on one machine share its CPUs: one copy thread per CPU in all, not per rank
        threads = plan.threads or (max(1, (os.cpu_count() or 1) // local_size()) if group.size > 1 else 0)
        results = _execute(plan, out, mine, progress, threads)
    except OSError as exc:
        failure = from_os_error(exc, path=Path(key), writing=True)
    except RavexError as exc:
        failure = exc
    except BaseException as exc:  # every rank must hear of it before anyone commits
        if group.size == 1:
            out.abort()
            raise
        failure = RavexError(f"{type(exc).__name__}: {exc}")
    reports = group.all_gather((results, None) if failure is None else ({}, (group.rank, failure.message, failure.hint)))
    failed = [r for _, r in reports if r is not None]
    sealed = {k: v for part, _ in reports for k, v in part.items()}
    committed: Any = None
    if group.rank == 0:
        if failed:
            out.abort()
        else:
            published = False
            try:
                out.publish(plan.commit(sealed) if callable(plan.commit) else plan.commit)
                published = True
                if plan.after is not None:
                    plan.after(sealed)
                committed = "ok"
            except OSError as exc:
                if not published:  # once published, the output is not this call's to remove: `after` undoes its own part
                    out.abort()
                failure = from_os_error(exc, path=Path(key), writing=True)
                committed = (failure.message, failure.hint)
            except BaseException as exc:  # every rank must hear of it before anyone commits
                if not published:
                    out.abort()
                if group.size == 1:
                    raise
                committed = (f"{type(exc).__name__}: {exc}", None)
    committed = group.broadcast(committed)
    if failure is not None:
        raise failure
    if failed:
        rank, message, hint = failed[0]
        raise RavexError(f"rank {rank} failed, so nothing was committed: {message}", hint=hint)
    if committed != "ok":
        raise RavexError(f"rank 0 could not commit the output: {committed[0]}", hint=committed[1])
    return {**plan.summary, "ranks": group.size, "sealed": sealed}
