"""The native device runner (device_sdk/runtimes/native): built with CMake against the executorch wheel's
C++ runtime, it links no libtorch, and its release and summed weight gradient over chunks of batch-1 and
batch-2 programs equal eager PyTorch. Bad inputs stop it with a message naming the file."""
from __future__ import annotations

import subprocess

import numpy as np
import pytest
import torch

from device_sdk.models import build_device_part, resolve_spec
from device_sdk.models.lrn import PaperLRN
from device_sdk.runtimes.native import build, run_native, write_inputs
from export.artifacts import RELEASE_GEMM_PTE, VJP_GEMM_PTE, export_gemm_ptes
from export.verify import GRAD_RTOL, RELEASE_ATOL, reference

SAMPLES, SIZE = 4, 24


@pytest.fixture(scope="module")
def native(tmp_path_factory):
    """The built runner, a device layer (DP clamp on) and its im2col programs for batches 1 and 2."""
    root = tmp_path_factory.mktemp("native")
    binary = build(root / "build")
    torch.manual_seed(0)
    layer = build_device_part(resolve_spec("iresnet_small"), "conv1").eval()
    for lrn in (m for m in layer.modules() if isinstance(m, PaperLRN)):
        lrn.input_max = 1.0
    programs = {}
    for batch in (1, 2):
        images = torch.rand(batch, 3, SIZE, SIZE)
        with torch.no_grad():
            noise = torch.zeros_like(layer(images))
        release, vjp = export_gemm_ptes(layer, images, noise, None)
        programs[batch] = root / f"b{batch}"
        programs[batch].mkdir()
        (programs[batch] / RELEASE_GEMM_PTE).write_bytes(release)
        (programs[batch] / VJP_GEMM_PTE).write_bytes(vjp)
    return binary, layer, programs, root


@pytest.mark.slow  # builds the runner (CMake, a few seconds) and lowers four programs
def test_native_runner_matches_eager_in_chunks_without_libtorch(native):
    binary, layer, programs, root = native
    linked = subprocess.run(["ldd", str(binary)], capture_output=True, text=True).stdout
    assert "libexecutorch.so" in linked and "xnnpack" in linked and "torch" not in linked.replace("executorch", "")
    g = torch.Generator().manual_seed(1)
    images = 3 * torch.rand(SAMPLES, 3, SIZE, SIZE, generator=g)  # above the clamp: its mask matters
    shape = layer(images[:1]).shape[1:]
    noise, grad = 0.1 * torch.randn((SAMPLES, *shape), generator=g), torch.randn((SAMPLES, *shape), generator=g)
    weights = [p.detach() + 0.05 * torch.randn(p.shape, generator=g) for p in layer.parameters()]  # not the exported ones
    want_release, want_grads = reference(layer, images, noise, grad, weights)
    work = root / "io"
    write_inputs(work, {"images": images.numpy(), "noise": noise.numpy(), "grad": grad.numpy(),
                        "weight": weights[0].numpy(), "bias": weights[1].numpy()})
    for batch, program in programs.items():
        report = run_native(binary, work, SAMPLES, (program / RELEASE_GEMM_PTE, ["images", "noise", "weight", "bias"]),
                            (program / VJP_GEMM_PTE, ["images", "grad", "weight", "bias"]), runs=1, warmup=0)
        assert report["program_batch"] == batch and report["grad_outputs"] == 2
        assert np.abs(report["release"] - want_release.numpy().ravel()).max() <= RELEASE_ATOL
        for got, want in zip(report["grads"], want_grads, strict=True):
            assert np.abs(got - want.numpy().ravel()).max() <= GRAD_RTOL * want.abs().max().item()
        assert 0 < report["rss_loaded_kb"] <= report["peak_forward_kb"] <= report["peak_kb"]
        assert len(report["forward_compute_ms"]) == 1 and report["forward_compute_ms"][0] > 0


@pytest.mark.slow
def test_native_runner_refuses_bad_inputs_by_name(native):
    binary, _, programs, root = native
    work = root / "bad"
    write_inputs(work, {"images": np.zeros((3, 3, SIZE, SIZE)), "noise": np.zeros(5), "weight": np.zeros(5),
                        "bias": np.zeros(5)})
    release = (programs[1] / RELEASE_GEMM_PTE, ["images", "noise", "weight", "bias"])
    with pytest.raises(RuntimeError, match=r"noise.f32 holds 20 bytes"):
        run_native(binary, work, 3, release, runs=1, warmup=0)
    with pytest.raises(RuntimeError, match="takes 4 inputs; 3 named"):
        run_native(binary, work, 3, (release[0], ["images", "noise", "weight"]), runs=1, warmup=0)
    with pytest.raises(RuntimeError, match="cannot open .*missing.f32"):
        run_native(binary, work, 3, (release[0], ["images", "missing", "weight", "bias"]), runs=1, warmup=0)
