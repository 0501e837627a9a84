"""A strong public starting point: distil a public face recognizer into splitface's own backbones.

A real deployment does not train a face recognizer from scratch on phones; it starts from a strong public
model and adapts it privately. The teacher is dlib's ResNet (the `face-recognition-models` wheel: trained
by its author on about 3 million public faces, 0.978 on LFW View 1 at 64 px here). The student is one of
splitface's backbones with its device stem unchanged (conv + ReLU + LRN), trained to reproduce the
teacher's embedding of each public face:

    loss = (1 - cos(P s, t)) + lambda_rel * mean_{i != j} (cos(s_i, s_j) - cos(t_i, t_j))^2

with s the student's embedding of an augmented image, t the teacher's embedding of the clean image (less its
mean over the public faces: dlib's embeddings share a large common component) and P
the identity when the embedding sizes agree (a linear map otherwise, dropped after training). The
relational term (Park et al., CVPR'19) asks for the teacher's geometry between faces as well as its
coordinates.

Function matching (`Recipe.views`, research/views.py): s and t are then the student's and the teacher's
embeddings of the same augmented view, one of K per face.

Noise-aware starts: with a release transform and a mechanism (the same options the devices take), the
student's device part makes each release as a device would (transform, clipping, noise) before the
server's tail reads it, so the tail has learned to read noisy releases before any private data arrives.

Public faces: LFW people who are neither in View 1's DevTest pairs nor among the LFW-158 evaluation
identities (people with >= 10 images); for the federated experiments (`public_set="federated"`), LFW people who
are neither in View 1's DevTest pairs nor possible private users there (View 1 DevTrain people with 1-9 images).
The checkpoint's manifest states the rule, names the people and counts their images.

Teacher embeddings are cached by the SHA-256 of each image file's bytes (and the teacher's settings), so a
second run, or another student, skips the teacher. Training is resumable: a partial checkpoint is written
after every epoch and picked up by a run with the same settings.
"""
from __future__ import annotations

import argparse
import hashlib
import json
import os
import time
from dataclasses import asdict, dataclass, fields, replace
from pathlib import Path
from typing import Any

import numpy as np
import torch
import torch.nn.functional as F
from torch import nn
from tqdm import tqdm

from splitface.common.data import FaceSet, find_lfw_root
from splitface.device.trainer import bound_for, privatize
from splitface.common.models import DEFAULT_SPLIT, RELEASE_KEYS, ModelSpec, build_backbone, split_backbone, to_input
from splitface.common.models.weights import load_into, save_backbone
from splitface.common.options import (add_data_args, add_data_root_arg, add_model_args, add_threads_arg, add_training_args,
                                      apply_threads, load_data, model_spec)
from splitface.device.privacy.options import add_privacy_args, release_mechanism
from splitface.device.privacy.described import from_description
from splitface.device.privacy.mechanisms import Mechanism, NoNoise

from research.audit.recognizer import DlibResNet, dlib_models_dir, load_vectors, save_vectors
from research.evaluation.verification import embed_in_batches, evaluate_embedder, view1_pairs
from research.federated.population import PUBLIC_MIN_IMAGES, private_people
from research.pretrain import pretrain
from research.ressfl import release_stage_state
from research.views import VIEWS_VERSION, ViewSet

# The teacher sees the 160 px centre crop at its own chip size (150 px); the students see it at their input size.
TEACHER_SIZE, CROP = 150, 160
LFW158_MIN_IMAGES = 10
EVALUATION_SEED = 20_221_001   # the evaluator's noise for a noise-aware student; no device's secret


# ---- the public faces ----------------------------------------------------------------------------------------

# The public sets a start can be distilled on; each leaves out the people its experiments score or keep private.
# "lfw158": the split-learning runs (LFW-158 identities and View 1's DevTest pairs); "federated": the federated
# experiments (research/federated/population.py: every DevTrain person who can be a private user, one-photo
# people included, and View 1's DevTest pairs; the DevTrain people with >= 10 images are public there).
PUBLIC_SETS = ("lfw158", "federated")


