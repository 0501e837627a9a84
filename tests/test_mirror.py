"""The server's test-time flipping (--mirror-average): the mirror image's release computed from the release."""
from __future__ import annotations

from dataclasses import replace

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from torch import nn

from research import demo
from splitface.common.models import PRESETS, build_backbone, split_backbone
from splitface.common.transforms import MIRRORED, mirror_averaged, release_mirror
from splitface.common.transforms.dct import BlockDCT, mirror_release
from splitface.common.transforms.mask import random_patch_mask
from splitface.server.trainer import ServerTrainer

SMALL = PRESETS["iresnet_small"]
DCT = replace(SMALL, release="dct", dct_drop=4, dct_stem_blocks=2)   # run.sh's release and server stage


@pytest.mark.parametrize("upsample, drop", [(1, 0), (1, 1), (2, 4), (2, 6)])
def test_the_mirror_of_a_block_dct_is_the_block_dct_of_the_mirror_image(upsample, drop):
    """Exact up to float32 rounding. Each coefficient sums 64 products of a basis value (|d_u d_v| <= 1/4) and a
    pixel in [0, 1] (bilinear upsampling keeps them there): |sum| <= 16, and the two sides sum the same products in
    another order, with basis values that may differ by one rounding of the cosine, so they differ by at most about
    (64 + 1) 2^-24 16 = 6.2e-5."""
    torch.manual_seed(0)
    dct = BlockDCT(upsample, drop)
    x = torch.rand(3, 3, 64, 64)
    assert torch.allclose(mirror_release(dct(x), drop), dct(x.flip(-1)), rtol=0, atol=1e-4)
    assert torch.equal(mirror_release(mirror_release(dct(x), drop), drop), dct(x))   # an involution, bit for bit


def test_the_clip_and_the_frequency_weights_commute_with_the_mirror():
    """The per-image mechanism scales each frequency, clips the whole release to its norm and adds noise whose law
    depends only on the frequency and is symmetric about 0: with the noise off (z = 0, the clip active), the release
    of the mirror image is the mirror of the release, up to the DCT's rounding (above) scaled by the clip (<= 1)."""
    from splitface.device.privacy.mechanisms import PerImageGaussian
    from splitface.device.trainer import privatize

    dct = BlockDCT(2, DCT.dct_drop)
    x = torch.rand(3, 3, 64, 64)
    mechanism = PerImageGaussian(clip_norm=1.0, noise_multiplier=0.0, frequency_gamma=2.0)
    release = lambda images: privatize(DCT, mechanism, dct(images), torch.Generator().manual_seed(0))  # noqa: E731
    assert not torch.allclose(release(x), dct(x), atol=1e-2)   # the clip is active
    assert torch.allclose(mirror_release(release(x), DCT.dct_drop), release(x.flip(-1)), rtol=0, atol=1e-4)


def test_the_server_mirrors_only_the_releases_whose_mirror_it_can_compute():
    """The image with patches masked mirrors as an image: the mirror of a masked release is the mirror image with
    the mirrored patches masked, a release the device could have made (the patch grid divides the image); a learned
    layer's output has no such map."""
    assert set(MIRRORED) == {"dct", "mask"}
    mask_spec = replace(SMALL, release="mask")
    image = torch.rand(2, 3, 64, 64)
    mask = random_patch_mask(2, 64, mask_spec.mask_patch, 0.75, torch.Generator().manual_seed(0))
    patches = mask[..., ::mask_spec.mask_patch, ::mask_spec.mask_patch]
    assert torch.equal(mask.flip(-1), torch.kron(patches.flip(-1), torch.ones(mask_spec.mask_patch, mask_spec.mask_patch)))
    assert torch.equal(release_mirror(mask_spec)(image * mask), image.flip(-1) * mask.flip(-1))
    for spec in (SMALL, replace(SMALL, release_pool=2), replace(SMALL, release="bottleneck")):
        with pytest.raises(ValueError, match="knows the mirror image's release only for"):
            release_mirror(spec)


def _trainer(mirror_average: bool, mirror_train: bool = False) -> ServerTrainer:
    torch.manual_seed(0)
    return ServerTrainer(DCT, "layer2", 5, device="cpu", mirror_average=mirror_average, mirror_train=mirror_train)


def _release(n: int = 4) -> np.ndarray:
    torch.manual_seed(1)
    device, _ = split_backbone(build_backbone(DCT), "layer2")
    return device(torch.rand(n, 3, 64, 64)).numpy()


