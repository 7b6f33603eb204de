"""The pieces of the runtime on many ranks that need no process group, tested in one
process: how a DistributedSampler's epoch is dealt out again at another world size
(and continued exactly at the same one), which rank's streams and position a rank
takes from a checkpoint, and the writers' message group over a real TCPStore with
one thread per rank. The whole thing runs under torchrun in
integration/test_dist_runtime.py."""

from __future__ import annotations

import threading
from datetime import timedelta
from pathlib import Path
from typing import Any

import pytest
import torch
from torch.utils.data import DataLoader, DistributedSampler, TensorDataset

from ravex_convert.model import Checkpoint, TensorLink
from ravex_runtime.dist import StoreGroup
from ravex_runtime.restoring import for_rank
from ravex_runtime.sampler import LoaderState

N_SAMPLES = 43  # not a multiple of any world size below: DistributedSampler pads
BATCH = 4


def _loader(world: int, rank: int, epoch: int = 2, drop_last: bool = False) -> DataLoader[Any]:
    ds = TensorDataset(torch.arange(N_SAMPLES))
    sampler = DistributedSampler(ds, num_replicas=world, rank=rank, shuffle=True, seed=11, drop_last=drop_last)
    sampler.set_epoch(epoch)
    return DataLoader(ds, batch_size=BATCH, sampler=sampler)


def _saved(world: int, consumed: int, offset: int = 0, epoch: int = 2) -> dict[str, Any]:
    """A loader position as a rank of a ``world``-rank run captures it."""
    return {"epoch": epoch, "consumed": consumed, "length": None, "replayable": True, "epoch_start": {}, "generators": {},
            "sampler_epoch": epoch, "distributed_sampler": {"num_replicas": world, "rank": 0, "batch_size": BATCH, "offset": offset,
                                                            "dataset_len": N_SAMPLES}}


def _resumed(world: int, rank: int, saved: dict[str, Any], batches: int | None = None) -> tuple[list[int], LoaderState]:
    """The samples rank ``rank`` of a ``world``-rank job draws in the resumed epoch (``batches`` of them, or all)."""
    loader = _loader(world, rank)
    st = LoaderState(loader, 0)
    st.pending = saved
    it = st.make_iter(loader, DataLoader.__iter__, torch.get_rng_state())
    out: list[int] = []
    for i, (x,) in enumerate(it):
        if batches is not None and i == batches:
            break
        st.consumed += 1
        out += x.tolist()
    return out, st


def _consumed_before(world: int, consumed: int) -> list[int]:
    """What the ranks of a ``world``-rank run trained on in the epoch's first ``consumed`` batches."""
    out: list[int] = []
    for r in range(world):
        out += list(_loader(world, r).sampler)[:consumed * BATCH]
    return out


@pytest.mark.parametrize("old,new", [(2, 3), (3, 2), (2, 1), (1, 4), (4, 4)])
def test_another_world_size_sees_every_sample_of_the_epoch_once(old: int, new: int) -> None:
    consumed = 2
    before = _consumed_before(old, consumed)
    after: list[int] = []
    for r in range(new):
        got, _ = _resumed(new, r, _saved(old, consumed))
        after += got
    seen = before + after
    assert sorted(set(seen)) == list(range(N_SAMPLES)), "a sample of the epoch was skipped"
    dupes = len(seen) - N_SAMPLES
    if old == new:
        # the same world size with an offset 0 takes the exact path (the sampler advanced): padding as the uninterrupted run
        assert dupes == (-N_SAMPLES) % old
    else:
        assert dupes == (-(N_SAMPLES - consumed * BATCH * old)) % new, "more samples than the padding seen twice"
        # the ranks get equal shares, as from a DistributedSampler
        assert len({len(_resumed(new, r, _saved(old, consumed))[0]) for r in range(new)}) == 1


def test_a_regrouped_epoch_resumed_again_at_its_world_size_continues_exactly() -> None:
    """2 ranks -> 3 (the epoch dealt out again), killed after 1 batch, resumed at 3: the same samples
    as the 3-rank continuation that was never killed, in the same order on every rank."""
    first = _saved(2, 2)
    whole = [_resumed(3, r, first)[0] for r in range(3)]
    for r in range(3):
        part, st = _resumed(3, r, first, batches=1)
        assert st.offset == 2 * BATCH * 2
        again = _saved(3, st.consumed, offset=st.offset)
        rest, _ = _resumed(3, r, again)
        assert part + rest == whole[r]


