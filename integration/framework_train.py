"""The training script of integration/test_frameworks.py: one tiny run driven by a framework (the
Hugging Face ``Trainer``, a Lightning ``Trainer``, or a plain loop over ``Accelerator.prepare``),
decorated with ``@ravex.train_loop(preemption_handler=True)`` and nothing else of Ravex's.

    python -P framework_train.py OPTS_JSON OUTDIR

Options (JSON):

- ``framework``: ``hf``, ``lightning`` or ``accelerate``; ``tag``: names the files written;
- ``noise``: randomness on: dropout 0.1 in the model, shuffled data (HF: its own seedable random
  sampler; Lightning and Accelerate: ``DataLoader(shuffle=True)``) and a dataset whose
  ``__getitem__`` draws from torch's global generator (HF: labels masked at random; the others:
  ``0.05 * torch.randn`` added to the input). Off: none of the three (HF: the sequential sampler);
- ``workers``: the DataLoader's ``num_workers`` (with 2 the augmentation runs in the workers);
- ``ga``: gradient accumulation steps (default 2); ``steps``: the optimizer steps to train (default 40);
- with ``noise`` the HF Trainer also evaluates every 8 steps (``eval_strategy="steps"``) and Lightning
  validates every 8 training batches (at most 3 batches of a 10-item set, its last batch partial,
  after its sanity check of ``sanity`` batches, default 2: Lightning's default); their datasets draw
  at random too, between two training steps. The LightningModule holds a torchmetrics metric and
  logs with ``self.log`` (``sync_dist=True`` in validation), as users' modules do;
- ``lora`` (HF only): the GPT-2 wrapped in a PEFT LoRA adapter on its attention (``lora_dropout``
  0.1 with ``noise``), as a user fine-tunes an adapter;
- ``lazy``: only the framework's top-level package is imported before the decorated call (the
  default imports ``transformers.trainer`` as well); the HF script touches ``transformers.Trainer``
  first after its model is built, so transformers loads its trainer module then;
- ``fw_ckpt``: the framework's own checkpointing on as well (HF: ``save_strategy="steps"``,
  ``save_steps=10``; Lightning: ``enable_checkpointing=True``, a ``ModelCheckpoint`` every epoch;
  Accelerate: ``accelerator.save_state`` every 5 steps); ``fw_every``: that checkpoint every so many
  steps instead, every one kept (Lightning: ``ModelCheckpoint(every_n_train_steps=..., save_top_k=-1)``
  in ``lightning-<tag>/checkpoints/``; the sources of integration/test_resume_from_frameworks.py).

The budget is the framework's own (HF and Lightning: ``max_steps``). The Accelerate loop is
``for epoch in range(100)`` over the prepared loader and ends by Ravex's ``max_steps`` (the test
sets ``RAVEX_MAX_STEPS``); with ``RAVEX_ENABLED=0`` nothing of Ravex stops it, so it breaks out
itself after ``steps`` steps.

The data: 60 items in batches of 4, 15 batches an epoch (odd: an epoch is not a whole number of
accumulation windows, and each framework ends an epoch with a step of one micro-batch: 8 steps
an epoch with ``ga`` 2), so 40 steps cross five epochs. Each item is a function of its index,
plus the augmentation's draw when ``noise`` is on.

It appends one JSON line per optimizer step to ``OUTDIR/log-<tag>.jsonl``: ``step`` (HF
``state.global_step``, Lightning ``trainer.global_step``, Accelerate ``ravex.step()``, or the
loop's own count with Ravex off), ``loss`` (the micro-batch losses of that step, in order, each
``float.hex()``: a shifted batch shows), ``lr`` (the first group's after the step and the
scheduler's step, ``float.hex()``) and ``epoch``, the framework's own epoch (HF ``repr(state.epoch)``,
Lightning ``trainer.current_epoch``, Accelerate the prepared loader's ``iteration``). At the end
it writes ``OUTDIR/out-<tag>.json``: ``weights`` (sha256 over ``named_parameters()`` in order:
each name, then the raw bytes), ``step`` (the last step logged) and the framework's own
progress (HF ``global_step``, ``epoch``, ``log_history``: the length of ``state.log_history``;
Lightning ``global_step``, ``current_epoch``; Accelerate ``epoch``: the loader's at the last step).

``KILL_AT_STEP=k``: right after logging step k, ``ravex.flush()`` and SIGKILL itself.

Under torchrun (``WORLD_SIZE`` > 1; gloo on CPU: integration/test_frameworks_dist.py) each rank
writes its own files, ``log-<tag>-r<RANK>.jsonl`` and ``out-<tag>-r<RANK>.json``, with its own
micro-batch losses; every rank kills itself after step k. HF and Accelerate take the distributed
environment up themselves (``use_cpu=True``, ``Accelerator(cpu=True)``: gloo); Lightning is given
``devices=WORLD_SIZE, strategy="ddp"``.
"""

