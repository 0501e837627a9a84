"""ExecuTorch with every large op in XNNPACK while the layer trains: the im2col programs.

XNNPACK runs a conv only with constant weights, so `executorch` (weights as inputs) runs conv1 on
portable kernels. release_gemm.pte writes the conv as im2col times the weight matrix (a `bmm` of two
run-time tensors, which XNNPACK takes), and vjp_gemm.pte computes the weight gradient in closed form
with the same ops (`splitface/export/gemm_programs.py`), so the weights stay program inputs: a weight update
costs nothing, and no training program on portable kernels runs.
"""
from __future__ import annotations

from pathlib import Path

import torch

from splitface.device.runtimes.base import mask_args, padded, require_gemm, training_args


class ExecuTorchGemmRuntime:
    name = "executorch-xnnpack"
    static_weights = False  # both programs take the weights as inputs

    def __init__(self, artifacts: Path, manifest, threads: int | None = None):
        from executorch.extension.pybindings import portable_lib

        from splitface.device.runtimes.manifest import RELEASE_GEMM_PTE, VJP_GEMM_PTE

        require_gemm(manifest, artifacts, self.name)
        if threads is not None:
            portable_lib._unsafe_reset_threadpool(threads)
        self.manifest, self.batch_size, self.trainable = manifest, manifest.batch_size, manifest.trainable
        self._release = portable_lib._load_for_executorch(str(artifacts / RELEASE_GEMM_PTE))
        self._vjp = portable_lib._load_for_executorch(str(artifacts / VJP_GEMM_PTE))

    def release(self, images: torch.Tensor, noise: torch.Tensor, weights: list[torch.Tensor],
                mask: torch.Tensor | None = None) -> torch.Tensor:
        n = len(images)
        args = [padded(images, self.batch_size), padded(noise, self.batch_size), *mask_args(self.manifest, n, mask),
                *(w.detach().contiguous() for w in weights)]
        return self._release.forward(args)[0][:n].clone()

    def weight_grads(self, images: torch.Tensor, noise: torch.Tensor, grad: torch.Tensor,
                     weights: list[torch.Tensor], mask: torch.Tensor | None = None) -> list[torch.Tensor]:
        grad = training_args(self.manifest, self.name, grad, mask)
        args = [padded(images, self.batch_size), padded(grad, self.batch_size),
                *(w.detach().contiguous() for w in weights)]
        return [g.clone() for g in self._vjp.forward(args)]
