"""Draw docs/layers.png from the layering contract itself (pyproject.toml's [tool.importlinter]), so that the
picture cannot drift from what `lint-imports` checks in the test suite.

Run from the repository root: `python docs/layers.py` (needs matplotlib). Each row is a layer: it may import
the rows below it, never those above. Rooms side by side in one row must not import each other.
"""
import tomllib
from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402
from matplotlib.patches import FancyArrowPatch, FancyBboxPatch  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
OUT = Path(__file__).with_name("layers.png")

WHAT = {
    "research": "experiments: the demo (main job), audit, distillation,\nevaluation, FaceMAE, ResSFL, federated "
                "experiments,\nfrontier, DP sweep (bench/ sits beside it)",
    "splitface.device_cli": "splitface-device: the simulator, the federated\ndevice and the privacy planner, as subcommands",
    "splitface.sim": "simulated devices (processes or Ray actors),\nexporting their programs when needed",
    "splitface.export": "ExecuTorch / ONNX programs, verified;\nthe Android app's bundle",
    "splitface.server": "edge server: app, auth, checkpoints,\nmetrics, recorder, split trainer",
    "splitface.device": "device SDK: connection, trainer, privacy\nengine, runtimes, federated device",
    "splitface.net": "the I/O layer: async transport, fast\nwebsocket connections, TLS",
    "splitface.common": "shared core: models, release transforms,\ndata, options, optimiser, faults, accountants",
    "splitface.protocol": "the wire: SPEC.md, byte-exact vectors,\nsans-I/O sessions (numpy + msgpack only)",
}
COLOURS = ["#eeeeee", "#ececf9", "#f3e6f7", "#f6e0ec", "#fdebd3", "#e3f1de", "#dbe9f6"]


def path(room: str) -> str:
    """The room's folder (splitface/sim/), or its one module (splitface/device_cli.py)."""
    folder = room.replace(".", "/")
    return folder + "/" if (ROOT / folder).is_dir() else folder + ".py"


def contracts() -> list[dict]:
    return tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["importlinter"]["contracts"]


def layers() -> list[list[str]]:
    contract = next(c for c in contracts() if c["type"] == "layers")
    return [[room.strip() for room in layer.split("|")] for layer in contract["layers"]]


def forbidden() -> str:
    """The forbidden contracts in words: imports that the layers alone would allow."""
    return "; ".join(f"{', '.join(c['source_modules'])} never import {', '.join(c['forbidden_modules'])}"
                     for c in contracts() if c["type"] == "forbidden")


def main() -> None:
    rows = layers()
    width, row_h, gap = 12.0, 1.35, 0.55
    height = len(rows) * (row_h + gap)
    fig, ax = plt.subplots(figsize=(9.5, 0.75 * height + 1.2))
    ax.set_xlim(-0.3, width + 0.3)
    ax.set_ylim(-0.9, height + 0.6)
    ax.axis("off")
    for i, rooms in enumerate(rows):
        y0 = height - (i + 1) * (row_h + gap) + gap
        room_w = (width - 0.5 * (len(rooms) - 1)) / len(rooms)
        for j, room in enumerate(rooms):
            x0 = j * (room_w + 0.5)
            ax.add_patch(FancyBboxPatch((x0, y0), room_w, row_h, boxstyle="round,pad=0.02,rounding_size=0.12",
                                        facecolor=COLOURS[min(i, len(COLOURS) - 1)], edgecolor="#333333",
                                        linewidth=1.2, linestyle="--" if room == "research" else "-"))
            ax.text(x0 + room_w / 2, y0 + row_h - 0.28, path(room), ha="center", va="center",
                    fontsize=10.5, fontweight="bold", family="monospace")
            ax.text(x0 + room_w / 2, y0 + row_h / 2 - 0.18, WHAT.get(room, ""), ha="center", va="center",
                    fontsize=7.8)
            if j:
                ax.text(x0 - 0.25, y0 + row_h / 2, "✕", ha="center", va="center", fontsize=12, color="#b22222")
        if i + 1 < len(rows):
            ax.add_patch(FancyArrowPatch((width / 2, y0), (width / 2, y0 - gap), arrowstyle="-|>",
                                         mutation_scale=14, linewidth=1.4, color="#1f4e79"))
    ax.text(width / 2, height + 0.3, "splitface: layers and the imports they allow", ha="center", va="center",
            fontsize=13, fontweight="bold")
    ax.text(width / 2, -0.55, "A row may import the rows below it (arrows), never above; ✕: rooms of one row do not "
            "import each other.\nAlso: " + forbidden() + ".\nChecked by lint-imports (pyproject.toml) in the test suite. android_demo/ (Java) "
            "speaks the protocol from SPEC.md alone.", ha="center", va="center", fontsize=8)
    fig.savefig(OUT, dpi=110, bbox_inches="tight")
    print(f"wrote {OUT}")


if __name__ == "__main__":
    main()
