"""LightningModules for tests/test_lightning.py, importable by name: ``load_from_checkpoint``
rebuilds the class from the checkpoint's hyper-parameters, so the class must live in a module.

- :class:`Tiny`: two Linear layers, ``save_hyperparameters()``, Adam with a StepLR scheduler;
  ``groups=2`` puts the biases in a second param group with their own lr and no weight decay.
- :class:`TwoOptimizers`: manual optimization with Adam and SGD (two entries in ``optimizer_states``);
- :class:`Counter`: a callback whose state holds a tensor (Lightning saves it under ``callbacks``);
- :class:`LitTinyLM`: the fixtures' TinyLM (fixtures/model.py) with its parameters at the top
  level of the LightningModule, so its ``state_dict`` names are the fixtures' own names.
"""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Any

import lightning as L
import torch
from torch import nn
from torch.utils.data import DataLoader, Dataset

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "fixtures"))
from model import build_model, make_optimizer  # fixtures/ is no package

IN, HIDDEN, OUT = 5, 7, 3


class Samples(Dataset[tuple[torch.Tensor, torch.Tensor]]):
    """Random data, a function of the sample's index only (a resumed run sees what the first run would have)."""

    def __init__(self, n: int = 64) -> None:
        self.n = n

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, i: int) -> tuple[torch.Tensor, torch.Tensor]:
        g = torch.Generator().manual_seed(1000 + i)
        return torch.randn(IN, generator=g), torch.randn(OUT, generator=g)


def loader() -> DataLoader[tuple[torch.Tensor, torch.Tensor]]:
    return DataLoader(Samples(), batch_size=4, shuffle=False, num_workers=0)


class Tiny(L.LightningModule):
    def __init__(self, hidden: int = HIDDEN, lr: float = 1e-2, groups: int = 1) -> None:
        super().__init__()
        self.save_hyperparameters()
        self.net = nn.Sequential(nn.Linear(IN, hidden), nn.Tanh(), nn.Linear(hidden, OUT))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out: torch.Tensor = self.net(x)
        return out

    def training_step(self, batch: tuple[torch.Tensor, torch.Tensor], batch_idx: int) -> torch.Tensor:
        x, y = batch
        return nn.functional.mse_loss(self(x), y)

    def configure_optimizers(self) -> Any:
        lr = self.hparams["lr"]
        if self.hparams["groups"] == 2:
            weights = [p for n, p in self.named_parameters() if n.endswith("weight")]
            biases = [p for n, p in self.named_parameters() if n.endswith("bias")]
            params: Any = [{"params": weights, "weight_decay": 0.1}, {"params": biases, "lr": lr / 2, "weight_decay": 0.0}]
        else:
            params = self.parameters()
        optimizer = torch.optim.Adam(params, lr=lr, foreach=False)
        scheduler = torch.optim.lr_scheduler.StepLR(optimizer, step_size=2, gamma=0.5)
        return {"optimizer": optimizer, "lr_scheduler": {"scheduler": scheduler, "interval": "step"}}


class TwoOptimizers(L.LightningModule):
    def __init__(self, hidden: int = HIDDEN) -> None:
        super().__init__()
        self.save_hyperparameters()
        self.automatic_optimization = False
        self.a = nn.Linear(IN, hidden)
        self.b = nn.Linear(hidden, OUT)

    def training_step(self, batch: tuple[torch.Tensor, torch.Tensor], batch_idx: int) -> None:
        x, y = batch
        first, second = self.optimizers()  # type: ignore[misc]
        loss = nn.functional.mse_loss(self.b(torch.tanh(self.a(x))), y)
        first.zero_grad()
        second.zero_grad()
        self.manual_backward(loss)
        first.step()
        second.step()

    def configure_optimizers(self) -> Any:
        return [torch.optim.Adam(self.a.parameters(), lr=1e-2, foreach=False),
                torch.optim.SGD(self.b.parameters(), lr=0.1, momentum=0.9, foreach=False)]


class Counter(L.Callback):
    """Counts the batches and sums the losses it saw: callback state with a tensor in it."""

    def __init__(self) -> None:
        self.count = 0
        self.total = torch.zeros(())

    def on_train_batch_end(self, trainer: L.Trainer, pl_module: L.LightningModule, outputs: Any, batch: Any, batch_idx: int) -> None:
        self.count += 1
        if isinstance(outputs, dict) and "loss" in outputs:
            self.total = self.total + outputs["loss"].detach()

    def state_dict(self) -> dict[str, Any]:
        return {"count": self.count, "total": self.total.clone()}

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        self.count = state_dict["count"]
        self.total = state_dict["total"].clone()


class LitTinyLM(L.LightningModule):
    """TinyLM's modules and parameters as the LightningModule's own (names ``embed.weight``, ``blocks.0...``)."""

    def __init__(self) -> None:
        super().__init__()
        lm = build_model()
        for name, child in lm.named_children():
            self.add_module(name, child)
        self.pos_embed = lm.pos_embed
        self.logit_gain = lm.logit_gain
        self.register_buffer("out_scale", lm.out_scale.clone())
        self.register_buffer("causal_mask", lm.causal_mask.clone(), persistent=False)
        self.head.weight = self.embed.weight

    def training_step(self, batch: tuple[torch.Tensor, torch.Tensor], batch_idx: int) -> torch.Tensor:
        raise NotImplementedError  # loaded, never trained

    def configure_optimizers(self) -> Any:
        return make_optimizer(self)


__all__ = ["Counter", "LitTinyLM", "Samples", "Tiny", "TwoOptimizers", "loader"]
