"""FedGC's server-side gradient correction of the clients' private class embeddings.

FedGC (Niu and Deng, "Federated Learning for Face Recognition with Gradient Correction", AAAI 2022,
Algorithm 1). Client k trains the backbone with its own class-embedding matrix W_k (CosFace over its own
people) and uploads both; the server averages the backbone, stacks W = [W_1; ...; W_K] and takes one
step on a softmax regularizer that treats every class embedding as a sample of its own class and the
OTHER clients' classes as its negatives (the negatives its local softmax never saw):
    Reg(W) = 1/C sum_i -log( e^{s w_i.w_i} / (e^{s w_i.w_i} + sum_{j in N(i)} e^{s w_i.w_j}) ),
with w the normalised rows, N(i) the classes of clients other than i's, C the number of classes; then
    W <- W - lambda * lr * grad_W Reg(W)      (lambda: the paper's multiplier, best 20 on its data)
and returns each client its corrected W_k. The scale s inside and the 1/C are our reading of the paper
(parameters here; s = 1 by default).

The closed form of the gradient (what tests/test_fedgc.py checks autograd against). Write
P_ij = e^{s w_i.w_j} / Z_i over {i} + N(i), Z_i the denominator above. Differentiating
-log P_mm = -s w_m.w_m + log Z_m, and the terms log Z_i where m is in N(i):
    dReg/dw_m = s/C [ -2 (1 - P_mm) w_m + sum_{j in N(m)} P_mj w_j + sum_{i in N(m)} P_im w_i ]
(N is symmetric: m in N(i) iff i in N(m)). The last sum is the correction's point: in centralised
softmax training, class m receives from each sample of another client's class i (whose feature ~ w_i)
the negative-class gradient s P_im w_i, which a private head never gets; the middle sum is m's own
samples' push away from the other clients' classes. Through the normalisation w_m = v_m / |v_m| of a
raw row v_m, the radial part vanishes (w_m.w_m = 1):
    grad_{v_m} Reg = s / (C |v_m|) (I - w_m w_m^T) sum_{j in N(m)} (P_mj + P_jm) w_j.
"""
from __future__ import annotations

from typing import Hashable, Mapping

import numpy as np
import torch
import torch.nn.functional as F

from splitface.protocol.clusters import HeadBoard


def stack_heads(heads: Mapping[Hashable, torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor, list[Hashable]]:
    """(W, owners, keys): the clients' class embeddings concatenated in `heads` order, and each row's client."""
    if not heads:
        raise ValueError("no class embeddings to correct")
    keys = list(heads)
    dims = {tuple(heads[k].shape[1:]) for k in keys}
    if len(dims) != 1 or any(heads[k].ndim != 2 or len(heads[k]) == 0 for k in keys):
        raise ValueError(f"every head must be a non-empty (classes, dim) matrix of one dim, got "
                         f"{[tuple(heads[k].shape) for k in keys]}")
    weights = torch.cat([heads[k].detach().to(torch.float64) for k in keys])
    if not torch.isfinite(weights).all() or not (weights.norm(dim=1) > 0).all():
        raise ValueError("class embeddings must be finite and non-zero")
    owners = torch.cat([torch.full((len(heads[k]),), i) for i, k in enumerate(keys)])
    return weights, owners, keys


def softmax_regularizer(weights: torch.Tensor, owners: torch.Tensor, scale: float = 1.0) -> torch.Tensor:
    """Reg(W): each normalised row's softmax over itself and the other clients' rows, mean of -log P_ii."""
    if owners.shape != (len(weights),):
        raise ValueError(f"owners must name one client per row: {tuple(owners.shape)} for {len(weights)} rows")
    w = F.normalize(weights, dim=1)
    same_client = owners[:, None] == owners[None, :]
    own_other = same_client & ~torch.eye(len(w), dtype=torch.bool)
    logits = (scale * w @ w.T).masked_fill(own_other, float("-inf"))
    return F.cross_entropy(logits, torch.arange(len(w)))


def regularizer_gradient(weights: torch.Tensor, owners: torch.Tensor, scale: float = 1.0) -> torch.Tensor:
    """grad_W Reg(W) by autograd (float64)."""
    w = weights.detach().to(torch.float64).requires_grad_(True)
    (grad,) = torch.autograd.grad(softmax_regularizer(w, owners, scale), w)
    return grad


def gradient_correction(heads: Mapping[Hashable, torch.Tensor], lr: float, lam: float = 20.0,
                        scale: float = 1.0) -> dict[Hashable, torch.Tensor]:
    """Each client's corrected W_k = W_k - lam * lr * (grad_W Reg(W))_k, in the heads' own dtype."""
    if not lr > 0 or not lam >= 0:
        raise ValueError(f"need lr > 0 and lam >= 0, got {lr}, {lam}")
    weights, owners, keys = stack_heads(heads)
    corrected = weights - lam * lr * regularizer_gradient(weights, owners, scale)
    return {k: corrected[owners == i].to(heads[k].dtype) for i, k in enumerate(keys)}


def device_head_board(embedding_dim: int, lr: float, lam: float = 20.0, scale: float = 1.0) -> HeadBoard:
    """FedGC on U-shaped split's device heads (SPEC.md section 8.2, opt-in: pass it to EdgeServer): each upload
    is corrected together with every other device's latest head by `gradient_correction` (lr: the heads' own
    learning rate, as in the federated form), and the uploader gets its corrected head back. The price: the
    server sees every device's class embeddings (docs/fedgc.md)."""
    def correct(heads: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
        corrected = gradient_correction({d: torch.from_numpy(h) for d, h in heads.items()}, lr, lam, scale)
        return {d: h.numpy() for d, h in corrected.items()}

    return HeadBoard(embedding_dim, correct)
