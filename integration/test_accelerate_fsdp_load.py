"""Ravex's 3-rank output of an Accelerate FSDP2 ``save_state`` directory, loaded by
``accelerator.load_state`` under FSDP2 at 3 ranks (CPU, gloo).

The source is fixtures/data/accelerate_fsdp2_ws2 (Accelerate wrote it at 2 ranks).
Ravex writes it back for 3 ranks (``--to accelerate --world-size 3``), and one
job of 3 ranks (integration/accelerate_fsdp_train.py) loads, in turn, Accelerate's
own directory and Ravex's, each followed by one training step. Checked in that
one job: both loads give the state live at the save, gathered, bit for bit
(weights, buffer, Adam moments and steps); the scheduler's state is the saved one;
ranks 0 and 1 take their RNG state from the carried ``random_states_{0,1}.pkl``;
rank 2, for which neither directory has an RNG file, keeps its own (Accelerate's
``load_state`` catches the missing file); and the step after the load ends with
bit-identical weights and optimizer state from both directories.
"""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

import pytest

import ravex_convert
from ravex_convert import ConvertOptions

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))
from _launch import launch

pytestmark = [pytest.mark.slow, pytest.mark.distributed]

REPO = Path(__file__).resolve().parents[1]
FIXTURE = REPO / "fixtures" / "data" / "accelerate_fsdp2_ws2"
SCRIPT = Path(__file__).with_name("accelerate_fsdp_train.py")


def test_load_state_at_three_ranks_from_ravex_output(tmp_path: Path) -> None:
    src, out = FIXTURE / "checkpoint" / "state", tmp_path / "state_ws3"
    ravex_convert.convert(src, out, "accelerate", ConvertOptions(world_size=3))
    assert sorted(p.name for p in (out / "pytorch_model_fsdp_0").iterdir()) == [".metadata", "__0_0.distcp", "__1_0.distcp", "__2_0.distcp"]
    args = [str(SCRIPT), str(src), str(out), str(FIXTURE / "reference" / "true_state.safetensors"), str(tmp_path / "result.json")]
    res = launch(3, args, cwd=tmp_path, env=dict(os.environ, OMP_NUM_THREADS="1"), timeout=300)
    assert res.returncode == 0, res.stderr[-4000:]
    got = json.loads((tmp_path / "result.json").read_text())
    assert (got["world_size"], got["is_fsdp2"]) == (3, True)
    assert got["own_loads_true_state"], "Accelerate did not load its own directory to the saved state: the check itself is broken"
    assert got["ravex_loads_true_state"]
    assert {k.split("/")[0] for k in got["loaded_keys"]} == {"model", "optim"} and "model/scale" in got["loaded_keys"]
    assert got["scheduler_equal"]
    assert got["after_step_moved"] and got["after_step_equal"]
    assert got["losses"][0] == got["losses"][1]
    ranks = got["per_rank"]
    for r in (0, 1):
        assert ranks[r]["ravex"]["rng_from_file"] and not ranks[r]["ravex"]["rng_kept"]
    assert ranks[2]["ravex"]["rng_kept"] and not ranks[2]["ravex"]["rng_from_file"]  # no random_states_2.pkl: load_state goes on
    assert [r["own"] for r in ranks] == [r["ravex"] for r in ranks]
