"""ONNX Runtime: release.onnx forward, vjp.onnx for the weight gradient (weights as inputs)."""
from __future__ import annotations

from pathlib import Path

import numpy as np
import torch

from splitface.device.runtimes.base import mask_args, padded, training_args


class OnnxRuntime:
    name = "onnxruntime"

    def __init__(self, artifacts: Path, manifest, threads: int | None = None):
        import onnxruntime as ort

        from splitface.device.runtimes.manifest import RELEASE_ONNX, VJP_ONNX

        options = ort.SessionOptions()
        if threads is not None:
            options.intra_op_num_threads = threads
            options.inter_op_num_threads = 1
        self.manifest, self.batch_size = manifest, manifest.batch_size
        self.static_weights = False  # both ONNX programs take the weights as inputs, whatever the export
        self.trainable = manifest.trainable
        providers = ["CPUExecutionProvider"]
        self._release = ort.InferenceSession(str(artifacts / RELEASE_ONNX), options, providers=providers)
        # A layer without parameters (the dct release) has no backward program.
        self._vjp = (ort.InferenceSession(str(artifacts / VJP_ONNX), options, providers=providers)
                     if manifest.weight_names and self.trainable else None)

    def _feed(self, session, tensors: list[torch.Tensor]) -> dict[str, np.ndarray]:
        # The exporter drops inputs a graph does not use (the VJP ignores the noise): feed by name.
        names = ["images", "noise", *(["mask"] if self.manifest.mask_shape else [])] if session is self._release \
            else ["images", "grad"]
        names += self.manifest.weight_names
        wanted = {i.name for i in session.get_inputs()}
        return {k: t.detach().numpy() for k, t in zip(names, tensors) if k in wanted}

    def release(self, images: torch.Tensor, noise: torch.Tensor, weights: list[torch.Tensor],
                mask: torch.Tensor | None = None) -> torch.Tensor:
        n = len(images)
        feed = self._feed(self._release, [padded(images, self.batch_size), padded(noise, self.batch_size),
                                          *mask_args(self.manifest, n, mask), *weights])
        return torch.from_numpy(self._release.run(None, feed)[0][:n].copy())

    def weight_grads(self, images: torch.Tensor, noise: torch.Tensor, grad: torch.Tensor,
                     weights: list[torch.Tensor], mask: torch.Tensor | None = None) -> list[torch.Tensor]:
        grad = training_args(self.manifest, self.name, grad, mask)
        if self._vjp is None:
            return []
        feed = self._feed(self._vjp, [padded(images, self.batch_size), padded(grad, self.batch_size), *weights])
        return [torch.from_numpy(g) for g in self._vjp.run(None, feed)]
