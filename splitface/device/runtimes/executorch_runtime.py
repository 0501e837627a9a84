"""ExecuTorch: the XNNPACK release program, then the portable joint forward-backward program."""
from __future__ import annotations

from pathlib import Path

import torch

from splitface.device.runtimes.base import mask_args, padded, training_args


class StaleWeights(ValueError):
    """A static-weight program was handed weights other than those it holds."""


class ExecuTorchRuntime:
    name = "executorch"

    def __init__(self, artifacts: Path, manifest, threads: int | None = None):
        from executorch.extension.pybindings import portable_lib
        from executorch.extension.training.pybindings._training_module import _load_for_executorch_for_training

        from splitface.device.runtimes.manifest import RELEASE_PTE, TRAIN_PTE

        if threads is not None:
            portable_lib._unsafe_reset_threadpool(threads)
        self.manifest, self.batch_size = manifest, manifest.batch_size
        # release.pte computes with the weights baked in at export: only a layer that never changes may use it
        self.static_weights = bool(manifest.static_weights)
        self.trainable = manifest.trainable
        self._release = portable_lib._load_for_executorch(str(artifacts / RELEASE_PTE))
        # A layer without parameters (the dct release) has no training program.
        self._train = (_load_for_executorch_for_training(str(artifacts / TRAIN_PTE))
                       if manifest.weight_names and self.trainable else None)
        self._params: list[torch.Tensor] | None = None

    def release(self, images: torch.Tensor, noise: torch.Tensor, weights: list[torch.Tensor],
                mask: torch.Tensor | None = None) -> torch.Tensor:
        n = len(images)
        args = [padded(images, self.batch_size), padded(noise, self.batch_size), *mask_args(self.manifest, n, mask)]
        if self.static_weights:
            from splitface.device.runtimes.manifest import weights_digest

            if weights_digest(weights) != self.manifest.weights_digest:
                raise StaleWeights("this release.pte has weights baked in, and the layer's weights are not those: "
                                   "a static-weight export serves only a frozen layer; re-export without "
                                   "--static-weights")
        else:
            args += [w.detach().contiguous() for w in weights]
        return self._release.forward(args)[0][:n].clone()

    def weight_grads(self, images: torch.Tensor, noise: torch.Tensor, grad: torch.Tensor,
                     weights: list[torch.Tensor], mask: torch.Tensor | None = None) -> list[torch.Tensor]:
        grad = training_args(self.manifest, self.name, grad, mask)
        if self._train is None:
            return []
        args = (padded(images, self.batch_size), padded(noise, self.batch_size), padded(grad, self.batch_size))
        if self._params is None:
            # The program's own weight buffers are reachable only after one call.
            self._train.forward_backward("forward", args)
            named = self._train.named_parameters()
            self._params = [named[f"layer.{name}"] for name in self.manifest.weight_names]
        for target, w in zip(self._params, weights):
            target.copy_(w.detach())           # aliases the program's memory: the next call uses w
        self._train.forward_backward("forward", args)
        grads = self._train.named_gradients()
        return [grads[f"layer.{name}"] for name in self.manifest.weight_names]
