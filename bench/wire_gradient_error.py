"""Why an i8 gradient hurts the device and i8c does not: the error of the device layer's weight gradient when
the server's gradient at the split travels in each encoding (docs/wire.md).

The device's weight gradient is a sum over every position of the split gradient times the input patch, and
the true sum nearly cancels (the server's batch norm right after conv1 makes the gradient orthogonal to the
layer's own output, channel by channel), so an error in the split gradient that is small against the
gradient itself can be large against the weight gradient. This trains IResNet-small split at conv1 on View 1's
DevTrain people (plain SGD, in one process: no devices, no wire) and every `--every` steps passes the same split
gradient through each encoding and back, reporting the relative error of conv1's weight gradient
(||dW' - dW|| / ||dW||), beside the relative error of the split gradient itself.

Encodings: the protocol's own `encode_tensor`/`decode_tensor` (i8, i8 with stochastic rounding, i8c, f16) and,
as a what-if that the protocol does not offer, one int8 scale per channel shared by the batch's images.

    .venv/bin/python bench/wire_gradient_error.py --data ../shared/data/lfw    # results/wire/gradient_error.{json,txt}
"""
from __future__ import annotations

import argparse
import statistics
from pathlib import Path
from typing import Callable

import numpy as np
import torch
import torch.nn.functional as F

from research.results import write_record

ROOT = Path(__file__).resolve().parents[1]


def per_channel_what_if(g: np.ndarray) -> np.ndarray:
    """int8 with one scale per channel over the whole batch (not a wire encoding: the comparison between i8 and i8c)."""
    peak = np.abs(g).max(axis=(0, *range(2, g.ndim)), keepdims=True)
    scale = np.where(peak > 0, peak / 127, 1.0).astype(np.float32)
    return (np.clip(np.rint(g / scale), -127, 127) * scale).astype(np.float32)


def encodings(rng: np.random.Generator) -> dict[str, Callable[[np.ndarray], np.ndarray]]:
    from splitface.protocol.tensor import decode_tensor, encode_tensor

    def wire(encoding: str, dither: np.random.Generator | None = None) -> Callable[[np.ndarray], np.ndarray]:
        return lambda g: np.asarray(decode_tensor(encode_tensor(g, encoding, dither=dither)))
    return {"i8": wire("i8"), "i8 stochastic": wire("i8", rng), "int8 per channel (what-if)": per_channel_what_if,
            "i8c": wire("i8c"), "f16": wire("f16")}


def relative(a: np.ndarray, b: np.ndarray) -> float:
    return float(np.linalg.norm(a - b) / np.linalg.norm(b))


def measure(data: Path, steps: int, every: int, batch: int, seed: int) -> list[dict]:
    from splitface.common.data import load_lfw
    from splitface.common.models import build_backbone, build_classifier, resolve_spec, split_backbone, to_input

    torch.manual_seed(seed)
    rng = np.random.default_rng(seed)   # the batches; the dithering has its own stream, so the columns see the same
    codecs = encodings(np.random.default_rng([seed, 1]))
    spec = resolve_spec("iresnet_small")
    backbone = build_backbone(spec)
    device, server = split_backbone(backbone, "conv1")
    split = load_lfw(data, people="devtrain", seed=seed)
    head = build_classifier(spec, len(split.train.class_names))
    optimizer = torch.optim.SGD([*backbone.parameters(), *head.parameters()], lr=0.05, momentum=0.9)
    images, labels = split.train.load(spec.input_size), split.train.labels
    weights = [p for p in device.parameters() if p.requires_grad]   # conv1's weight (batch norm is the server's)
    rows = []
    for step in range(steps + 1):
        pick = rng.choice(len(labels), batch, replace=False)
        x, y = to_input(images[pick]), torch.as_tensor(labels[pick])
        out = device(x)
        cut = out.detach().requires_grad_()
        loss = F.cross_entropy(head(server(cut)), y)
        optimizer.zero_grad()
        loss.backward()
        g = cut.grad.numpy()
        if step % every == 0:
            true = [t.numpy() for t in torch.autograd.grad(out, weights, cut.grad, retain_graph=True)]
            row = {"step": step, "loss": loss.item(), "encodings": {}}
            for name, codec in codecs.items():
                sent = codec(g)
                got = torch.autograd.grad(out, weights, torch.from_numpy(sent), retain_graph=True)
                row["encodings"][name] = {"split_gradient": relative(sent, g),
                                          "weight_gradient": max(relative(w.numpy(), t) for w, t in zip(got, true))}
            rows.append(row)
        out.backward(cut.grad)
        optimizer.step()
    return rows


def table(rows: list[dict], args: argparse.Namespace) -> str:
    names = list(rows[0]["encodings"])
    lines = [f"IResNet-small split at conv1, View 1 DevTrain people, batch {args.batch}, plain SGD (lr 0.05, momentum "
             f"0.9) for {args.steps} steps, seed {args.seed}; every {args.every} steps the split gradient goes through each "
             "encoding and back. Relative error of conv1's weight gradient (of the split gradient in brackets).", "",
             "| step | loss | " + " | ".join(names) + " |", "|---:|---:|" + "---:|" * len(names)]
    for r in rows:
        cells = [f"{r['encodings'][n]['weight_gradient']:.3f} ({r['encodings'][n]['split_gradient']:.3f})" for n in names]
        lines.append(f"| {r['step']} | {r['loss']:.2f} | " + " | ".join(cells) + " |")
    span = [f"{n}: {min(r['encodings'][n]['weight_gradient'] for r in rows):.3f}-"
            f"{max(r['encodings'][n]['weight_gradient'] for r in rows):.3f} (median "
            f"{statistics.median(r['encodings'][n]['weight_gradient'] for r in rows):.3f})" for n in names]
    return "\n".join(lines + ["", "Weight-gradient error, range over the measured steps: " + "; ".join(span) + "."]) + "\n"


def main(argv: list[str] | None = None) -> None:
    from splitface.common.options import add_data_root_arg

    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_data_root_arg(p, required=True, help="LFW root (with View 1's people files)")
    p.add_argument("--steps", type=int, default=60)
    p.add_argument("--every", type=int, default=10)
    p.add_argument("--batch", type=int, default=64)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out", type=Path, default=ROOT / "results" / "wire")
    args = p.parse_args(argv)
    torch.set_num_threads(1)
    rows = measure(args.data, args.steps, args.every, args.batch, args.seed)
    write_record(args.out / "gradient_error", {"args": {k: str(v) for k, v in vars(args).items()}, "rows": rows},
                 table(rows, args), newline=True)


if __name__ == "__main__":
    main()
