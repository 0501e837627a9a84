"""The exported device programs: the hand-written ONNX backward equals autograd, every artifact
verifies against PyTorch on random and real faces, and a wrong artifact is caught loudly."""
from __future__ import annotations

import numpy as np
import pytest
import torch

from splitface.common.data import load_lfw
from splitface.device.trainer import DeviceTrainer, PrivacyEngine, to_input
from splitface.common.models import build_backbone, resolve_spec, split_backbone
from splitface.common.models.lrn import PaperLRN
from splitface.device.privacy.mechanisms import PerImageGaussian
from splitface.device.runtimes import load_runtime
from splitface.device.runtimes.manifest import Manifest
from splitface.export.programs import LayerVJP
from splitface.device.runtimes.parity import ExportMismatch, verify
from splitface.export.verify import export_verified


def device_layer(model: str, clamp: float | None) -> torch.nn.Module:
    torch.manual_seed(0)
    layer, _ = split_backbone(build_backbone(resolve_spec(model)), "conv1")
    for lrn in (m for m in layer.modules() if isinstance(m, PaperLRN)):
        lrn.input_max = clamp
    return layer


@pytest.mark.parametrize("model", ["vgg_face_small", "iresnet_small"])
@pytest.mark.parametrize("clamp", [None, 1.0])
def test_hand_written_vjp_equals_autograd(model, clamp):
    layer = device_layer(model, clamp)
    x = torch.rand(3, 3, 64, 64) * 2  # values above the clamp exercise its mask
    grad = torch.randn_like(layer(x))
    layer.zero_grad()
    (layer(x) * grad).sum().backward()
    got = LayerVJP(layer)(x, grad, *[p.detach() for p in layer.parameters()])
    for g, p in zip(got, layer.parameters()):
        assert torch.allclose(g, p.grad, rtol=1e-4, atol=1e-5 * p.grad.abs().max().item())


@pytest.fixture(scope="module")
def faces(lfw) -> np.ndarray:
    split = load_lfw(lfw, min_images=10, max_identities=2)
    return split.train.subset(np.arange(4)).load(64, 160)


def test_every_artifact_verifies_on_random_and_real_faces(tmp_path, faces):
    layer = device_layer("iresnet_small", 1.0)
    manifest = export_verified(layer, 64, 4, tmp_path, faces)
    names = set(manifest.verification["checks"])
    for runtime in ("executorch", "onnxruntime"):
        for images in ("random", "real"):
            for weights in ("weights", "perturbed weights"):
                assert f"{runtime}: {images} images, {weights}" in names
    assert all(c["ok"] for c in manifest.verification["checks"].values())
    assert Manifest.load(tmp_path).input_max == 1.0
    for f in ("release.pte", "train.pte", "release.onnx", "vjp.onnx"):
        assert (tmp_path / f).stat().st_size > 0
    # With the weights as inputs, release.pte's conv is a portable kernel (a .pte names the kernels it calls);
    # test_export_gemm.py checks that the im2col programs have none.
    assert b"aten::convolution" in (tmp_path / "release.pte").read_bytes()
    # The LRN runs as its 5-tap window in the ONNX programs too: the convs are conv1's (and its weight gradient's).
    import onnx
    for f, convs in (("release.onnx", 1), ("vjp.onnx", 2)):
        ops = [node.op_type for node in onnx.load(str(tmp_path / f)).graph.node]
        assert ops.count("Conv") == convs and "Pad" not in ops, (f, ops)

    # The same artifacts judged against a different layer (no clamp, other weights) must fail, not pass quietly.
    other = device_layer("iresnet_small", None)
    with torch.no_grad():
        for p in other.parameters():
            p.mul_(3.0)
    with pytest.raises(ExportMismatch, match="release error"):
        verify(other, tmp_path, faces)

    # A runtime refuses artifacts exported for another batch size or clamp instead of computing nonsense.
    with pytest.raises(ValueError, match="re-export"):
        load_runtime("onnxruntime", layer, 64, 8, tmp_path)
    with pytest.raises(ValueError, match="re-export"):
        load_runtime("executorch", other, 64, 4, tmp_path)


def test_static_weights_put_the_conv_in_xnnpack_and_still_verify(tmp_path):
    layer = device_layer("iresnet_small", None)
    manifest = export_verified(layer, 64, 2, tmp_path, static_weights=True)
    assert manifest.static_weights and all(c["ok"] for c in manifest.verification["checks"].values())
    assert not any("perturbed" in name for name in manifest.verification["checks"])
    # the im2col backend refuses artifacts exported without its programs
    for backend in ("executorch-xnnpack", "native"):  # one refusal, before the native runner is built
        with pytest.raises(ValueError, match=f"the {backend} backend runs the im2col programs, and .* has none .* --gemm"):
            load_runtime(backend, layer, 64, 2, tmp_path)

    # ... and serve only a frozen layer: a layer that trains is refused, and so are weights other than the baked ones.
    spec = resolve_spec("iresnet_small")
    runtime = load_runtime("executorch", layer, 64, 2, tmp_path)
    trains = DeviceTrainer(spec, "conv1", "server", 3)
    with pytest.raises(ValueError, match="baked in .* this layer trains"):
        trains.attach_runtime(runtime)
    frozen = DeviceTrainer(spec, "conv1", "server", 3, privacy=PrivacyEngine(layer_training="frozen"))
    frozen.layer.load_state_dict(layer.state_dict())
    frozen.attach_runtime(runtime)
    images = np.random.default_rng(0).integers(0, 256, (2, 3, 64, 64), dtype=np.uint8)
    released = frozen.evaluate_release(images, ("eval", 0, 0), [0, 1], [0, 0])
    np.testing.assert_allclose(released, layer(to_input(images)).detach().numpy(), atol=1e-4)
    with torch.no_grad():
        # weights changed behind the program's back: never a stale release
        frozen.layer.stages["conv1"][0].weight[0, 0, 0, 0] += 0.1
    with pytest.raises(ValueError, match="not those"):
        frozen.evaluate_release(images, ("eval", 0, 1), [0, 1], [0, 0])
    # ONNX Runtime's programs take the weights as inputs even from a static export: they may train
    trains.attach_runtime(load_runtime("onnxruntime", layer, 64, 2, tmp_path))


def test_runtimes_refuse_what_they_cannot_compute(tmp_path):
    layer = device_layer("iresnet_small", None)
    export_verified(layer, 64, 2, tmp_path)
    runtime = load_runtime("onnxruntime", layer, 64, 2, tmp_path)
    clipped = DeviceTrainer(resolve_spec("iresnet_small"), "conv1", "server", 3,
                           privacy=PrivacyEngine(mechanism=PerImageGaussian(1.0, 1.0)))
    with pytest.raises(ValueError, match="per_image"):
        clipped.attach_runtime(runtime)
    dpsgd = DeviceTrainer(resolve_spec("iresnet_small"), "conv1", "server", 3, privacy=PrivacyEngine(layer_training="dpsgd"))
    with pytest.raises(ValueError, match="DP-SGD"):
        dpsgd.attach_runtime(runtime)
    with pytest.raises(ValueError, match="exceeds the exported batch size"):
        runtime.release(torch.rand(3, 3, 64, 64), torch.zeros(3, 16, 64, 64), list(layer.parameters()))
