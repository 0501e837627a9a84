"""PrivacyFace's consensus-aware recognition loss (the paper's Eq. 5) around a margin softmax.

A client's head has only its own people, so its softmax never sees another client's identities as
negatives. PrivacyFace gives it other clients' sanitised clusters p (DPLC releases, unit vectors) and
adds, for each, a negative term exp(mu(p, f, rho)) to the denominator, with
    mu(p, f, rho) = s * cos(max(theta_{p,f} - rho, 0)),
theta_{p,f} the angle between the embedding f and p. A cluster stands for a cap of radius rho, and
theta - rho is the angle from f to the cap's nearest point: the term is the cosine logit of that point,
so f is pushed at least rho away from p. Inside the cap it is s (its largest), with no gradient; at or
beyond the cap's edge it pushes f away from p. With no clusters the loss is the plain margin softmax.

Margins: ArcFace s cos(theta_y + m) (with arcface_torch's fallback cos(theta_y) - m sin(m) where
theta_y + m > pi) or CosFace s (cos(theta_y) - m).
"""
from __future__ import annotations

import math

import torch
import torch.nn.functional as F

MARGINS = ("arcface", "cosface")
_EPS = 1e-7  # keeps arccos's gradient finite at +-1


def cosines(embeddings: torch.Tensor, centres: torch.Tensor) -> torch.Tensor:
    """(N, C) cosines between each embedding and each centre (both normalised here)."""
    return F.normalize(embeddings, dim=1) @ F.normalize(centres, dim=1).T


def margin_logits(cos: torch.Tensor, labels: torch.Tensor, scale: float, margin: float,
                  kind: str = "arcface") -> torch.Tensor:
    """s * cos(theta_j) for j != y and the margin target logit for j == y."""
    if kind not in MARGINS:
        raise ValueError(f"margin kind must be one of {MARGINS}, got {kind!r}")
    if labels.shape != (cos.shape[0],) or labels.min() < 0 or labels.max() >= cos.shape[1]:
        raise ValueError(f"labels must be ({cos.shape[0]},) class ids below {cos.shape[1]}")
    target = cos.gather(1, labels[:, None]).clamp(-1 + _EPS, 1 - _EPS)
    if kind == "arcface":
        theta = torch.acos(target)
        adjusted = torch.where(theta + margin <= math.pi, torch.cos(theta + margin), target - margin * math.sin(margin))
    else:
        adjusted = target - margin
    return scale * cos.scatter(1, labels[:, None], adjusted)


def cluster_logits(embeddings: torch.Tensor, clusters: torch.Tensor, rho: float, scale: float) -> torch.Tensor:
    """(N, P) mu(p, f, rho) = s cos(max(theta_{p,f} - rho, 0)) for each embedding f and cluster p."""
    if clusters.ndim != 2 or clusters.shape[1] != embeddings.shape[1]:
        raise ValueError(f"clusters must be (P, {embeddings.shape[1]}), got {tuple(clusters.shape)}")
    if not 0 < rho <= math.pi / 2:
        raise ValueError(f"rho must be in (0, pi/2], got {rho}")
    theta = torch.acos(cosines(embeddings, clusters).clamp(-1 + _EPS, 1 - _EPS))
    return scale * torch.cos((theta - rho).clamp(min=0.0))


def consensus_loss(embeddings: torch.Tensor, weight: torch.Tensor, labels: torch.Tensor,
                   clusters: torch.Tensor | None, rho: float, scale: float = 32.0, margin: float = 0.5,
                   kind: str = "arcface") -> torch.Tensor:
    """Mean over the batch of -log(e^{target} / (sum_j e^{logit_j} + sum_p e^{mu(p, f, rho)})).

    embeddings (N, d); weight: the client's class centres (C, d); clusters: the other clients' sanitised
    clusters (P, d), or None / (0, d) for none (then this is the plain margin softmax)."""
    logits = margin_logits(cosines(embeddings, weight), labels, scale, margin, kind)
    if clusters is not None and len(clusters):
        logits = torch.cat([logits, cluster_logits(embeddings, clusters.to(embeddings.dtype), rho, scale)], dim=1)
    return F.cross_entropy(logits, labels)