from __future__ import annotations

import hashlib
import importlib
import json
import os
import signal
import sys
from pathlib import Path
from typing import Any

import torch

import ravex

KILL_AT = int(os.environ.get("KILL_AT_STEP", "0"))
WORLD = int(os.environ.get("WORLD_SIZE", "1"))
RANK_SUFFIX = f"-r{os.environ.get('RANK', '0')}" if WORLD > 1 else ""  # the files' names: one process's carry none
RAVEX_ON = os.environ.get("RAVEX_ENABLED", "1").strip().lower() not in ("0", "false", "no", "off")  # as ravex_runtime.config reads it
ITEMS, BATCH, VOCAB, SEQ, FEATURES, VAL_ITEMS = 60, 4, 64, 8, 8, 10
# imported before the decorated call, as a script imports them at its top
IMPORTS = {"hf": ("transformers", "transformers.trainer"), "lightning": ("lightning", "lightning.pytorch"),
           "accelerate": ("accelerate", "accelerate.data_loader")}


class Tokens(torch.utils.data.Dataset[dict[str, torch.Tensor]]):
    """For the GPT-2: the tokens of item i are fixed by i; with noise a quarter of the labels is masked at random."""

    def __init__(self, noise: bool):
        self.noise = noise

    def __len__(self) -> int:
        return ITEMS

    def __getitem__(self, i: int) -> dict[str, torch.Tensor]:
        x = torch.randint(0, VOCAB, (SEQ,), generator=torch.Generator().manual_seed(i))
        labels = x.clone()
        if self.noise:
            labels[torch.rand(SEQ) < 0.25] = -100  # torch's global generator (a worker's, with workers)
        return {"input_ids": x, "labels": labels}


class Samples(torch.utils.data.Dataset[tuple[torch.Tensor, torch.Tensor]]):
    """For the MLP: (x, y) fixed by i; with noise, x + 0.05 * randn from torch's global generator."""

    def __init__(self, noise: bool, items: int = ITEMS):
        self.noise, self.items = noise, items

    def __len__(self) -> int:
        return self.items

    def __getitem__(self, i: int) -> tuple[torch.Tensor, torch.Tensor]:
        g = torch.Generator().manual_seed(1000 + i)
        x, y = torch.randn(FEATURES, generator=g), torch.randn(1, generator=g)
        if self.noise:
            x = x + 0.05 * torch.randn(FEATURES)
        return x, y


def mlp(noise: bool) -> torch.nn.Sequential:
    layers: list[torch.nn.Module] = [torch.nn.Linear(FEATURES, 16), torch.nn.ReLU()]
    if noise:
        layers.append(torch.nn.Dropout(0.1))
    layers.append(torch.nn.Linear(16, 1))
    return torch.nn.Sequential(*layers)


def hexf(t: torch.Tensor | float) -> str:
    return float(t.detach() if isinstance(t, torch.Tensor) else t).hex()


