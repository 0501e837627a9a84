"""VGG-Face backbone (VGG-16 layout), as used by the source paper.

Stage "conv1" (conv1_1 + ReLU + PaperLRN) is the layer the phone runs; every
later stage is separately named so the model can be split anywhere. The
classifier (fc8) is not part of the backbone: the server owns it and its size
depends on the identities being trained.
"""

from __future__ import annotations

from collections import OrderedDict
from typing import Iterator

from torch import nn

from splitface.common.models.lrn import PaperLRN

BLOCKS = (2, 2, 3, 3, 3)
MULTIPLIERS = (1, 2, 4, 8, 8)


def _conv_relu(cin: int, cout: int) -> nn.Sequential:
    return nn.Sequential(nn.Conv2d(cin, cout, kernel_size=3, stride=1, padding=1), nn.ReLU())


def vgg_face_stages(
    input_size: int = 224,
    width: int = 64,
    fc_width: int = 4096,
    dropout: float = 0.5,
) -> "OrderedDict[str, nn.Module]":
    """Ordered stages conv1, conv1_2, pool1, ..., pool5, fc6, fc7.

    Returned as stages (not one module) so the split point is a name, not an
    index into an opaque Sequential.
    """
    if input_size < 32 or input_size % 32:
        raise ValueError(f"vgg_face input_size must be a positive multiple of 32, got {input_size}")
    return OrderedDict(iter_vgg_face_stages(input_size, width, fc_width, dropout))


def iter_vgg_face_stages(input_size: int, width: int, fc_width: int, dropout: float) -> Iterator[tuple[str, nn.Module]]:
    """The stages one at a time, each built only when asked for (a device builds its own, not the server's)."""
    cin = 3
    for b, (n_convs, mult) in enumerate(zip(BLOCKS, MULTIPLIERS), start=1):
        cout = mult * width
        for c in range(1, n_convs + 1):
            if b == 1 and c == 1:
                # The device layer: LRN bounds the activations that leave the phone.
                yield "conv1", nn.Sequential(
                    nn.Conv2d(cin, cout, kernel_size=3, stride=1, padding=1),
                    nn.ReLU(),
                    PaperLRN(cout, size=5, alpha=1.0, beta=0.5, gamma=2.0),
                )
            else:
                yield f"conv{b}_{c}", _conv_relu(cin, cout)
            cin = cout
        yield f"pool{b}", nn.MaxPool2d(kernel_size=2, stride=2)
    spatial = input_size // 32
    yield "fc6", nn.Sequential(
        nn.Flatten(1),
        nn.Linear(cin * spatial * spatial, fc_width),
        nn.ReLU(),
        nn.Dropout(dropout),
    )
    yield "fc7", nn.Sequential(nn.Linear(fc_width, fc_width), nn.ReLU(), nn.Dropout(dropout))