def test_the_servers_test_embedding_is_the_mean_of_the_release_and_its_mirror():
    """Outside training: the embedding (device head) and the logits (server head) of a release are those of its
    mirror's (the same two tail passes, summed in the other order: equal bit for bit), and the mean of the two
    passes; training steps are untouched."""
    averaged, plain = _trainer(True), _trainer(False)
    x = _release()
    mirrored = mirror_release(torch.from_numpy(x), DCT.dct_drop).numpy()
    once = plain.embed(x, train=False)
    assert np.array_equal(averaged.embed(x, train=False), averaged.embed(mirrored, train=False))
    assert np.allclose(averaged.embed(x, train=False), (once + plain.embed(mirrored, train=False)) / 2, rtol=0,
                       atol=1e-6)   # the same passes, averaged inside the autocast context or outside it
    assert not np.allclose(once, plain.embed(mirrored, train=False), atol=1e-3)   # the mirror is another input
    labels = np.array([0, 1, 2, 3])
    loss, correct = averaged.evaluate(x, labels)
    assert (loss, correct) == averaged.evaluate(mirrored, labels)
    with torch.no_grad():
        logits = averaged.classifier(torch.from_numpy(averaged.embed(x, train=False)))
    assert loss == pytest.approx(float(F.cross_entropy(logits, torch.from_numpy(labels))), rel=1e-6)
    # training is the same with or without it
    for t in (averaged, plain):
        t.train_server_head(x, labels)
    assert all(torch.equal(a, b) for a, b in zip(averaged.tail.state_dict().values(), plain.tail.state_dict().values()))


def test_training_on_the_mirror_average_is_one_pass_over_the_release_and_its_mirror():
    """--mirror-train: the loss, the gradient sent back and the batch norms' running statistics are those of one pass
    over the release and its mirror's (as an identical copy computes them: the same operations in the same order,
    so equal bit for bit), so the running statistics take one update a step, as the guard on them assumes; the
    imprinted class means are the average's too, and a device head's embeddings. Without it training differs."""
    x, labels = _release(), np.array([0, 1, 2, 3])
    trained, copy = _trainer(True, True), _trainer(True, True)
    copy.tail.train()
    release = torch.from_numpy(x).requires_grad_(True)
    expected = F.cross_entropy(copy.classifier(mirror_averaged(copy.tail, copy.mirror, release)),
                               torch.from_numpy(labels))
    expected.backward()
    grad, loss, _ = trained.train_server_head(x, labels)
    assert loss == float(expected.detach()) and np.array_equal(grad, release.grad.numpy())
    batch_norms = [(a, b) for a, b in zip(trained.tail.modules(), copy.tail.modules()) if isinstance(a, nn.BatchNorm2d)]
    assert batch_norms and all(int(a.num_batches_tracked) == 1 for a, _ in batch_norms)
    assert all(torch.equal(a.running_mean, b.running_mean) and torch.equal(a.running_var, b.running_var)
               for a, b in batch_norms)
    plain = _trainer(True)
    plain.train_server_head(x, labels)
    assert not all(torch.equal(a, b) for a, b in zip(trained.tail.parameters(), plain.tail.parameters()))
    # imprinting: the head's rows are the class means of the averaged embeddings
    imprinted = ServerTrainer(DCT, "layer2", 5, device="cpu", imprint_steps=2, mirror_average=True, mirror_train=True)
    means = ServerTrainer(DCT, "layer2", 5, device="cpu", imprint_steps=2, mirror_average=True, mirror_train=True)
    means.tail.train()
    with torch.no_grad():
        averaged = mirror_averaged(means.tail, means.mirror, torch.from_numpy(x))
    imprinted.train_server_head(x, labels)
    rows = F.normalize(imprinted.classifier.weight[:4].detach(), dim=1)   # each class once: its row, its one embedding
    # unit vectors a few float32 roundings apart (2^-24 each, on components of at most 1)
    assert torch.allclose(rows, F.normalize(averaged, dim=1), rtol=0, atol=1e-6)
    # a device head trains on the same average, and the gradient it gets back goes through both halves
    device_head = _trainer(True, True)
    copy = _trainer(True, True)
    copy.tail.train()
    release = torch.from_numpy(x).requires_grad_(True)
    averaged = mirror_averaged(copy.tail, copy.mirror, release)
    assert np.array_equal(device_head.embed(x, train=True), averaged.detach().numpy())
    embedding_grad = np.linspace(-1, 1, averaged.numel(), dtype=np.float32).reshape(averaged.shape)
    averaged.backward(torch.from_numpy(embedding_grad))
    assert np.array_equal(device_head.train_tail(embedding_grad), release.grad.numpy())
    with pytest.raises(ValueError, match="needs mirror_average"):
        _trainer(False, True)