class Log:
    """One JSON line per optimizer step; SIGKILL right after step ``KILL_AT_STEP``."""

    def __init__(self, path: Path):
        self.file = path.open("a")
        self.last: int = 0
        self.epoch: Any = None

    def step(self, step: int, losses: list[str], lr: float, epoch: Any) -> None:
        self.file.write(json.dumps({"step": step, "loss": losses, "lr": hexf(lr), "epoch": epoch}) + "\n")
        self.file.flush()
        self.last, self.epoch = step, epoch
        if KILL_AT and step == KILL_AT:
            ravex.flush()
            os.kill(os.getpid(), signal.SIGKILL)


def digest(model: torch.nn.Module) -> str:
    h = hashlib.sha256()
    for name, p in model.named_parameters():
        h.update(name.encode())
        h.update(p.detach().contiguous().view(torch.uint8).numpy().tobytes())
    return h.hexdigest()


def train_hf(opts: dict[str, Any], out: Path, log: Log, final: dict[str, Any]) -> None:
    import transformers

    set_seed = transformers.set_seed
    set_seed(0)
    p = 0.1 if opts["noise"] else 0.0
    # The model first, then the Trainer: with ``lazy`` nothing has imported transformers.trainer yet,
    # and transformers loads it at the first touch of transformers.Trainer, below (as a user's script does).
    model = transformers.GPT2LMHeadModel(transformers.GPT2Config(n_layer=2, n_embd=16, n_head=2, vocab_size=VOCAB, n_positions=16, bos_token_id=0,
                                                                 eos_token_id=0, resid_pdrop=p, embd_pdrop=p, attn_pdrop=p))
    if opts["lora"]:  # a LoRA adapter on the attention (PEFT): the base frozen, the adapter trained, with its own dropout
        import peft

        model = peft.get_peft_model(model, peft.LoraConfig(r=4, lora_alpha=8, target_modules=["c_attn"], fan_in_fan_out=True,
                                                           lora_dropout=0.1 if opts["noise"] else 0.0))
    micro: list[str] = []

    class Recording(transformers.Trainer):  # type: ignore[misc]
        def training_step(self, model: torch.nn.Module, inputs: dict[str, Any], num_items_in_batch: Any = None) -> torch.Tensor:
            loss: torch.Tensor = super().training_step(model, inputs, num_items_in_batch)
            micro.append(hexf(loss))  # as the Trainer returns it: normalised for the accumulation
            return loss

    class StepLog(transformers.TrainerCallback):  # type: ignore[misc]
        def on_step_end(self, args: Any, state: Any, control: Any, optimizer: Any = None, **kwargs: Any) -> None:
            losses = micro[:]
            micro.clear()
            log.step(state.global_step, losses, optimizer.param_groups[0]["lr"], repr(state.epoch))

    save: dict[str, Any] = {"save_strategy": "steps", "save_steps": opts["fw_every"] or 10} if opts["fw_ckpt"] else {"save_strategy": "no"}
    if opts["noise"]:  # an evaluation every 8 steps: its loader's random draws happen between two training steps
        save.update(eval_strategy="steps", eval_steps=8)
    args = transformers.TrainingArguments(
        output_dir=str(out / f"hf-{opts['tag']}"), report_to=[], logging_steps=1, max_steps=opts["steps"], gradient_accumulation_steps=opts["ga"],
        per_device_train_batch_size=BATCH, dataloader_num_workers=opts["workers"], use_cpu=True, disable_tqdm=True, seed=0, learning_rate=1e-3,
        lr_scheduler_type="linear", warmup_steps=2, train_sampling_strategy="random" if opts["noise"] else "sequential", **save)
    trainer = Recording(model=model, args=args, train_dataset=Tokens(opts["noise"]), callbacks=[StepLog()],
                        eval_dataset=Tokens(opts["noise"]) if opts["noise"] else None)
    final.update(model=model, trainer=trainer)
    trainer.train()


