"""Load (issue #16, item 4), short: 32 devices at batch 16 (every other device's last batch of an epoch holds
one image) against one server process, for a few seconds, on the fuzz's model (vgg_face at 32 px, 4 channels:
a tenth of vgg_face_small's step, so that 32 devices get through in the test's time). The full run is
`python -m bench.load` on vgg_face_small (results/reliability/load.json)."""
from __future__ import annotations

import pytest

from bench.load import run

MODEL = {"family": "vgg_face", "input_size": 32, "width": 4, "fc_width": 32, "dropout": 0.0}

pytestmark = pytest.mark.slow


def test_32_devices_lose_and_double_nothing(tmp_path, lfw):
    result = run(devices=32, batch_size=16, seconds=3, checkpoint_every=2, run_dir=tmp_path, lfw=lfw, model=MODEL)
    assert result["devices"] == 32 and result["last_batch_sizes"]["33"] == 1
    assert result["batches_per_device"]["min"] >= 1  # every device trained
    assert result["errors"] == 0, (result["device_errors"], result["server_errors"])
    assert result["lost"] == 0 and result["double_applied"] == 0 and result["mismatched_devices"] == []
    assert result["server_steps"] == result["batches"] and result["server_exit_status"] == 0
    # the checkpoint holds the model and small per-device fields; replies only beside it, one per device at most
    assert result["checkpoint_bytes"]["final"] < 1.01 * result["checkpoint_bytes"]["model_and_optimizer_tensors"] + 2**20
    assert result["checkpoint_bytes"]["replies_kept_final"] <= 32
