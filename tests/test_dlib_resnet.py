"""dlib's face-recognition network ported to PyTorch (research/audit/dlib_resnet.py) against dlib's own, on
real LFW faces aligned by dlib: the audit's strong recognizer and the distillation teacher run the port.

The tolerance, from an error analysis (an estimate, not a bound): both compute the same float32 network, in
different orders and groupings of each sum, with or without fused multiply-adds (dlib's im2col and gemm
against oneDNN's kernels). Rounding errors of random sign grow as the square root of the number of terms: a
sum of K = 3 * 3 * 256 = 2304 products (the widest here) is off by about sqrt(K) * 2**-24 = 2.9e-6 of its
terms' magnitudes, and a descriptor passes through 30 such layers (29 convolutions and the fully connected
one), about sqrt(30) * 2.9e-6 = 1.6e-5 of its norm. TOLERANCE allows about 6 times that, for sums that cancel
and layers that amplify; measured here, 8e-7. Half precision (bf16, 2**-8) or TF32 (2**-11) anywhere in the
port would exceed it. dlib's own decision threshold is a distance of 0.6 between descriptors of norm about
1.4 (1.2-1.7 on the public faces)."""
from __future__ import annotations

import numpy as np
import pytest

from splitface.common.data import load_lfw
from splitface.device.trainer import to_input
from research.audit.dlib_resnet import DlibFaceNet, DlibFormatError
from research.audit.recognizer import DlibResNet, dlib_models_dir

WEIGHTS = "dlib_face_recognition_resnet_model_v1.dat"
TOLERANCE = 1e-4   # of the descriptor's norm


@pytest.fixture(scope="module")
def faces(lfw) -> tuple[np.ndarray, np.ndarray]:
    """Three photos each of eight LFW people, as the audit sees them (64 px of the 160 px centre crop)."""
    data = load_lfw(lfw, min_images=10, max_identities=8)
    keep = np.concatenate([np.flatnonzero(data.train.labels == c)[:3] for c in np.unique(data.train.labels)])
    return to_input(data.train.subset(keep).load(64, 160)).numpy(), data.train.labels[keep]


def test_the_port_gives_dlibs_descriptors_on_real_faces(faces):
    images, labels = faces
    ported, own = DlibResNet(engine="torch").embed(images, batch=7), DlibResNet(engine="dlib").embed(images)
    assert ported.shape == own.shape == (len(images), 128)
    error = np.linalg.norm(ported - own, axis=1) / np.linalg.norm(own, axis=1)
    assert error.max() <= TOLERANCE, error.max()
    # the same faces are nearest to each other by either network (no pair sits within the error of a tie)
    def nearest(v: np.ndarray) -> np.ndarray:
        d = np.linalg.norm(v[:, None] - v[None], axis=2)
        np.fill_diagonal(d, np.inf)
        return d.argmin(1)
    assert np.array_equal(nearest(ported), nearest(own))
    assert (labels[nearest(own)] == labels).mean() > 0.8   # and they find people: this is a face recognizer


def test_a_batch_gives_each_faces_descriptor_alone(faces):
    images, _ = faces
    dlib = DlibResNet()
    together, alone = dlib.embed(images[:5]), np.concatenate([dlib.embed(images[i:i + 1]) for i in range(5)])
    assert (np.linalg.norm(together - alone, axis=1) / np.linalg.norm(alone, axis=1)).max() <= TOLERANCE


@pytest.mark.parametrize("other", ["mmod_human_face_detector.dat", "shape_predictor_5_face_landmarks.dat"])
def test_another_dlib_model_is_refused_by_name(other):
    with pytest.raises(DlibFormatError, match="not dlib's face-recognition ResNet"):
        DlibFaceNet(dlib_models_dir() / other)


@pytest.mark.parametrize("keep", [0, 100, 500_000, -2000])
def test_a_truncated_file_is_refused_clearly(tmp_path, keep):
    data = (dlib_models_dir() / WEIGHTS).read_bytes()
    cut = tmp_path / "cut.dat"
    cut.write_bytes(data[:keep])
    with pytest.raises(DlibFormatError, match="cut.dat: not dlib's face-recognition ResNet"):
        DlibFaceNet(cut)


def test_a_fixed_alignment_cuts_every_face_where_the_averaged_landmarks_say(faces):
    """Alignment "fixed" (what aligning each face is worth, results/verification/): fitted on one face, its chip
    of that face is the landmark-aligned one exactly (dlib's landmarks are whole pixels, so their mean over one
    face is themselves); other faces are cut where that face's landmarks were, not their own."""
    images, _ = faces
    aligned, fixed = DlibResNet(), DlibResNet(alignment="fixed")
    with pytest.raises(RuntimeError, match="fix_alignment"):
        fixed.chip(images[0])
    fixed.fix_alignment(images[:1])
    assert np.array_equal(fixed.chip(images[0]), aligned.chip(images[0]))
    def marks(image: np.ndarray) -> list[tuple[int, int]]:
        shape = aligned._landmarks(aligned._work_rgb(image))
        return [(shape.part(i).x, shape.part(i).y) for i in range(shape.num_parts)]
    for image in images[1:]:
        assert np.array_equal(fixed.chip(image), aligned.chip(image)) == (marks(image) == marks(images[0]))
    unaligned = DlibResNet(alignment="none").chip(images[0])
    assert unaligned.shape == (150, 150, 3) and not np.array_equal(unaligned, aligned.chip(images[0]))
    # each way of cutting names its own cache of embeddings
    assert len({aligned.fingerprint, fixed.fingerprint, DlibResNet(alignment="none").fingerprint}) == 3
    with pytest.raises(ValueError, match="alignment must be one of"):
        DlibResNet(alignment="eyes")
    with pytest.raises(ValueError, match="for alignment='fixed'"):
        aligned.fix_alignment(images)
    with pytest.raises(ValueError, match="at least one face"):
        DlibResNet(alignment="fixed").fix_alignment(images[:0])
    # another fit, another geometry, another name for its embeddings
    assert DlibResNet(alignment="fixed").fix_alignment(images[1:2]).fingerprint != fixed.fingerprint
