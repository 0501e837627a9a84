"""Pipelining on the device (`--pipeline`): batch n+1's release is made before batch n's gradient arrives,
on the weights from before batch n's step. Its commit must then apply the gradient taken at those weights
(the gradient of the release that was actually sent), for eager PyTorch and for an exported runtime; at most
one batch waits; the configurations whose step needs the current weights are refused in words."""
from __future__ import annotations

import numpy as np
import pytest
import torch

from splitface.device.trainer import DeviceTrainer
from splitface.common.models import resolve_spec
from splitface.device.privacy.engine import PrivacyEngine
from splitface.common.optim import TrainConfig
from splitface.device.runtimes.parity import GRAD_RTOL
from splitface.export.exporter import EXPORTER

SPEC = resolve_spec("iresnet_small")
rng = np.random.default_rng(0)
IMAGES = rng.integers(0, 256, (4, 3, 64, 64), dtype=np.uint8)
LABELS, IDS = np.array([0, 1, 0, 1]), np.arange(4)


def gradient_at(engine: DeviceTrainer, weights: list[torch.Tensor], images: np.ndarray, grad: np.ndarray):
    """d sum(layer(images) * grad) / d weights at `weights`: what a lock-step device would apply there."""
    from splitface.common.models import to_input

    names = [n for n, _ in engine.layer.named_parameters()]
    leaves = [w.clone().requires_grad_(True) for w in weights]
    out = torch.func.functional_call(engine.layer, dict(zip(names, leaves)), (to_input(images),))
    return torch.autograd.grad((out * torch.from_numpy(grad)).sum(), leaves)


def test_a_pipelined_commit_applies_the_gradient_at_the_weights_its_release_used():
    engine = DeviceTrainer(SPEC, "conv1", "server", 2, TrainConfig(lr=0.1), pipeline=True)
    w0 = [p.detach().clone() for p in engine.layer.parameters()]
    first = engine.forward(IMAGES[:2], ("train", 1), IDS[:2], LABELS[:2])
    second = engine.forward(IMAGES[2:], ("train", 2), IDS[2:], LABELS[2:])  # batch 1 is still at the server
    g1, g2 = (np.random.default_rng(s).standard_normal(first.shape).astype(np.float32) for s in (1, 2))
    engine.commit(1, g1)
    w1 = [p.detach().clone() for p in engine.layer.parameters()]
    assert any(not torch.equal(a, b) for a, b in zip(w0, w1))
    for p, want in zip(engine.layer.parameters(), gradient_at(engine, w0, IMAGES[:2], g1)):
        assert torch.allclose(p.grad, want, rtol=1e-5, atol=1e-6)
    engine.commit(2, g2)   # its release was made at w0, not at w1: the gradient is taken there
    for p, at_w0, at_w1 in zip(engine.layer.parameters(), gradient_at(engine, w0, IMAGES[2:], g2),
                               gradient_at(engine, w1, IMAGES[2:], g2)):
        assert torch.allclose(p.grad, at_w0, rtol=1e-5, atol=1e-6)
    assert any(not torch.allclose(a, b) for a, b in zip(gradient_at(engine, w0, IMAGES[2:], g2),
                                                         gradient_at(engine, w1, IMAGES[2:], g2)))
    # and the release itself was made at w0: the lock-step device's first forward of those images
    lockstep = DeviceTrainer(SPEC, "conv1", "server", 2, TrainConfig(lr=0.1))
    assert np.array_equal(lockstep.forward(IMAGES[2:], ("train", 2), IDS[2:], LABELS[2:]), second)
    assert engine.committed == 2 and not engine._pending