def train_lightning(opts: dict[str, Any], out: Path, log: Log, final: dict[str, Any]) -> None:
    import lightning as L
    import torchmetrics

    class Module(L.LightningModule):
        def __init__(self) -> None:
            super().__init__()
            self.net = mlp(opts["noise"])
            self.val_mae = torchmetrics.MeanAbsoluteError()  # a metric module, built inside the decorated call
            self.micro: list[str] = []
            self.seen: int | None = None  # global_step at the last batch's end (None: no batch yet in this process)

        def training_step(self, batch: tuple[torch.Tensor, torch.Tensor], batch_idx: int) -> torch.Tensor:
            x, y = batch
            loss = torch.nn.functional.mse_loss(self.net(x), y)
            self.micro.append(hexf(loss))
            self.log("train_loss", loss)  # Lightning builds a metric (_ResultMetric) for each logged name
            return loss

        def on_train_batch_start(self, batch: Any, batch_idx: int) -> None:
            if self.seen is None:  # the first batch of this process: the step it starts from (restored, if resumed)
                self.seen = self.trainer.global_step

        def on_train_batch_end(self, outputs: Any, batch: Any, batch_idx: int) -> None:
            step = self.trainer.global_step
            if step != self.seen:  # this batch ended with an optimizer step (and the scheduler's)
                self.seen = step
                losses = self.micro[:]
                self.micro.clear()
                log.step(step, losses, self.trainer.optimizers[0].param_groups[0]["lr"], self.trainer.current_epoch)

        def validation_step(self, batch: tuple[torch.Tensor, torch.Tensor], batch_idx: int) -> None:
            x, y = batch
            pred = self.net(x)
            self.log("val_loss", torch.nn.functional.mse_loss(pred, y), sync_dist=True)  # a collective over the ranks
            self.val_mae(pred, y)
            self.log("val_mae", self.val_mae)

        def configure_optimizers(self) -> Any:
            opt = torch.optim.Adam(self.parameters(), lr=1e-2)
            sched = torch.optim.lr_scheduler.StepLR(opt, step_size=5, gamma=0.7)
            return {"optimizer": opt, "lr_scheduler": {"scheduler": sched, "interval": "step"}}

    class Counter(L.Callback):
        """A callback with state of its own (Lightning saves it by ``state_key``): the training batches seen."""

        def __init__(self) -> None:
            self.batches = 0

        def on_train_batch_end(self, *args: Any) -> None:
            self.batches += 1

        def state_dict(self) -> dict[str, Any]:
            return {"batches": self.batches}

        def load_state_dict(self, state_dict: dict[str, Any]) -> None:
            self.batches = int(state_dict["batches"])

    L.seed_everything(0)
    module = Module()
    loader = torch.utils.data.DataLoader(Samples(opts["noise"]), batch_size=BATCH, shuffle=opts["noise"], num_workers=opts["workers"])
    # with noise, a validation every 8 training batches (and Lightning's sanity check before training), of
    # 10 items: its last batch is partial (at 2 ranks, 5 items each: batches of 4 and 1)
    val = torch.utils.data.DataLoader(Samples(True, VAL_ITEMS), batch_size=BATCH) if opts["noise"] else None
    counter = Counter()
    final["counter"] = counter
    callbacks: list[Any] = [counter]
    if opts["fw_ckpt"] and opts["fw_every"]:
        callbacks.append(L.pytorch.callbacks.ModelCheckpoint(dirpath=str(out / f"lightning-{opts['tag']}" / "checkpoints"),
                                                             every_n_train_steps=opts["fw_every"], save_top_k=-1))
    trainer = L.Trainer(max_steps=opts["steps"], accumulate_grad_batches=opts["ga"], enable_checkpointing=opts["fw_ckpt"], logger=False,
                        enable_progress_bar=False, enable_model_summary=False, accelerator="cpu",
                        **({"devices": WORLD, "strategy": "ddp"} if WORLD > 1 else {"devices": 1}),
                        default_root_dir=str(out / f"lightning-{opts['tag']}"), callbacks=callbacks,
                        **({"val_check_interval": 8, "limit_val_batches": 3, "num_sanity_val_steps": opts["sanity"]} if opts["noise"] else {}))
    final.update(model=module, trainer=trainer)
    trainer.fit(module, train_dataloaders=loader, val_dataloaders=val)


