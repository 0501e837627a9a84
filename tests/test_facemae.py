"""FaceMAE (splitface/common/transforms/mask.py, research/facemae.py): the device releases 25% of its patches,
drawn per image and release from its keyed generator; what the server records off the websocket is that
eager release; the server reconstructs with a frozen MAE and trains the rest; the MAE's pre-training with
the instance-relation-matching loss runs and writes a file the server starts from."""
from __future__ import annotations

import asyncio
from dataclasses import replace

import numpy as np
import pytest
import torch

from splitface.device.connection import DeviceClient
from splitface.device.trainer import DeviceTrainer, to_input
from splitface.common.models import PRESETS, ModelSpec, activation_shape, build_backbone, split_backbone
from splitface.common.models.weights import load_into
from splitface.common.optim import TrainConfig
from splitface.common.transforms.mask import infer_mask, random_patch_mask, visible_patches
from research.facemae import irm_loss, pretrain
from splitface.server.recorder import load_recordings
from splitface.server.trainer import ServerTrainer
from tests.conftest import TOKENS, serve_in_thread

MASK = replace(PRESETS["iresnet_small"], release="mask")


def test_mask_spec_round_trips_and_refuses_bad_values():
    assert (MASK.mask_ratio, MASK.mask_patch) == (0.75, 8)
    again = ModelSpec.from_dict(replace(MASK, mask_ratio=0.5, mask_patch=16).to_dict())
    assert again.mask_ratio == 0.5 and isinstance(again.mask_ratio, float) and again.mask_patch == 16
    for bad in (dict(mask_ratio=1.0), dict(mask_ratio=-0.1), dict(mask_patch=6), dict(mask_patch=128)):
        with pytest.raises(ValueError, match="mask_"):
            replace(MASK, **bad)
    with pytest.raises(ValueError, match="split earlier"):
        activation_shape(MASK, "layer1")   # the server's reconstruction is an image: the split must keep its size


def test_mask_shapes_ratio_and_fresh_draws():
    assert activation_shape(MASK, "conv1") == (3, 64, 64) and visible_patches(64, 8, 0.75) == 16
    g = torch.Generator().manual_seed(0)
    mask = random_patch_mask(5, 64, 8, 0.75, g)
    assert mask.shape == (5, 1, 64, 64) and set(mask.unique().tolist()) == {0.0, 1.0}
    grid = mask[:, 0, ::8, ::8]
    assert (grid.sum(dim=(1, 2)) == 16).all()                          # exactly 25% of the 64 patches visible
    assert torch.equal(mask, grid.repeat_interleave(8, 1).repeat_interleave(8, 2)[:, None])   # whole patches
    assert len({tuple(m.flatten().tolist()) for m in grid}) == 5       # a different draw per image
    assert not torch.equal(random_patch_mask(5, 64, 8, 0.75, g), mask)  # and per release
    # the server reads the mask back from the zeros
    x = torch.rand(5, 3, 64, 64) * 0.9 + 0.05
    assert torch.equal(infer_mask(x * mask, 8), mask)


def test_a_release_is_repeated_on_resend_and_fresh_otherwise():
    engine = DeviceTrainer(MASK, "conv1", "server", 5)
    images = np.random.default_rng(0).integers(1, 256, (4, 3, 64, 64), dtype=np.uint8)
    first = engine.forward(images, ("train", 1), range(4), range(4))
    assert np.array_equal(engine.forward(images, ("train", 1), range(4), range(4)), first)   # a re-sent batch
    assert not np.array_equal(engine.forward(images, ("train", 2), range(4), range(4)), first)
    engine.commit(2, np.ones_like(first))   # no device parameters: nothing to step


