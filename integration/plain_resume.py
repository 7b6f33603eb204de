"""The training script of integration/test_resume_from_frameworks.py: a plain PyTorch loop,
decorated, that builds the model, optimizer and scheduler a framework run of
integration/framework_train.py built, and trains on the same data. It has no loading code:
``RAVEX_RESUME_FROM`` points it at the framework's own checkpoint directory.

    python -P plain_resume.py OPTS_JSON OUTDIR

Options (JSON): ``kind`` (``hf``, ``lightning``, ``accelerate``: the framework_train.py run it
continues, with ``noise`` off and one micro-batch a step; ``titan``: see below), ``tag``, ``steps``
(the global step to stop at).

- ``hf``: the GPT-2 of framework_train.py, AdamW in the Trainer's two groups (decay, no decay),
  the Trainer's linear schedule with 2 warm-up steps over ``steps`` (``one_group``: one group, as
  DeepSpeed builds the Trainer's optimizer under DeepSpeed);
- ``lightning``: the MLP as the LightningModule's ``net`` (its names ``net.0.weight``, ...), Adam
  and a StepLR, as ``configure_optimizers`` made them;
- ``accelerate``: the MLP itself (Accelerate saves the unwrapped model's names), Adam, StepLR;
- ``lightning_ds``, ``accelerate_fsdp``: the models, optimizers and schedulers of the fixtures
  ``lightning_ds{2,3}_ws2`` (tests/_lightning_model.py's ``Tiny(groups=2)``, as its
  ``configure_optimizers`` makes them) and ``accelerate_fsdp2_ws2`` (fixtures/_accelerate_fsdp.py),
  one process with the 2-rank source's global batch (8, 6);
- ``titan``: the MLP, AdamW in two groups and a warm-up ``LambdaLR`` of a ``functools.partial``, as
  torchtitan builds them. With ``save_at`` (run with ``RAVEX_ENABLED=0``) it writes, after that
  step, a DCP in torchtitan's layout at ``OUTDIR/titan-<tag>/step-<k>``: the model's keys at the
  top level, the ``optimizer`` flattened, ``lr_scheduler`` and ``train_state`` (``step``,
  ``ntokens_seen``, and ``global_avg_losses`` as torchtitan's older versions keep it: a
  torch.save of a list in a ``BytesIO``).

Data: framework_train.py's datasets in order (batch 4, no shuffle); a resumed run's loader is moved
on by Ravex. One JSON line per optimizer step in ``OUTDIR/log-<tag>.jsonl``: ``step``, ``loss``
(``float.hex()``), ``lr`` (the first group's after the scheduler's step). At its first batch it
writes ``OUTDIR/restored-<tag>.json``: the scheduler's state and each parameter group's ``lr``
and Adam step count as they are then (put in by Ravex, when resumed); with ``dump``, also
``OUTDIR/restored-<tag>.safetensors``, the state then (:func:`dump`). At the end,
``OUTDIR/out-<tag>.json``: ``weights``, the final parameters' digest as framework_train.py makes it.
"""

from __future__ import annotations

import functools
import io
import json
import sys
from pathlib import Path
from typing import Any

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))  # python -P leaves the script's own directory out
sys.path[1:1] = [str(Path(__file__).resolve().parents[1] / d) for d in ("tests", "fixtures")]  # the fixtures' models
from framework_train import BATCH, VOCAB, Samples, Tokens, digest, hexf, mlp

import ravex


