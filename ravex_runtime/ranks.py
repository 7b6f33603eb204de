"""The session's ranks: joining the job's other ranks, and a capture on every rank of it.

:meth:`RankCapture.join` uses Ravex's own group of the job's ranks (dist.py),
made once the script has initialized its process group. Every rank then
captures at the same iteration boundary (:meth:`RankCapture.capture`). How the
checkpoint is captured follows from the model:

- ``replicated`` (one process's model on every rank, DDP): rank 0 copies the
  model, optimizers and schedulers; the first capture checks with one checksum
  per rank that the ranks hold the same weights;
- ``gather`` (a sharded model, FSDP1 or FSDP2): the sharded tensors are gathered
  whole to rank 0 by torch (collectives every rank joins); rank 0 writes;
- ``per_rank`` (FSDP2 with ``sharded_checkpoints: per_rank``): each rank copies
  its own shards and its writer writes them into the one checkpoint.

In every mode each rank's random streams and data position are gathered to
rank 0. A rank that cannot copy its state still takes part in the exchanges,
which then refuse the step on every rank.
"""

from __future__ import annotations

import logging
import zlib
from pathlib import Path
from typing import Any, cast

import torch

from ravex_convert.storage import Location

from .config import Config
from .dist import Coord
from .state import Snapshot, Tracked, _is_dtensor, capture, is_fsdp1, layout_of
from .writer import Job

__all__ = ["RankCapture"]

log = logging.getLogger("ravex")


def _sharded(m: torch.nn.Module) -> bool:
    return any(_is_dtensor(p) for p in m.parameters())


def _mesh_of(t: Tracked) -> list[int] | None:
    for m in t.models:
        for p in m.parameters():
            if _is_dtensor(p):
                return [int(s) for s in cast(Any, p).device_mesh.shape]
    return None


