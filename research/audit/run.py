"""A recorded training run as the two parties of an audit see it.

`AttackerView`: what the curious edge server holds. The releases it recorded (with labels when the
head is on the server, embedding gradients when it is on the device), its own trained model, the
model spec every device announced, and the device's privacy setting, which is published with the
app. For the device layer it has the published weights when the device runs them frozen
(white-box), or else a surrogate: the published start the devices trained theirs from (a distilled
start), or the seeded initial layer every device starts from, built with the device SDK's own code
(the devices have since trained theirs; the audit reports which case held).

`GroundTruth`: what only the auditor knows: which private image each recorded release came from.
It is recomputed from the run's recorded data selection and the simulator's seeded batch order.
"""
from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

import numpy as np
import torch
from torch import nn

from splitface.common.data import FaceSet, load_lfw, partition
from splitface.device.trainer import bound_for, initial_layer
from splitface.common.models import ModelSpec, build_backbone, build_classifier, split_backbone
from splitface.common.transforms import mirror_averaged, release_mirror
from splitface.device.privacy.described import from_description
from splitface.device.privacy.mechanisms import Mechanism
from splitface.sim.simulator import batch_indices

from splitface.server.checkpoint import load_checkpoint
from splitface.server.recorder import load_recordings
from research.audit.attack import layer_outputs, privatized, releases


@dataclass
class AttackerView:
    name: str
    spec: ModelSpec
    split: str
    head: str
    mechanism: Mechanism
    layer: nn.Module            # white-box copy or surrogate of the device layer, bounded as the mechanism needs
    layer_knowledge: str        # "white-box (published frozen weights)" | "surrogate (seeded initial layer)"
    tail: nn.Module
    classifier: nn.Module | None
    recordings: dict[str, dict[str, np.ndarray]]
    results: dict               # the run's results.json: its published privacy setting and its accuracy

    @property
    def test_accuracy(self) -> float:
        """Of the run itself, for the privacy-utility chart."""
        return self.results["epochs"][-1]["test_acc"]

    @property
    def epsilon_image(self) -> float:
        return self.results["epochs"][-1]["epsilon_image_max"]

    def releases(self, images: np.ndarray, seed: int) -> np.ndarray:
        """Images in [0, 1] through the attacker's layer and the published mechanism, with noise of its
        own (the device's secret noise is unknown to it)."""
        return releases(self.layer, images, self.mechanism, seed, self.spec)

    def release_sampler(self, images: np.ndarray) -> Callable[[int], np.ndarray]:
        """seed -> fresh releases of the same images (the layer runs once)."""
        outputs = layer_outputs(self.layer, images)
        return lambda seed: privatized(outputs, self.mechanism, seed, self.spec)

    @torch.no_grad()
    def embed(self, releases: np.ndarray, batch: int = 256, mirror_average: bool = False) -> np.ndarray:
        """The server's trained tail on releases: its face embedding. `mirror_average`: the mean of the tail's on
        each release and on the mirror image's release, which the server computes from it (--mirror-average)."""
        self.tail.eval()
        mirror = release_mirror(self.spec) if mirror_average else None
        return np.concatenate([mirror_averaged(self.tail, mirror, torch.from_numpy(
            np.asarray(releases[i:i + batch], np.float32))).numpy() for i in range(0, len(releases), batch)])

    @torch.no_grad()
    def losses(self, releases: np.ndarray, labels: np.ndarray) -> np.ndarray:
        """Per-sample cross-entropy of the server's classifier (server head only)."""
        assert self.classifier is not None
        self.classifier.eval()
        logits = self.classifier(torch.from_numpy(self.embed(releases)))
        return torch.nn.functional.cross_entropy(logits, torch.from_numpy(labels), reduction="none").numpy()

    def recorded(self, key: str) -> np.ndarray:
        return np.concatenate([r[key] for _, r in sorted(self.recordings.items())])


