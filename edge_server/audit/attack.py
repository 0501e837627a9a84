"""The reconstruction attack, scored: what the curious server gets back from the activations it
received, and how often that finds the person, next to what the same recognizer does on clean
photos (the upper bound) and by chance (the floor)."""
from __future__ import annotations

from typing import Sequence

import numpy as np
import torch
from torch import nn

from device_sdk.privacy.mechanisms import Mechanism, noise_generator

from .inversion import RidgeInversion, resized
from .metrics import chance_risk, linkage_rate, psnr, reidentification_risk, ssim
from .recognizer import Eigenfaces


def releases(layer: nn.Module, images: np.ndarray, mechanism: Mechanism, seed: int) -> np.ndarray:
    """Images in [0, 1] through a device layer and a mechanism: how the attacker prepares its public
    training pairs, with the device SDK's own code (and noise of its own: it lacks the device's secret)."""
    with torch.no_grad():
        return mechanism.privatize(layer(torch.from_numpy(images)), noise_generator(seed, 1)).numpy()


def reconstruction_report(inversion: RidgeInversion, recognizer: Eigenfaces, received: np.ndarray,
                          originals: np.ndarray, identities: np.ndarray, photos: np.ndarray, photo_identities: np.ndarray,
                          ks: Sequence[int] = (1, 5)) -> tuple[dict, np.ndarray]:
    """`received`: the releases of `originals` (private training images of `identities`) as the server
    got them; `photos`: the attacker's other real photos of those people. Returns (figures, reconstructions)."""
    recon = inversion.reconstruct(received)
    target = resized(originals, inversion.image_size)
    flat = lambda a: a.reshape(len(a), -1)  # noqa: E731
    queries = recognizer.embed(photos)
    gallery, clean = recognizer.embed(recon), recognizer.embed(originals)
    report = {
        "images": len(originals), "identities": int(len(np.unique(identities))), "queries": len(photos),
        "psnr_db": float(np.mean(psnr(recon, target))), "ssim": float(np.mean(ssim(recon, target))),
        "linkage_pixels": linkage_rate(flat(recon), flat(target)),
        "linkage_face": linkage_rate(gallery, clean),
    }
    for k in ks:
        report[f"risk@{k}"] = reidentification_risk(queries, photo_identities, gallery, identities, k)
        report[f"risk@{k}_clean_upper_bound"] = reidentification_risk(queries, photo_identities, clean, identities, k)
        report[f"risk@{k}_chance"] = chance_risk(photo_identities, identities, k)
    return report, recon