def public_faces(lfw_root: str | Path | None, limit: int | None = None,
                 public_set: str = "lfw158") -> tuple[FaceSet, dict[str, Any]]:
    """LFW's people outside View 1's DevTest pairs and outside the people `public_set` keeps out (LFW-158, or
    the federated private users), in name order; `limit`: the first N images (tests). Returns the faces and
    their manifest, which states the rule."""
    base = find_lfw_root(lfw_root)
    devtest = view1_pairs(base, "test").people
    if public_set == "lfw158":
        def kept_out(person: str, images: int) -> bool:
            return images >= LFW158_MIN_IMAGES
        rule = f"nor among the LFW-158 evaluation identities (>= {LFW158_MIN_IMAGES} images)"
    elif public_set == "federated":
        private = {person for person, _ in private_people(base, single_photo=True)}

        def kept_out(person: str, images: int) -> bool:
            return person in private
        rule = (f"nor among the federated experiments' possible private users ({len(private)} View 1 DevTrain "
                f"people with 1 to {PUBLIC_MIN_IMAGES - 1} images: the users with 2-9 and the one-photo people); "
                f"DevTrain people with >= {PUBLIC_MIN_IMAGES} images, public in those experiments, are included")
    else:
        raise ValueError(f"public_set must be one of {PUBLIC_SETS}, not {public_set!r}")
    people, paths, labels = [], [], []
    for person in sorted(p.name for p in base.iterdir() if p.is_dir()):
        files = sorted(f for f in (base / person).iterdir() if f.suffix.lower() in (".jpg", ".jpeg", ".png"))
        if person in devtest or kept_out(person, len(files)):
            continue
        people.append((person, len(files)))
        paths += files
        labels += [len(people) - 1] * len(files)
    faces = FaceSet(paths, np.array(labels), [p for p, _ in people])
    if limit is not None:
        faces = faces.subset(np.arange(min(limit, len(faces))))
        kept = set(faces.labels.tolist())
        people = [(p, sum(1 for y in faces.labels if y == i)) for i, (p, _) in enumerate(people) if i in kept]
    manifest = {
        "public_set": public_set,
        "rule": f"LFW people neither in View 1's DevTest pairs ({len(devtest)} people) {rule}",
        "people": len(people), "images": len(faces), "content_sha256": content_hash(faces.paths),
        "per_person": {p: n for p, n in people},
    }
    return faces, manifest


def file_hash(path: Path) -> str:
    return hashlib.sha256(Path(path).read_bytes()).hexdigest()


def content_hash(paths: list[Path]) -> str:
    """One hash of the images' bytes in order: names the exact public set a checkpoint was distilled on."""
    h = hashlib.sha256()
    for p in paths:
        h.update(bytes.fromhex(file_hash(p)))
    return h.hexdigest()


# ---- the teacher ---------------------------------------------------------------------------------------------

class TeacherCache:
    """dlib's embeddings of image files, kept on disk by the SHA-256 of each file's bytes (a renamed or moved
    copy of LFW hits the cache; an edited image does not)."""

    def __init__(self, cache_dir: Path | None, size: int = TEACHER_SIZE):
        """`size`: the teacher sees the centre crop at this size (upsampled to its 150 px work size)."""
        weights = file_hash(dlib_models_dir() / "dlib_face_recognition_resnet_model_v1.dat")[:12]
        self.size = size
        self.fingerprint_of_network = f"dlib-resnet-v1-{weights}-{DlibResNet.CHIP}"
        self.fingerprint = f"{self.fingerprint_of_network}-in{size}c{CROP}"
        self.file = Path(cache_dir) / f"teacher-{self.fingerprint}.npz" if cache_dir else None
        self.known = load_vectors(self.file)
        self.computed = 0

    def embed(self, paths: list[Path], progress: bool = True) -> np.ndarray:
        """(N, 128) float32 teacher embeddings of the files, computing only those not cached."""
        keys = [file_hash(p) for p in paths]
        todo = sorted({k: i for i, k in enumerate(keys) if k not in self.known}.values())
        if todo:
            teacher = DlibResNet(work_size=TEACHER_SIZE)
            bar = tqdm(total=len(todo), desc="teacher (dlib)", unit="img", disable=not progress)
            for start in range(0, len(todo), 256):
                chunk = todo[start:start + 256]
                images = FaceSet([paths[i] for i in chunk], np.zeros(len(chunk)), ["?"]).load(self.size, CROP)
                for i, v in zip(chunk, teacher.embed(images.astype(np.float32) / 255)):
                    self.known[keys[i]] = v
                bar.update(len(chunk))
                if bar.n % 4096 < len(chunk):
                    self._save()   # a killed run keeps what it embedded
            bar.close()
            self.computed += len(todo)
            self._save()
        return np.stack([self.known[k] for k in keys]).astype(np.float32) if keys else np.empty((0, 128), np.float32)

    def _save(self) -> None:
        if self.file is not None:
            save_vectors(self.file, self.known)


# ---- the student ---------------------------------------------------------------------------------------------

