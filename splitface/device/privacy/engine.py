"""The device's privacy engine (in the spirit of Opacus's PrivacyEngine): the one object that owns the
mechanism, the accountant, the budget guard and the noise secret, and keeps them on disk.

Every value that leaves the device, and every DP-SGD step, goes through `PrivacyEngine.release`:
its noise is drawn from a generator keyed by (secret, release, attempt), the budget guard admits it
before it can be sent, and the state is written (atomically) before the value is handed back.
A release made again with the same key is free only if it is bit-identical to the one made before;
otherwise (if it draws noise) it is a new attempt, with fresh noise, and counted (docs/privacy.md, "Durable privacy state").
"""
from __future__ import annotations

import hashlib
import math
import secrets
from pathlib import Path
from typing import Any, Callable, Sequence

import torch
from dp_accounting.dp_event import DpEvent

from splitface.common.accountants.ledger import PrivacyAccountant
from splitface.device.privacy.budget import BudgetGuard
from splitface.device.privacy.fastnoise import KEY_BYTES
from splitface.device.privacy.mechanisms import Mechanism, NoNoise, noise_generator
from splitface.device.privacy.state import StateFileError, read_state, write_state

LAYER_TRAINING = ("plain", "frozen", "dpsgd")
RELEASE_KINDS = {"train": 1, "eval": 2, "dpsgd": 3}
Release = tuple  # (kind, *ints), e.g. ("train", 12) or ("eval", 3, 0)
SECRET_BITS = 256


def release_key(release: Release) -> str:
    return ":".join(str(x) for x in release)


def attempt_key(release: Release, attempt: int) -> str:
    """The accountant's name for one attempt at a release: "train:12", then "train:12#1", ..."""
    return release_key(release) + (f"#{attempt}" if attempt else "")


def digest(value: torch.Tensor) -> str:
    """blake2b of a tensor's dtype, shape and bytes: equal digests mean bit-identical values."""
    t = value.detach().cpu().contiguous()
    h = hashlib.blake2b(f"{t.dtype}:{tuple(t.shape)};".encode(), digest_size=16)
    h.update(t.view(torch.uint8).numpy().tobytes() if t.numel() else b"")
    return h.hexdigest()


