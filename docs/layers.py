"""Draw docs/layers.png: splitface's layers as boxes, the imports each may make as arrows.

Run from anywhere: `python docs/layers.py` (needs matplotlib). The imports themselves are checked by
tests/test_imports.py; this picture is only a map of the rule (docs/layout.md states it in words).
"""
from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402
from matplotlib.patches import FancyArrowPatch, FancyBboxPatch  # noqa: E402

OUT = Path(__file__).with_name("layers.png")

# name: (x0, y0, x1, y1, face colour, description lines)
BOXES = {
    "splitface/protocol/": (0.3, 0.5, 4.7, 1.9, "#dbe9f6",
                            ["wire format: SPEC.md, byte-exact vectors,", "sans-I/O sessions (numpy + msgpack only)"]),
    "splitface/common/": (7.3, 0.5, 11.7, 1.9, "#dbe9f6",
                          ["models, release transforms, data, optimiser,", "options, faults, accountants"]),
    "splitface/net/": (0.3, 2.8, 4.7, 4.1, "#e3f1de",
                       ["async transport, fast websockets,", "TLS, reconnect"]),
    "splitface/device/": (0.3, 5.1, 4.7, 6.5, "#fdebd3",
                          ["device SDK: connection, trainer, privacy", "engine, runtimes, simulator, federated"]),
    "splitface/server/": (7.3, 5.1, 11.7, 6.5, "#fdebd3",
                          ["edge server: app, auth, checkpoints, metrics,", "recorder, split trainer, federated serving"]),
    "splitface/export/": (4.6, 7.3, 7.4, 8.5, "#f6e0ec",
                          ["ExecuTorch / ONNX programs,", "Android app bundle"]),
    "research/": (0.5, 9.3, 5.6, 10.6, "#eeeeee",
                  ["audit, distillation, evaluation, FaceMAE, ResSFL,", "federated experiments, frontier, DP sweep, demo"]),
    "bench/": (6.4, 9.3, 11.5, 10.6, "#eeeeee",
               ["performance benchmarks", "(side-by-side ratios)"]),
}

# (importer, imported, attach point on importer, attach point on imported, curvature)
ARROWS = [
    ("splitface/common/", "splitface/protocol/", (7.3, 1.2), (4.7, 1.2), 0.0),
    ("splitface/net/", "splitface/protocol/", (2.5, 2.8), (2.5, 1.9), 0.0),
    ("splitface/device/", "splitface/net/", (2.5, 5.1), (2.5, 4.1), 0.0),
    ("splitface/device/", "splitface/protocol/", (0.3, 5.5), (0.3, 1.5), 0.35),
    ("splitface/device/", "splitface/common/", (4.7, 5.3), (7.9, 1.9), 0.0),
    ("splitface/server/", "splitface/common/", (9.5, 5.1), (9.5, 1.9), 0.0),
    ("splitface/server/", "splitface/net/", (7.3, 5.4), (4.7, 3.7), 0.0),
    ("splitface/server/", "splitface/protocol/", (7.6, 5.1), (4.3, 1.9), 0.0),
    ("splitface/export/", "splitface/device/", (5.0, 7.3), (3.6, 6.5), 0.0),
    ("splitface/export/", "splitface/common/", (6.6, 7.3), (8.4, 1.9), 0.0),
]


def main() -> None:
    fig, ax = plt.subplots(figsize=(10, 8.6))
    ax.set_xlim(-0.6, 12.4)
    ax.set_ylim(-0.9, 11.6)
    ax.axis("off")

    for name, (x0, y0, x1, y1, colour, lines) in BOXES.items():
        dashed = name in ("research/", "bench/")
        ax.add_patch(FancyBboxPatch((x0, y0), x1 - x0, y1 - y0, boxstyle="round,pad=0.02,rounding_size=0.15",
                                    facecolor=colour, edgecolor="#333333", linewidth=1.3,
                                    linestyle="--" if dashed else "-", zorder=2))
        cx = (x0 + x1) / 2
        ax.text(cx, y1 - 0.32, name, ha="center", va="center", fontsize=11, fontweight="bold",
                family="monospace", zorder=3)
        ax.text(cx, (y0 + y1) / 2 - 0.22, "\n".join(lines), ha="center", va="center", fontsize=8, zorder=3)

    for _, _, start, end, rad in ARROWS:
        ax.add_patch(FancyArrowPatch(start, end, arrowstyle="-|>", mutation_scale=14, linewidth=1.3,
                                     color="#1f4e79", connectionstyle=f"arc3,rad={rad}", zorder=1))

    # research/ and bench/ may import every layer below
    ax.add_patch(FancyArrowPatch((6.0, 9.3), (6.0, 8.5), arrowstyle="-|>", mutation_scale=18, linewidth=2.2,
                                 color="#555555", zorder=1))
    ax.text(6.0, 8.95, "  may import everything below", ha="left", va="center", fontsize=8.5, color="#555555",
            style="italic")

    # device and server never import each other
    ax.plot([6.0, 6.0], [5.2, 6.4], color="#b22222", linewidth=1.5, linestyle=":")
    ax.text(6.0, 5.8, "no imports\neither way", ha="center", va="center", fontsize=8, color="#b22222",
            bbox=dict(facecolor="white", edgecolor="none", pad=1.0))

    # the Android demo speaks the protocol from SPEC.md alone, in Java
    ax.add_patch(FancyBboxPatch((8.4, 7.3), 3.1, 1.2, boxstyle="round,pad=0.02,rounding_size=0.15",
                                facecolor="white", edgecolor="#888888", linestyle="--", linewidth=1.0))
    ax.text(9.95, 8.05, "android_demo/", ha="center", va="center", fontsize=10, fontweight="bold",
            family="monospace", color="#555555")
    ax.text(9.95, 7.65, "JVM: the protocol from SPEC.md,\nno Python imports", ha="center", va="center",
            fontsize=7.5, color="#555555")

    ax.text(6.0, 11.25, "splitface: layers and the imports they allow", ha="center", va="center",
            fontsize=13, fontweight="bold")
    ax.text(6.0, -0.45, "An arrow A → B: A may import B. Nothing imports upwards. "
            "splitface/protocol/ imports only numpy and msgpack.", ha="center", va="center", fontsize=8.5)

    fig.savefig(OUT, dpi=110, bbox_inches="tight")
    print(f"wrote {OUT}")


if __name__ == "__main__":
    main()
