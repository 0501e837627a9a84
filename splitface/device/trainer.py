"""The device's training engine: its layer (and, with the device head, its classifier), its
optimiser, what it releases, and snapshots of its state for each batch the server may still
roll back.

Nothing leaves the device except through `forward`/`evaluate_release`, which apply the privacy
mechanism and ask the budget guard first. Device state changes only when a batch's BACKWARD
arrives (`commit`), so a batch re-sent after a dropped connection is never applied twice.

Pipelined (`pipeline=True`): the release of batch n+1 is made while batch n is still at the server,
so it uses the weights from before batch n's step (staleness one). Each forward then runs on its own
copy of the weights, and its commit takes the gradient at that copy: the gradient of the release that
was actually sent, applied to the current weights. A rollback drops the release made ahead; made again
from the restored weights it differs from the one sent, so it draws fresh noise and is counted again
(lock-step re-sends after a rollback repeat their bytes and cost nothing).
"""
from __future__ import annotations

import copy
import math
from pathlib import Path
from typing import Any, Sequence

import numpy as np
import torch
import torch.nn.functional as F
from torch import nn

from splitface.common.models import ModelSpec, activation_shape, build_classifier, build_device_part, to_input
from splitface.common.models.lrn import PaperLRN
from splitface.common.models.weights import load_into
from splitface.common.optim import TrainConfig, exponential_decay, sgd_with_head
from splitface.device.privacy.dpsgd import clipped_noisy_grad, dpsgd_event, per_sample_grads
from splitface.device.privacy.discrete import DiscreteGaussianMechanism
from splitface.device.privacy.engine import LAYER_TRAINING, PrivacyEngine, Release, release_key
from splitface.device.privacy.nopeek import distance_correlation
from splitface.device.progress import TrainingProgress
from splitface.device.privacy.mechanisms import Mechanism, PerActivationGaussian
from splitface.device.runtimes.base import LayerRuntime
from splitface.common.transforms import release_mask
from splitface.common.transforms.dct import frequency_weights

__all__ = ["DeviceTrainer", "PrivacyEngine", "LAYER_TRAINING", "to_input", "initial_layer", "privatize", "bound_for",
           "release_key"]


def initial_layer(spec: ModelSpec, split: str, seed: int, weights: Path | None = None) -> nn.Module:
    """The device part as every device starts it: seeded (all devices draw the same layer) or loaded
    from published weights. An edge server that knows the seed can build the same one. Only the stages
    the device runs are built (the server's tail never exists here), with the full build's weights."""
    torch.manual_seed(seed)
    layer = build_device_part(spec, split)
    if weights is not None:
        load_into(layer, weights, spec)
    return layer


def privatize(spec: ModelSpec, mechanism: Mechanism, outputs: torch.Tensor, generator: torch.Generator) -> torch.Tensor:
    """What the device releases for its part's outputs: the transform's random channel subset (dct_keep),
    then the mechanism. Both draw from `generator`, in that order, so a re-sent batch repeats both; an
    auditor or evaluator that simulates the device passes a generator of its own."""
    mask = release_mask(spec, len(outputs), tuple(outputs.shape[1:]), generator)
    masked = outputs if mask is None else outputs * mask.to(outputs.device)
    gamma = getattr(mechanism, "frequency_gamma", 0.0)
    if not gamma:
        return mechanism.privatize(masked, generator)
    if spec.release != "dct":
        raise ValueError(f"frequency-shaped noise (--frequency-gamma) needs the dct release, not {spec.release!r}")
    weights = frequency_weights(spec.dct_drop, gamma).to(outputs.device)   # noise per frequency: z C / w
    return mechanism.privatize(masked * weights, generator) / weights


def bound_for(mechanism: Mechanism, layer: nn.Module) -> None:
    """The paper's per-activation sensitivity needs LRN inputs in [0, 1]: clamp them (in place)."""
    if not isinstance(mechanism, PerActivationGaussian):
        return
    lrns = [m for m in layer.modules() if isinstance(m, PaperLRN)]
    if not lrns:
        raise ValueError("the per-activation mechanism needs the device part to end in the paper's LRN")
    for lrn in lrns:
        lrn.input_max = 1.0
    bound = max(lrn.output_bound() for lrn in lrns)
    if mechanism.sensitivity < bound:
        raise ValueError(f"sensitivity {mechanism.sensitivity} is below the layer's output bound {bound}")


