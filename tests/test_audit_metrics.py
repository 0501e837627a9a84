"""The audit's metrics on constructed cases whose answers are known."""
from __future__ import annotations

import numpy as np
import pytest

from research.audit.attack import label_leakage, membership_inference
from research.audit.metrics import chance_risk, linkage_rate, psnr, reidentification_risk, roc_auc, ssim


def test_psnr_and_ssim_on_known_images():
    rng = np.random.default_rng(0)
    x = rng.random((3, 3, 32, 32))
    assert np.isinf(psnr(x, x)).all() and np.allclose(ssim(x, x), 1.0)
    shifted = np.clip(x + 0.1, 0, 1)
    noisy = x + 0.1 * rng.standard_normal(x.shape)
    assert psnr(np.zeros_like(x) + 0.5, np.zeros_like(x) + 0.6)[0] == pytest.approx(20.0)  # mse 0.01
    # y = x + independent noise of variance s2, same means: SSIM -> (2 var + C2) / (2 var + s2 + C2)
    var, s2, c2 = 1 / 12, 0.01, 0.03 ** 2
    assert ssim(noisy, x) == pytest.approx(np.full(3, (2 * var + c2) / (2 * var + s2 + c2)), abs=0.01)
    assert (ssim(np.zeros_like(x), x) < 0.1).all()
    assert (psnr(noisy, x) < psnr(shifted, x) + 5).all()


def test_linkage_counts_reconstructions_nearest_their_own_source():
    originals = np.eye(4)
    assert linkage_rate(originals + 0.01, originals) == 1.0
    swapped = originals[[1, 0, 2, 3]]
    assert linkage_rate(swapped, originals) == 0.5


def test_reidentification_risk_top_k():
    gallery = np.array([[1, 0], [0.9, 0.1], [0, 1], [-1, 0]], dtype=float)
    gallery_ids = np.array([7, 7, 8, 9])
    queries = np.array([[1, 0.05], [0.1, 1], [0.8, 0.2]])
    query_ids = np.array([7, 8, 9])  # the third query is nearest to person 7's reconstructions
    assert reidentification_risk(queries, query_ids, gallery, gallery_ids, k=1) == pytest.approx(2 / 3)
    assert reidentification_risk(queries, query_ids, gallery, gallery_ids, k=3) == 1.0


def test_chance_risk_keeps_the_gallery_unbalanced():
    rng = np.random.default_rng(0)
    gallery, queries = rng.normal(size=(40, 8)), rng.normal(size=(30, 8))
    balanced = np.repeat(np.arange(10), 4)
    assert chance_risk(queries, rng.integers(0, 10, 30), gallery, balanced, 1, rounds=200) == \
        pytest.approx(0.1, abs=0.02)
    # identity 0 holds 31 of 40 items and is every query's identity: it wins the best-item ranking
    # far more often than 1 in 10
    skewed = np.concatenate([np.zeros(31, int), np.arange(1, 10)])
    assert chance_risk(queries, np.zeros(30, int), gallery, skewed, 1, rounds=200) > 0.5


def test_auc():
    assert roc_auc([3, 4, 5], [0, 1, 2]) == 1.0
    assert roc_auc([0, 1], [2, 3]) == 0.0
    assert roc_auc([1, 1], [1, 1]) == 0.5
    rng = np.random.default_rng(1)
    assert roc_auc(rng.normal(size=4000), rng.normal(size=4000)) == pytest.approx(0.5, abs=0.02)
    # one Gaussian shifted by d' = 1: AUC = Phi(1 / sqrt 2) = 0.760
    assert roc_auc(rng.normal(1, 1, 20000), rng.normal(0, 1, 20000)) == pytest.approx(0.760, abs=0.01)


def test_label_leakage_reads_identities_from_gradient_directions():
    rng = np.random.default_rng(0)
    labels = rng.integers(0, 5, 256)
    batches = np.repeat(np.arange(4), 64)
    directions = rng.normal(size=(5, 32))
    telling = directions[labels] + 0.3 * rng.normal(size=(256, 32))
    r = label_leakage(telling, labels, batches)
    assert r["direction_auc"] > 0.95 and r["nearest_gradient_same_identity"] > 0.9
    assert r["nearest_gradient_same_identity_chance"] == pytest.approx(0.2, abs=0.05)
    silent = label_leakage(rng.normal(size=(256, 32)), labels, batches)
    assert silent["direction_auc"] == pytest.approx(0.5, abs=0.05)
    assert silent["norm_auc_one_vs_rest_mean"] == pytest.approx(0.5, abs=0.1)
    # one identity's gradients twice as long: the norm attack finds it
    loud = rng.normal(size=(256, 32)) * np.where(labels == 0, 2.0, 1.0)[:, None]
    assert roc_auc(np.linalg.norm(loud[labels == 0], axis=1), np.linalg.norm(loud[labels != 0], axis=1)) > 0.9


def test_membership_inference_auc():
    rng = np.random.default_rng(0)
    assert membership_inference(rng.exponential(0.2, 500), rng.exponential(2.0, 500))["auc"] > 0.85
    assert membership_inference(rng.exponential(1.0, 500), rng.exponential(1.0, 500))["auc"] == \
        pytest.approx(0.5, abs=0.05)
