"""Accelerate's ``load_state`` under FSDP2, at 3 ranks, on two save_state directories:
for integration/test_accelerate_fsdp_load.py.

    torchrun --nproc_per_node 3 accelerate_fsdp_train.py OWN RAVEX TRUE_STATE OUT_JSON

The model, optimizer, scheduler and the set-aside that turns FSDP2 on on CPU are
fixtures/_accelerate_fsdp.py's (imported, so both are one definition). For each
directory in turn (``OWN``: the one Accelerate wrote at 2 ranks; ``RAVEX``: Ravex's
3-rank output of it) every rank reseeds its RNG the same way, calls
``accelerator.load_state(dir)``, records what it loaded (the gathered weights and
optimizer state, the scheduler's state, its own RNG state and ``accelerator.step``),
then takes one training step on a fixed batch (dropout draws from the RNG just
loaded) and records the loss and the weights after it. Rank 0 writes ``OUT_JSON``:
each comparison as a boolean, and the facts behind them.
"""

from __future__ import annotations

import hashlib
import json
import sys
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from safetensors.torch import load_file

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "fixtures"))
import _accelerate_fsdp as F  # the fixture's own model and set-aside


def digest(t: torch.Tensor) -> str:
    return hashlib.sha256(t.contiguous().view(torch.uint8).numpy().tobytes()).hexdigest()[:16]


def equal(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> bool:
    return a.keys() == b.keys() and all(a[k].dtype == b[k].dtype and torch.equal(a[k], b[k]) for k in a)


def main() -> None:
    from accelerate.utils import set_seed

    own, ravex, true_path, out = Path(sys.argv[1]), Path(sys.argv[2]), Path(sys.argv[3]), Path(sys.argv[4])
    acc = F.accelerator()
    set_seed(0)
    model, opt, _, sched = F.prepared(acc)
    rank = acc.process_index
    data = F.dataset()
    rows = slice(rank * F.BATCH, (rank + 1) * F.BATCH)  # a fixed batch per rank
    x, y = data.tensors[0][rows], data.tensors[1][rows]
    runs: dict[str, dict[str, Any]] = {}
    for name, d in (("own", own), ("ravex", ravex)):
        set_seed(1000, device_specific=True)  # what a rank keeps where load_state finds no RNG file for it
        before = torch.get_rng_state().clone()
        acc.load_state(str(d))
        rng = torch.get_rng_state().clone()
        loaded = F.live_state(model, opt)
        rec: dict[str, Any] = {"loaded": loaded, "scheduler": sched.state_dict(), "step": acc.step,
                               "rng": digest(rng), "rng_kept": torch.equal(rng, before)}
        f = d / f"random_states_{rank}.pkl"
        # the test's own reading of the pickle Accelerate wrote (Ravex never unpickles it)
        rec["rng_from_file"] = f.exists() and torch.equal(rng, torch.load(f, weights_only=False)["torch_manual_seed"])
        rec["loss"] = F.train_step(acc, model, opt, sched, x, y)
        rec["after"] = F.live_state(model, opt)
        runs[name] = rec
    per_rank: list[Any] = [None] * acc.num_processes
    dist.all_gather_object(per_rank, {k: {f: runs[k][f] for f in ("rng", "rng_kept", "rng_from_file", "step", "loss")} for k in runs})
    if rank == 0:
        true = load_file(str(true_path))
        true_json = json.loads((true_path.parent / "true_state.json").read_text())
        o, r = runs["own"], runs["ravex"]
        result = {
            "world_size": acc.num_processes,
            "is_fsdp2": bool(acc.is_fsdp2),
            "own_loads_true_state": equal(o["loaded"], true),
            "ravex_loads_true_state": equal(r["loaded"], true),
            "loaded_keys": sorted(r["loaded"]),
            "scheduler_equal": o["scheduler"] == r["scheduler"] == true_json["lr_scheduler_state"],
            "scheduler": r["scheduler"],
            "losses": [o["loss"], r["loss"]],
            "after_step_equal": equal(o["after"], r["after"]),
            "after_step_moved": not equal(r["after"], true),
            "per_rank": per_rank,
        }
        out.write_text(json.dumps(result, indent=1, default=str))
    acc.wait_for_everyone()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
