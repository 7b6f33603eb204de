"""The training script of integration/test_foreign_resume.py: the fixtures' model (fixtures/model.py:
TinyLM, AdamW in two parameter groups, LambdaLR warm-up) in plain PyTorch, decorated, with no
loading code of its own. Where it starts from is Ravex's business (``RAVEX_RESUME_FROM``).

    python foreign_train.py OPTS_JSON                 # one process
    torchrun --nproc_per_node N foreign_train.py OPTS_JSON

Options (JSON): ``tag``; ``wrap``: none, ddp, fsdp2 (or fsdp1, which a foreign resume refuses); ``precision``: fp32, bf16 (the model's
parameters in bf16) or bf16-mixed (FSDP2 keeps fp32 parameters and computes in bf16);
``steps``: the global step to stop at; ``noise``: the dataset draws from torch's random stream
at every read (the kill-and-resume case; the DeepSpeed comparison has none: DeepSpeed saves no
random state to continue).

The data: item i is row i % 6 of ``global_batch(i // 6)``, the batch the fixtures' runs trained
on at step i // 6; a DistributedSampler (no shuffle) deals it to the ranks, 6 / N rows each, so
every step's global batch is the fixtures' one at any world size.

Each rank appends one JSON line per optimizer step to ``log-<tag>-rank<r>.jsonl``: the step
(Ravex's count before it), the loss averaged over the ranks (and its ``float.hex()``), each
group's lr used, the Adam step counter of ``embed.weight`` after it, and the samples. Rank 0
writes ``out-<tag>.json`` at the end: the full weights' sha256 and the step.

``one_group``: the optimizer has one parameter group (the saved runs had two).
``dump``: at the first iteration, rank 0 writes ``restored-<tag>.safetensors``, the restored
weights and Adam moments, whole (see :func:`dump`).

``KILL_AT_STEP=k``: every rank, after logging step k, waits for its checkpoints and SIGKILLs
itself (rank 0 first: torchrun tears the others down).
"""

from __future__ import annotations

import json
import os
import signal
import sys
from datetime import timedelta
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "fixtures"))
sys.path.insert(0, str(Path(__file__).resolve().parent))  # python -P leaves the script's own directory out

import model as M
from dist_train import digest, full_weights  # the same weights' hash as integration/test_dist_runtime.py's script

import ravex

KILL_AT = int(os.environ.get("KILL_AT_STEP", "0"))


