"""Function matching: augmented views of the public faces, each with the teacher's own embedding of it.

The distilled student fits its public faces far better than faces it never saw (`pretrain fit`: cosine loss
0.22 against 0.36): it is short of data more than of capacity. Beyer et al. (CVPR'22, "Knowledge distillation: a
good teacher is patient and consistent") find that a student learns the teacher's function best when both see
exactly the same input, and that aggressive views (crops, mixup) are then free data: the teacher labels
each one. Here each public face gets K views (view 0 is the clean centre crop that the students see at test
time; the others are random crops of 140-180 px around the centre, shifted by up to 12 px, flipped, with
brightness, contrast and saturation changed, sometimes grey, and half of them mixed with another public face,
which keeps its own colours),
rendered at the student's input size, and the teacher embeds those very pixels (upsampled to its work size, as
the audit's recognizer sees 64 px images). The teacher's embeddings are cached under a hash of each view's
recipe and the bytes of its images, so a second run skips the teacher.
"""
from __future__ import annotations

import hashlib
import json
from pathlib import Path

import numpy as np
from PIL import Image
from tqdm import tqdm

from research.audit.recognizer import DlibResNet, load_vectors, save_vectors

VIEWS_VERSION = 1            # the augmentation below; a change here is another set of views (another cache key)
CROP_SIDE = (140, 180)       # px of LFW's 250 px image; the students' test crop is 160
SHIFT = 12                   # px, each axis
BRIGHTNESS = CONTRAST = (0.7, 1.3)
SATURATION = (0.6, 1.4)
GREY = 0.1                   # probability
MIX = 0.5                    # probability that a view is mixed with another public face
MIX_WEIGHT = (0.1, 0.4)      # the other face's weight: the view's own face stays the larger part


def view_recipes(count: int, views: int, seed: int) -> list[list[dict]]:
    """For each of `count` images, `views` recipes (the first the clean centre crop), from the seed alone."""
    rng = np.random.default_rng([seed, 11])
    out = []
    for i in range(count):
        row = [{"side": 160, "dx": 0, "dy": 0, "flip": False, "b": 1.0, "c": 1.0, "s": 1.0, "grey": False}]
        for _ in range(views - 1):
            r = {"side": int(rng.integers(CROP_SIDE[0], CROP_SIDE[1] + 1)),
                 "dx": int(rng.integers(-SHIFT, SHIFT + 1)), "dy": int(rng.integers(-SHIFT, SHIFT + 1)),
                 "flip": bool(rng.random() < 0.5), "b": round(float(rng.uniform(*BRIGHTNESS)), 3),
                 "c": round(float(rng.uniform(*CONTRAST)), 3), "s": round(float(rng.uniform(*SATURATION)), 3),
                 "grey": bool(rng.random() < GREY)}
            if rng.random() < MIX and count > 1:
                other = int(rng.integers(count - 1))
                r["mix"] = other + (other >= i)          # another image, never itself
                r["w"] = round(float(rng.uniform(*MIX_WEIGHT)), 3)
            row.append(r)
        out.append(row)
    return out


def _geometry(image: Image.Image, r: dict, size: int) -> np.ndarray:
    """The crop (square, `side` px about the centre moved by dx, dy) at `size`, flipped if asked: float (H, W, 3)."""
    w, h = image.size
    side = min(r["side"], w, h)
    left = min(max((w - side) // 2 + r["dx"], 0), w - side)
    top = min(max((h - side) // 2 + r["dy"], 0), h - side)
    x = np.asarray(image.crop((left, top, left + side, top + side)).resize((size, size), Image.BILINEAR), np.float32)
    return x[:, ::-1] if r["flip"] else x


def _colour(x: np.ndarray, r: dict) -> np.ndarray:
    grey = x @ np.array([0.299, 0.587, 0.114], np.float32)
    x = x * r["b"]
    x = (x - grey.mean() * r["b"]) * r["c"] + grey.mean() * r["b"]
    grey = x @ np.array([0.299, 0.587, 0.114], np.float32)
    s = 0.0 if r["grey"] else r["s"]
    return grey[..., None] + (x - grey[..., None]) * s


def render(paths: list[Path], recipes: list[list[dict]], size: int, index: int) -> np.ndarray:
    """Image `index`'s views, uint8 (K, 3, size, size). The clean view equals FaceSet.load's centre crop."""
    def opened(i: int) -> Image.Image:
        with Image.open(paths[i]) as im:
            return im.convert("RGB")
    own = opened(index)
    out = []
    for r in recipes[index]:
        x = _colour(_geometry(own, r, size), r)
        if "mix" in r:
            x = (1 - r["w"]) * x + r["w"] * _geometry(opened(r["mix"]), r, size)
        out.append(np.clip(np.rint(x), 0, 255).astype(np.uint8).transpose(2, 0, 1))
    return np.stack(out)


class ViewSet:
    """Every public face's K views at the student's input size, and the teacher's embedding of each."""

    def __init__(self, paths: list[Path], image_hashes: list[str], views: int, seed: int, size: int,
                 cache_dir: Path | None, teacher_fingerprint: str):
        self.recipes = view_recipes(len(paths), views, seed)
        self.paths, self.size = paths, size
        # the other face by its bytes, not its place in this public set (another set shares the cache file)
        self.keys = [[hashlib.sha256(json.dumps({**r, "v": VIEWS_VERSION, "size": size, "image": image_hashes[i],
                                                 "mix": image_hashes[r["mix"]] if "mix" in r else None},
                                                sort_keys=True).encode()).hexdigest()
                      for r in row] for i, row in enumerate(self.recipes)]
        self.file = Path(cache_dir) / f"teacher-views-{teacher_fingerprint}.npz" if cache_dir else None
        self.known = load_vectors(self.file)
        self.computed = 0

    def missing(self) -> int:
        return sum(k not in self.known for row in self.keys for k in row)

    def build(self, progress: bool = True) -> tuple[np.ndarray, np.ndarray]:
        """(images uint8 (N, K, 3, size, size), teacher float32 (N, K, 128)); the teacher runs on uncached views."""
        n, k = len(self.paths), len(self.recipes[0])
        images = np.empty((n, k, 3, self.size, self.size), np.uint8)
        teacher = None
        todo: list[tuple[int, int]] = []
        for i in tqdm(range(n), desc="rendering views", unit="img", disable=not progress):
            images[i] = render(self.paths, self.recipes, self.size, i)
            todo += [(i, j) for j in range(k) if self.keys[i][j] not in self.known]
        if todo:
            teacher = DlibResNet(work_size=150)
            bar = tqdm(total=len(todo), desc="teacher on the views (dlib)", unit="view", disable=not progress)
            for start in range(0, len(todo), 256):
                chunk = todo[start:start + 256]
                batch = np.stack([images[i, j] for i, j in chunk]).astype(np.float32) / 255
                for (i, j), v in zip(chunk, teacher.embed(batch)):
                    self.known[self.keys[i][j]] = v
                bar.update(len(chunk))
                if bar.n % 8192 < len(chunk):
                    self._save()   # a killed run keeps what it embedded
            bar.close()
            self.computed = len(todo)
            self._save()
        targets = np.stack([[self.known[key] for key in row] for row in self.keys]).astype(np.float32)
        return images, targets

    def _save(self) -> None:
        if self.file is not None:
            save_vectors(self.file, self.known)