@dataclass(frozen=True)
class Recipe:
    """How the student is trained; part of the checkpoint's identity (a different recipe, a different file)."""
    epochs: int = 30
    batch_size: int = 128
    lr: float = 0.1
    weight_decay: float = 5e-4
    relational: float = 1.0     # lambda_rel
    shift: int = 4              # augmentation: random translation up to this many pixels (reflect padding)
    flip: bool = True           # augmentation: random horizontal flip
    seed: int = 0
    views: int = 0              # function matching: K views of each face, each with the teacher's own embedding
                                # (research/views.py; replaces shift and flip); 0: the clean image's embedding


# Recipe fields added after starts were cached, at the value that leaves the recipe as it was: left out of the key
# at that value, so those starts keep their names
LATER_RECIPE_FIELDS = {"views": 0}


class Student(nn.Module):
    """The backbone cut at `split` (with the release transform's stages), a release mechanism between the two
    parts, and the projection to the teacher's space when the sizes differ."""

    def __init__(self, spec: ModelSpec, split: str, mechanism: Mechanism, teacher_dim: int,
                 init: Path | None = None):
        super().__init__()
        self.spec, self.mechanism = spec, mechanism
        self.backbone = build_backbone(spec)
        if init is not None:
            load_into(self.backbone, init, spec)
        self.device_part, self.server_part = split_backbone(self.backbone, split)
        bound_for(mechanism, self.device_part)
        dim = spec.embedding_dim
        self.project = nn.Identity() if dim == teacher_dim else nn.Linear(dim, teacher_dim, bias=False)
        # arcface fixes the embedding batch norm's scale at 1; the teacher's coordinates have their own scales
        features = getattr(self.server_part.stages, "features", None)
        if features is not None and hasattr(features, "features"):
            features.features.weight.requires_grad = True

    def forward(self, x: torch.Tensor, noise: torch.Generator) -> torch.Tensor:
        release = self.device_part(x)
        if not isinstance(self.mechanism, NoNoise) or self.spec.dct_keep:
            release = privatize(self.spec, self.mechanism, release, noise)
        return self.server_part(release)

    def release_stages(self) -> dict[str, torch.Tensor]:
        return release_stage_state(self.device_part, self.server_part)


def distillation_loss(student: torch.Tensor, projected: torch.Tensor, teacher: torch.Tensor,
                      relational: float) -> tuple[torch.Tensor, dict[str, float]]:
    """(loss, its parts): cosine regression onto the teacher, plus the relational term on pairwise cosines."""
    t = F.normalize(teacher, dim=1)
    regression = (1 - F.cosine_similarity(projected, t, dim=1)).mean()
    s = F.normalize(student, dim=1)
    off = ~torch.eye(len(s), dtype=torch.bool, device=s.device)
    rel = ((s @ s.T - t @ t.T)[off] ** 2).mean() if len(s) > 1 else regression * 0
    return regression + relational * rel, {"cosine": float(regression.detach()), "relational": float(rel.detach())}


def augment(x: torch.Tensor, recipe: Recipe, rng: torch.Generator) -> torch.Tensor:
    """Random translation (reflect padding) and horizontal flip: identity-preserving, and what a phone's framing
    varies. The teacher's target stays the clean image's embedding."""
    n, _, h, w = x.shape
    if recipe.shift:
        k = recipe.shift
        padded = F.pad(x, (k, k, k, k), mode="reflect")
        dx, dy = torch.randint(0, 2 * k + 1, (2, n), generator=rng)
        x = torch.stack([padded[i, :, dy[i]:dy[i] + h, dx[i]:dx[i] + w] for i in range(n)])
    if recipe.flip:
        flip = torch.rand(n, generator=rng) < 0.5
        x = torch.where(flip[:, None, None, None], x.flip(3), x)
    return x


def checkpoint_key(spec: ModelSpec, split: str, mechanism: Mechanism, recipe: Recipe, manifest: dict,
                   init: Path | None) -> str:
    """What makes two distillations the same: model, cut, release noise, recipe, public set and starting point."""
    # (the spec less keys added later at their defaults: a start built before one keeps its name, which the
    # recorded runs hold)
    kept = {k: v for k, v in asdict(recipe).items() if LATER_RECIPE_FIELDS.get(k, object()) != v}
    desc = {"spec": spec.compact_dict(), "split": split, "mechanism": mechanism.describe(), "recipe": kept,
            "faces": manifest["content_sha256"], "init": file_hash(init) if init is not None else None}
    return hashlib.sha256(json.dumps(desc, sort_keys=True).encode()).hexdigest()[:16]


