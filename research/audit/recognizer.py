"""The attacker's face recognizer, trained on public faces only.

`Eigenfaces`: PCA of standardised greyscale faces, whitened (Turk & Pentland 1991). Weak against
modern recognizers but honest and fast; the audit always reports its re-identification rate on
clean photos next to every attack result, so the attack's numbers can be read against it.

`PublicBackbone`: a face-recognition backbone pre-trained on public LFW people
(`splitface-research pretrain classify`), its embedding as the recognizer.

`DlibResNet`: dlib's ResNet face recognizer (the `face-recognition-models` wheel, trained on
about 3 million public faces; about 0.99 on LFW pairs), its network run in PyTorch. The strong attacker:
the audit's headline figures use it, and a risk measured with a recognizer that is weak on clean photos says
little either way. Needs the `audit` extra (`pip install -e .[audit]`).
"""
from __future__ import annotations

import hashlib
import importlib.util
import os
from pathlib import Path
from typing import Protocol

import numpy as np
import torch

from splitface.common.models import ModelSpec, build_backbone
from splitface.common.models.weights import load_into

from research.audit.dlib_resnet import DlibFaceNet
from research.audit.inversion import resized


class Recognizer(Protocol):
    def embed(self, images: np.ndarray) -> np.ndarray: ...


def grey(images: np.ndarray, size: int) -> np.ndarray:
    g = resized(images, size).mean(axis=1).reshape(len(images), -1).astype(np.float64)
    g -= g.mean(axis=1, keepdims=True)             # per-image brightness and contrast do not identify anyone
    return g / np.maximum(g.std(axis=1, keepdims=True), 1e-8)


class Eigenfaces:
    def __init__(self, components: int = 64, size: int = 32, skip: int = 1):
        # the first components mostly code lighting; skipping them is the classic remedy
        self.components, self.size, self.skip = components, size, skip

    def fit(self, public_images: np.ndarray) -> "Eigenfaces":
        x = grey(public_images, self.size)
        self.mean = x.mean(0)
        _, s, vt = np.linalg.svd(x - self.mean, full_matrices=False)
        keep = slice(self.skip, self.skip + self.components)
        self.basis, self.scale = vt[keep], s[keep] / np.sqrt(len(x))
        return self

    def embed(self, images: np.ndarray) -> np.ndarray:
        return ((grey(images, self.size) - self.mean) @ self.basis.T) / self.scale


class PublicBackbone:
    def __init__(self, weights: Path):
        saved = torch.load(Path(weights), map_location="cpu", weights_only=True)
        self.spec = ModelSpec.from_dict(saved["spec"])
        torch.manual_seed(0)
        self.net = build_backbone(self.spec)
        load_into(self.net, weights, self.spec)
        self.net.eval()

    @torch.no_grad()
    def embed(self, images: np.ndarray, batch: int = 256) -> np.ndarray:
        """(N, 3, H, W) in [0, 1], any size: resized to the backbone's input (reconstructions are smaller)."""
        size = self.spec.input_size
        out = []
        for i in range(0, len(images), batch):
            x = torch.from_numpy(np.asarray(images[i:i + batch], np.float32))
            if x.shape[-1] != size:
                x = torch.nn.functional.interpolate(x, size=(size, size), mode="bilinear", align_corners=False)
            out.append(self.net(x).numpy())
        return np.concatenate(out)


def dlib_models_dir() -> Path:
    """The `models/` folder of the face-recognition-models wheel, found without importing it (its
    __init__ needs pkg_resources, which new setuptools no longer ships)."""
    spec = importlib.util.find_spec("face_recognition_models")
    if spec is None or spec.origin is None:
        raise ImportError("the strong recognizer needs dlib's models: pip install -e .[audit] "
                          "(dlib-bin and face-recognition-models)")
    return Path(spec.origin).parent / "models"