class Rows(torch.utils.data.Dataset[tuple[torch.Tensor, torch.Tensor, int]]):
    def __init__(self, steps: int, noise: bool):
        self.steps, self.noise = steps, noise

    def __len__(self) -> int:
        return self.steps * M.GLOBAL_BATCH

    def __getitem__(self, i: int) -> tuple[torch.Tensor, torch.Tensor, int]:
        x, y = M.global_batch(i // M.GLOBAL_BATCH)
        x, y = x[i % M.GLOBAL_BATCH].clone(), y[i % M.GLOBAL_BATCH]
        if self.noise:
            x[int(torch.randint(0, M.SEQ, ()))] = int(torch.randint(0, M.VOCAB, ()))
        return x, y, i


def dump(model: torch.nn.Module, opt: torch.optim.Optimizer, rank: int, path: str) -> None:
    """The state as restored, whole (gathered from the shards: every rank calls this): rank 0 saves
    ``model/<name>`` and ``optim/<state>/<name>``, the true_state.safetensors naming."""
    from safetensors.torch import save_file
    from torch.distributed.tensor import DTensor

    def whole(t: torch.Tensor) -> torch.Tensor:
        return (t.full_tensor() if isinstance(t, DTensor) else t).detach().contiguous().clone()

    out = {f"model/{k}": whole(v) for k, v in full_weights(model).items()}
    for name, p in model.named_parameters():
        for k, v in opt.state.get(p, {}).items():
            if k in ("exp_avg", "exp_avg_sq"):
                out[f"optim/{k}/{name}"] = whole(v)
    if rank == 0:
        out = {k: v.clone() for k, v in out.items()}  # no shared storage (the tied head)
        save_file(out, path)


@ravex.train_loop(preemption_handler=True)
def train(opts: dict[str, Any]) -> None:
    torch.set_num_threads(1)
    distributed = opts["wrap"] != "none"
    if distributed:
        dist.init_process_group("gloo", timeout=timedelta(seconds=60))
    rank, ws = (dist.get_rank(), dist.get_world_size()) if distributed else (0, 1)
    model: torch.nn.Module = M.build_model()
    if opts.get("precision") == "bf16":
        model = model.to(torch.bfloat16)
    if opts["wrap"] == "ddp":
        model = torch.nn.parallel.DistributedDataParallel(model)
    elif opts["wrap"] == "fsdp1":  # refused by a foreign resume (the test checks the error)
        from torch.distributed.fsdp import FullyShardedDataParallel

        model = FullyShardedDataParallel(model, device_id=torch.device("cpu"), use_orig_params=True)
    elif opts["wrap"] == "fsdp2":
        from torch.distributed.device_mesh import init_device_mesh
        from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

        mesh = init_device_mesh("cpu", (ws,))
        mp = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32) if opts.get("precision") == "bf16-mixed" else MixedPrecisionPolicy()
        for block in model.blocks:  # type: ignore[union-attr]
            fully_shard(block, mesh=mesh, mp_policy=mp)
        fully_shard(model, mesh=mesh, mp_policy=mp)
    inner = model.module if isinstance(model, torch.nn.parallel.DistributedDataParallel) else model
    if opts.get("one_group"):  # not the saved run's parameter groups: the resume must refuse it
        opt = torch.optim.AdamW([p for p in inner.parameters() if p.requires_grad], lr=M.DECAY_LR, foreach=False)
    else:
        opt = M.make_optimizer(inner)
    sched = M.make_scheduler(opt)
    torch.manual_seed(1000 + rank)  # the noise: each rank's own stream

    ds = Rows(int(opts["steps"]) + 2, bool(opts.get("noise")))
    sampler = torch.utils.data.distributed.DistributedSampler(ds, shuffle=False) if distributed else None
    loader = torch.utils.data.DataLoader(ds, batch_size=M.GLOBAL_BATCH // ws, sampler=sampler, shuffle=False)
    embed = next(p for n, p in inner.named_parameters() if n.split(".")[-2:] == ["embed", "weight"])
    steps = int(opts["steps"])
    first = True
    with open(f"log-{opts['tag']}-rank{rank}.jsonl", "a") as log:
        for epoch in range(10):
            if sampler is not None:
                sampler.set_epoch(epoch)
            for x, y, idx in loader:
                s = ravex.step()
                if opts.get("dump") and first:
                    dump(inner, opt, rank, f"restored-{opts['tag']}.safetensors")
                first = False
                if s >= steps:
                    break
                lrs = [g["lr"] for g in opt.param_groups]
                loss = M.loss_fn(model(x), y)
                loss.backward()
                opt.step()
                opt.zero_grad()
                sched.step()
                mean = loss.detach().float().clone()
                if distributed:
                    dist.all_reduce(mean)
                mean = mean / ws
                adam = opt.state[embed]["step"]
                log.write(json.dumps({"step": s, "loss": mean.item(), "hex": mean.item().hex(), "lrs": lrs,
                                      "adam_step": float(adam.full_tensor() if hasattr(adam, "full_tensor") else adam),
                                      "samples": idx.tolist()}) + "\n")
                log.flush()
                if KILL_AT and s == KILL_AT:
                    ravex.flush()
                    os.kill(os.getpid(), signal.SIGKILL)
            else:
                continue
            break
    weights = full_weights(model)
    if rank == 0:
        with open(f"out-{opts['tag']}.json", "w") as f:
            json.dump({"weights": digest(weights), "step": ravex.step()}, f)


if __name__ == "__main__":
    train(json.loads(sys.argv[1]))
    if dist.is_initialized():
        dist.barrier()
        dist.destroy_process_group()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)  # past gloo's occasional abort in its teardown at interpreter exit (as in dist_train.py)