def load_run(run_dir: Path, published_weights: Path | None = None) -> AttackerView:
    """`run_dir`: a `splitface-research demo --record-max N` run (results.json, server/checkpoint.pt, server/recordings).
    `published_weights`: where the frozen device layer's weights are on this machine, if not where the run
    recorded them."""
    run_dir = Path(run_dir)
    results_file = run_dir / "results.json"
    if not results_file.exists():
        raise FileNotFoundError(f"{run_dir} has no results.json: not a finished splitface-research demo run")
    results = json.loads(results_file.read_text())
    recordings = load_recordings(run_dir / "server" / "recordings")
    if not recordings:
        raise FileNotFoundError(f"{run_dir / 'server' / 'recordings'} is empty: the server recorded nothing "
                                f"(run splitface-research demo with --record-max N)")
    state = load_checkpoint(run_dir / "server" / "checkpoint.pt")
    if state is None:
        raise FileNotFoundError(f"{run_dir / 'server' / 'checkpoint.pt'} is missing")
    config = results["config"]
    spec = ModelSpec.from_dict(config["model"])
    privacy = results["devices"][0]["privacy"]
    mechanism = from_description(privacy["mechanism"])
    weights = config.get("device_weights")
    if weights:   # published: the server itself sent the devices their start
        path = published_weights or Path(weights)
        if not path.exists():
            raise FileNotFoundError(f"{run_dir.name}: the published device weights {path} are missing "
                                    f"(pass their path with --published-weights)")
        layer = initial_layer(spec, config["split"], config["train"]["seed"], path)
        knowledge = ("white-box (the published frozen weights)" if privacy.get("layer_training") == "frozen" else
                     "surrogate (the published start's device part; the devices trained theirs from it)")
    else:
        layer, knowledge = initial_layer(spec, config["split"], config["train"]["seed"], None), \
            "surrogate (the seeded initial layer; the devices trained theirs from it)"
    if not any(True for _ in layer.parameters()):
        knowledge = "exact (the device part has no learned weights)"
    bound_for(mechanism, layer)
    layer.eval()
    _, tail = split_backbone(build_backbone(spec), config["split"])
    tail.load_state_dict(state["trainer"]["tail"])
    classifier = None
    if config["head"] == "server":
        classifier = build_classifier(spec, config["num_classes"])
        classifier.load_state_dict(state["trainer"]["classifier"])
    return AttackerView(run_dir.name, spec, config["split"], config["head"], mechanism, layer, knowledge, tail,
                        classifier, recordings, results)


@dataclass
class GroundTruth:
    """The private images behind the recorded releases (row for row) and the attacker's other photos."""
    private: FaceSet           # row i: the source of recorded release i
    photos: FaceSet            # held-out photos of the same people (the run's test images)
    size: int
    crop: int


def public_faces(lfw_root: Path, count: int, seed: int = 0) -> FaceSet:
    """The attacker's public faces: `count` images of LFW people with 3..9 images each."""
    split = load_lfw(lfw_root, min_images=3, max_images=9, seed=0)
    faces = FaceSet([*split.train.paths, *split.test.paths], np.concatenate([split.train.labels, split.test.labels]),
                    split.class_names)
    return faces.subset(np.random.default_rng(seed).permutation(len(faces))[:count])


def ground_truth(view: AttackerView, lfw_root: Path, public: FaceSet) -> GroundTruth:
    """Refused when `public` shares a person with the run's private set."""
    config = view.results["config"]
    selection = config.get("data")
    if not selection:
        raise ValueError(f"{view.name}: results.json has no data selection (a run from before the audit existed)")
    if selection["image_folder"]:
        raise ValueError("the audit needs LFW: its public faces must be disjoint from the private ones")
    data = load_lfw(lfw_root, min_images=selection["min_images"], seed=selection["seed"],
                    max_identities=selection["max_identities"], max_images=selection["max_images"],
                    people=selection.get("people", "all"))
    device_index = {d["device_id"]: i for i, d in enumerate(view.results["devices"])}
    rows = []
    for device_id, rec in sorted(view.recordings.items()):
        i = device_index[device_id]
        share = partition(data.train, config["num_devices"], i, config["partition"], config["seed"])
        for batch_id, row in zip(rec["batch_ids"], rec["rows"]):
            _, idx = batch_indices(len(share), config["batch_size"], int(batch_id), config["seed"], i)
            rows.append((share, idx[row]))
    private = FaceSet([s.paths[j] for s, j in rows], np.array([s.labels[j] for s, j in rows]), data.class_names)
    recorded_labels = view.recorded("labels")
    if view.head == "server" and not np.array_equal(recorded_labels, private.labels):
        raise ValueError(f"{view.name}: the recomputed batches do not match the recorded labels")
    overlap = {public.class_names[c] for c in np.unique(public.labels)} & \
        {data.class_names[c] for c in np.unique(private.labels)}
    if overlap:
        raise ValueError(f"public and private people overlap ({len(overlap)}): the run used --min-images below 10")
    return GroundTruth(private, data.test, view.spec.input_size, config.get("crop", 160))
