"""The split is exact: two SGD steps through device + protocol + real websocket server equal
two steps of the unsplit model in one process bit for bit (loss, gradients, updated weights, batch norm
statistics), in both heads, for batches of six and of one image (the protocol allows N >= 1; IResNet's batch
norm then normalises with its running statistics and leaves them unchanged).

Bit for bit, not within a tolerance: both sides run the same float32 kernels on the same values (the wire's
float32 is lossless) with the same thread count (torch.set_num_threads reaches the server's compute thread before
its first op, splitface/server/app.py), so every sum is taken in the same order; on AVX2 or AVX-512, with 1 or 2
threads alike. A difference in the last bit is a difference in what was computed."""
from __future__ import annotations

import asyncio

import numpy as np
import pytest
import torch
import torch.nn.functional as F

from splitface.device.connection import DeviceClient
from splitface.device.trainer import DeviceTrainer, to_input
from splitface.common.models import build_backbone, build_classifier, resolve_spec, split_backbone
from splitface.common.optim import TrainConfig, exponential_decay, make_sgd
from splitface.server.trainer import ServerTrainer
from tests.conftest import TOKENS, at_torch_count, openmp_default, openmp_runtime, serve_in_thread, small_trainer

NUM_CLASSES = 5
LR, DECAY_STEPS = 0.05, 4


def _batches(spec, n: int = 6, steps: int = 2):
    rng = np.random.default_rng(0)
    s = spec.input_size
    return [(rng.integers(0, 256, (n, 3, s, s), dtype=np.uint8), rng.integers(0, NUM_CLASSES, n)) for _ in range(steps)]


def _unsplit(spec, batches):
    torch.manual_seed(123)
    backbone, classifier = build_backbone(spec), build_classifier(spec, NUM_CLASSES)
    init = {"backbone": {k: v.clone() for k, v in backbone.state_dict().items()},
            "classifier": {k: v.clone() for k, v in classifier.state_dict().items()}}
    params = list(backbone.parameters()) + list(classifier.parameters())
    opt = make_sgd(params, LR, 0.9)
    sched = exponential_decay(opt, 0.1, DECAY_STEPS)
    losses = []
    for images, labels in batches:
        backbone.train(), classifier.train()
        opt.zero_grad()
        loss = F.cross_entropy(classifier(backbone(to_input(images))), torch.from_numpy(labels))
        loss.backward()
        opt.step()
        sched.step()
        losses.append(loss.item())
    return init, backbone, classifier, losses


@pytest.mark.parametrize("model,head,n", [("vgg_face_small", "server", 6), ("vgg_face_small", "device", 6),
                                          ("iresnet_small", "server", 6), ("iresnet_small", "device", 6),
                                          ("iresnet_small", "server", 1), ("iresnet_small", "device", 1)])
def test_split_step_equals_unsplit_step(tmp_path, model, head, n):
    spec = resolve_spec(model)
    batches = _batches(spec, n)
    init, ref_backbone, ref_classifier, ref_losses = _unsplit(spec, batches)
    ref_device, ref_tail = split_backbone(ref_backbone, "conv1")

    trainer = small_trainer(NUM_CLASSES, model, lr=LR, decay_steps=DECAY_STEPS)
    backbone = build_backbone(spec)
    backbone.load_state_dict(init["backbone"])
    device_init, tail_init = split_backbone(backbone, "conv1")
    trainer.tail.load_state_dict(tail_init.state_dict())
    engine = DeviceTrainer(spec, "conv1", head, NUM_CLASSES, TrainConfig(lr=LR, decay_steps=DECAY_STEPS))
    engine.layer.load_state_dict(device_init.state_dict())
    (trainer.classifier if head == "server" else engine.classifier).load_state_dict(init["classifier"])

    with serve_in_thread(trainer, tmp_path) as server:
        async def run():
            client = DeviceClient(server.url, "device-0", TOKENS["device-0"], engine, batch_size=8)
            await client.connect()
            results = [await client.train_batch(i + 1, images, labels, np.arange(len(labels)) + 100 * i)
                       for i, (images, labels) in enumerate(batches)]
            await client.close()
            return results
        results = asyncio.run(run())

    assert [r.loss for r in results] == ref_losses
    classifier = trainer.classifier if head == "server" else engine.classifier
    pairs = [(engine.layer, ref_device), (trainer.tail, ref_tail), (classifier, ref_classifier)]
    for split_part, ref_part in pairs:
        for (name, p), (_, q) in zip(split_part.named_parameters(), ref_part.named_parameters(), strict=True):
            assert torch.equal(p, q), f"{name} weights differ by {float((p - q).abs().max()):.3g}"
            if q.grad is not None:
                assert torch.equal(p.grad, q.grad), f"{name} gradients differ by {float((p.grad - q.grad).abs().max()):.3g}"
        for (name, b), (_, c) in zip(split_part.named_buffers(), ref_part.named_buffers(), strict=True):
            assert torch.equal(b, c), f"buffer {name} differs"
    if model.startswith("iresnet"):
        # The embedding's batch norm trained in both steps; with one image its running statistics stay as they were.
        features = trainer.tail.stages["features"].features
        start = init["backbone"]["stages.features.features.running_mean"]
        assert torch.equal(features.running_mean, start) == (n == 1)
        assert features.bias.grad is not None and features.bias.grad.abs().sum() > 0


def test_a_head_lr_scale_trains_the_classifier_at_that_multiple_on_both_sides():
    """--head-lr-scale: the server's classifier (server head) and the device's (device head) get lr x scale, the
    rest lr; at 1 there is one parameter group, as before the option existed (old checkpoints' optimizer state
    still loads)."""
    spec, config = resolve_spec("iresnet_small"), TrainConfig(lr=0.01, head_lr_scale=10.0)
    trainer = ServerTrainer(spec, "conv1", NUM_CLASSES, config)
    lrs = {len(g["params"]): g["lr"] for g in trainer.optimizer.param_groups}
    assert sorted(lrs.values()) == [0.01, 0.1] and lrs[len(list(trainer.classifier.parameters()))] == 0.1
    engine = DeviceTrainer(spec, "conv1", "device", NUM_CLASSES, config)
    assert [g["lr"] for g in engine.optimizer.param_groups] == [0.01, 0.1]
    assert engine.optimizer.param_groups[1]["params"] == list(engine.classifier.parameters())
    plain = ServerTrainer(spec, "conv1", NUM_CLASSES, TrainConfig(lr=0.01))
    assert len(plain.optimizer.param_groups) == 1


def test_the_servers_compute_thread_takes_torchs_thread_count(tmp_path):
    """The server's compute thread runs at torch's count from its first op (splitface/common/compute.py says why;
    one more thread than a plain thread's default, so the two cannot agree by chance)."""
    gomp, default = openmp_runtime(), openmp_default()
    with at_torch_count(default + 1), serve_in_thread(small_trainer(), tmp_path) as server:
        assert server.call(server.server._compute(gomp.omp_get_max_threads)) == default + 1
