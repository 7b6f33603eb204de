"""The client state of a DeepSpeed model-states file, and Lightning's in it.

``engine.save_checkpoint(dir, client_state=...)`` writes the caller's dict into
the model-states file beside DeepSpeed's own keys (``state.update(client_state)``;
the ZeRO-3 per-rank files each hold a copy), and ``engine.load_checkpoint``
hands every key that is not DeepSpeed's back as the client state. Lightning's
``DeepSpeedStrategy.save_checkpoint`` passes its whole checkpoint there, less
``state_dict`` and ``optimizer_states`` (DeepSpeed's files hold those):
``epoch``, ``global_step``, ``pytorch-lightning_version``, ``loops``,
``callbacks``, ``lr_schedulers``, ``hparams_name``, ``hyper_parameters``
(verified with Lightning 2.6.6 and DeepSpeed 0.19.8; fixtures/README.md). On
resume it loads the ZeRO state with ``load_lr_scheduler_states=False`` and
restores the rest from that client state.

The reader keeps the client state as ``objects["extra"]``, the place a
torch.save source's other top-level keys go, with any tensor in it an
``obj/<key>/...`` logical tensor: a torch_save output puts them back at the top
of a ``.ckpt`` (Lightning's own layout), a ZeRO output back into its
model-states file.
"""

from __future__ import annotations

from typing import Any

from ..._layout import SOURCE_KEY
from ..._torchfile.archive import TorchArchive
from ...info import CheckpointInfo
from ...model import OBJ, Checkpoint
from ..small_state import read_objects

__all__ = ["DS_KEYS", "LIGHTNING_MARK", "lightning_version", "read_client", "show_lightning"]

# DeepSpeed 0.19.8's own keys of a model-states file (engine._common_checkpoint_state, plus what
# older and special-purpose saves add); every other key is the caller's client state.
DS_KEYS = frozenset(("module", "buffer_names", "optimizer", "param_shapes", "frozen_param_shapes", "shared_params", "frozen_param_fragments",
                     "lr_scheduler", "data_sampler", "random_ltd", "sparse_tensor_module_names", "csr_tensor_module_names", "skipped_steps",
                     "global_steps", "global_samples", "dp_world_size", "mp_world_size", "checkpoint_parallel_dimensions", "ds_config",
                     "ds_version", "universal_checkpoint_info"))
LIGHTNING_MARK = "pytorch-lightning_version"


def lightning_version(ms: dict[str, Any]) -> str | None:
    """The Lightning version of a model-states file written by Lightning's DeepSpeed strategy, else None."""
    v = ms.get(LIGHTNING_MARK)
    return None if v is None else str(v)


def read_client(ckpt: Checkpoint, archive: TorchArchive, ms: dict[str, Any], shallow: bool = False) -> list[str]:
    """The client state of rank 0's model-states file into ``ckpt.objects["extra"]``; its keys.
    Lightning's: also its layout (``state_dict``, ``optimizer_states``) as the source's, so a
    torch_save output is a Lightning ``.ckpt`` by default."""
    from ..torch_save import LIGHTNING

    keys = [str(k) for k in ms if k not in DS_KEYS]
    if not keys:
        return []
    extra: dict[str, Any] = ckpt.objects.setdefault("extra", {})
    for key in keys:
        extra[key] = read_objects(archive, ms[key], ckpt, f"{OBJ}{key}", shallow)  # as torch_save reads a Lightning .ckpt's keys
    version = lightning_version(ms)
    if version is not None:
        ckpt.source["lightning"] = version
        ckpt.source[SOURCE_KEY] = LIGHTNING.to_json()
        ckpt.notes.append(f"Lightning DeepSpeed strategy (Lightning {version}): Lightning's state is read from "
                          f"{archive.path.name}: {', '.join(k for k in keys if k != LIGHTNING_MARK)}")
    else:
        ckpt.notes.append(f"DeepSpeed client state (save_checkpoint(client_state=...)) read from {archive.path.name}: {', '.join(keys)}")
    return keys


def show_lightning(info: CheckpointInfo, ckpt: Checkpoint) -> None:
    """``inspect``'s view of a Lightning DeepSpeed-strategy checkpoint: the variant, why, and Lightning's keys."""
    version = ckpt.source.get("lightning")
    if version is None:
        return
    extra = ckpt.objects.get("extra") or {}
    state = [k for k in extra if k != LIGHTNING_MARK]
    info.variant = f"lightning deepspeed {info.variant}"
    info.reasons.append(f"the model-states file carries PyTorch Lightning's client state ('{LIGHTNING_MARK}' {version!r}): "
                        "a checkpoint of Lightning's DeepSpeed strategy (Trainer.save_checkpoint)")
    callbacks = extra.get("callbacks")
    info.extra["lightning"] = {"version": version, "strategy": "deepspeed", "state": state,
                               "epoch": extra.get("epoch"), "global_step": extra.get("global_step"),
                               "callbacks": sorted(map(str, callbacks)) if isinstance(callbacks, dict) else [],
                               "lr_schedulers": len(extra["lr_schedulers"]) if isinstance(extra.get("lr_schedulers"), list) else 0}