class DlibResNet:
    """dlib's face recognizer on (N, 3, H, W) images in [0, 1] of centred face crops.

    Each image is upsampled to `work_size` (the reconstructions and the 64 px inputs are small),
    aligned by dlib's 5-point landmark model inside the central 80% (the crop is the face: no
    detector is needed, and one would miss faces this small), cut into dlib's 150 px chip (dlib,
    about 2 ms a face) and embedded (128-d, Euclidean). `engine`: "torch" runs dlib's network as
    ported to PyTorch (research/audit/dlib_resnet.py; batched, about 5 ms a face on 2 cores here),
    "dlib" runs dlib's own (one core without BLAS, about 0.15 s a face). The two agree to about 1e-6
    of a descriptor's norm (tests/test_dlib_resnet.py), so they share the fingerprint that names cached
    embeddings. `alignment` other than "landmarks" is for asking what aligning each face is worth (see
    fix_alignment); the audit and the teacher align."""

    ALIGNMENTS = ("landmarks", "fixed", "none")
    CHIP_SIZE, CHIP_PADDING = 150, 0.25   # dlib's chip, as its network was trained on
    CHIP = f"chip{CHIP_SIZE}-pad{CHIP_PADDING}"   # in every cache name of its embeddings

    def __init__(self, work_size: int = 150, engine: str = "torch", alignment: str = "landmarks"):
        try:
            import dlib
        except ImportError as exc:
            raise ImportError("the strong recognizer needs dlib: pip install -e .[audit] (dlib-bin)") from exc
        models = dlib_models_dir()
        self._dlib = dlib
        self.landmarks = dlib.shape_predictor(str(models / "shape_predictor_5_face_landmarks.dat"))
        weights = models / "dlib_face_recognition_resnet_model_v1.dat"
        if engine == "torch":
            self.net = DlibFaceNet(weights)
        elif engine == "dlib":
            self.net = dlib.face_recognition_model_v1(str(weights))
        else:
            raise ValueError(f"engine must be 'torch' or 'dlib', not {engine!r}")
        if alignment not in self.ALIGNMENTS:
            raise ValueError(f"alignment must be one of {self.ALIGNMENTS}, not {alignment!r}")
        self.engine, self.work_size, self.alignment = engine, work_size, alignment
        self.fixed_shape = None   # alignment "fixed": set by fix_alignment
        self.fingerprint = f"w{work_size}-{self.CHIP}"   # names the on-disk cache: other settings, other file
        if alignment != "landmarks":
            self.fingerprint += f"-align-{alignment}"

    def fix_alignment(self, images: np.ndarray) -> "DlibResNet":
        """Alignment "fixed": one chip geometry for every face, from dlib's 5 landmarks averaged over `images`
        (other faces than the ones measured). It asks what aligning each face is worth to the teacher: a student
        sees its face crops unaligned."""
        if self.alignment != "fixed":
            raise ValueError("fix_alignment is for alignment='fixed'")
        if not len(images):
            raise ValueError("fix_alignment needs at least one face to average the landmarks of")
        shapes = [self._landmarks(self._work_rgb(im)) for im in images]
        mean = np.array([[(s.part(i).x, s.part(i).y) for i in range(s.num_parts)] for s in shapes], float).mean(0)
        points = [(round(x), round(y)) for x, y in mean]
        self.fixed_shape = self._dlib.full_object_detection(self._central_box(),
                                                            [self._dlib.point(x, y) for x, y in points])
        # another fit, another geometry: its embeddings under another name
        self.fingerprint = f"w{self.work_size}-{self.CHIP}-align-fixed-" + \
            hashlib.sha256(repr(points).encode()).hexdigest()[:12]
        return self

    def chip(self, image: np.ndarray) -> np.ndarray:
        """One (3, H, W) image in [0, 1] -> dlib's 150 x 150 x 3 uint8 chip: aligned by its own landmarks, by
        the fixed geometry, or (alignment "none") the image itself, resized to 150."""
        if self.alignment == "none":
            return self._work_rgb(image, self.CHIP_SIZE)
        rgb = self._work_rgb(image)
        if self.alignment == "fixed":
            if self.fixed_shape is None:
                raise RuntimeError("alignment 'fixed' needs fix_alignment(images) first")
            return self._dlib.get_face_chip(rgb, self.fixed_shape, self.CHIP_SIZE, self.CHIP_PADDING)
        return self._dlib.get_face_chip(rgb, self._landmarks(rgb), self.CHIP_SIZE, self.CHIP_PADDING)

    def _work_rgb(self, image: np.ndarray, size: int | None = None) -> np.ndarray:
        """(3, H, W) in [0, 1] -> H x W x 3 uint8 at `size` (the work size by default)."""
        size = size or self.work_size
        x = torch.from_numpy(np.asarray(image, np.float32))[None]
        if x.shape[-1] != size:
            x = torch.nn.functional.interpolate(x, size=(size, size), mode="bilinear", align_corners=False)
        return np.ascontiguousarray((x[0].clamp(0, 1) * 255).round().byte().permute(1, 2, 0).numpy())

    def _central_box(self):
        lo, hi = int(0.1 * self.work_size), int(0.9 * self.work_size)
        return self._dlib.rectangle(lo, lo, hi, hi)

    def _landmarks(self, rgb: np.ndarray):
        return self.landmarks(rgb, self._central_box())

    def embed(self, images: np.ndarray, batch: int = 64) -> np.ndarray:
        out = []
        for i in range(0, len(images), batch):
            chips = [self.chip(im) for im in images[i:i + batch]]
            if self.engine == "torch":
                out.append(self.net(torch.from_numpy(np.stack(chips)).permute(0, 3, 1, 2)).numpy())
            else:
                out.append(np.array([np.array(d) for d in self.net.compute_face_descriptor(chips)], np.float32))
        return np.concatenate(out) if out else np.empty((0, 128), np.float32)


