"""A tiny model trained with Accelerate on CPU, for tests/test_accelerate_layout.py.

    python -P _accelerate_train.py OUT STEPS SAVE_AT [RESUME_FROM]

Trains ``STEPS`` steps; after step ``SAVE_AT`` calls ``accelerator.save_state(OUT/state)``
and writes beside it ``true_state.safetensors`` (the live optimizer state by
parameter name) and ``param_names.txt`` (the names in optimizer order, as a user's
script would write them for ``--param-names``). With ``RESUME_FROM``, calls
``accelerator.load_state`` on it first and skips the ``SAVE_AT`` batches already
trained. Writes ``final.safetensors``. Dropout and a dataset that draws from
torch's global RNG make a resume that loses ``random_states_0.pkl`` differ.
"""

from __future__ import annotations

import sys
from pathlib import Path

import torch
from accelerate import Accelerator
from accelerate.utils import set_seed
from safetensors.torch import save_file


class Noisy(torch.utils.data.Dataset[tuple[torch.Tensor, torch.Tensor]]):
    def __len__(self) -> int:
        return 64

    def __getitem__(self, i: int) -> tuple[torch.Tensor, torch.Tensor]:
        g = torch.Generator().manual_seed(i)
        x = torch.randn(4, generator=g)
        return x + 0.1 * torch.randn(4), torch.randn(2, generator=g)  # the noise: torch's global RNG


def main() -> None:
    out, steps, save_at = Path(sys.argv[1]), int(sys.argv[2]), int(sys.argv[3])
    resume = sys.argv[4] if len(sys.argv) > 4 else None
    set_seed(0)
    acc = Accelerator(cpu=True)
    model = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.Dropout(0.2), torch.nn.LayerNorm(8), torch.nn.Linear(8, 2))
    decay = [p for n, p in model.named_parameters() if "bias" not in n]
    rest = [p for n, p in model.named_parameters() if "bias" in n]
    opt = torch.optim.AdamW([{"params": decay}, {"params": rest, "weight_decay": 0.0}], lr=1e-2)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: 1.0 / (1 + s))
    dl = torch.utils.data.DataLoader(Noisy(), batch_size=4, shuffle=True)
    model, opt, dl, sched = acc.prepare(model, opt, dl, sched)
    start = 0
    if resume is not None:
        acc.load_state(resume)
        dl = acc.skip_first_batches(dl, save_at)
        start = save_at
    step = start
    for x, y in dl:
        loss = torch.nn.functional.mse_loss(model(x), y)
        acc.backward(loss)
        opt.step()
        sched.step()
        opt.zero_grad()
        step += 1
        if resume is None and step == save_at:
            acc.save_state(str(out / "state"))
            names = {id(p): n for n, p in model.named_parameters()}
            (out / "param_names.txt").write_text("".join(names[id(p)] + "\n" for g in opt.param_groups for p in g["params"]))
            true = {f"{k}/{names[id(p)]}": v.clone() for p, st in opt.state.items() for k, v in st.items() if v.dim() > 0}
            save_file(true, str(out / "true_state.safetensors"))
        if step == steps:
            break
    save_file({n: p.detach().clone() for n, p in model.named_parameters()}, str(out / "final.safetensors"))


if __name__ == "__main__":
    main()