class Lit(torch.nn.Module):
    """The LightningModule's parameters under their names, without Lightning."""

    def __init__(self) -> None:
        super().__init__()
        self.net = mlp(False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out: torch.Tensor = self.net(x)
        return out


def warmup(step: int, warm: int) -> float:
    return min(1.0, (step + 1) / warm)


def build(kind: str, steps: int, one_group: bool = False) -> tuple[torch.nn.Module, torch.optim.Optimizer, Any, torch.utils.data.Dataset[Any]]:
    data: torch.utils.data.Dataset[Any]
    if kind == "hf":
        from transformers import GPT2Config, GPT2LMHeadModel, get_linear_schedule_with_warmup

        model: torch.nn.Module = GPT2LMHeadModel(GPT2Config(n_layer=2, n_embd=16, n_head=2, vocab_size=VOCAB, n_positions=16,
                                                            bos_token_id=0, eos_token_id=0, resid_pdrop=0.0, embd_pdrop=0.0,
                                                            attn_pdrop=0.0))
        # the Trainer's groups: weight decay for all but biases and normalisation weights
        no_decay = [n for n, m in model.named_modules() if isinstance(m, torch.nn.LayerNorm)]
        decay = [p for n, p in model.named_parameters() if not n.endswith("bias") and n.rpartition(".")[0] not in no_decay]
        rest = [p for n, p in model.named_parameters() if n.endswith("bias") or n.rpartition(".")[0] in no_decay]
        groups: list[dict[str, Any]] = [{"params": decay, "weight_decay": 0.0}, {"params": rest, "weight_decay": 0.0}]
        if one_group:  # the Trainer under DeepSpeed: DeepSpeed builds its AdamW over all parameters
            groups = [{"params": decay + rest, "weight_decay": 0.01}]
        opt: torch.optim.Optimizer = torch.optim.AdamW(groups, lr=1e-3)
        return model, opt, get_linear_schedule_with_warmup(opt, 2, steps), Tokens(False)  # type: ignore[no-untyped-call]
    if kind == "lightning_ds":  # the fixtures lightning_ds{2,3}_ws2: tests/_lightning_model.py's Tiny(groups=2)
        from _lightning_model import Samples as LitSamples  # type: ignore[import-not-found]
        from _lightning_model import Tiny

        lit = Tiny(groups=2)
        made = lit.configure_optimizers()
        return lit, made["optimizer"], made["lr_scheduler"]["scheduler"], LitSamples()
    if kind == "accelerate_fsdp":  # the fixture accelerate_fsdp2_ws2 (fixtures/_accelerate_fsdp.py)
        import _accelerate_fsdp as A  # type: ignore[import-not-found]

        tiny = A.Tiny()
        opt = torch.optim.AdamW(A.groups(tiny), betas=(0.9, 0.95), eps=1e-8)
        return tiny, opt, A.scheduler(opt), A.dataset()
    model = Lit() if kind == "lightning" else mlp(False)
    data = Samples(False)
    if kind == "titan":
        decay = [p for n, p in model.named_parameters() if n.endswith("weight")]
        rest = [p for n, p in model.named_parameters() if n.endswith("bias")]
        opt = torch.optim.AdamW([{"params": decay, "weight_decay": 0.1}, {"params": rest, "weight_decay": 0.0}], lr=5e-3)
        return model, opt, torch.optim.lr_scheduler.LambdaLR(opt, functools.partial(warmup, warm=3)), data
    opt = torch.optim.Adam(model.parameters(), lr=1e-2)
    return model, opt, torch.optim.lr_scheduler.StepLR(opt, step_size=5, gamma=0.7), data


def loss_of(kind: str, model: torch.nn.Module, batch: Any) -> torch.Tensor:
    if kind == "lightning_ds":
        lit: Any = model
        found: torch.Tensor = lit.training_step(batch, 0)
        return found
    if kind == "hf":  # divided by the labels before the shift, as the Trainer's num_items_in_batch is
        out: torch.Tensor = model(**batch, num_items_in_batch=(batch["labels"] != -100).sum()).loss
        return out
    x, y = batch
    return torch.nn.functional.mse_loss(model(x), y)


def titan_save(path: Path, model: torch.nn.Module, opt: torch.optim.Optimizer, sched: Any, step: int, losses: list[float]) -> None:
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_state_dict

    msd, osd = get_state_dict(model, opt, options=StateDictOptions(flatten_optimizer_state_dict=True))
    history = io.BytesIO()
    torch.save(losses, history)
    state: dict[str, Any] = {**msd, "optimizer": osd, "lr_scheduler": sched.state_dict(),
                             "train_state": {"step": step, "ntokens_seen": step * BATCH * 8, "global_avg_losses": history}}
    dcp.save(state, checkpoint_id=str(path))  # type: ignore[attr-defined]
    # what the scheduler was, for the test to compare with what a resume put in
    (path.parent / f"scheduler-{step}.json").write_text(json.dumps({k: v for k, v in sched.state_dict().items() if k != "lr_lambdas"}))


def dump(model: torch.nn.Module, opt: torch.optim.Optimizer, path: Path) -> None:
    """The state as put in: ``model/<name>`` (the state dict: parameters and buffers) and
    ``optim/<state>/<name>`` (Adam's moments), the fixtures' true_state naming."""
    from safetensors.torch import save_file

    out = {f"model/{n}": t.detach().clone() for n, t in model.state_dict().items()}
    names = {id(p): n for n, p in model.named_parameters()}
    for p, st in opt.state.items():
        for k, v in st.items():
            if k in ("exp_avg", "exp_avg_sq"):
                out[f"optim/{k}/{names[id(p)]}"] = v.detach().clone()
    save_file(out, str(path))


def main() -> None:
    opts: dict[str, Any] = json.loads(sys.argv[1])
    out = Path(sys.argv[2])
    kind, tag, steps = opts["kind"], opts["tag"], opts["steps"]
    torch.set_num_threads(1)
    log = (out / f"log-{tag}.jsonl").open("a")

    built: dict[str, torch.nn.Module] = {}

    @ravex.train_loop()  # type: ignore[untyped-decorator]
    def train() -> None:
        torch.manual_seed(0)
        model, opt, sched, data = build(kind, steps, bool(opts.get("one_group")))
        built["model"] = model
        batch_size = {"lightning_ds": 8, "accelerate_fsdp": 6}.get(kind, BATCH)  # one process: the 2-rank source's global batch
        loader = torch.utils.data.DataLoader(data, batch_size=batch_size, shuffle=False)
        own, losses = 0, []
        while own < steps:
            for batch in loader:
                if own == 0:
                    first = opt.param_groups[0]["params"][0]
                    seen = {"scheduler": {k: v for k, v in sched.state_dict().items() if k != "lr_lambdas"},
                            "lrs": [g["lr"] for g in opt.param_groups], "adam_step": float(opt.state.get(first, {}).get("step", 0))}
                    (out / f"restored-{tag}.json").write_text(json.dumps(seen))
                    if opts.get("dump"):
                        dump(model, opt, out / f"restored-{tag}.safetensors")
                loss = loss_of(kind, model, batch)
                loss.backward()  # type: ignore[no-untyped-call]
                if kind == "hf":  # the Trainer's max_grad_norm
                    torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
                opt.step()
                sched.step()
                opt.zero_grad()
                own += 1
                step = ravex.step() or own
                losses.append(float(loss))
                log.write(json.dumps({"step": step, "loss": hexf(loss), "lr": hexf(opt.param_groups[0]["lr"])}) + "\n")
                log.flush()
                if own == opts.get("save_at"):
                    titan_save(out / f"titan-{tag}" / f"step-{own}", model, opt, sched, own, losses)
                if step >= steps:
                    return

    train()
    # the final weights as framework_train.py digests them (the same parameter names, in order)
    (out / f"out-{tag}.json").write_text(json.dumps({"weights": digest(built["model"])}) + "\n")


if __name__ == "__main__":
    main()
