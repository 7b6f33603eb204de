"""The dataset position after a resume, in-process: an IterableDataset with its own
state_dict(), a DistributedSampler told its epoch by the script's own loop, and the
samplers people use. Each run is stopped part-way (its last checkpoint is taken
when the decorated function returns) and called again; the batches seen across
both calls must be the batches of one uninterrupted run."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
import torch
from torch.utils.data import (
    BatchSampler,
    DataLoader,
    DistributedSampler,
    RandomSampler,
    SubsetRandomSampler,
    TensorDataset,
    WeightedRandomSampler,
)

import ravex


class Counting(torch.utils.data.IterableDataset[torch.Tensor]):
    """A stream that keeps its own position (as Hugging Face's IterableDataset does)."""

    def __init__(self) -> None:
        self.pos = 0

    def __iter__(self) -> Iterator[torch.Tensor]:
        while self.pos < 40:
            self.pos += 1
            yield torch.tensor([float(self.pos)])

    def state_dict(self) -> dict[str, int]:
        return {"pos": self.pos}

    def load_state_dict(self, sd: dict[str, int]) -> None:
        self.pos = sd["pos"]


def _trainer(make_loader: Callable[[], tuple[DataLoader[Any], Any]], seen: list[list[float]]) -> Callable[[int], int]:
    @ravex.train_loop
    def run(limit: int) -> int:
        torch.manual_seed(0)
        model = torch.nn.Linear(1, 1)
        opt = torch.optim.SGD(model.parameters(), lr=0.01)
        loader, sampler = make_loader()
        n = 0
        for epoch in range(6):
            if sampler is not None:
                sampler.set_epoch(epoch)
            for batch in loader:
                x = batch[0] if isinstance(batch, (list, tuple)) else batch
                seen.append(x.flatten().tolist())
                model(x.reshape(-1, 1)).sum().backward()
                opt.step()
                opt.zero_grad()
                n += 1
                if n == limit:
                    return ravex.step()
        return ravex.step()
    return run


def _same_as_uninterrupted(monkeypatch: pytest.MonkeyPatch, make_loader: Callable[[], tuple[DataLoader[Any], Any]], stop: int, total: int) -> None:
    whole: list[list[float]] = []
    monkeypatch.setenv("RAVEX_ENABLED", "0")
    _trainer(make_loader, whole)(total)
    monkeypatch.delenv("RAVEX_ENABLED")
    seen: list[list[float]] = []
    run = _trainer(make_loader, seen)
    assert run(stop) == stop
    assert run(total - stop) == total
    assert seen == whole


_DATA = TensorDataset(torch.arange(30, dtype=torch.float32))


def test_a_stateful_iterable_dataset_continues_from_its_own_state(env: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    _same_as_uninterrupted(monkeypatch, lambda: (DataLoader(Counting(), batch_size=3), None), stop=5, total=11)


def test_a_stateful_iterable_dataset_in_workers_is_replayed(env: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    _same_as_uninterrupted(monkeypatch, lambda: (DataLoader(Counting(), batch_size=3, num_workers=2), None), stop=5, total=11)


def _distributed() -> tuple[DataLoader[Any], Any]:
    sampler = DistributedSampler(_DATA, num_replicas=2, rank=0, shuffle=True, seed=5)
    return DataLoader(_DATA, batch_size=4, sampler=sampler), sampler


def test_a_distributed_sampler_stays_on_the_true_epoch(env: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    # 15 items a rank, 4 batches an epoch: stopped in the second epoch, whose set_epoch(0)
    # after the resume is the script's own loop starting again.
    _same_as_uninterrupted(monkeypatch, _distributed, stop=6, total=14)


@pytest.mark.parametrize("kind", ["weighted", "subset", "batch_sampler", "own_generator", "workers_batch_sampler"])
def test_samplers_resume_at_their_exact_position(kind: str, env: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    def make() -> tuple[DataLoader[Any], Any]:
        if kind == "weighted":
            return DataLoader(_DATA, batch_size=4, sampler=WeightedRandomSampler(torch.linspace(0.1, 1, 30).tolist(), 24)), None
        if kind == "subset":
            return DataLoader(_DATA, batch_size=4, sampler=SubsetRandomSampler(list(range(0, 30, 2)))), None
        if kind == "own_generator":
            g = torch.Generator().manual_seed(11)
            return DataLoader(_DATA, batch_size=4, sampler=RandomSampler(_DATA, generator=g)), None
        bs = BatchSampler(RandomSampler(_DATA), batch_size=5, drop_last=False)
        return DataLoader(_DATA, batch_sampler=bs, num_workers=2 if kind == "workers_batch_sampler" else 0), None
    # stopped in the second epoch or later: the generator's state at the epoch's start must come back, not a fresh seed
    _same_as_uninterrupted(monkeypatch, make, stop=10, total=17)


class _OwnOrder(torch.utils.data.Sampler[int]):
    """A user-written sampler keeping its generator under a name of its own."""

    def __init__(self, n: int):
        self.n = n
        self.rng_for_order = torch.Generator().manual_seed(21)

    def __iter__(self) -> Iterator[int]:
        yield from torch.randperm(self.n, generator=self.rng_for_order).tolist()

    def __len__(self) -> int:
        return self.n


def test_a_user_written_sampler_with_its_own_generator_resumes_exactly(env: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    _same_as_uninterrupted(monkeypatch, lambda: (DataLoader(_DATA, batch_size=4, sampler=_OwnOrder(30)), None), stop=10, total=17)


class _NumpyOrder(torch.utils.data.Sampler[int]):
    def __init__(self, n: int):
        import numpy as np

        self.n, self.rng = n, np.random.default_rng(3)

    def __iter__(self) -> Iterator[int]:
        yield from (int(i) for i in self.rng.permutation(self.n))

    def __len__(self) -> int:
        return self.n


def test_a_sampler_drawing_from_numpy_is_named_at_start(env: Path, caplog: pytest.LogCaptureFixture) -> None:
    import logging

    logging.getLogger("ravex").addHandler(caplog.handler)
    try:
        _trainer(lambda: (DataLoader(_DATA, batch_size=4, sampler=_NumpyOrder(30)), None), [])(2)
    finally:
        logging.getLogger("ravex").removeHandler(caplog.handler)
    assert any("_NumpyOrder.rng (numpy.random._generator.Generator)" in r.getMessage() for r in caplog.records)


class _Noisy(torch.utils.data.Dataset[torch.Tensor]):
    """Each item drawn anew in whichever process loads it."""

    def __len__(self) -> int:
        return 30

    def __getitem__(self, i: int) -> torch.Tensor:
        return torch.tensor([float(i)]) + torch.rand(1)


@pytest.mark.filterwarnings("ignore:'set_vital' is deprecated")  # torchdata 0.11 calls it on import, under torch 2.15
@pytest.mark.parametrize("workers", [0, 2])
def test_torchdata_stateful_dataloader_resumes_exactly(workers: int, env: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    # StatefulDataLoader defines its own __iter__ (patched too); Ravex replays it like any DataLoader,
    # so the noise drawn in __getitem__ continues too, which the loader's own state_dict() does not give.
    from torchdata.stateful_dataloader import StatefulDataLoader

    _same_as_uninterrupted(monkeypatch, lambda: (StatefulDataLoader(_Noisy(), batch_size=4, shuffle=True, num_workers=workers), None),
                           stop=10, total=17)