def test_drop_last_drops_the_remainder_instead_of_padding() -> None:
    seen: list[int] = []
    for r in range(3):
        seen += _resumed(3, r, _saved(2, 1))[0]
    rest = N_SAMPLES - BATCH * 2
    assert len(seen) == rest + (-rest) % 3  # padded: the sampler above does not drop_last
    dl = _loader(3, 0, drop_last=True)
    st = LoaderState(dl, 0)
    st.pending = _saved(2, 1)
    got = [int(v) for (x,) in st.make_iter(dl, DataLoader.__iter__, torch.get_rng_state()) for v in x]
    assert len(got) == (rest - rest % 3) // 3


def _ckpt(ranks: int) -> Checkpoint:
    objs: dict[str, Any] = {"rng": {"torch": TensorLink("obj/rng/torch")}, "loaders": [{"epoch": 0, "consumed": 5}],
                            "ranks": [{"rng": {"torch": TensorLink(f"obj/ranks/{r}/rng/torch")}, "loaders": [{"epoch": 0, "consumed": 5, "who": r}]}
                                      for r in range(ranks)],
                            "distributed": {"world_size": ranks, "mode": "gather"}}
    return Checkpoint("native", Path("."), step=4, objects=objs)


def test_each_rank_takes_its_own_streams_and_position() -> None:
    for r in range(3):
        mine = for_rank(_ckpt(3), r, 3).objects
        assert mine["rng"]["torch"].name == f"obj/ranks/{r}/rng/torch"
        assert mine["loaders"][0]["who"] == r
        assert "ranks" not in mine and "distributed" not in mine


def test_a_rank_the_saved_run_did_not_have_keeps_its_seeded_streams() -> None:
    mine = for_rank(_ckpt(2), 3, 4).objects
    assert "rng" not in mine  # the live generators stay as the script seeded them
    assert mine["loaders"][0]["who"] == 1  # rank 3 mod 2


def test_a_one_process_checkpoint_on_many_ranks() -> None:
    ckpt = Checkpoint("native", Path("."), step=4, objects={"rng": {"torch": TensorLink("obj/rng/torch")}, "loaders": [{"epoch": 0}]})
    assert "rng" in for_rank(ckpt, 0, 2).objects
    assert "rng" not in for_rank(ckpt, 1, 2).objects
    assert for_rank(ckpt, 1, 2).objects["loaders"] == [{"epoch": 0}]


def test_the_writers_group_over_a_real_store() -> None:
    """Three threads as three ranks, each with its own connection to one TCPStore: broadcasts and
    all-gathers in the same order on every rank, many rounds (the keys of earlier rounds are deleted
    only once every rank has read them: a slow rank still finds what it needs)."""
    import time

    master = torch.distributed.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False, timeout=timedelta(seconds=30))
    port = master.port
    size, rounds = 3, 12
    results: dict[int, list[Any]] = {}
    errors: list[BaseException] = []

    def rank(r: int) -> None:
        try:
            client = torch.distributed.TCPStore("127.0.0.1", port, is_master=False, wait_for_workers=False, timeout=timedelta(seconds=30))
            g = StoreGroup(torch.distributed.PrefixStore("t", client), "w/", r, size, timeout_s=30)
            out = []
            for i in range(rounds):
                if r == 2 and i % 4 == 0:
                    time.sleep(0.05)  # a slow rank
                out.append(g.broadcast(("decided", i) if r == 0 else None))
                out.append(g.broadcast(("token", i) if r == 0 else None))
                out.append(g.all_gather((r, i)))
            results[r] = out
        except BaseException as exc:  # noqa: BLE001 - reported below
            errors.append(exc)

    threads = [threading.Thread(target=rank, args=(r,)) for r in range(size)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    assert not errors, errors
    want = []
    for i in range(rounds):
        want += [("decided", i), ("token", i), [(r, i) for r in range(size)]]
    assert results == {r: want for r in range(size)}
