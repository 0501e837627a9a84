"""Who takes part: the public split, the private users, and their grouping into virtual clients.

Split of View 1's DevTrain people (DevTest people are never used, so View 1 scores unseen faces):
- public: DevTrain people with >= PUBLIC_MIN_IMAGES (10) images (111 people, 3264 images); the
  backbone is pre-trained on them and they are never private users;
- private users: DevTrain people with 2 to 9 images (1073 people, 3407 images), one user per person
  (a user's data is all of one person's photos). People with one image (2854) cannot be a class of a global
  head and are left out, unless `single_photo` makes them users too: DP-FedEmb's local heads allow them (a
  virtual client's fresh head gives each of its users a class for one round, dropped afterwards;
  docs/federated.md).
A virtual client groups k users; every user is in exactly one virtual client (`check_partition`),
which is what makes the client-level guarantee a user-level one.
"""
from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import numpy as np

from splitface.common.data import DataSplit, FaceSet, dev_people, find_lfw_root, load_lfw

PUBLIC_MIN_IMAGES = 10
SINGLE_PHOTO_METHODS = ("fedemb", "dp-fedemb")  # local heads only: no global class for a one-photo user


def public_split(lfw_root: str | Path | None) -> DataSplit:
    """The public people (the same selection as `splitface-research pretrain classify --people devtrain --min-images 10`)."""
    return load_lfw(lfw_root, min_images=PUBLIC_MIN_IMAGES, people="devtrain")


@dataclass
class Population:
    """The private users' images: ``labels[i]`` is the user (person) index of image i."""
    users: list[str]
    images: np.ndarray  # uint8 (N, 3, S, S)
    labels: np.ndarray  # int64 (N,)

    def of_users(self, users: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """(images, labels) of these users."""
        mask = np.isin(self.labels, users)
        return self.images[mask], self.labels[mask]


def private_people(lfw_root: str | Path | None, single_photo: bool = True) -> list[tuple[str, list[Path]]]:
    """Every DevTrain person who can be a private user, with their photos, in name order: fewer than
    PUBLIC_MIN_IMAGES photos, and at least two unless `single_photo`. A public start for these experiments must
    leave all of them out (research/distill.py's "federated" public set)."""
    base = find_lfw_root(lfw_root)
    fewest = 1 if single_photo else 2
    people = []
    for person in sorted(dev_people(base, "train")):
        files = sorted(p for p in (base / person).iterdir() if p.suffix.lower() in (".jpg", ".jpeg", ".png"))
        if fewest <= len(files) < PUBLIC_MIN_IMAGES:
            people.append((person, files))
    return people


def private_faces(lfw_root: str | Path | None, max_users: int | None = None, seed: int = 0,
                  single_photo: bool = False) -> FaceSet:
    """The private users' photos, labels in name order; `max_users`: a seeded random subset of them;
    `single_photo`: DevTrain people with one photo are users too."""
    people = private_people(lfw_root, single_photo)
    if max_users is not None:
        if max_users < 2:
            raise ValueError(f"max_users must be >= 2, got {max_users}")
        keep = np.sort(np.random.default_rng(seed).permutation(len(people))[:max_users])
        people = [people[i] for i in keep]
    paths = [f for _, files in people for f in files]
    labels = np.concatenate([np.full(len(files), i) for i, (_, files) in enumerate(people)])
    return FaceSet(paths, labels, [name for name, _ in people])


def check_single_photo(method: str) -> None:
    """One-photo users need a method without a global class head."""
    if method not in SINGLE_PHOTO_METHODS:
        raise ValueError(f"one-photo users need a method with local heads only ({', '.join(SINGLE_PHOTO_METHODS)}); "
                         f"{method} would need a global class for each one-photo user")


def load_population(lfw_root: str | Path | None, size: int, crop: int = 160, max_users: int | None = None,
                    seed: int = 0, single_photo: bool = False) -> Population:
    faces = private_faces(lfw_root, max_users, seed, single_photo)
    return Population(faces.class_names, faces.load(size, crop), faces.labels)


def virtual_clients(num_users: int, users_per_client: int, seed: int) -> list[np.ndarray]:
    """Users 0..num_users-1 shuffled and cut into groups of `users_per_client` (the last may be smaller)."""
    if users_per_client < 1 or num_users < users_per_client:
        raise ValueError(f"need 1 <= users_per_client <= num_users, got {users_per_client} and {num_users}")
    order = np.random.default_rng(seed).permutation(num_users)
    clients = [np.sort(order[i:i + users_per_client]) for i in range(0, num_users, users_per_client)]
    check_partition(clients, num_users)
    return clients


def check_partition(clients: list[np.ndarray], num_users: int) -> None:
    """Refuse a grouping where a user is in two virtual clients (or in none): the accounting assumes
    one user changes one client's contribution only."""
    seen = np.concatenate([np.asarray(c, dtype=np.int64) for c in clients]) if clients else np.array([], np.int64)
    counts = np.bincount(seen, minlength=num_users) if len(seen) else np.zeros(num_users, np.int64)
    if len(counts) > num_users or seen.min(initial=0) < 0:
        raise ValueError(f"virtual clients name users outside 0..{num_users - 1}")
    twice = np.flatnonzero(counts > 1)
    if len(twice):
        raise ValueError(f"users {twice[:5].tolist()} are in more than one virtual client: user-level accounting "
                         f"needs each user in exactly one")
    missing = np.flatnonzero(counts == 0)
    if len(missing):
        raise ValueError(f"users {missing[:5].tolist()} are in no virtual client")
