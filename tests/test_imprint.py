"""Weight imprinting of the server head (splitface/server/imprint.py): while it is on, each seen class's row is
the scaled mean direction of that class's embeddings and the head takes no gradient; afterwards the head trains
from there. A refused step leaves the means as they were, and a checkpoint carries them."""
from __future__ import annotations

import argparse
import copy

import numpy as np
import pytest
import torch
import torch.nn.functional as F

from splitface.common.models import build_backbone, resolve_spec, split_backbone
from splitface.common.optim import TrainConfig
from splitface.server.imprint import SCALE, Imprinter
from splitface.server.trainer import ServerTrainer, StepGuard, StepRefused
from research import demo

SPEC = resolve_spec("iresnet_small")
NUM_CLASSES = 5
torch.manual_seed(0)
DEVICE_LAYER, _ = split_backbone(build_backbone(SPEC), "conv1")


def _batch(seed: int, labels: list[int]) -> tuple[np.ndarray, np.ndarray]:
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        x = DEVICE_LAYER(torch.rand(len(labels), 3, SPEC.input_size, SPEC.input_size, generator=g))
    return x.numpy(), np.array(labels)


def _trainer(imprint_steps: int, guard: StepGuard | None = None, hold_tail: bool = False) -> ServerTrainer:
    return ServerTrainer(SPEC, "conv1", NUM_CLASSES, TrainConfig(lr=0.05), device="cpu", guard=guard,
                         imprint_steps=imprint_steps, imprint_hold_tail=hold_tail)


def _embeddings(trainer: ServerTrainer, activations: np.ndarray) -> torch.Tensor:
    """What the trainer's next training step computes: the same tail in training mode on the same batch (a
    copy, so its batch norms' running statistics stay the trainer's)."""
    tail = copy.deepcopy(trainer.tail).train()
    with torch.no_grad():
        return tail(torch.as_tensor(activations))


def test_the_rows_of_seen_classes_are_their_scaled_mean_directions_and_the_rest_keep_their_start():
    trainer = _trainer(imprint_steps=2)
    start = trainer.classifier.weight.detach().clone()
    batches = [_batch(1, [0, 1, 0, 2]), _batch(2, [1, 2, 2, 0])]
    seen = []
    for x, y in batches:
        seen.append((_embeddings(trainer, x), torch.as_tensor(y)))
        trainer.train_server_head(x, y)
        assert trainer.classifier.weight.grad is None   # set by the means, not trained
    e = torch.cat([s[0] for s in seen])
    y = torch.cat([s[1] for s in seen])
    w = trainer.classifier.weight.detach()
    for c in range(3):
        direction = F.normalize(F.normalize(e[y == c], dim=1).sum(0), dim=0)
        # float32 sums and normalisations of 8 vectors of 128 values: relative errors of a few 1e-7
        torch.testing.assert_close(w[c], SCALE / e.norm(dim=1).mean() * direction, rtol=1e-5, atol=1e-6)
    assert torch.equal(w[3:], start[3:])
    assert torch.equal(trainer.classifier.bias.detach()[:3], torch.zeros(3))


def test_after_the_imprinting_steps_the_head_trains_from_the_means():
    trainer = _trainer(imprint_steps=1)
    trainer.train_server_head(*_batch(1, [0, 1, 2, 3]))
    imprinted = trainer.classifier.weight.detach().clone()
    counts = trainer.imprinter.counts.clone()
    assert trainer.classifier.weight.requires_grad
    trainer.train_server_head(*_batch(2, [0, 1, 2, 4]))
    assert trainer.classifier.weight.grad is not None
    assert not torch.equal(trainer.classifier.weight.detach(), imprinted)   # an SGD step moved it
    assert torch.equal(trainer.imprinter.counts, counts)   # and the means took nothing more


@pytest.mark.parametrize("hold_tail", [False, True])
def test_a_held_tail_keeps_its_weights_while_the_head_is_imprinted_and_trains_after(hold_tail):
    """--imprint-hold-tail: fine-tuning starts from the start's class means. The device still gets its gradient
    meanwhile, and the guard still checks the tail's gradient (computed, then dropped)."""
    trainer = _trainer(imprint_steps=1, hold_tail=hold_tail)
    weights = {k: v.detach().clone() for k, v in trainer.tail.named_parameters()}

    def moved() -> bool:
        return any(not torch.equal(v.detach(), weights[k]) for k, v in trainer.tail.named_parameters())
    grad, _, _ = trainer.train_server_head(*_batch(1, [0, 1, 2, 3]))
    assert np.abs(grad).max() > 0
    assert moved() != hold_tail
    trainer.train_server_head(*_batch(2, [0, 1, 2, 4]))
    assert moved()


def test_the_guard_checks_a_held_tails_gradient_and_a_checkpoint_keeps_the_hold():
    held = _trainer(imprint_steps=4, guard=StepGuard(max_grad_norm=1e-12), hold_tail=True)
    with pytest.raises(StepRefused, match="gradient norm"):
        held.train_server_head(*_batch(1, [0, 1, 2, 3]))
    first = _trainer(imprint_steps=2, hold_tail=True)
    first.train_server_head(*_batch(1, [0, 1, 0, 2]))
    resumed = _trainer(imprint_steps=2)   # restarted without the flag: the run goes on as it started
    resumed.load_state_dict(copy.deepcopy(first.state_dict()))
    assert resumed.imprinter.holds_tail(resumed.steps)
    for trainer in (first, resumed):
        trainer.train_server_head(*_batch(2, [3, 1, 4, 2]))
    assert all(torch.equal(a, b) for a, b in zip(first.tail.parameters(), resumed.tail.parameters()))
    with pytest.raises(ValueError, match="needs imprint steps"):
        Imprinter(torch.nn.Linear(4, 3), 0, hold_tail=True)