def distill(spec: ModelSpec, split: str, mechanism: Mechanism, lfw_root: str | Path | None, out: Path,
            recipe: Recipe = Recipe(), cache_dir: Path | None = None, init: Path | None = None,
            limit: int | None = None, progress: bool = True,
            evaluate: bool = True, view1_limit: int | None = None, stop_after: int | None = None,
            device: str = "cpu", public_set: str = "lfw158") -> dict[str, Any]:
    """Train the student, write it to `out` (a splitface backbone file, with the transform's stages when it has
    one) and return its metadata (manifest, recipe, history, View 1 of the student). `stop_after`: train at most
    that many epochs now and leave the partial checkpoint, as an interrupted run does (returns the partial meta);
    `public_set`: which public faces (PUBLIC_SETS)."""
    started = time.time()
    faces, manifest = public_faces(lfw_root, limit, public_set)
    cache = TeacherCache(cache_dir)
    keys = [file_hash(f) for f in faces.paths]
    views = ViewSet(faces.paths, keys, recipe.views, recipe.seed, spec.input_size, cache_dir,
                    cache.fingerprint_of_network) if recipe.views else None
    missing = views.missing() if views else sum(k not in cache.known for k in dict.fromkeys(keys))
    if progress:
        print(f"distilling {Path(out).name}: {len(faces)} public faces"
              f"{f' x {recipe.views} views' if views else ''} ({missing} not yet embedded by the teacher), "
              f"{recipe.epochs} epochs; roughly {estimate_minutes(len(faces), missing, recipe, spec):.0f} min on a "
              f"2-core machine", flush=True)
    if views:   # (N, K, ...) images and their targets; epoch e shows image i its view (e + i) mod K
        images, targets = views.build(progress)
        teacher = torch.from_numpy(targets)
        teacher = teacher - teacher.reshape(-1, teacher.shape[-1]).mean(0)
    else:
        teacher = torch.from_numpy(cache.embed(faces.paths, progress))
        # dlib's embeddings share a large common component (two strangers' cosine is about 0.9); the targets are
        # the teacher's directions about its mean over the public faces, which a student ending in batch norm can
        # reach
        teacher = teacher - teacher.mean(0)
        images = faces.load(spec.input_size, CROP, progress)
    teacher_s = time.time() - started
    key = checkpoint_key(spec, split, mechanism, recipe, manifest, init)

    torch.manual_seed(recipe.seed)
    student = Student(spec, split, mechanism, teacher.shape[-1], init).to(device)
    teacher = teacher.to(device)
    params = [p for p in dict.fromkeys(student.parameters()) if p.requires_grad]
    steps_per_epoch = -(-len(images) // recipe.batch_size)
    optimizer = torch.optim.SGD(params, lr=recipe.lr, momentum=0.9, nesterov=True, weight_decay=recipe.weight_decay)
    scheduler = torch.optim.lr_scheduler.OneCycleLR(optimizer, recipe.lr, total_steps=recipe.epochs * steps_per_epoch,
                                                    pct_start=min(0.3, 1 / max(recipe.epochs, 1)))
    augment_rng, noise = torch.Generator().manual_seed(recipe.seed + 1), torch.Generator().manual_seed(recipe.seed + 2)
    partial = Path(out).with_suffix(".partial.pt")
    history: list[dict[str, float]] = []
    first = 0
    if partial.exists():
        saved = torch.load(partial, map_location=device, weights_only=False)
        if saved["key"] == key:
            student.load_state_dict(saved["student"])
            optimizer.load_state_dict(saved["optimizer"])
            scheduler.load_state_dict(saved["scheduler"])
            augment_rng.set_state(saved["augment_rng"].cpu())
            noise.set_state(saved["noise_rng"].cpu())
            history, first = saved["history"], saved["epoch"]
            print(f"resuming {out.name} after epoch {first} of {recipe.epochs}", flush=True)
    order_rng = np.random.default_rng([recipe.seed, 7])
    for _ in range(first):   # the shuffles of the epochs already trained
        order_rng.permutation(len(images))

    bar = tqdm(total=recipe.epochs * steps_per_epoch, initial=first * steps_per_epoch, desc=f"distil {out.name}",
               unit="batch", disable=not progress)
    for epoch in range(first, recipe.epochs):
        student.train()
        order = order_rng.permutation(len(images))
        sums = {"loss": 0.0, "cosine": 0.0, "relational": 0.0}
        epoch_started = time.time()
        for i in range(0, len(order), recipe.batch_size):
            idx = order[i:i + recipe.batch_size]
            if len(idx) < 2:   # batch norm needs two images
                continue
            if views:
                view = (epoch + idx) % recipe.views
                x, target = to_input(images[idx, view]).to(device), teacher[torch.from_numpy(idx), torch.from_numpy(view)]
            else:
                x, target = augment(to_input(images[idx]), recipe, augment_rng).to(device), teacher[idx]
            s = student(x, noise)
            loss, parts = distillation_loss(s, student.project(s), target, recipe.relational)
            optimizer.zero_grad()
            loss.backward()
            optimizer.step()
            scheduler.step()
            for k, v in (("loss", float(loss.detach())), *parts.items()):
                sums[k] += v * len(idx)
            bar.update(1)
        history.append({"epoch": epoch + 1, **{k: v / len(images) for k, v in sums.items()},
                        "lr": scheduler.get_last_lr()[0], "epoch_s": time.time() - epoch_started})
        if evaluate and (epoch + 1) % 5 == 0 and epoch + 1 < recipe.epochs:   # the learning curve on View 1
            history[-1]["view1_accuracy"] = evaluate_student(student, lfw_root, view1_limit)["view1_accuracy"]
        bar.set_postfix(cosine=f"{history[-1]['cosine']:.3f}", view1=history[-1].get("view1_accuracy"))
        tmp = partial.with_suffix(".tmp")
        partial.parent.mkdir(parents=True, exist_ok=True)
        torch.save({"key": key, "epoch": epoch + 1, "student": student.state_dict(), "optimizer": optimizer.state_dict(),
                    "scheduler": scheduler.state_dict(), "augment_rng": augment_rng.get_state(),
                    "noise_rng": noise.get_state(), "history": history}, tmp)
        tmp.replace(partial)
        if stop_after is not None and epoch + 1 - first >= stop_after and epoch + 1 < recipe.epochs:
            bar.close()
            return {"key": key, "history": history, "partial": str(partial)}
    bar.close()

    method = "embedding distillation (cosine regression + relational)"
    if views:
        method += f"; function matching on {recipe.views} views a face (research/views.py v{VIEWS_VERSION})"
    meta = {"method": method, "key": key,
            "teacher": {"name": "dlib ResNet v1 (face-recognition-models)", "input": (
                            f"the student's own views at {spec.input_size} px, upsampled to 150 px" if views else
                            f"{TEACHER_SIZE} px from the {CROP} px centre crop") + ", aligned by dlib's 5-point "
                        "landmarks", "trained_on": "dlib's public training set (about 3 million faces; its author's)",
                        "cache": views.file.name if views and views.file else cache.fingerprint,
                        "computed_now": views.computed if views else cache.computed, "seconds": round(teacher_s, 1)},
            "student": {"spec": spec.to_dict(), "split": split, "release_mechanism": mechanism.describe(),
                        "input": f"{spec.input_size} px " + (f"views ({recipe.views} a face)" if views else
                                                             f"from the {CROP} px centre crop"),
                        "init": str(init) if init is not None else "seeded"},
            "public_faces": manifest, "recipe": asdict(recipe), "history": history,
            # a resumed run: this leg's time and its earlier legs' epochs
            "seconds": round(time.time() - started + sum(h["epoch_s"] for h in history[:first]), 1)}
    if evaluate:
        meta["view1"] = evaluate_student(student, lfw_root, view1_limit)
    student.cpu()
    save_backbone(out, spec, student.backbone, meta, student.release_stages() or None)
    partial.unlink(missing_ok=True)
    return meta


def load_student(path: Path, split: str, mechanism: Mechanism, spec: ModelSpec | None = None) -> Student:
    """A distilled backbone file as a Student of `spec` (default: the file's own) in eval mode: each part loaded
    with its release stages, as a run loads them, which refuses a file of another model (the projection to the
    teacher's space is not saved: a 128-d student needs none)."""
    spec = spec or ModelSpec.from_dict(torch.load(path, map_location="cpu", weights_only=True)["spec"])
    student = Student(spec, split, mechanism, 128).eval()
    for part in (student.device_part, student.server_part):
        load_into(part, path, spec)
    return student


@torch.no_grad()
def teacher_fit(student: Student, lfw_root: str | Path | None, cache_dir: Path | None, public_set: str = "lfw158",
                sample: int = 1000, limit: int | None = None, view1_limit: int | None = None,
                teacher_size: int = TEACHER_SIZE) -> dict:
    """How closely the student reproduces the teacher (the distillation's cosine loss, on un-augmented images with
    its release's noise, in eval mode) on `sample` of its own public faces and on View 1's DevTest images, which it
    never saw. A student far closer on the first than on the second is short of data more than of capacity.
    `teacher_size`: the teacher's input, as the student was distilled (`fit_teacher_size`)."""
    student.eval()
    if not isinstance(student.project, nn.Identity):
        raise ValueError("the student's embedding is not the teacher's size, and its projection is not saved")
    faces, _ = public_faces(lfw_root, limit, public_set)
    cache = TeacherCache(cache_dir, teacher_size)
    mean = torch.from_numpy(cache.embed(faces.paths, progress=False)).mean(0)
    chosen = np.sort(np.random.default_rng(0).permutation(len(faces))[:sample])
    seen = FaceSet([faces.paths[i] for i in chosen], faces.labels[chosen], faces.class_names)
    device = next(student.parameters()).device

    def loss(images: FaceSet) -> float:   # each set with the evaluator's noise from its start
        noise = torch.Generator().manual_seed(EVALUATION_SEED)
        targets = torch.from_numpy(cache.embed(images.paths, progress=False)) - mean
        s = embed_in_batches(lambda x: student(torch.from_numpy(x).to(device), noise).cpu().numpy(),
                             images.load(student.spec.input_size, CROP))
        return round(float((1 - F.cosine_similarity(torch.from_numpy(s), targets, dim=1)).mean()), 4)
    unseen = view1_pairs(lfw_root, "test", view1_limit).faces
    return {"teacher_input": teacher_size, "public_cosine_loss": loss(seen), "public_sample": len(seen),
            "view1_cosine_loss": loss(unseen), "view1_images": len(unseen)}


def fit_teacher_size(path: Path) -> int:
    """The teacher's input a distilled file learned from: the student's own (its views at its input size, research/
    views.py) for function matching, else the 150 px centre crop."""
    meta = torch.load(path, map_location="cpu", weights_only=True).get("meta", {})
    views = meta.get("recipe", {}).get("views", 0)
    return int(meta["student"]["spec"]["input_size"]) if views else TEACHER_SIZE


@torch.no_grad()
def evaluate_student(student: Student, lfw_root: str | Path | None, limit: int | None = None,
                     flip: bool = False) -> dict:
    """View 1 (DevTest pairs) of the student's embedding of each image as a device would release it (`flip`: and
    of its mirror image, released too; evaluate_embedder)."""
    student.eval()
    noise = torch.Generator().manual_seed(EVALUATION_SEED)
    device = next(student.parameters()).device
    return evaluate_embedder(lambda x: student(torch.from_numpy(x).to(device), noise).cpu().numpy(), lfw_root,
                             student.spec.input_size, CROP, limit, flip)


# ---- the distilled start, built once and cached ------------------------------------------------------------

# The recipes of the distilled starts that `--init distilled` builds (and research/pretrain_table.py measures): the plain
# student from seeded weights, and each noise-aware start from the plain student with its release and noise.
# A noise-aware start's epochs are `splitface-research demo --noise-aware-epochs` (this recipe's by default). The
# main job's release still climbed at 10 (View 1 0.790; 0.853 at 30, 0.864 at 60, its server stage a conv alone): run.sh asked for 60 (150 now, on 16 views), which its
# release affords, having no weights on the device (about 15 s an epoch on 2 cores); a release whose device part
# trains at full resolution, the bottleneck's, takes 300-400 s an epoch (results/pretrain/).
PLAIN_RECIPE = Recipe(epochs=30)
NOISE_AWARE_RECIPE = Recipe(epochs=10, lr=0.05)


def plain_spec(spec: ModelSpec) -> ModelSpec:
    """The backbone without a release transform (the release options at their defaults)."""
    defaults = {f.name: f.default for f in fields(ModelSpec) if f.name in RELEASE_KEYS}
    return replace(spec, **defaults)


def is_plain(spec: ModelSpec, mechanism: Mechanism) -> bool:
    return spec == plain_spec(spec) and isinstance(mechanism, NoNoise)


def distilled_start(spec: ModelSpec, split: str, mechanism: Mechanism, lfw_root: str | Path | None,
                    cache_dir: Path | None = None, progress: bool = True,
                    recipes: tuple[Recipe, Recipe] = (PLAIN_RECIPE, NOISE_AWARE_RECIPE),
                    limit: int | None = None, public_set: str = "lfw158") -> Path:
    """The distilled backbone file for this model, cut and release: the plain student, or a noise-aware start
    made from it. Built on first use (with a stated time and progress bars), then read from the cache.
    `recipes`: (plain, noise-aware); `limit`: the first N public images only (both for smoke tests);
    `public_set`: the faces it is distilled on (PUBLIC_SETS; "federated" for the federated experiments)."""
    cache_dir = Path(cache_dir) if cache_dir is not None else default_cache()
    plain = _cached_student(plain_spec(spec), DEFAULT_SPLIT, NoNoise(), recipes[0], lfw_root, cache_dir, None,
                            progress, limit, public_set)
    if is_plain(spec, mechanism):
        return plain
    return _cached_student(spec, split, mechanism, recipes[1], lfw_root, cache_dir, plain, progress, limit, public_set)


def _cached_student(spec: ModelSpec, split: str, mechanism: Mechanism, recipe: Recipe, lfw_root: str | Path | None,
                    cache_dir: Path, init: Path | None, progress: bool, limit: int | None,
                    public_set: str) -> Path:
    """The file's key holds the public set's content hash, so another public set is another file; a set other
    than the default is named in the file name too (the default's names stay those already cached)."""
    _, manifest = public_faces(lfw_root, limit, public_set)
    key = checkpoint_key(spec, split, mechanism, recipe, manifest, init)
    name = f"{spec.family}{spec.depth if spec.family == 'iresnet' else ''}-w{spec.width}-{spec.input_size}px"
    tag = "" if public_set == "lfw158" else f"-{public_set}"
    path = cache_dir / "distilled" / f"{name}{tag}-{key}.pt"
    if path.exists():
        return path
    if progress:
        print(f"building the distilled start {path} (first use; cached afterwards)", flush=True)
    distill(spec, split, mechanism, lfw_root, path, recipe, cache_dir, init, limit, progress=progress,
            public_set=public_set)
    return path


# ---- the command ---------------------------------------------------------------------------------------------

def default_cache() -> Path:
    return Path(os.environ.get("SPLITFACE_CACHE", Path.home() / ".cache" / "splitface"))


def add_recipe_args(p: argparse.ArgumentParser, **defaults: Any) -> None:
    """One option per Recipe field (--field-name), defaults from the dataclass unless given."""
    base = {**asdict(Recipe()), **defaults}
    for name, value in base.items():
        flag = "--" + name.replace("_", "-")
        if isinstance(value, bool):
            p.add_argument(flag, action=argparse.BooleanOptionalAction, default=value)
        else:
            p.add_argument(flag, type=type(value), default=value)


def recipe_of(args: argparse.Namespace) -> Recipe:
    return Recipe(**{k: getattr(args, k) for k in asdict(Recipe())})


# iresnet_small's training images a second at 64 px on this project's 2-core machines, the fastest of the
# distillations in results/pretrain/summary.json (images x epochs / the students' seconds; others ran beside
# other work): the plain student (the device's conv, ReLU and LRN at full resolution: 112), a release that
# replaces the device part (the DCT, no weights on the device: 441), and the bottleneck (convs at full resolution
# on both sides of a noised 4-channel map: 18); other releases as the plain student
STUDENT_RATE = {"none": 112, "dct": 441, "bottleneck": 18}


def estimate_minutes(images: int, missing: int, recipe: Recipe, spec: ModelSpec) -> float:
    """A stated, rough time on this project's machines (2 cores), from rates measured there: the teacher 0.008 s an
    image (decoding, dlib's alignment, the network ported to PyTorch), rendering function matching's views 0.0008 s
    each (57,224 in about 45 s; every run renders them, cached targets or not), and STUDENT_RATE (other models:
    unknown, scaled by input area only)."""
    teacher = missing * 0.008   # an image or a view
    rendering = images * recipe.views * 0.0008
    student = recipe.epochs * images / STUDENT_RATE.get(spec.release, STUDENT_RATE["none"]) * (spec.input_size / 64) ** 2
    return (teacher + rendering + student) / 60


def fit_release(args: argparse.Namespace, p: argparse.ArgumentParser) -> tuple[str, Mechanism]:
    """The cut and the release noise that `fit` measures a file with: the ones its distillation recorded (given
    others, an error), or for a file that records none, the options' (conv1 and no noise by default)."""
    given = release_mechanism(args)
    recorded = torch.load(args.start, map_location="cpu", weights_only=True).get("meta", {}).get("student")
    if recorded is None:
        return args.split or DEFAULT_SPLIT, given
    named = given.describe() != NoNoise().describe()
    if (args.split and args.split != recorded["split"]) or (
            named and given.describe() != recorded["release_mechanism"]):
        p.error(f"{args.start.name} was distilled cut at {recorded['split']} with the release noise "
                f"{recorded['release_mechanism']}; fit measures it so (leave out --split and the noise options)")
    return recorded["split"], from_description(recorded["release_mechanism"])


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(prog="splitface-research pretrain", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = p.add_subparsers(dest="command", required=True)
    d = sub.add_parser("distill", help="distil dlib's recognizer into a splitface backbone on public LFW faces")
    add_data_root_arg(d, required=True, help="LFW root (with View 1's pairs files)")
    d.add_argument("--out", type=Path, required=True, help="the backbone file to write")
    add_model_args(d, model="iresnet_small")
    add_privacy_args(d)
    add_recipe_args(d)
    d.add_argument("--init", type=Path, default=None, help="start from this backbone file (e.g. the plain student, "
                                                           "for a noise-aware start)")
    d.add_argument("--cache", type=Path, default=default_cache(), help="teacher embeddings (default: "
                                                                        "$SPLITFACE_CACHE or ~/.cache/splitface)")
    d.add_argument("--limit", type=int, default=None, help="only the first N public images (smoke tests)")
    d.add_argument("--public-set", choices=PUBLIC_SETS, default="lfw158",
                   help="lfw158: leave out LFW-158 and View 1's DevTest people (the split runs); federated: leave out "
                        "the federated experiments' private users and View 1's DevTest people (docs/pretrain.md)")
    d.add_argument("--view1-limit", type=int, default=None, help="only this many View 1 pairs (smoke tests)")
    d.add_argument("--no-progress", action="store_true")
    d.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu",
                   help="torch device of the student (default: cuda if available, else cpu)")
    add_threads_arg(d)
    f = sub.add_parser("fit", help="how closely a distilled file reproduces the teacher on its public faces and on "
                                   "View 1's test images (its cosine loss on each)")
    f.add_argument("start", type=Path, help="a distilled backbone file")
    add_data_root_arg(f, required=True, help="LFW root (with View 1's pairs files)")
    f.add_argument("--split", default=None, help="a file that does not record its cut (not distilled here): where to "
                                                  "cut it (default: conv1)")
    add_privacy_args(f)   # the same, for its noise: a distilled file's own are taken, and others refused
    f.add_argument("--cache", type=Path, default=default_cache(), help="teacher embeddings")
    f.add_argument("--public-set", choices=PUBLIC_SETS, default="lfw158")
    f.add_argument("--sample", type=int, default=1000, help="public faces to measure on (a seeded choice)")
    f.add_argument("--limit", type=int, default=None, help="only the first N public images (smoke tests)")
    f.add_argument("--view1-limit", type=int, default=None, help="only this many View 1 pairs (smoke tests)")
    f.add_argument("--teacher-input", type=int, default=None,
                   help="the teacher's input size in px (default: as the file was distilled, 64 for function "
                        "matching, else 150): files distilled either way are compared against the same targets")
    add_threads_arg(f)
    c = sub.add_parser("classify", help="train the whole backbone as a classifier on a public set and save it")
    add_model_args(c)
    add_data_args(c)
    c.set_defaults(min_images=3, max_images=9)
    add_training_args(c, epochs=10, batch_size=64, lr=0.1)
    c.add_argument("--out", type=Path, required=True)
    add_threads_arg(c)
    args = p.parse_args(argv)
    apply_threads(args)
    if args.command == "classify":
        meta = pretrain(model_spec(args), load_data(args), args.out, args.epochs, args.lr, args.batch_size, args.seed)
        print(json.dumps({k: v for k, v in meta.items() if k != "history"}), "final:", meta["history"][-1])
        return
    if args.command == "fit":
        split, mechanism = fit_release(args, p)
        student = load_student(args.start, split, mechanism)
        print(json.dumps(teacher_fit(student, args.data, args.cache, args.public_set, args.sample, args.limit,
                                     args.view1_limit, args.teacher_input or fit_teacher_size(args.start)),
                         indent=2))
        return
    meta = distill(model_spec(args), args.split, release_mechanism(args), args.data, args.out, recipe_of(args),
                   args.cache, args.init, args.limit, not args.no_progress,
                   view1_limit=args.view1_limit, device=args.device, public_set=args.public_set)
    print(json.dumps({"out": str(args.out), "view1": meta.get("view1"), "last_epoch": meta["history"][-1],
                      "seconds": meta["seconds"]}, indent=2))


if __name__ == "__main__":
    main()
