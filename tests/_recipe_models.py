"""Models for tests/test_recipe.py, in a module a fresh interpreter can import (PYTHONPATH=tests):
what a checkpoint's recipe names, and what a loader must refuse."""

from __future__ import annotations

import torch
from torch import nn


class Net(nn.Module):
    """Keyword arguments of every kind a recipe records: ints, a str, a list, a dict, a tuple, a dtype."""

    def __init__(self, width: int = 16, depth: int = 2, act: str = "relu", sizes: list[int] | None = None,
                 extra: dict[str, float] | None = None, shape: tuple[int, int] = (4, 1), dtype: torch.dtype = torch.float32,
                 device: torch.device | None = None) -> None:
        super().__init__()
        self.width, self.depth, self.act = width, depth, act
        self.inp = nn.Linear(shape[0], width, dtype=dtype, device=device)
        self.body = nn.Sequential(*[nn.Linear(width, width, dtype=dtype, device=device) for _ in range(depth)])
        self.out = nn.Linear(width, shape[1], dtype=dtype, device=device)
        if sizes is not None:
            sizes.append(0)  # __init__ changes its argument: the recipe keeps what it was given

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        f = nn.functional.gelu if self.act == "gelu" else nn.functional.relu
        h = f(self.inp(x))
        for layer in self.body:
            h = f(layer(h))
        out: torch.Tensor = self.out(h)
        return out


class Blocks(nn.Module):
    """Built from live modules (not data): it declares its own recipe, a factory and its arguments."""

    def __init__(self, layers: list[nn.Module], width: int) -> None:
        super().__init__()
        self.width = width
        self.layers = nn.ModuleList(layers)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for layer in self.layers:
            x = torch.tanh(layer(x))
        return x

    def ravex_recipe(self) -> tuple[object, dict[str, object]]:
        return make_blocks, {"width": self.width, "depth": len(self.layers)}


def make_blocks(width: int, depth: int) -> Blocks:
    return Blocks([nn.Linear(width, width) for _ in range(depth)], width)


class Wraps(nn.Module):
    """A live module as a constructor argument: no recipe."""

    def __init__(self, inner: nn.Module) -> None:
        super().__init__()
        self.inner = inner

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out: torch.Tensor = self.inner(x)
        return out


class PositionalOnly(nn.Module):
    def __init__(self, width: int, /) -> None:
        super().__init__()
        self.lin = nn.Linear(4, width)


def unannotated(width: int):  # type: ignore[no-untyped-def]  # a function that does not say it returns a module
    return Net(width=width)


def not_a_module(width: int) -> Net:
    """Says it returns a module and does not."""
    return {"width": width}  # type: ignore[return-value]