class DeviceTrainer:
    def __init__(self, spec: ModelSpec, split: str, head: str, num_classes: int,
                 config: TrainConfig | None = None, privacy: PrivacyEngine | None = None,
                 device_weights: Path | None = None, pipeline: bool = False):
        if head not in ("server", "device"):
            raise ValueError(f"head must be 'server' or 'device', not {head!r}")
        privacy_engine = privacy if privacy is not None else PrivacyEngine()
        if pipeline and head == "device":
            raise ValueError("pipelining keeps the next batch's release ready while the server works; with the "
                             "device head (U-shaped) the device's own head step sits in that wait: drop --pipeline")
        if pipeline and privacy_engine.layer_training == "dpsgd":
            raise ValueError("DP-SGD clips per-sample gradients at the current weights; a pipelined release was "
                             "made at the previous ones: drop --pipeline or use --layer-training plain")
        self.pipeline = pipeline
        self.spec, self.split, self.head, self.num_classes = spec, split, head, num_classes
        self.config = config or TrainConfig()
        self.privacy = privacy_engine
        self.layer = initial_layer(spec, split, self.config.seed, device_weights)
        mechanism = self.privacy.mechanism
        if spec.release != "none" and isinstance(mechanism, PerActivationGaussian):
            raise ValueError(f"the per-activation mechanism's sensitivity is the paper's LRN output; a {spec.release} "
                             f"release ends elsewhere: use the per-image mechanism")
        bound_for(mechanism, self.layer)
        if getattr(mechanism, "frequency_gamma", 0.0) and spec.release != "dct":
            raise ValueError(f"frequency-shaped noise (--frequency-gamma) needs the dct release, not {spec.release!r}")
        frozen = self.privacy.layer_training == "frozen"
        if not frozen and any(isinstance(m, nn.modules.batchnorm._BatchNorm) for m in self.layer.modules()):
            # In training mode batch norm normalises each image with its batch's statistics (one image's release
            # depends on the others') and its running statistics average the training images. A frozen layer runs
            # in eval mode, where batch norm is a fixed per-channel affine map of each image alone.
            raise ValueError(f"the device part up to {split!r} holds batch norm, which mixes a batch while it trains: "
                             f"split before it (e.g. conv1) or use --layer-training frozen")
        self.trainable = not frozen and any(True for _ in self.layer.parameters())
        if self.privacy.layer_training == "dpsgd" and not self.trainable:
            raise ValueError("the device part has no parameters: nothing for DP-SGD to train (use plain or frozen)")
        if self.privacy.nopeek_weight and not self.trainable:
            raise ValueError(f"NoPeek trains the device part, and the part up to {split!r} of this release has no "
                             f"parameters: drop --nopeek-weight")
        self.classifier = build_classifier(spec, num_classes) if head == "device" else None
        head_params = list(self.classifier.parameters()) if self.classifier else []
        params = head_params
        if frozen:
            self.layer.requires_grad_(False)
        else:
            params = list(self.layer.parameters()) + params
        self.optimizer = self.scheduler = None
        if params:
            self.optimizer = sgd_with_head(params, head_params, self.config)
            self.scheduler = exponential_decay(self.optimizer, self.config.lr_decay, self.config.decay_steps)
        self.release_shape = tuple(activation_shape(spec, split))
        self.runtime: LayerRuntime | None = None  # None: eager PyTorch
        self.committed = 0                      # last batch id applied on the device
        self.snapshots: dict[int, dict[str, Any]] = {0: self._state()}
        self._initial = self.snapshots[0]       # batch 0 is the initial state, which a fresh server run starts from
        self.progress: TrainingProgress | None = None  # durable committed + snapshots (open_progress)
        self._kept_head: tuple[int, dict[str, Any]] | None = None  # a restarted device's head step of batch C + 1
        self._pending: dict[int, dict[str, Any]] = {}  # batch id -> what its commit needs (two when pipelined)

    @property
    def integer_step(self) -> float | None:
        """The public step of a release made of integers (the discrete Gaussian's), which the wire carries as
        they are (`ClientSession.forward`); None for float releases."""
        mechanism = self.privacy.mechanism
        return mechanism.step if isinstance(mechanism, DiscreteGaussianMechanism) else None

    def attach_runtime(self, runtime: "LayerRuntime") -> None:
        """Compute releases and weight gradients with an exported program (ExecuTorch, ONNX Runtime).

        Those programs add noise they are given, so only additive mechanisms qualify, and they have no
        per-sample gradients, so DP-SGD stays on the torch backend. A program with static weights serves
        only a frozen layer. The exact option (`--noise discrete`) needs a runtime that makes the whole
        release itself under the engine's key (`exact_release`: the native runner); its gradient is the
        straight-through one, the layer's own vector-Jacobian product, as eager PyTorch's. A runtime that
        draws the float noise itself under the engine's key (`keyed_release`: the native runner) does so for
        unmasked releases: the same law as `additive_noise`, another sampler (docs/noise.md).
        """
        if isinstance(self.privacy.mechanism, DiscreteGaussianMechanism):
            if not hasattr(runtime, "exact_release"):
                raise ValueError(f"the {runtime.name} backend adds float noise it is given; --noise discrete's "
                                 f"exact release runs on --backend native or torch")
        elif not hasattr(self.privacy.mechanism, "additive_noise"):
            raise ValueError(f"the {runtime.name} backend supports the none and per-activation mechanisms, "
                             f"not {self.privacy.mechanism.name} (use --backend torch)")
        if self.privacy.layer_training == "dpsgd":
            raise ValueError(f"the {runtime.name} backend has no per-sample gradients: DP-SGD needs --backend torch")
        if self.privacy.nopeek_weight:
            raise ValueError(f"the {runtime.name} backend computes the server's gradient only; NoPeek's penalty needs "
                             f"--backend torch")
        if runtime.static_weights and self.trainable:
            raise ValueError(f"the {runtime.name} program has the layer's weights baked in (exported with "
                             f"--static-weights) but this layer trains: its releases would go stale; re-export "
                             f"without --static-weights or use --layer-training frozen")
        self.runtime = runtime

    # ---- releases ----------------------------------------------------------------------
    def _release(self, x: torch.Tensor, release: Release, image_ids: Sequence[int], identities: Sequence[int],
                 also: Sequence[tuple[Release, Any, bool]] = (),
                 weights: dict[str, torch.Tensor] | None = None) -> dict[str, Any]:
        """Privatize through the privacy engine, which asks the guard before anything can be sent (raises
        BudgetExceeded) and keys the noise by the release. `weights`: the layer's parameters to use instead
        of its own (a pipelined forward's copy)."""
        mechanism = self.privacy.mechanism

        params = list(self.layer.parameters()) if weights is None else list(weights.values())  # a runtime's weights

        def layer(t: torch.Tensor) -> torch.Tensor:
            return self.layer(t) if weights is None else torch.func.functional_call(self.layer, weights, (t,))

        def compute(generator: torch.Generator) -> dict[str, Any]:
            if isinstance(mechanism, DiscreteGaussianMechanism):  # the exact option: integers, keyed per release
                mask = release_mask(self.spec, len(x), self.release_shape, generator)
                key = self.privacy.stream_key(generator)
                if self.runtime is not None:  # the runner clips, quantises and draws under the same key
                    if mask is not None:
                        raise ValueError(f"the {self.runtime.name} backend's exact release takes no mask")
                    q = self.runtime.exact_release(x, params, mechanism, key).reshape(len(x), *self.release_shape)
                    # the straight-through gradient is the layer's own (see straight_through): the noise is none
                    return {"noise": torch.zeros((len(x), *self.release_shape)), "released": mechanism.values(q)}
                activations = layer(x)
                masked = activations if mask is None else activations * mask
                q = mechanism.release(masked, key)
                return {"activations": activations, "released": mechanism.straight_through(masked, q)}
            if self.runtime is None:
                activations = layer(x)
                return {"activations": activations, "released": privatize(self.spec, mechanism, activations, generator)}
            # dct_keep: the channel subset is drawn first, from the same keyed generator, as `privatize` does
            mask = release_mask(self.spec, len(x), self.release_shape, generator)
            std = mechanism.iid_gaussian_std()
            if mask is None and std is not None and hasattr(self.runtime, "keyed_release"):
                # the runner draws the same law under the release's key
                released = self.runtime.keyed_release(x, params, std, self.privacy.stream_key(generator))
                return {"noise": None, "released": released.reshape(len(x), *self.release_shape)}
            noise = mechanism.additive_noise((len(x), *self.release_shape), generator)
            if mask is None:
                released = self.runtime.release(x, noise, params)
            else:  # the program adds its noise after the layer; the mask must come between
                released = self.runtime.release(x, torch.zeros_like(noise), params) * mask + noise
            return {"noise": noise, "released": released}

        event = mechanism.image_event(math.prod(self.release_shape))
        return self.privacy.release(release, list(image_ids), list(identities), event, compute, also=also)

    def forward(self, images: np.ndarray, release: Release, image_ids: Sequence[int],
                identities: Sequence[int]) -> np.ndarray:
        """The training release of a batch; the graph (or the noise, with a runtime) is kept for `commit`.
        Pipelined, it runs on a copy of the weights taken now, which its commit differentiates."""
        self.layer.train(self.trainable)  # a frozen layer is a fixed function: eval mode (see __init__)
        if self.optimizer is not None and not self.pipeline:
            self.optimizer.zero_grad(set_to_none=True)
        weights = None
        if self.pipeline and self.trainable:
            weights = {n: p.detach().clone().requires_grad_(True)
                       for n, p in self.layer.named_parameters()}
        x = to_input(images)
        also = []
        if self.privacy.layer_training == "dpsgd":
            # The step this batch will take, counted up front. One noise draw covers the whole sum, so an
            # identity with k images in the batch moves it k times as far: recorded jointly.
            also.append((("dpsgd", *release[1:]), dpsgd_event(self.privacy.dpsgd_noise), True))
        with torch.set_grad_enabled(self.trainable and self.runtime is None):
            out = self._release(x, release, image_ids, identities, also, weights)
        if not self.pipeline:
            self._pending.clear()  # lock-step: a forward replaces a batch that was never committed
        elif len(self._pending) >= 2:
            raise RuntimeError(f"pipelined forward of {release} with batches {sorted(self._pending)} uncommitted: "
                               "at most one batch may wait at the server while the next is prepared")
        self._pending[release[1]] = {"x": x, "release": release, "image_ids": list(image_ids),
                                     "identities": list(identities), "weights": weights, **out}
        return out["released"].detach().numpy()

    @torch.no_grad()
    def evaluate_release(self, images: np.ndarray, release: Release, image_ids: Sequence[int],
                         identities: Sequence[int]) -> np.ndarray:
        """An evaluation release: no graph, no state change, but still a release the accountant counts."""
        self.layer.eval()
        return self._release(to_input(images), release, image_ids, identities)["released"].numpy()

    def head_step(self, embeddings: np.ndarray, labels: np.ndarray,
                  batch_id: int | None = None) -> tuple[np.ndarray, float, int]:
        """Device head: loss on the device's own labels; returns (embedding gradient, loss, correct).

        The classifier's gradient waits in .grad until `commit`; a recomputation overwrites it. With a training
        state and the batch id, the step is also kept on disk until then (`kept_head_step`).
        """
        assert self.classifier is not None
        self.classifier.train()
        for p in self.classifier.parameters():
            p.grad = None
        e = torch.from_numpy(np.array(embeddings, dtype=np.float32)).requires_grad_(True)
        y = torch.from_numpy(np.asarray(labels, dtype=np.int64))
        logits = self.classifier(e)
        loss = F.cross_entropy(logits, y)
        loss.backward()
        n_correct = int((logits.argmax(1) == y).sum())
        if self.progress is not None and batch_id is not None:   # before its EMBEDDING_GRAD can leave
            self.progress.save_head(batch_id, {"grads": {n: p.grad for n, p in self.classifier.named_parameters()},
                                               "loss": loss.item(), "n_correct": n_correct})
        return e.grad.numpy(), loss.item(), n_correct

    def kept_head_step(self, batch_id: int) -> tuple[float, int]:
        """The head step of `batch_id` that a restarted device kept (its gradient back in .grad): for a re-sent
        FORWARD answered by BACKWARD alone, the server having applied the batch before the device died (SPEC.md
        section 8); (loss, correct). RuntimeError if it has none: the batch cannot be committed whole."""
        kept = self._kept_head
        if kept is None or kept[0] != batch_id:
            raise RuntimeError(f"the server had applied batch {batch_id}, but this device kept no head step for it "
                               f"(no training state, or one from before its EMBEDDING_GRAD): it cannot commit it")
        for name, p in self.classifier.named_parameters():
            p.grad = kept[1]["grads"][name].clone()
        return kept[1]["loss"], kept[1]["n_correct"]

    def commit(self, batch_id: int, activation_grad: np.ndarray, durable_through: int = 0) -> None:
        """Apply the server's gradient to the layer (as its training mode says), step, snapshot; forget the
        snapshots the server's checkpoint now covers (`durable_through`, as `forget_before`), one save for both."""
        if batch_id not in self._pending:
            raise RuntimeError(f"commit of batch {batch_id} without its forward (pending: {sorted(self._pending)})")
        pending = self._pending.pop(batch_id)
        grad = torch.from_numpy(np.array(activation_grad, dtype=np.float32))
        mode = self.privacy.layer_training if self.trainable else "frozen"  # no parameters: nothing to apply
        copied = pending["weights"]  # pipelined: the weights this release was made with
        if self.optimizer is not None and copied is not None:
            self.optimizer.zero_grad(set_to_none=True)
        if mode == "plain" and self.runtime is not None:
            params = list(self.layer.parameters())
            at = params if copied is None else list(copied.values())
            for p, g in zip(params, self.runtime.weight_grads(pending["x"], pending["noise"], grad, at)):
                p.grad = g
        elif mode == "plain" and self.privacy.nopeek_weight:
            # NoPeek: the server's gradient of its loss, plus the device's own penalty on what it released
            penalty = self.privacy.nopeek_weight * distance_correlation(pending["x"], pending["released"])
            torch.autograd.backward([pending["released"], penalty], [grad, None])
        elif mode == "plain":
            pending["released"].backward(grad)
        elif mode == "dpsgd":
            output_grads, = torch.autograd.grad(pending["released"], pending["activations"], grad)
            # The server's gradient is of the batch-mean loss; DP-SGD clips per-sample gradients of
            # per-sample losses and divides by N itself, so undo the mean first.
            per_sample = per_sample_grads(self.layer, pending["x"], output_grads * len(output_grads))

            def step(generator: torch.Generator) -> dict[str, Any]:
                noisy = clipped_noisy_grad(per_sample, self.privacy.dpsgd_clip, self.privacy.dpsgd_noise, generator)
                return {"grads": noisy, "released": torch.cat([g.flatten() for g in noisy.values()])}

            # Counted at `forward` already; it costs again only if this step is not bit-identical to one taken
            # before under the same key (a replay after a rollback whose server gradient changed).
            noisy = self.privacy.release(("dpsgd", *pending["release"][1:]), pending["image_ids"],
                                         pending["identities"], dpsgd_event(self.privacy.dpsgd_noise), step,
                                         joint=True)["grads"]
            for name, p in self.layer.named_parameters():
                p.grad = noisy[name]
        if mode == "plain" and self.runtime is None and copied is not None:
            for name, p in self.layer.named_parameters():  # the gradient at the copy, applied to the weights
                p.grad = copied[name].grad
        if self.optimizer is not None:
            self.optimizer.step()
            self.scheduler.step()
        self.committed = batch_id
        self.snapshots[batch_id] = self._state()
        self._forget(durable_through)
        self._save_progress()

    @torch.no_grad()
    def classify(self, embeddings: np.ndarray, labels: np.ndarray) -> tuple[float, int]:
        assert self.classifier is not None
        self.classifier.eval()
        logits = self.classifier(torch.from_numpy(np.array(embeddings, dtype=np.float32)))
        y = torch.from_numpy(np.asarray(labels, dtype=np.int64))
        return F.cross_entropy(logits, y).item(), int((logits.argmax(1) == y).sum())

    def privacy_report(self) -> dict[str, Any]:
        """The privacy engine's figures, and whether the layer's training voids them."""
        return self.privacy.report(layer_trains=self.trainable)

    def drop_uncommitted(self) -> None:
        """Forget releases whose batches will not be committed (a pipelined one made before a rollback)."""
        self._pending.clear()

    # ---- snapshots for server rollbacks, and their durable copy ---------------------------
    def open_progress(self, path: Path) -> None:
        """Keep the committed batch and the snapshots in `path` (splitface/device/progress.py) from now on: a device
        restarted after a crash resumes the state of its last committed batch, so it rejoins the server's run
        there (SPEC.md sections 10, 11). Written at once if absent; a bad or foreign file raises StateFileError."""
        if self.committed or self._pending:
            raise RuntimeError("open the training state before the first batch")
        identity = {"model": self.spec.to_dict(), "split": self.split, "head": self.head,
                    "num_classes": self.num_classes, "layer_training": self.privacy.layer_training}
        self.progress = TrainingProgress(path, identity)
        loaded = self.progress.load()
        if loaded is not None:
            committed, self.snapshots, head = loaded
            self._restore(self.snapshots[committed])
            self.committed = committed
            self._kept_head = (committed + 1, head) if head is not None else None
        self._save_progress()

    def _save_progress(self) -> None:
        if self.progress is not None:
            self.progress.save(self.committed, self.snapshots)

    def _state(self) -> dict[str, Any]:
        return copy.deepcopy({
            "layer": self.layer.state_dict(),
            "classifier": self.classifier.state_dict() if self.classifier else None,
            "optimizer": self.optimizer.state_dict() if self.optimizer else None,
            "scheduler": self.scheduler.state_dict() if self.scheduler else None,
        })

    def forget_before(self, durable_through: int) -> None:
        """The server's checkpoint covers `durable_through`: older snapshots can never be needed."""
        if self._forget(durable_through):
            self._save_progress()

    def _forget(self, durable_through: int) -> bool:
        """Drop the snapshots before min(durable_through, committed); whether there were any."""
        old = [k for k in self.snapshots if k < min(durable_through, self.committed)]
        for k in old:
            del self.snapshots[k]
        return bool(old)

    def rollback(self, batch_id: int) -> None:
        """Return to the state right after `batch_id` (the server restarted from its checkpoint; batch 0: a server
        run with no batch of this device, which starts from the initial state, kept for it)."""
        if batch_id == 0:
            self.snapshots.setdefault(0, self._initial)
        if batch_id not in self.snapshots:
            raise RuntimeError(f"cannot roll back to batch {batch_id}: no snapshot (have {sorted(self.snapshots)})")
        self._restore(self.snapshots[batch_id])
        self.committed = batch_id
        self.drop_uncommitted()
        for k in [k for k in self.snapshots if k > batch_id]:
            del self.snapshots[k]
        self._save_progress()

    def _restore(self, state: dict[str, Any]) -> None:
        """Load a snapshot into the layer, head, optimiser and scheduler."""
        self.layer.load_state_dict(state["layer"])
        if self.classifier is not None:
            self.classifier.load_state_dict(state["classifier"])
        if self.optimizer is not None:
            self.optimizer.load_state_dict(copy.deepcopy(state["optimizer"]))
            self.scheduler.load_state_dict(state["scheduler"])