def test_at_most_one_batch_waits_and_a_rollback_drops_the_one_made_ahead():
    engine = DeviceTrainer(SPEC, "conv1", "server", 2, pipeline=True)
    engine.forward(IMAGES[:2], ("train", 1), IDS[:2], LABELS[:2])
    engine.forward(IMAGES[2:], ("train", 2), IDS[2:], LABELS[2:])
    with pytest.raises(RuntimeError, match="at most one batch may wait"):
        engine.forward(IMAGES[:2], ("train", 3), IDS[:2], LABELS[:2])
    engine.rollback(0)
    assert not engine._pending
    with pytest.raises(RuntimeError, match="commit of batch 1 without its forward"):
        engine.commit(1, np.zeros((2, *engine.release_shape), np.float32))


@pytest.mark.parametrize("head, training, words", [("device", "plain", "device head"),
                                                   ("server", "dpsgd", "DP-SGD clips")])
def test_pipelining_is_refused_where_the_step_needs_the_current_weights(head, training, words):
    with pytest.raises(ValueError, match=words):
        DeviceTrainer(SPEC, "conv1", head, 2, privacy=PrivacyEngine(layer_training=training, dpsgd_clip=1.0,
                                                                    dpsgd_noise=1.0), pipeline=True)


@pytest.mark.slow  # exports and verifies the ONNX programs
def test_a_runtime_takes_the_pipelined_gradient_at_the_same_weights(tmp_path):
    from splitface.device.runtimes import load_runtime

    eager = DeviceTrainer(SPEC, "conv1", "server", 2, TrainConfig(lr=0.1), pipeline=True)
    onnx = DeviceTrainer(SPEC, "conv1", "server", 2, TrainConfig(lr=0.1), pipeline=True)
    onnx.attach_runtime(load_runtime("onnxruntime", onnx.layer, SPEC.input_size, 2, tmp_path, exporter=EXPORTER))
    grads = [np.random.default_rng(s).standard_normal((2, *eager.release_shape)).astype(np.float32) for s in (1, 2)]
    applied = {}   # engine -> the weight gradients of its two commits
    for e in (eager, onnx):
        e.forward(IMAGES[:2], ("train", 1), IDS[:2], LABELS[:2])
        e.forward(IMAGES[2:], ("train", 2), IDS[2:], LABELS[2:])
        applied[e] = []
        for batch_id, grad in ((1, grads[0]), (2, grads[1])):
            e.commit(batch_id, grad)
            applied[e].append([p.grad.clone() for p in e.layer.parameters()])
    # Both commits' gradients are taken at w0 on both engines, so the program's are within GRAD_RTOL max|g| of
    # eager's (the per-evaluation tolerance export verification holds it to against eager float32), with nothing
    # carried over from the first step. Two momentum steps from the same w0 then put the weights within
    # lr ((1 + momentum) e1 + e2) of each other, plus both sides' float32 roundings (u per operation each: the
    # buffer m b + g and w - lr b, two steps).
    u, lr, m = 2.0 ** -24, 0.1, eager.config.momentum
    for k, (a, b) in enumerate(zip(eager.layer.parameters(), onnx.layer.parameters())):
        e1, e2 = (GRAD_RTOL * float(step[k].abs().max()) for step in applied[eager])
        for g_eager, g_onnx, e in zip(applied[eager], applied[onnx], (e1, e2)):
            assert float((g_eager[k] - g_onnx[k]).abs().max()) <= e
        top_w = max(float(a.abs().max()), float(b.abs().max()))
        top_b = float((1 + m) * applied[eager][0][k].abs().max() + applied[eager][1][k].abs().max())
        rounding = 2 * 2 * 2 * u * (top_w + lr * top_b)
        assert float((a - b).abs().max()) <= lr * ((1 + m) * e1 + e2) + rounding


def test_a_release_is_made_ahead_only_within_an_epoch():
    """Not after the last batch, and not across an epoch's end: the epoch's evaluation releases come between, and
    a FORWARD made before them would carry a lower spent epsilon than the server has already seen."""
    from splitface.sim.simulator import prepares_ahead

    assert [b for b in range(1, 10) if prepares_ahead(True, b, total=9, per_epoch=3)] == [1, 2, 4, 5, 7, 8]
    assert not any(prepares_ahead(False, b, total=9, per_epoch=3) for b in range(1, 10))