class PrivacyEngine:
    """What the device does to its releases and how its own layer learns, with the books to prove it.

    mechanism: what is added to each release (NoNoise: none; the accountant then records epsilon = inf).
    delta, budget_epsilon, budget_level: the guard refuses a release that would take an image (or an
    identity) past budget_epsilon at delta. layer_training: "plain" (ordinary SGD: the layer's weights
    carry every training image, which voids any per-image guarantee for later releases), "frozen"
    (public weights, never updated) or "dpsgd" (per-sample clipped gradients with noise dpsgd_noise *
    dpsgd_clip: later releases are post-processing). secret: the noise key, never sent; None draws
    SECRET_BITS bits from the OS CSPRNG (an explicit one is for tests). state_path: the device's state
    file; resumed if present (its secret then wins, and must equal an explicit one), else created.
    """

    def __init__(self, mechanism: Mechanism | None = None, *, delta: float = 1e-5, budget_epsilon: float = math.inf,
                 budget_level: str = "image", layer_training: str = "plain", dpsgd_clip: float = 1.0,
                 dpsgd_noise: float = 1.0, nopeek_weight: float = 0.0, secret: int | None = None,
                 state_path: Path | None = None) -> None:
        if layer_training not in LAYER_TRAINING:
            raise ValueError(f"layer_training must be one of {LAYER_TRAINING}, not {layer_training!r}")
        if not (nopeek_weight >= 0 and math.isfinite(nopeek_weight)):
            raise ValueError(f"nopeek_weight must be finite and >= 0, got {nopeek_weight}")
        if nopeek_weight and layer_training != "plain":
            # DP-SGD clips per-sample gradients of per-sample losses; a batch penalty has none. Frozen: nothing trains.
            raise ValueError(f"NoPeek's penalty trains the layer: it needs layer_training 'plain', not {layer_training!r}")
        self.nopeek_weight = float(nopeek_weight)
        if not dpsgd_clip > 0 or dpsgd_noise < 0:
            raise ValueError(f"need dpsgd_clip > 0 and dpsgd_noise >= 0, got {dpsgd_clip=}, {dpsgd_noise=}")
        self.mechanism = mechanism if mechanism is not None else NoNoise()
        self.layer_training, self.dpsgd_clip, self.dpsgd_noise = layer_training, float(dpsgd_clip), float(dpsgd_noise)
        self.accountant = PrivacyAccountant(delta)
        self.guard = BudgetGuard(self.accountant, budget_epsilon, budget_level)
        self._explicit_secret = secret is not None
        self.secret = int(secret) if secret is not None else secrets.randbits(SECRET_BITS)
        self.attempts: dict[str, tuple[int, str]] = {}  # release key -> (its latest attempt, digest of what it gave)
        self.state_path: Path | None = None
        if state_path is not None:
            self.open_state(state_path)

    # ---- durable state -------------------------------------------------------------------
    def open_state(self, path: Path) -> None:
        """Keep this engine's state in `path` from now on: resume it if the file exists (a corrupt or foreign
        file raises StateFileError), else write it at once, so that the secret is on disk before any release."""
        if self.attempts:
            raise RuntimeError("open the state before the first release: this engine has released already")
        path = Path(path)
        if path.exists():
            self._load(read_state(path), path)
        self.state_path = path
        self.save()

    def _load(self, state: dict[str, Any], path: Path) -> None:
        try:
            secret = int(state["secret"], 16)
            attempts = {str(k): (int(a), str(d)) for k, (a, d) in state["attempts"].items()}
            accountant = PrivacyAccountant(self.accountant.delta)
            accountant.load_state_dict(state["accountant"])
        except (KeyError, TypeError, ValueError, AttributeError) as exc:
            raise StateFileError(f"{path}: privacy state is malformed ({exc!r}); refusing to release") from exc
        if self._explicit_secret and secret != self.secret:
            raise StateFileError(f"{path}: holds another noise secret than the one given")
        if accountant.delta != self.accountant.delta:
            raise StateFileError(f"{path}: was accounted at delta {accountant.delta:g}, this run asks "
                                 f"{self.accountant.delta:g}; the budget's figures would not be comparable")
        self.secret, self.attempts = secret, attempts
        self.accountant = self.guard.accountant = accountant

    def state_dict(self) -> dict[str, Any]:
        return {"secret": format(self.secret, "x"), "accountant": self.accountant.state_dict(),
                "attempts": {k: [a, d] for k, (a, d) in self.attempts.items()},
                "mechanism": self.mechanism.describe()}  # for whoever reads the file; not trusted on load

    def save(self) -> None:
        if self.state_path is not None:
            write_state(self.state_path, self.state_dict())

    # ---- releases ------------------------------------------------------------------------
    def generator(self, release: Release, attempt: int = 0) -> torch.Generator:
        """The keyed generator of one attempt at a release: the same key gives the same noise, everywhere."""
        kind, *numbers = release
        return noise_generator(self.secret, RELEASE_KINDS[kind], *numbers, *((f"attempt{attempt}",) if attempt else ()))

    def stream_key(self, generator: torch.Generator) -> bytes:
        """The ChaCha key of the release whose keyed generator this is (for the native runner's ChaCha8 float noise
        and the exact option's ChaCha20 `fastnoise.NoiseStream`): blake2b-256 of the secret (256 bits from the OS
        CSPRNG) and the generator's seed (itself keyed by release and attempt).
        A re-sent release gets its key again; the server cannot derive any key without the secret."""
        material = f"{self.secret:x}:{generator.initial_seed()}".encode()
        return hashlib.blake2b(material, digest_size=KEY_BYTES, person=b"splitface-noise").digest()

    def _noisy(self, release: Release) -> bool:
        return self.dpsgd_noise > 0 if release[0] == "dpsgd" else self.mechanism.adds_noise

    def attempt(self, release: Release) -> int:
        return self.attempts.get(release_key(release), (0, ""))[0]

    def release(self, release: Release, image_ids: Sequence[int], identities: Sequence[int], event: DpEvent,
                compute: Callable[[torch.Generator], dict[str, Any]], *, joint: bool = False,
                also: Sequence[tuple[Release, DpEvent, bool]] = ()) -> dict[str, Any]:
        """`compute(generator)`: a dict whose "released" tensor is what this release hands out (a batch's
        released values, or a DP-SGD step's noisy gradient), and whatever else the caller keeps. Raises
        BudgetExceeded, recording and saving nothing, if the guard refuses it or any of `also` (events of
        other releases taken with this one, at their current attempts, e.g. the DP-SGD step a training batch
        will take). A key made before is free only if `compute` gives bit-identical values; if not (and it
        draws noise), the release is made again as a new attempt with fresh noise and counted like any other."""
        key = release_key(release)
        attempt, before = self.attempts.get(key, (0, None))
        out = compute(self.generator(release, attempt))
        now = digest(out["released"])
        if before is not None and now != before and self._noisy(release):
            # Same key, different values: the old noise must not be reused on them (their difference would be
            # noise-free). A fresh attempt draws fresh noise and is a release of its own. Without noise there is
            # nothing to reuse (epsilon is infinite either way), and a fresh draw would only show a dct_keep
            # release's other channels: the key stays.
            attempt += 1
            out = compute(self.generator(release, attempt))
            now = digest(out["released"])
        admissions = [(attempt_key(release, attempt), event, joint),
                      *((attempt_key(r, self.attempt(r)), e, j) for r, e, j in also)]
        self.guard.admit_all(admissions, image_ids, identities)
        self.attempts[key] = (attempt, now)
        self.save()  # on disk before the value can leave the device
        return out

    # ---- figures -------------------------------------------------------------------------
    def report(self, layer_trains: bool) -> dict[str, Any]:
        """The accountant's figures, and whether the layer's training voids them (`layer_trains`: it has
        parameters that this run updates)."""
        report = self.accountant.report()
        report["mechanism"] = self.mechanism.describe()
        report["layer_training"] = self.layer_training
        if self.nopeek_weight:
            report["nopeek_weight"] = self.nopeek_weight
        report["guarantee_void"] = (layer_trains and self.layer_training == "plain"
                                    and not isinstance(self.mechanism, NoNoise))
        if report["guarantee_void"]:
            report["note"] = ("the device layer trained without DP: its weights carry other images, so the per-image "
                              "figures hold only for the first release; treat the guarantee as void")
        report["state_file"] = str(self.state_path) if self.state_path else None
        return report
