"""The `native` backend: the device layer's release and weight gradient through the C++ runner
(`splitface/device/runtimes/native`), ExecuTorch's runtime with no Python binding and no libtorch in its process,
as a phone app would link it.

One runner process per runtime (`StripServer`) keeps the strip programs (`splitface.export.artifacts.write_strip_ptes`,
4 image rows per call) loaded and answers a request per batch; the weights are program inputs written with
every request, so each step's weights are the ones used. The engine's releases are drawn in the runner
(`keyed_release`): N(0, std^2) per value from ChaCha8 + Box-Muller under the engine's per-release key
(`PrivacyEngine.stream_key`, given with each request), added to each strip while it is in cache, so that no
100 MB noise tensor is drawn by torch and passed through a file, and a replayed release under the same key is
bit-identical (the accountant counts it once). Never a fresh OS key here: that noise would differ on a replay
the accountant counts as free. `release` still takes a noise tensor (the self-check's, any caller's own).
The exact option (`--noise discrete`, `exact_release`) is computed whole in the runner, clip, quantisation
and integer noise, under the same per-release key.

Covered: what the im2col programs cover (`Manifest.gemm_refusal`, the same refusal as `executorch-xnnpack`),
unmasked, with the image height a multiple of the strip's rows. Checked against eager PyTorch
(`splitface.device.runtimes.parity.check`, the layer's and perturbed weights) every time a runtime starts.
"""
from __future__ import annotations

import threading
from pathlib import Path

import numpy as np
import torch
from torch import nn

from splitface.device.privacy.discrete import DiscreteGaussianMechanism
from splitface.device.runtimes.base import require_gemm, training_args
from splitface.device.runtimes.manifest import RELEASE_STRIP_PTE, STRIP_FORMAT, VJP_STRIP_PTE
from splitface.device.runtimes.native import StripServer, build_cached

STRIP_ROWS = 4  # the release's fastest strip in bench/bench_native.py (docs/device.md, "The native runner")


def strip_refusal(manifest, rows: int) -> str | None:
    """Why the strip programs cannot run this export, beyond `gemm_refusal`: a mask, or rows that do not
    divide the image's height."""
    if manifest.mask_shape is not None:
        return ("the strip programs take no mask (a masked release transform: dct's channel subset, FaceMAE); "
                "use --backend executorch-xnnpack or torch")
    if manifest.input_shape[-2] % rows:
        return f"the image height {manifest.input_shape[-2]} is not a multiple of the strip's {rows} rows"
    return None


def strip_programs(layer: nn.Module, rows: int, width: int, folder: Path, exporter=None) -> tuple[Path, Path]:
    """The strip programs in `folder`, written there first by `exporter` if they are missing."""
    release, vjp = folder / RELEASE_STRIP_PTE, folder / VJP_STRIP_PTE
    if release.exists() and vjp.exists():
        return release, vjp
    if exporter is None:
        raise FileNotFoundError(f"{folder}: no strip programs (write them with splitface-export --app, or pass "
                                f"an exporter)")
    return exporter.write_strips(layer, rows, width, folder)