def test_the_server_refuses_to_train_on_a_mirror_average_that_it_does_not_make(tmp_path, capsys):
    """`serve --mirror-train` needs --mirror-average; the demo, whose run.sh asks for both, drops the training on it
    where the average is off (`./run.sh --no-mirror-average`) and says so."""
    from research.pretrain_table import run_sh_array
    from splitface.server import cli

    with pytest.raises(SystemExit) as stopped:
        cli.main(["serve", "--num-classes", "3", "--tokens", str(tmp_path / "tokens.json"), "--mirror-train"])
    assert stopped.value.code == 2 and "it needs --mirror-average" in capsys.readouterr().err
    main_job = [*run_sh_array("DEFAULT_RELEASE"), *run_sh_array("DEFAULT_SERVER_STAGE"), "--mirror-train"]
    args, _ = demo.parser().parse_known_args(main_job)
    demo.drop_mirror_without_map(args)
    assert args.mirror_average and args.mirror_train and capsys.readouterr().err == ""
    args, _ = demo.parser().parse_known_args([*main_job, "--no-mirror-average"])
    demo.drop_mirror_without_map(args)
    assert not args.mirror_train and "trains on each release once" in capsys.readouterr().err
    args, _ = demo.parser().parse_known_args([*main_job, "--release", "none", "--split", "conv1"])
    demo.drop_mirror_without_map(args)
    assert not args.mirror_average and not args.mirror_train


def test_the_server_refuses_a_mirror_it_cannot_compute(tmp_path, capsys):
    from splitface.server import cli

    with pytest.raises(SystemExit) as stopped:
        cli.main(["serve", "--num-classes", "3", "--tokens", str(tmp_path / "tokens.json"), "--mirror-average"])
    assert stopped.value.code == 2 and "knows the mirror image's release only for" in capsys.readouterr().err
    with pytest.raises(ValueError, match="knows the mirror image's release only for"):
        ServerTrainer(SMALL, "conv1", 3, device="cpu", mirror_average=True)


def test_the_demo_drops_the_mirror_where_the_release_has_none_and_says_so(tmp_path, capsys):
    """run.sh asks for the mirror; `./run.sh --release none --split conv1` (the paper's release) still runs, embedding
    each release once, and says so; --no-mirror-average after run.sh's flags turns it off."""
    from research.pretrain_table import run_sh_array

    main_job = [*run_sh_array("DEFAULT_START"), *run_sh_array("DEFAULT_RELEASE"), *run_sh_array("DEFAULT_SERVER_STAGE")]
    args, _ = demo.parser().parse_known_args(main_job)
    demo.drop_mirror_without_map(args)
    assert args.mirror_average and capsys.readouterr().err == ""
    assert not demo.parser().parse_known_args([*main_job, "--no-mirror-average"])[0].mirror_average
    with pytest.raises(FileNotFoundError):   # no data there: the demo stops after its checks of the arguments
        demo.main([*main_job, "--release", "none", "--split", "conv1", "--data", str(tmp_path / "no-lfw"),
                   "--run-dir", str(tmp_path / "run")])
    assert "the server embeds each release once" in capsys.readouterr().err


