"""A tiny GPT-2 trained by the Hugging Face Trainer on CPU, for tests/test_hf_trainer.py.

    python -P _hf_train.py OUT MAX_STEPS [RESUME_FROM] [--zero STAGE]

With ``--zero STAGE`` (under torchrun, ``DS_ACCELERATOR=cpu``) the Trainer runs
DeepSpeed ZeRO-STAGE, which saves ``global_stepN/`` and ``latest`` instead of
``optimizer.pt`` (no ``true_state`` then: DeepSpeed holds the optimizer).

Saves ``checkpoint-N`` every 2 steps (the Trainer's own save), and beside each
``true_state-N.safetensors``: the live optimizer state at that save, by
parameter name (``exp_avg/<name>``, ``exp_avg_sq/<name>``), the truth the
position-keyed ``optimizer.pt`` is checked against. Writes ``final.safetensors``
(the weights at the end). The model has dropout and the dataset draws from
torch's global RNG in ``__getitem__``, so a resume that loses the RNG state
does not reproduce the uninterrupted run. Nothing is downloaded.
"""

from __future__ import annotations

import sys
from pathlib import Path

import torch
from safetensors.torch import save_file
from transformers import GPT2Config, GPT2LMHeadModel, Trainer, TrainerCallback, TrainingArguments

VOCAB = 64


class Tokens(torch.utils.data.Dataset[dict[str, torch.Tensor]]):
    def __len__(self) -> int:
        return 48

    def __getitem__(self, i: int) -> dict[str, torch.Tensor]:
        x = torch.randint(0, VOCAB, (8,), generator=torch.Generator().manual_seed(i))
        labels = x.clone()
        labels[torch.rand(8) < 0.25] = -100  # torch's global RNG: lost by a resume that drops rng_state.pth
        return {"input_ids": x, "labels": labels}


class TrueState(TrainerCallback):
    def on_save(self, args, state, control, model=None, optimizer=None, **kwargs):  # type: ignore[no-untyped-def]
        out: dict[str, torch.Tensor] = {}
        for name, p in model.named_parameters():
            for k, v in optimizer.state.get(p, {}).items():
                if isinstance(v, torch.Tensor) and v.dim() > 0:
                    out[f"{k}/{name}"] = v.detach().clone()
        save_file(out, str(Path(args.output_dir) / f"true_state-{state.global_step}.safetensors"))


def main() -> None:
    argv = sys.argv[1:]
    stage = None
    if "--zero" in argv:
        at = argv.index("--zero")
        stage = int(argv[at + 1])
        del argv[at:at + 2]
    out, max_steps = argv[0], int(argv[1])
    resume = argv[2] if len(argv) > 2 else None
    ds = None if stage is None else {
        "train_micro_batch_size_per_gpu": "auto", "gradient_accumulation_steps": "auto", "zero_optimization": {"stage": stage},
        "optimizer": {"type": "AdamW", "params": {"lr": "auto", "weight_decay": "auto", "torch_adam": True}},
        "scheduler": {"type": "WarmupLR", "params": {"warmup_num_steps": 1}}}
    torch.manual_seed(0)
    model = GPT2LMHeadModel(GPT2Config(n_layer=2, n_embd=16, n_head=2, vocab_size=VOCAB, n_positions=16,
                                       bos_token_id=0, eos_token_id=0))
    args = TrainingArguments(output_dir=out, per_device_train_batch_size=4, max_steps=max_steps, save_steps=2, use_cpu=ds is None,
                             report_to=[], logging_steps=1, lr_scheduler_type="linear", warmup_steps=1, learning_rate=1e-3,
                             weight_decay=0.01, seed=0, dataloader_num_workers=0, disable_tqdm=True, deepspeed=ds)
    trainer = Trainer(model=model, args=args, train_dataset=Tokens(), callbacks=[TrueState()] if ds is None else [])
    trainer.train(resume_from_checkpoint=resume)
    if trainer.is_world_process_zero():
        if ds is not None:  # the fp32 master weights DeepSpeed trains, gathered by DeepSpeed's own consolidation
            from deepspeed.utils.zero_to_fp32 import get_fp32_state_dict_from_zero_checkpoint

            final = get_fp32_state_dict_from_zero_checkpoint(str(Path(out) / f"checkpoint-{max_steps}"))
            save_file({k: v.contiguous() for k, v in final.items() if k != "lm_head.weight"}, str(Path(out) / "final.safetensors"))
        else:
            save_file({n: p.detach().clone() for n, p in model.named_parameters()}, str(Path(out) / "final.safetensors"))


if __name__ == "__main__":
    main()
