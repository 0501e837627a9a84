"""The device layer as the Android demo's Java core takes it (android_demo/core's `Cli`, `DeviceLayer`): the conv's
geometry, the paper's LRN constants and clamp, and the weights as little-endian float32 bytes, for a msgpack job.
The Java reference layer rebuilds the layer from these numbers; `GemmLayerTrainer` gives the same weights to the
im2col programs (`export_gemm_ptes`)."""
from __future__ import annotations

from torch import nn

from splitface.common.models.lrn import PaperLRN


def java_layer_job(layer: nn.Module) -> dict:
    """The job keys "conv", "lrn", "weight" and "bias" for a conv + ReLU + LRN device layer."""
    conv = next(m for m in layer.modules() if isinstance(m, nn.Conv2d))
    lrn = next(m for m in layer.modules() if isinstance(m, PaperLRN))
    f32 = lambda t: t.detach().numpy().astype("<f4").tobytes()  # noqa: E731
    return {"conv": {"cin": conv.in_channels, "cout": conv.out_channels, "k": conv.kernel_size[0],
                     "stride": conv.stride[0], "pad": conv.padding[0]},
            "lrn": {"size": lrn.size, "alpha": lrn.alpha, "beta": lrn.beta, "gamma": lrn.gamma, "input_max": lrn.input_max},
            "weight": f32(conv.weight), "bias": None if conv.bias is None else f32(conv.bias)}