def test_view1_embeds_a_finished_run_as_its_server_embeds_with_the_mirror(lfw, tmp_path):
    """`splitface-research evaluate --mirror-average`: each release's embedding is the mean of the server's tail on it
    and on its mirror image's release (the same passes, in the same order: equal bit for bit), and the report
    says so; by default it embeds as the run's server did, which its metrics.json records."""
    import asyncio

    from research.evaluation.run import evaluate_run, load_split_model, recorded_mirror_average, run_embedder
    from splitface.common.data import load_lfw
    from splitface.common.optim import TrainConfig
    from splitface.sim.simulator import SimConfig, simulate
    from tests.conftest import TOKENS, serve_in_thread

    selection = {"image_folder": False, "min_images": 10, "max_identities": 4, "max_images": None,
                 "people": "devtrain", "seed": 0}
    data = load_lfw(lfw, min_images=10, max_identities=4, people="devtrain")
    data.train, data.test = data.train.subset(np.arange(24)), data.test.subset(np.arange(8))
    config = SimConfig(url="", spec=DCT, split="layer2", num_devices=1, epochs=1, batch_size=24, progress=False,
                       train=TrainConfig(lr=0.05), results=tmp_path / "results.json", data=selection)
    torch.manual_seed(0)
    server_trainer = ServerTrainer(DCT, "layer2", 4, TrainConfig(lr=0.05), device="cpu", mirror_average=True)
    with serve_in_thread(server_trainer, tmp_path / "server") as server:
        config.url = server.url
        asyncio.run(simulate(config, data, {"device-0": TOKENS["device-0"]}))
    layer, tail, _ = load_split_model(tmp_path)
    plain, _ = run_embedder(tmp_path)
    averaged, _ = run_embedder(tmp_path, mirror_average=True)
    x = np.random.default_rng(0).random((4, 3, 64, 64), dtype=np.float32)
    with torch.no_grad():   # the run released without noise: the release is the block DCT itself
        release = layer(torch.from_numpy(x))
        assert np.array_equal(plain(x), tail(release).numpy())
        by_hand = (tail(release) + tail(mirror_release(release, DCT.dct_drop))) / 2
    assert np.array_equal(averaged(x), by_hand.numpy())
    assert recorded_mirror_average(tmp_path)   # the server's metrics.json says how it embedded
    report = evaluate_run(tmp_path, lfw, limit=20)
    assert report["mirror_average"] is True and report["pairs"] == 20
    assert evaluate_run(tmp_path, lfw, limit=20, mirror_average=False)["mirror_average"] is False


def test_the_audits_server_model_attack_also_averages_and_the_identity_figures_take_the_stronger():
    """The curious server embeds as it can: each release with its mirror's (AttackerView.embed, the same two passes
    as the server's, bit for bit); `server_model` and the headline figures take whichever server-model attack beats
    its chance by more, and reports from before the mirror keep their single attack."""
    from research.audit.cli import headline, identity_kinds, server_model, server_model_attacks
    from research.audit.run import AttackerView

    trainer = _trainer(False)
    view = AttackerView(name="run", spec=DCT, split="layer2", head="server", mechanism=None, layer=None,
                        layer_knowledge="exact", tail=trainer.tail, classifier=None, recordings={}, results={})
    x = _release()
    with torch.no_grad():
        trainer.tail.eval()
        by_hand = (trainer.tail(torch.from_numpy(x)) + trainer.tail(mirror_release(torch.from_numpy(x), DCT.dct_drop))) / 2
    assert np.array_equal(view.embed(x, mirror_average=True), by_hand.numpy())
    assert np.array_equal(view.embed(x), trainer.embed(x, train=False))

    def risk(r1: float, chance: float) -> dict:
        return {"risk@1": r1, "risk@1_chance": chance}
    attacks = {"reconstruction_ridge": {"recognizers": {"dlib": {**risk(0.5, 0.05), "risk@1_clean_upper_bound": 0.97}},
                                        "linkage_pixels": 0.9, "linkage_pixels_chance": 0.01},
               "identity_matching": risk(0.3, 0.05), "server_model_linkage": risk(0.70, 0.05),
               "membership_inference": {}, "label_leakage": {}}
    report = {"run": "run", "head": "server", "mechanism": {}, "test_accuracy": 0.8, "attacks": attacks,
              "strong_recognizer": {"name": "dlib", "clean_risk@1": 0.97}}
    assert [name for name, _ in server_model_attacks(report)] == ["server model"]   # an old report
    assert identity_kinds(report)["model_identity_r1"] == 0.70
    attacks["server_model_linkage_mirror"] = risk(0.74, 0.05)
    assert server_model(report) == risk(0.74, 0.05)
    assert identity_kinds(report)["model_identity_r1"] == 0.74
    top = headline(report)
    assert top["server_model_risk@1"] == 0.74 and top["identity_attack"] == "server model, mirror-averaged"
    attacks["server_model_linkage_mirror"] = risk(0.72, 0.01)   # fewer found, but further above its chance
    assert server_model(report) == risk(0.72, 0.01)


def test_the_paired_table_reads_each_runs_wire_and_signs_its_differences():
    """research/mirror_pairs.py: the release passes through the run's own wire encoding (none for float32), and each
    row's differences are the mirror's figure less the single embedding's, signed."""
    from research.mirror_pairs import report, wire_encoding

    assert wire_encoding({"config": {"encodings": {"activations": "i8c", "gradients": "i8c"}}}) == "i8c"
    assert wire_encoding({"config": {"encodings": {"activations": "f32"}}}) is None
    assert wire_encoding({"config": {}}) is None
    figures = lambda lfw, view1: {"lfw158_test_accuracy": lfw, "view1_accuracy": view1}  # noqa: E731
    text = report([{"run": "r", "recorded_test_acc": 0.84, "once": figures(0.818, 0.865), "mirror": figures(0.846, 0.859)}])
    assert "| r | 0.840 | 0.818 | 0.846 | +0.028 | 0.865 | 0.859 | -0.006 |" in text