class NativeRuntime:
    name = "native"
    static_weights = False  # the weights are program inputs

    def __init__(self, layer: nn.Module, artifacts: Path, manifest, threads: int | None = None,
                 rows: int = STRIP_ROWS, exporter=None):
        """`exporter` (`splitface.device.runtimes.Exporter`) writes the strip programs for `rows` unless they are
        in `artifacts` already."""
        require_gemm(manifest, artifacts, self.name)
        refusal = strip_refusal(manifest, rows)
        if refusal is not None:
            raise ValueError(f"the native backend cannot run {artifacts}: {refusal}")
        self.manifest, self.batch_size, self.trainable = manifest, manifest.batch_size, manifest.trainable
        folder = artifacts / f"native-strips-{rows}-v{STRIP_FORMAT}"  # another format's programs: exported anew
        release, vjp = strip_programs(layer, rows, manifest.input_shape[-1], folder, exporter)
        self._names = [f"w{i}" for i in range(len(manifest.weight_names))]
        self._start = (build_cached(), release, vjp, self._names, "1" if threads == 1 else "all")
        self._server = StripServer(*self._start)
        self._exact: dict[tuple[str, float, int], StripServer] = {}  # the exact option's runners, by parameters
        self._keyed: dict[float, StripServer] = {}  # the runners that draw the float noise, by its std
        self._starting = threading.Lock()
        self.last_report: dict = {}  # the runner's answer to the last request (times in ms, peak RSS in kB)
        try:
            self.verification = self_check(layer, self)
        except BaseException:   # a runner that fails its check must not live on until garbage collection
            self._server.close()
            raise

    def _weights(self, weights: list[torch.Tensor]) -> dict[str, np.ndarray]:
        return {name: w.detach().numpy() for name, w in zip(self._names, weights, strict=True)}

    def release(self, images: torch.Tensor, noise: torch.Tensor, weights: list[torch.Tensor],
                mask: torch.Tensor | None = None) -> torch.Tensor:
        if mask is not None:
            raise ValueError(strip_refusal(self.manifest, 1) or "the strip programs take no mask")
        flat, self.last_report = self._server.release(
            {"images": images.numpy(), "noise": noise.numpy(), **self._weights(weights)}, len(images))
        return torch.from_numpy(flat).reshape(noise.shape)

    def keyed_release(self, images: torch.Tensor, weights: list[torch.Tensor], std: float, key: bytes) -> torch.Tensor:
        """The release plus N(0, std^2) noise the runner draws under `key` (the engine's per-release
        `PrivacyEngine.stream_key`), shaped (N, numel): the same images, weights and key give the same
        release. Its own runner process per std, started on first use; std 0 adds no noise."""
        with self._starting:  # one runner per std, however many threads ask at once
            if std not in self._keyed:
                self._keyed[std] = StripServer(*self._start, noise_std=std)
        flat, self.last_report = self._keyed[std].keyed_release(
            {"images": images.numpy(), **self._weights(weights)}, len(images), key)
        return torch.from_numpy(flat).reshape(len(images), -1)

    def exact_release(self, images: torch.Tensor, weights: list[torch.Tensor], mechanism: DiscreteGaussianMechanism,
                      key: bytes) -> np.ndarray:
        """The exact option's release, int8 of shape (N, numel): each image's layer output clipped and quantised
        (discrete.py's `clip_quantise`) plus discrete Gaussian noise, all in the runner, drawn from ChaCha20 under
        `key` (the engine's per-release `PrivacyEngine.stream_key`), so that a replay repeats its integers. Its
        own runner process, started on first use, keeps the mechanism's parameters."""
        info = mechanism.describe()
        params = (info["sigma2_steps"], info["step"], info["bound_steps"])
        with self._starting:
            if params not in self._exact:
                self._exact[params] = StripServer(*self._start, exact=params)
        flat, self.last_report = self._exact[params].exact_release(
            {"images": images.numpy(), **self._weights(weights)}, len(images), key)
        return flat.reshape(len(images), -1)

    def weight_grads(self, images: torch.Tensor, noise: torch.Tensor | None, grad: torch.Tensor,
                     weights: list[torch.Tensor], mask: torch.Tensor | None = None) -> list[torch.Tensor]:
        """The weight gradient (the noise is additive and does not enter it: None after `keyed_release`)."""
        grad = training_args(self.manifest, self.name, grad, mask)
        flats, self.last_report = self._server.grads(
            {"images": images.numpy(), "grad": grad.detach().numpy(), **self._weights(weights)}, len(images),
            len(weights))
        return [torch.from_numpy(g).reshape(w.shape) for g, w in zip(flats, weights, strict=True)]

    def close(self) -> None:
        """End the runner processes now (otherwise when the runtime is collected or Python exits)."""
        self._server.close()
        for server in (*self._exact.values(), *self._keyed.values()):
            server.close()


def self_check(layer: nn.Module, runtime: NativeRuntime) -> dict:
    """The runner against eager PyTorch on two random images with the layer's and perturbed weights, at
    splitface/device/runtimes/parity.py's tolerances; raises `ExportMismatch` naming the error otherwise."""
    from splitface.device.runtimes.parity import check, weight_variants

    shape = runtime.manifest.input_shape[1:]
    images = torch.rand((min(2, runtime.batch_size), *shape), generator=torch.Generator().manual_seed(1))
    return {name: check(layer, runtime, images, weights, f"random images, {name}")
            for name, weights in weight_variants(layer).items()}
