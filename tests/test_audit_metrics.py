"""The audit's metrics on constructed cases whose answers are known."""
from __future__ import annotations

import numpy as np
import pytest

from edge_server.audit.metrics import chance_risk, linkage_rate, psnr, reidentification_risk, roc_auc, ssim


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
    assert chance_risk(query_ids, gallery_ids, 1) == pytest.approx(1 / 3)


def test_auc():
    assert roc_auc([3, 4, 5], [0, 1, 2]) == 1.0
    assert roc_auc([0, 1], [2, 3]) == 0.0
    assert roc_auc([1, 1], [1, 1]) == 0.5
    rng = np.random.default_rng(1)
    assert roc_auc(rng.normal(size=4000), rng.normal(size=4000)) == pytest.approx(0.5, abs=0.02)
    # one Gaussian shifted by d' = 1: AUC = Phi(1 / sqrt 2) = 0.760
    assert roc_auc(rng.normal(1, 1, 20000), rng.normal(0, 1, 20000)) == pytest.approx(0.760, abs=0.01)