def train_accelerate(opts: dict[str, Any], out: Path, log: Log, final: dict[str, Any]) -> None:
    from accelerate import Accelerator  # type: ignore[import-untyped]
    from accelerate.utils import set_seed  # type: ignore[import-untyped]

    set_seed(0)
    acc = Accelerator(cpu=True, gradient_accumulation_steps=opts["ga"])
    model = mlp(opts["noise"])
    opt = torch.optim.Adam(model.parameters(), lr=1e-2)
    sched = torch.optim.lr_scheduler.StepLR(opt, step_size=5, gamma=0.7)
    loader = torch.utils.data.DataLoader(Samples(opts["noise"]), batch_size=BATCH, shuffle=opts["noise"], num_workers=opts["workers"])
    model, opt, dl, sched = acc.prepare(model, opt, loader, sched)
    final.update(model=model)
    own, micro = 0, []
    for _epoch in range(100):  # ended by Ravex's max_steps
        for x, y in dl:
            with acc.accumulate(model):
                loss = torch.nn.functional.mse_loss(model(x), y)
                acc.backward(loss)
                opt.step()
                sched.step()
                opt.zero_grad()
            micro.append(hexf(loss))
            if acc.sync_gradients:
                own += 1
                losses, micro = micro, []
                log.step(ravex.step() or own, losses, opt.param_groups[0]["lr"], dl.iteration)
                if opts["fw_ckpt"] and own % (opts["fw_every"] or 5) == 0:  # Accelerate's own checkpoint as well
                    acc.save_state(str(out / f"accelerate-{opts['tag']}" / f"step{own}"))
                if own >= opts["steps"] and not RAVEX_ON:
                    return  # the reference run: no Ravex to stop it


def main() -> None:
    opts: dict[str, Any] = {"noise": False, "workers": 0, "ga": 2, "steps": 40, "fw_ckpt": False, "fw_every": None, "sanity": 2, "lazy": False, "lora": False,
                            **json.loads(sys.argv[1])}
    out = Path(sys.argv[2])
    framework, tag = opts["framework"], opts["tag"]
    for name in IMPORTS[framework][:1] if opts["lazy"] else IMPORTS[framework]:
        importlib.import_module(name)
    torch.set_num_threads(1)
    log = Log(out / f"log-{tag}{RANK_SUFFIX}.jsonl")
    final: dict[str, Any] = {}
    body = {"hf": train_hf, "lightning": train_lightning, "accelerate": train_accelerate}[framework]

    @ravex.train_loop(preemption_handler=True)  # type: ignore[untyped-decorator]
    def train() -> None:
        body(opts, out, log, final)

    train()  # returns when the framework's budget is trained, or Ravex's max_steps stopped it
    res: dict[str, Any] = {"weights": digest(final["model"]), "step": log.last}
    if framework == "hf":
        state = final["trainer"].state
        # log_history whole (losses, learning rates, evaluations, the final train_loss) but its wall-clock timings
        history = [{k: v for k, v in entry.items() if not k.endswith(("_runtime", "_per_second"))} for entry in state.log_history]
        res.update(global_step=state.global_step, epoch=repr(state.epoch), log_history=history)
    elif framework == "lightning":
        res.update(global_step=final["trainer"].global_step, current_epoch=final["trainer"].current_epoch, counted=final["counter"].batches)
    else:  # the loader's counter at the last step: past it, where a run stops moves it on its own (an epoch's last batch ends it)
        res.update(epoch=log.epoch)
    (out / f"out-{tag}{RANK_SUFFIX}.json").write_text(json.dumps(res, indent=1) + "\n")


if __name__ == "__main__":
    main()