def test_eager_release_is_what_the_server_records_and_the_mae_stays_frozen(tmp_path):
    """Over the real websocket: each recorded release is the image itself on exactly 16 whole patches and
    zeros elsewhere, a different choice per image; two training steps move the server's stem, not its MAE."""
    config = TrainConfig(lr=0.05, seed=0)
    trainer = ServerTrainer(MASK, "conv1", 5, config)
    mae_before = {k: v.clone() for k, v in trainer.tail.stages["mask_server"].mae.state_dict().items()}
    stem_before = trainer.tail.stages["mask_server"].stem.conv.weight.clone()
    engine = DeviceTrainer(MASK, "conv1", "server", 5, config)
    rng = np.random.default_rng(0)
    batches = [(rng.integers(1, 256, (6, 3, 64, 64), dtype=np.uint8), rng.integers(0, 5, 6)) for _ in range(2)]
    with serve_in_thread(trainer, tmp_path, record_max=64) as server:
        async def run():
            client = DeviceClient(server.url, "device-0", TOKENS["device-0"], engine, batch_size=8)
            await client.connect()
            out = [await client.train_batch(i + 1, images, labels, np.arange(6) + 10 * i)
                   for i, (images, labels) in enumerate(batches)]
            await client.close()
            return out
        results = asyncio.run(run())
    assert all(np.isfinite(r.loss) for r in results)
    recorded = load_recordings(tmp_path / "recordings")["device-0"]
    grids = []
    for i, (images, _) in enumerate(batches):
        got = torch.from_numpy(recorded["activations"][recorded["batch_ids"] == i + 1])
        mask = infer_mask(got, 8)   # the images have no zero pixel: a zero patch is a masked one
        # the recorder keeps float16 (the wire carried float32): equal to that precision, exact zeros
        assert torch.allclose(got.float(), to_input(images) * mask, rtol=0, atol=5e-4)
        grid = mask[:, 0, ::8, ::8]
        assert (grid.sum(dim=(1, 2)) == 16).all()
        grids += [tuple(g.flatten().tolist()) for g in grid]
    assert len(set(grids)) == 12
    mae_after = trainer.tail.stages["mask_server"].mae.state_dict()
    assert all(torch.equal(v, mae_after[k]) for k, v in mae_before.items())
    assert not torch.equal(stem_before, trainer.tail.stages["mask_server"].stem.conv.weight)


def test_irm_loss_is_zero_for_equal_relations_and_positive_otherwise():
    f = torch.randn(6, 16)
    assert float(irm_loss(f, 3 * f)) == pytest.approx(0, abs=1e-6)   # relations are of directions
    assert float(irm_loss(f, torch.randn(6, 16))) > 0.01
    with pytest.raises(ValueError, match="at least 3"):
        irm_loss(f[:2], f[:2])


@pytest.mark.slow
def test_pretraining_smoke_writes_a_file_the_server_loads(tmp_path, lfw):
    """A few steps on a few public faces, IRM included (warm-up 0): the loss terms are finite, and the file
    carries the trained MAE into a server tail while its backbone keeps the seeded start."""
    out = tmp_path / "mae.pt"
    meta = pretrain(MASK, "conv1", lfw, out, epochs=1, irm_warmup=0, batch_size=16, limit=32, progress=False)
    h = meta["history"][0]
    assert meta["images"] == 32 and np.isfinite(h["mse_hidden"]) and h["irm"] > 0 and np.isfinite(h["irm"])
    torch.manual_seed(5)
    _, tail = split_backbone(build_backbone(MASK), "conv1")
    fresh_mae = {k: v.clone() for k, v in tail.stages["mask_server"].mae.state_dict().items()}
    load_into(tail, out, MASK)
    loaded = tail.stages["mask_server"].mae.state_dict()
    assert any(not torch.equal(v, loaded[k]) for k, v in fresh_mae.items())
    assert not any(p.requires_grad for p in tail.stages["mask_server"].mae.parameters())
    torch.manual_seed(0)
    _, seeded = split_backbone(build_backbone(MASK), "conv1")
    assert torch.equal(tail.stages["layer1"].state_dict()[next(iter(tail.stages["layer1"].state_dict()))],
                       seeded.stages["layer1"].state_dict()[next(iter(seeded.stages["layer1"].state_dict()))])


def test_frontier_only_updates_its_rows_and_has_the_facemae_point(tmp_path):
    """`research/frontier.py --only P` (how the facemae point was added) keeps the other points' rows, in POINTS order."""
    import argparse
    import json

    from research import frontier
    names = [frontier.point_name(t, p) for t, p, _ in frontier.POINTS]
    assert "facemae-ratio0.75-patch8-lambda_irm1" in names
    (tmp_path / "summary.json").write_text(json.dumps([{"run": n, "old": True} for n in names[:3]] +
                                                      [{"run": "gone-point", "old": True}]))
    args = argparse.Namespace(out=tmp_path, only=[names[-1]])
    rows = frontier.merged_rows([{"run": names[-1]}, {"run": names[0], "old": False}], args)
    assert [r["run"] for r in rows] == [*names[:3], names[-1]] and rows[0]["old"] is False and rows[1]["old"]
    assert frontier.merged_rows([{"run": names[0]}], argparse.Namespace(out=tmp_path, only=None)) == [{"run": names[0]}]