def test_a_refused_step_leaves_the_means_and_the_head_as_they_were():
    trainer = _trainer(imprint_steps=4, guard=StepGuard(max_grad_norm=1e-12))
    head = {k: v.clone() for k, v in trainer.classifier.state_dict().items()}
    with pytest.raises(StepRefused):
        trainer.train_server_head(*_batch(1, [0, 1, 2, 3]))
    assert trainer.imprinter.counts.sum() == 0 and trainer.imprinter.norm_sum == 0
    assert all(torch.equal(v, head[k]) for k, v in trainer.classifier.state_dict().items())


def test_a_checkpoint_carries_the_means_and_the_resumed_trainer_goes_on_as_the_first_would():
    first = _trainer(imprint_steps=2)
    first.train_server_head(*_batch(1, [0, 1, 0, 2]))
    resumed = _trainer(imprint_steps=2)
    resumed.load_state_dict(copy.deepcopy(first.state_dict()))
    assert torch.equal(resumed.imprinter.sums, first.imprinter.sums)
    for trainer in (first, resumed):
        trainer.train_server_head(*_batch(2, [3, 1, 4, 2]))
    assert torch.equal(resumed.classifier.weight, first.classifier.weight)
    assert resumed.classifier.weight.requires_grad and first.classifier.weight.requires_grad


def test_negative_imprint_steps_are_refused():
    with pytest.raises(ValueError, match="imprint steps"):
        Imprinter(torch.nn.Linear(4, 3), -1)


def test_the_demo_imprints_a_server_head_over_its_epochs_and_says_when_the_head_is_on_the_devices(capsys):
    args = argparse.Namespace(imprint_epochs=1.0, head="server", devices=2, batch_size=64, imprint_hold_tail=False)
    assert demo.server_imprint_steps(args, 3895) == 2 * 31   # each device: ceil(3895 / 2 / 64) batches an epoch
    args.imprint_epochs = 0.5
    assert demo.server_imprint_steps(args, 3895) == 31
    args.head = "device"
    assert demo.server_imprint_steps(args, 3895) == 0
    assert "not imprinted" in capsys.readouterr().err
    args.imprint_hold_tail = True
    assert demo.server_imprint_steps(args, 3895) == 0
    assert "the server's tail is not held" in capsys.readouterr().err


def test_the_server_refuses_negative_imprint_steps_as_a_usage_error(tmp_path, capsys):
    from splitface.server import cli

    with pytest.raises(SystemExit) as stopped:
        cli.main(["serve", "--num-classes", "3", "--tokens", str(tmp_path / "tokens.json"), "--imprint-steps", "-1"])
    assert stopped.value.code == 2 and "--imprint-steps must be >= 0" in capsys.readouterr().err
    with pytest.raises(SystemExit) as stopped:
        cli.main(["serve", "--num-classes", "3", "--tokens", str(tmp_path / "tokens.json"), "--imprint-hold-tail"])
    assert stopped.value.code == 2 and "it needs --imprint-steps" in capsys.readouterr().err


def test_the_demo_holds_nothing_where_nothing_is_imprinted_and_says_so(tmp_path, capsys):
    """run.sh holds the tail while the head is imprinted; with its start and --imprint-epochs 0 (the old start's
    flags) the demo says that nothing is held (before it looks for the data) and sets the hold off;
    --no-imprint-hold-tail after run.sh's flags turns it off (the last flag wins)."""
    from research.pretrain_table import run_sh_array

    start = run_sh_array("DEFAULT_START")
    with pytest.raises(FileNotFoundError):   # no data there: the demo stops after its checks of the arguments
        demo.main([*start, "--imprint-epochs", "0", "--data", str(tmp_path / "no-lfw"), "--run-dir", str(tmp_path / "run")])
    assert "nothing is imprinted, so the server's tail is not held" in capsys.readouterr().err
    assert demo.parser().parse_known_args(start)[0].imprint_hold_tail
    assert not demo.parser().parse_known_args([*start, "--no-imprint-hold-tail"])[0].imprint_hold_tail
    args, _ = demo.parser().parse_known_args([*start, "--imprint-epochs", "0"])
    demo.drop_hold_without_imprinting(args)
    assert not args.imprint_hold_tail and "nothing is imprinted, so the server's tail is not held" in capsys.readouterr().err
    args, _ = demo.parser().parse_known_args(start)
    demo.drop_hold_without_imprinting(args)
    assert args.imprint_hold_tail and capsys.readouterr().err == ""


def test_a_resumed_run_keeps_its_schedule_and_an_old_checkpoint_is_never_imprinted_over():
    first = _trainer(imprint_steps=3)
    first.train_server_head(*_batch(1, [0, 1, 0, 2]))
    restarted = _trainer(imprint_steps=0)   # restarted with another --imprint-steps: the run's own schedule holds
    restarted.load_state_dict(copy.deepcopy(first.state_dict()))
    assert restarted.imprinter.active(restarted.steps) and not restarted.classifier.weight.requires_grad
    old = copy.deepcopy(first.state_dict())
    del old["imprint"]   # a checkpoint written before imprinting existed
    trained = old["classifier"]["weight"].clone()
    resumed = _trainer(imprint_steps=10)
    resumed.load_state_dict(old)
    assert not resumed.imprinter.active(resumed.steps) and resumed.classifier.weight.requires_grad
    resumed.train_server_head(*_batch(2, [3, 1, 4, 2]))
    assert resumed.imprinter.counts.sum() == 0 and not torch.equal(resumed.classifier.weight.detach(), trained) \
        and resumed.classifier.weight.grad is not None   # trained by SGD, not imprinted over