class CachedFaces:
    """A recognizer's embeddings of clean LFW photos, kept on disk by (image path, size, crop): every audit
    embeds the same public faces and photos again, and dlib's alignment alone takes milliseconds a face."""

    def __init__(self, recognizer: Recognizer, name: str, cache_dir: Path | None):
        self.recognizer, self.name = recognizer, name
        self.file = Path(cache_dir) / f"{name}.npz" if cache_dir else None
        self.known = load_vectors(self.file)

    def embed_faces(self, faces, size: int, crop: int | None, images: np.ndarray | None = None) -> np.ndarray:
        """`faces`: a FaceSet; `images`: the same faces already decoded to [0, 1] (else decoded here)."""
        keys = [f"{Path(p).resolve()}|{size}|{crop}" for p in faces.paths]
        missing = [i for i, k in enumerate(keys) if k not in self.known]
        if missing:
            if images is None:
                images = faces.subset(missing).load(size, crop).astype(np.float32) / 255
            else:
                images = images[missing]
            for i, v in zip(missing, self.recognizer.embed(images)):
                self.known[keys[i]] = v
            self._save()
        return np.stack([self.known[k] for k in keys]) if keys else np.empty((0, 0), np.float32)

    def _save(self) -> None:
        if self.file is not None:
            save_vectors(self.file, self.known)


def load_vectors(file: Path | None) -> dict[str, np.ndarray]:
    """A key -> vector store written by `save_vectors` ({} if there is none yet)."""
    if file is None or not Path(file).exists():
        return {}
    with np.load(file) as saved:
        return dict(zip(saved["keys"].tolist(), saved["vectors"]))


def save_vectors(file: Path, known: dict[str, np.ndarray]) -> None:
    """Atomically: a killed process leaves the previous store, never half of one."""
    file.parent.mkdir(parents=True, exist_ok=True)
    tmp = file.with_suffix(f".{os.getpid()}.tmp.npz")
    np.savez(tmp, keys=np.array(list(known)), vectors=np.stack(list(known.values())))
    tmp.replace(file)