class RankCapture:
    """The session's ranks, joined, and captures on them.

    Args:
        coord: Ravex's own group of the job's ranks.
        config: the session's configuration (``sharded_checkpoints``, ``backend``).
        job: who writes: :meth:`join` sets the rank, size, keys and run id in it, a per_rank
            capture the writers' store connection.
    """

    def __init__(self, coord: Coord, config: Config, job: Job) -> None:
        self.coord, self.config, self.job = coord, config, job
        self.shared = True  # whether every rank sees the store rank 0 writes to (the probe at join())
        self.mode: str | None = None  # replicated, gather or per_rank: how the last checkpoint was captured
        self._checked_replicas = False
        self._warned_per_rank = False

    def join(self, dst: str | Path | Location, path: Path) -> None:
        """Join the job's other ranks (a collective: every rank calls it at the same place): rank 0's
        run id on every rank, and a probe of whether every rank sees the store ``dst`` (``path``:
        its local view, for the message when one does not)."""
        coord, job = self.coord, self.job
        job.prefix, job.rank, job.world_size = coord.prefix, coord.rank, coord.size
        job.run_id = coord.broadcast(job.run_id)  # one run: rank 0's id on every rank
        seen = coord.probe(dst)
        self.shared = all(seen)
        if job.rank == 0 and not self.shared:
            blind = [r for r, ok in enumerate(seen) if not ok]
            log.warning("ravex: storage: %s is not shared: rank(s) %s do not see the directory rank 0 writes to (local disks on several "
                        "machines). Rank 0 writes every checkpoint there; to resume, start rank 0 on this machine again, and the other ranks "
                        "receive the state from it over the network. %s", path, ", ".join(map(str, blind)),
                        "replicate_every copies its checkpoints to another machine (below)" if self.config.replicate_every else
                        "A lost machine loses its checkpoints: put storage.path on storage every rank sees (a shared filesystem) to resume "
                        "anywhere, or set replicate_every")
        coord.watch()

    def capture(self, t: Tracked, step: int, spare: dict[str, torch.Tensor], extra: dict[str, Any], *, ddp: bool = False,
                ddp_relayout: bool = False) -> Snapshot:
        """The snapshot of ``step`` on this rank: rank 0's holds the checkpoint (with every rank's
        streams and positions); a per_rank one holds this rank's shards and every rank's layout.
        ``ddp``/``ddp_relayout``: what the registry saw of a DistributedDataParallel wrapper."""
        coord, rank, world_size = self.coord, self.job.rank, self.job.world_size
        fsdp1 = any(is_fsdp1(m) for m in t.models)
        sharded = fsdp1 or any(_sharded(m) for m in t.models)
        if fsdp1 and self.config.sharded_checkpoints == "per_rank" and not self._warned_per_rank:
            self._warned_per_rank = True
            if rank == 0:
                log.warning("ravex: sharded_checkpoints: per_rank falls back to gather: the model is wrapped in FSDP1 "
                            "(FullyShardedDataParallel), whose flat parameters name no tensor of the model; FSDP2 (fully_shard) writes per rank")
        per_rank = sharded and not fsdp1 and self._per_rank()
        self.mode = "per_rank" if per_rank else "gather" if sharded else "replicated"
        if not sharded and not self._checked_replicas:
            self._checked_replicas = True
            self._check_replicas(t)
            if ddp_relayout and world_size >= 3 and rank == 0:
                log.warning("ravex: DDP on %d ranks: after a resume, DDP's first step sums the ranks' gradients in another order than "
                            "the uninterrupted run's (DDP lays its gradient buckets out again after its first step; this happens without "
                            "Ravex too), so the weights can differ in the last bit from there on. For bit-identical resumes pass "
                            "find_unused_parameters=True to DistributedDataParallel: it keeps one bucket layout", world_size)
        try:
            snap = capture(t, step, spare, extra, keep=rank == 0, rank_part=rank, local_shards=per_rank)
        except Exception as exc:  # this rank still takes part in the exchanges below, which refuse the step on every rank
            # (a failure inside one of the gathers above leaves the group broken: torch reports that itself)
            log.exception("ravex: rank %d could not copy its state at step %d", rank, step)
            snap = Snapshot(step=step, rank=rank, local_shards=per_rank, failed=f"{type(exc).__name__}: {exc}")
            snap.objects["rank_part"] = {"rng": {}, "loaders": []}
        part = snap.objects.pop("rank_part")
        mine = f"obj/ranks/{rank}/"
        part_tensors = {n: snap.tensors.pop(n) for n in [n for n in snap.tensors if n.startswith(mine)]}
        parts = coord.gather((step, part, part_tensors, snap.failed))
        if parts is not None:
            failed = [(r, p[3]) for r, p in enumerate(parts) if p[3] is not None]
            steps = sorted({p[0] for p in parts})
            if len(steps) > 1:
                # (every rank learns it below, in the layout exchange or when rank 0 writes nothing)
                log.error("ravex: the ranks are at different steps (%s) at a checkpoint boundary; no checkpoint is written", steps)
            snap.objects["ranks"] = [p[1] for p in parts]
            for _, _, tensors, _ in parts:
                snap.tensors.update(tensors)
            files = {str(r): f"rank{r:05d}" + (" and checkpoint.json" if r == 0 else "") for r in range(world_size)} if per_rank else {"0": "all"}
            snap.objects["distributed"] = {"world_size": world_size, "mode": self.mode, "mesh": _mesh_of(t),
                                           "wrap": "fsdp1" if fsdp1 else "fsdp2" if sharded else ("ddp" if ddp else "none"),
                                           "written_by": files, "shared_storage": self.shared}
            if len(steps) > 1:
                snap.objects["distributed"]["refused"] = f"the ranks are at different steps: {steps}"
            if failed:
                snap.objects["distributed"]["refused"] = f"rank {failed[0][0]} could not copy its state: {failed[0][1]}"
                log.error("ravex: no checkpoint at step %d: rank %d could not copy its state (%s)", step, *failed[0])
        if per_rank:
            # Every rank's writer builds the same checkpoint: each rank's list of tensors and shards
            # (and every rank sees the steps: all write, or none).
            got = coord.all_gather((step, layout_of(snap), snap.failed))
            snap.layout = [layout for _, layout, _ in got]
            if len({s for s, _, _ in got}) > 1 or any(f is not None for _, _, f in got):
                snap.objects.setdefault("distributed", {})["refused"] = "the ranks are at different steps, or one could not copy its state"
        return snap

    def _per_rank(self) -> bool:
        """Whether per_rank checkpoints can be written here (asked for, every rank sees the store, and a
        store connection for the writers); else gather, said once."""
        if self.config.sharded_checkpoints != "per_rank":
            return False
        why = None if self.shared else "not every rank sees the store (each rank's shard must reach the one checkpoint)"
        if why is None and self.config.backend != "native":
            why = f"backend: {self.config.backend} writes one file per checkpoint; per_rank writes into a native store"
        # The writers' connection (asked for on every rank: a collective) outlives the process group:
        # a final checkpoint is written after it is gone.
        store = self.coord.writer_store()
        if why is None and store is None:
            why = "some rank has no connection to the job's store at MASTER_ADDR:MASTER_PORT for the writers to agree through (start it with torchrun)"
        if why is None:
            self.job.writers = store
        if why is not None and not self._warned_per_rank:
            self._warned_per_rank = True
            if self.job.rank == 0:
                log.warning("ravex: sharded_checkpoints: per_rank falls back to gather: %s", why)
        return why is None

    def _check_replicas(self, t: Tracked) -> None:
        """A model not sharded is written once, by rank 0: every rank must hold the same weights. DDP
        sees to it (it broadcasts rank 0's weights when it wraps the model and averages the
        gradients every step); the first capture checks it with one checksum per rank."""
        crc = 0
        for m in t.models:
            # parameters only: buffers (BatchNorm's running statistics) differ between the ranks
            # until DDP broadcasts them again at the next forward
            for k, v in m.named_parameters():
                crc = zlib.crc32(k.encode(), crc)
                crc = zlib.crc32(v.detach().cpu().contiguous().reshape(-1).view(torch.uint8).numpy().data, crc)
        sums = self.coord.all_gather(crc)
        if len(set(sums)) > 1 and self.job.rank == 0:
            log.warning("ravex: the ranks hold different weights (checksums %s) and the model is not sharded: rank 0's are checkpointed. "
                        "Wrap the model in DistributedDataParallel (or FSDP2's fully_shard) so the ranks train one model",
                        ", ".join(f"{s:08x}" for s in sums))
