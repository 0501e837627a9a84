"""The Android app's folder (`splitface-export --app`): everything the app's trainer needs, and nothing else.

- release_strip.pte, vjp_strip.pte  the strip programs that android_demo/core's `StripLayerTrainer` runs through
                                    libsplitface_jni (the native runner's strip layer; weights are inputs)
- layer.msgpack                     the starting layer: conv geometry, LRN constants and clamp, weight and bias
                                    (`java_layer_job`, little-endian float32)
- job.msgpack                       the job: server URL (or a placeholder the app must replace), model spec, split,
                                    release, wire encodings, batch size, epochs, SGD, the noise (epsilon, delta)
                                    and budget, the server's class names (the app's faces/<name>/ folders)
- schedule.msgpack                  with --epsilon and --budget: the per-image epsilon after k releases (the phone
                                    composes nothing itself; `BudgetGuard.fromSchedule`)
- bundle.msgpack                    the manifest: format, version, each file's size and SHA-256, the strip rows and
                                    the image size; `AppBundle.load` (Java) refuses a folder that does not match it

One definition of the file names and format: the constants below and `AppBundle`'s, which the tests hold together.
"""
from __future__ import annotations

import hashlib
from pathlib import Path

import msgpack
from torch import nn

from splitface.common.models import ModelSpec
from splitface.common.models.lrn import PaperLRN

from splitface.device.runtimes.manifest import RELEASE_STRIP_PTE, VJP_STRIP_PTE
from splitface.export.artifacts import write_strip_ptes
from splitface.export.java_layer import java_layer_job

# 2: the strip programs hold only the conv's GEMMs and the clamp; the strip layer does the LRN and its backward
FORMAT, VERSION = "splitface-app", 2
MANIFEST, LAYER, JOB, SCHEDULE = "bundle.msgpack", "layer.msgpack", "job.msgpack", "schedule.msgpack"
URL_PLACEHOLDER = "wss://EDGE-SERVER.invalid:8765"  # AppBundle refuses to connect to it: the app asks for the URL
ENCODINGS = ("f32", "f16", "i8")


def app_refusal(spec: ModelSpec, split: str, layer: nn.Module) -> str | None:
    """Why the app's strip trainer cannot run this device part, or None: it runs conv1 + ReLU + LRN with a bias,
    released as is (no release transform, no pooling)."""
    if split != "conv1":
        return f"the app's strip trainer runs the conv1 split only, not {split}"
    if spec.release != "none" or spec.release_pool != 1:
        return f"the app's strip trainer releases the layer as is, not through the {spec.release} release"
    convs = [m for m in layer.modules() if isinstance(m, nn.Conv2d)]
    if len(convs) != 1 or not any(isinstance(m, PaperLRN) for m in layer.modules()):
        return "the app's strip trainer runs one conv + ReLU + the paper's LRN"
    if convs[0].bias is None:
        return "the strip programs take a conv with a bias"
    return None


def _sha256(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


def write_app_bundle(layer: nn.Module, spec: ModelSpec, split: str, job: dict, out: Path, rows: int = 4,
                     schedule: list[float] | None = None) -> dict:
    """The app's folder in `out` for `layer` (its current weights and clamp); returns the manifest. `job`: the
    run's settings (`job_settings`); `schedule`: the per-image epsilon after k releases, if any."""
    refusal = app_refusal(spec, split, layer)
    if refusal:
        raise ValueError(refusal)
    if job.get("epsilon") is not None and layer_clamp(layer) != 1.0:
        raise ValueError("per-activation noise (--epsilon) needs the LRN inputs clamped to [0, 1] (--dp-clamp): "
                         "its sensitivity holds only then")
    out.mkdir(parents=True, exist_ok=True)
    for stale in (RELEASE_STRIP_PTE, VJP_STRIP_PTE):  # write_strip_ptes keeps existing programs: these must be new
        (out / stale).unlink(missing_ok=True)
    write_strip_ptes(layer.eval(), rows, spec.input_size, out)
    (out / LAYER).write_bytes(msgpack.packb(java_layer_job(layer)))
    (out / JOB).write_bytes(msgpack.packb({**job, "model": spec.to_dict(), "split": split}))
    files = [RELEASE_STRIP_PTE, VJP_STRIP_PTE, LAYER, JOB]
    (out / SCHEDULE).unlink(missing_ok=True)
    if schedule is not None:
        (out / SCHEDULE).write_bytes(msgpack.packb({"delta": job["delta"], "epsilon_after": list(schedule)}))
        files.append(SCHEDULE)
    manifest = {"format": FORMAT, "version": VERSION, "strip_rows": rows, "input_size": spec.input_size,
                "files": {name: {"bytes": (out / name).stat().st_size, "sha256": _sha256(out / name)}
                          for name in files}}
    (out / MANIFEST).write_bytes(msgpack.packb(manifest))
    return manifest


def layer_clamp(layer: nn.Module) -> float | None:
    return next(m.input_max for m in layer.modules() if isinstance(m, PaperLRN))


def job_settings(*, url: str | None, num_classes: int, batch_size: int, epochs: int, lr: float, momentum: float,
                 weight_decay: float, lr_decay: float, activations: str = "f32", gradients: str = "f32",
                 epsilon: float | None = None, delta: float = 1e-5, budget: float | None = None,
                 classes: list[str] | None = None) -> dict:
    """job.msgpack's keys (besides the model and split), as android_demo/core's `AppBundle` reads them. The SGD
    decays by `lr_decay` over the device's whole run (epochs x batches per epoch), as `Cli train` does. `classes`:
    the server's class names in label order, which the app matches to its faces/<name>/ folders."""
    if classes is not None and len(classes) != num_classes:
        raise ValueError(f"{len(classes)} class names for {num_classes} classes")
    for name, enc in (("activations", activations), ("gradients", gradients)):
        if enc not in ENCODINGS:
            raise ValueError(f"{name} encoding {enc!r} is not one of {ENCODINGS}")
    return {"url": url or URL_PLACEHOLDER, "num_classes": num_classes, "batch_size": batch_size, "epochs": epochs,
            "lr": lr, "momentum": momentum, "weight_decay": weight_decay, "lr_decay": lr_decay,
            "encodings": {"activations": activations, "gradients": gradients},
            "epsilon": epsilon, "delta": delta, "budget": budget, "classes": classes}