@pytest.mark.slow
def test_a_dct_run_with_the_mirror_average_is_audited_with_the_mirror_too(tmp_path, lfw):
    """End to end on a tiny run: the demo's server averages (metrics.json says so), and the audit attacks the
    release as that server can: its own model and each inversion also on the mirror images' releases."""
    import json
    import subprocess
    import sys

    from research.audit.cli import headline
    from tests.conftest import ROOT, tiny_audit

    run = tmp_path / "run"
    demo_run = subprocess.run(
        [sys.executable, "-m", "research.demo", "--data", str(lfw), "--run-dir", str(run), "--release", "dct",
         "--split", "layer2", "--dct-drop", "4", "--mirror-average", "--mirror-train", "--epochs", "1", "--max-identities", "3",
         "--devices", "1", "--batch-size", "8", "--record-max", "8", "--threads", "1", "--no-progress"],
        capture_output=True, text=True, timeout=300, cwd=ROOT)
    assert demo_run.returncode == 0, demo_run.stdout + demo_run.stderr
    metrics = json.loads((run / "server" / "metrics.json").read_text())
    assert metrics["test_embedding"] == metrics["train_embedding"] == {"mirror_average": True}
    report = tiny_audit(run, lfw, tmp_path)
    attacks = report["attacks"]
    assert 0 <= attacks["server_model_linkage_mirror"]["risk@1"] <= 1
    for attack in ("reconstruction_ridge_mirror", "reconstruction_decoder_mirror"):
        assert 0 <= attacks[attack]["recognizers"]["eigenfaces"]["risk@1"] <= 1, attack
    assert attacks["reconstruction_decoder_mirror"]["images"] == attacks["reconstruction_decoder"]["images"]
    assert 0 <= headline(report)["linkage_pixels"] <= 1


def test_a_run_made_before_the_servers_record_is_evaluated_as_its_demo_asked():
    """The committed -mirror runs predate metrics.json's `test_embedding`: their recorded demo arguments say how their
    server embedded (and their committed View 1 was made so); runs without the flag embedded once."""
    import json

    from research.evaluation.run import recorded_mirror_average
    from tests.conftest import ROOT

    runs = ROOT / "results" / "pretrain-hold" / "runs"
    for run, averaged in (("runsh-first-recipe-hold-mirror", True), ("runsh-first-recipe-hold", False)):
        assert "test_embedding" not in json.loads((runs / run / "server" / "metrics.json").read_text())
        assert recorded_mirror_average(runs / run) is averaged
        assert json.loads((runs / run / "view1.json").read_text()).get("mirror_average", False) is averaged


def test_the_audits_mirrored_reconstruction_is_the_face_itself_not_its_mirror():
    """With an exact inversion (the full block DCT, nothing dropped, inverted by its transpose), the reconstruction
    from the mirror image's release, mirrored back, is the face itself, not its mirror: the audit averages two views
    of the same face. Tolerance: each pixel back is a sum of 64 coefficients (|c| <= 8) times basis values
    (<= 1/4), |terms| summing to at most 128, so float32 rounding stays below about 64 2^-24 128 = 4.9e-4 (and the
    forward transform's 6.2e-5, above); a mirror image differs from the face by far more than 1e-2."""
    from research.audit.cli import mirror_reconstruction

    full = replace(SMALL, release="dct", dct_drop=0)
    dct = BlockDCT(1, 0)

    class ExactInversion:
        def reconstruct(self, releases: np.ndarray) -> np.ndarray:
            return F.conv_transpose2d(torch.from_numpy(np.ascontiguousarray(releases)), dct.basis, stride=8,
                                      groups=3).numpy()

    x = torch.rand(2, 3, 64, 64)
    with torch.no_grad():
        releases = dct(x).numpy()
    assert np.allclose(ExactInversion().reconstruct(releases), x.numpy(), rtol=0, atol=1e-3)
    back = mirror_reconstruction(ExactInversion(), releases, release_mirror(full))
    assert np.allclose(back, x.numpy(), rtol=0, atol=1e-3) and not np.allclose(back, x.flip(-1).numpy(), atol=1e-2)
