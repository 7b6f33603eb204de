"""Resume Lightning's DeepSpeed strategy on CPU from a checkpoint directory, under torchrun
(launched by integration/test_lightning_ds_strategy.py):

    torchrun --nproc_per_node N integration/lightning_ds_train.py MAX_STEPS CKPT_DIR STAGE OUT_DIR [CKPT_DIR STAGE OUT_DIR ...]

For each (CKPT_DIR, STAGE, OUT_DIR), one after the other in the same processes (one job, one
start-up): ``Trainer.fit(Tiny(groups=2), ckpt_path=CKPT_DIR)`` under ``CPUDeepSpeed``
(Lightning's ``DeepSpeedStrategy`` with its "only supported on CUDA GPUs" check set aside, as
in fixtures/_lightning_ds.py) at N ranks and ZeRO stage STAGE, to MAX_STEPS. Rank 0 writes
into OUT_DIR:

- ``start.safetensors`` / ``start.json``: the state the run resumed from, taken when training
  starts (after Lightning and DeepSpeed restored the checkpoint): the gathered fp32 masters
  (``model/<name>``) and Adam moments (``optim/<state>/<name>``), the callback's tensor; the
  global step, epoch, the scheduler's and the callback's state, the optimizer's lrs;
- ``end.safetensors`` / ``end.json``: the same after the last step.
"""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path
from typing import Any

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))
sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "fixtures"))
from _lightning_ds import cpu_deepspeed  # the fixtures' CPU DeepSpeed strategy: one set-aside, one place
from _workers import exit_after


def snapshot(trainer: Any, module: Any, counter: Any) -> tuple[dict[str, torch.Tensor], dict[str, Any]]:
    """The live state, gathered (collectives: every rank calls this)."""
    from deepspeed.utils import safe_get_full_fp32_param, safe_get_full_optimizer_state

    opt = trainer.strategy.deepspeed_engine.optimizer
    if hasattr(opt, "_lazy_init_hp_params_optimizer_state"):
        # ZeRO-1/2 links each parameter's optimizer-state fragment once, possibly before every
        # group has state (fixtures/README.md): relink with DeepSpeed's own routine, on every rank
        opt._hp_optimizer_states_linked = False
        opt._lazy_init_hp_params_optimizer_state()
    tensors: dict[str, torch.Tensor] = {}
    for n, p in module.named_parameters():
        tensors[f"model/{n}"] = safe_get_full_fp32_param(p).detach().clone()
        for key in ("exp_avg", "exp_avg_sq"):
            tensors[f"optim/{key}/{n}"] = safe_get_full_optimizer_state(p, key).detach().clone()
    tensors["callbacks/Counter/total"] = counter.total.detach().clone().reshape(())
    sched = trainer.lr_scheduler_configs[0].scheduler
    meta = {"global_step": trainer.global_step, "epoch": trainer.current_epoch, "count": counter.count,
            "lr_scheduler": {k: v for k, v in sched.state_dict().items() if isinstance(v, (int, float, list, bool))},
            "lrs": [g["lr"] for g in opt.param_groups], "world_size": trainer.world_size}
    return tensors, meta


def resume(ckpt: str, stage: int, out: Path, steps: int) -> None:
    import lightning as L
    from _lightning_model import Counter, Tiny, loader
    from safetensors.torch import save_file

    ws = int(os.environ["WORLD_SIZE"])

    class Record(L.Callback):
        def on_train_start(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
            self.save("start", trainer, pl_module)

        def on_train_end(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
            self.save("end", trainer, pl_module)

        def save(self, what: str, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
            tensors, meta = snapshot(trainer, pl_module, counter)
            if trainer.global_rank == 0:
                out.mkdir(parents=True, exist_ok=True)
                save_file(tensors, str(out / f"{what}.safetensors"))
                (out / f"{what}.json").write_text(json.dumps(meta))

    counter = Counter()
    L.seed_everything(1, verbose=False)  # not the fixture's seed: every restored value must come from the checkpoint
    strategy = cpu_deepspeed(stage, ws)  # the fixtures' set-aside of Lightning's CUDA-only check
    trainer = L.Trainer(max_steps=steps, accelerator="cpu", devices=ws, strategy=strategy, logger=False, enable_progress_bar=False,
                        enable_checkpointing=False, enable_model_summary=False, callbacks=[counter, Record()])
    trainer.fit(Tiny(groups=2), loader(), ckpt_path=ckpt)


def main() -> None:
    steps, runs = int(sys.argv[1]), sys.argv[2:]
    for i in range(0, len(runs), 3):
        resume(runs[i], int(runs[i + 1]), Path(runs[i + 2]), steps)


if __name__ == "__main__":
    exit_after(main)
