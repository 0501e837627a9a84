"""The shared server part of the network: the tail after the split, and the server-head classifier.

Every device feeds this one model. Calls are made one at a time by the server shell
(it holds the model lock), so the trainer itself keeps no locks.
"""
from __future__ import annotations

import math
import warnings
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import torch
import torch.nn.functional as F
from torch.nn.modules.batchnorm import _BatchNorm

from splitface.common.models import ModelSpec, build_backbone, build_classifier, release_range, split_backbone
from splitface.common.models.weights import load_into
from splitface.common.transforms import mirror_averaged, release_mirror
from splitface.common.optim import TrainConfig, exponential_decay, sgd_with_head
from splitface.protocol.errors import ErrorCode
from splitface.server.imprint import Imprinter


# Received activations may leave an honest release's range by this many standard deviations of the devices' noise:
# P(|N(0, 1)| > 10) = 1.5e-23, so over 1e12 released values (years of training) an honest batch is refused with a
# probability below 1e-10, while a batch inside the bound is held within range + 10 sigma.
NOISE_SIGMAS = 10.0
# Room for the wire's rounding, relative to the range's larger end: f16 rounds by 2^-11 at most; i8 and i8c scale to
# the tensor's own largest |value|, which they keep (to float32's last bit).
ENCODING_SLACK = 2.0 ** -10
# A batch counts towards a batch norm's running variance as at most this many times that variance, so each batch
# multiplies it by at most 1 + momentum (1.1). Honest steps shrink an inflated variance by about 1 - momentum, so
# one device in a share p of the steps cannot inflate it for ever while (1 + m)^p (1 - m)^(1 - p) < 1: p < 0.49 at
# m = 0.1. Lower, no bound is needed: a batch can at most shrink it by 1 - momentum (a variance is >= 0).
STAT_VAR_RATIO = 2.0
# Running statistics start as placeholders (mean 0, variance 1). Until a batch norm has mostly forgotten them (their
# weight (1 - momentum)^n below 0.1: 22 batches at momentum 0.1), a batch's distance from them says nothing about
# the batch, and its update is not clipped.
PLACEHOLDER_WEIGHT = 0.1


@dataclass(frozen=True)
class StepGuard:
    """What a step must look like to reach the shared model. One device's batch must never poison it:
    a finite but huge tensor (e.g. 3e38) passes the codec's finiteness check and turns the loss into NaN, and a
    batch of finite values far outside what a device releases (all 1e4 at the conv1 split) drags the batch norms'
    running statistics, which inference and every later checkpoint use."""
    max_abs_value: float = field(default=1e6, metadata={
        "help": "largest |value| accepted in received activations and embedding gradients (0: no bound)"})
    max_grad_norm: float = field(default=1e6, metadata={
        "help": "a step whose gradient norm over the server's parameters exceeds this is refused (0: no bound)"})
    release_noise_std: float = field(default=-1.0, metadata={
        "help": "the largest noise std per released value of the devices' privacy mechanism (0: none; per-image: "
                "noise multiplier x clip norm; per-activation: its std; the device's Mechanism.value_noise_std(); "
                "splitface-research demo passes it): activations outside the release's honest range widened by 10 of it "
                "are refused (bad_tensor). -1: not stated, no release-aware bound (the server cannot know the "
                "devices' noise), --max-abs-value and the statistics clip only"})
    stat_clip_sigmas: float = field(default=3.0, metadata={
        "help": "a training batch moves each batch-norm running mean by at most momentum x this many running "
                "standard deviations, and raises its running variance by at most momentum x itself (0: torch's "
                "update, unclipped)"})

    def release_bound(self, spec: ModelSpec, split: str) -> tuple[float, float] | None:
        """[lo, hi] of the activations a FORWARD may carry: the release's range before noise (models.release_range)
        widened by NOISE_SIGMAS noise std and the wire's rounding; None where nothing bounds the release a priori."""
        honest = release_range(spec, split)
        if honest is None or self.release_noise_std < 0:
            return None
        lo, hi = honest
        room = NOISE_SIGMAS * self.release_noise_std + ENCODING_SLACK * max(abs(lo), abs(hi))
        return lo - room, hi + room


class StepRefused(Exception):
    """The batch was not applied and the model, its statistics and the optimizer are untouched; `code` and
    the message go into the ERROR sent to the device."""

    def __init__(self, message: str, code: ErrorCode = ErrorCode.BAD_TENSOR):
        super().__init__(message)
        self.code = code
        self.message = message


def pick_device(name: str | None = None) -> torch.device:
    if name:
        return torch.device(name)
    return torch.device("cuda" if torch.cuda.is_available() else "cpu")


class ServerTrainer:
    def __init__(self, spec: ModelSpec, split: str, num_classes: int, config: TrainConfig | None = None,
                 device: str | None = None, init: Path | None = None, train_only: str = "all",
                 guard: StepGuard | None = None, imprint_steps: int = 0, imprint_hold_tail: bool = False,
                 mirror_average: bool = False, mirror_train: bool = False):
        """`init`: start the tail from a saved (e.g. public pre-trained) backbone; `train_only="classifier"`
        freezes the tail and trains only the output layer (the source paper's fine-tuning setting);
        `imprint_steps`: the server head's rows are its classes' mean embeddings for that many steps, then trained
        from there (server/imprint.py: for a pre-trained start); `imprint_hold_tail`: the tail's weights take no
        step meanwhile either; `mirror_average`: outside training, a release's embedding is the mean of the tail's
        embeddings of it and of the mirror image's release, computed here from it (test-time flipping at no
        further release: transforms.release_mirror, which refuses a release that has no such map); `mirror_train`: in
        training too, so that the model learns the embedding that it is tested on (the loss, the imprinted means and a
        device head's embeddings are the average's; it needs `mirror_average`)."""
        if train_only not in ("all", "classifier"):
            raise ValueError(f"train_only must be 'all' or 'classifier', not {train_only!r}")
        self.spec, self.split, self.num_classes, self.train_only = spec, split, num_classes, train_only
        self.config = config or TrainConfig()
        self.guard = guard or StepGuard()
        self.release_bound = self.guard.release_bound(spec, split)
        if mirror_train and not mirror_average:
            raise ValueError("mirror_train trains on the mirror average: it needs mirror_average")
        self.mirror = release_mirror(spec) if mirror_average else None
        self.train_mirror = self.mirror if mirror_train else None
        self.statistics_clipped = 0   # batch-norm channels whose running statistics the last training batch hit the clip of
        torch.manual_seed(self.config.seed)
        _, tail = split_backbone(build_backbone(spec), split)
        if init is not None:
            load_into(tail, init, spec)
        self.device = pick_device(device)
        self.tail = tail.to(self.device)
        self.classifier = build_classifier(spec, num_classes).to(self.device)
        trained = list(self.classifier.parameters())
        if train_only == "all":
            trained += list(self.tail.parameters())
        else:
            self.tail.requires_grad_(False)
        self.optimizer = sgd_with_head(trained, self.classifier.parameters(), self.config)
        self.scheduler = exponential_decay(self.optimizer, self.config.lr_decay, self.config.decay_steps)
        self.steps = 0
        self.imprinter = Imprinter(self.classifier, imprint_steps, imprint_hold_tail)
        self.imprinter.hold_head(self.steps)
        self._trained = trained
        self._pending: tuple[torch.Tensor, torch.Tensor, dict[str, torch.Tensor]] | None = None

    def accelerator(self) -> dict[str, Any]:
        """Where the model runs and, on a GPU, its memory peaks since the start (torch's allocator, this process)."""
        out: dict[str, Any] = {"device": str(self.device), "autocast": "bf16" if self.device.type == "cuda" else None}
        if self.device.type == "cuda":
            out |= {"name": torch.cuda.get_device_name(self.device),
                    "memory_peak_allocated_bytes": torch.cuda.max_memory_allocated(self.device),
                    "memory_peak_reserved_bytes": torch.cuda.max_memory_reserved(self.device),
                    "memory_total_bytes": torch.cuda.get_device_properties(self.device).total_memory}
        return out

    def _autocast(self):
        # bf16 on a GPU for throughput; exact fp32 on the CPU.
        return torch.autocast("cuda", dtype=torch.bfloat16, enabled=self.device.type == "cuda")

    def _tensor(self, array: np.ndarray, what: str = "activations") -> torch.Tensor:
        """Wrap the message's read-only buffer without a copy (nothing here writes to it), after the range check."""
        bound = self.guard.max_abs_value
        if bound and array.size:
            peak = max(float(array.max()), -float(array.min()))  # no |array| temporary of the batch's size
            if not peak <= bound:
                raise StepRefused(f"{what} reach |{peak:.3g}|, beyond the server's bound of {bound:.3g}; not applied")
        if what == "activations" and self.release_bound is not None and array.size:
            lo, hi = self.release_bound
            low, high = float(array.min()), float(array.max())
            if not lo <= low <= high <= hi:
                raise StepRefused(f"activations reach [{low:.3g}, {high:.3g}], outside [{lo:.3g}, {hi:.3g}]: what this "
                                  f"model's release at {self.split} can be with noise of std "
                                  f"{self.guard.release_noise_std:g} per value; not applied")
        with warnings.catch_warnings():
            warnings.filterwarnings("ignore", message="The given NumPy array is not writable")
            return torch.as_tensor(array, dtype=torch.float32).to(self.device)

    def _input(self, activations: np.ndarray) -> torch.Tensor:
        return self._tensor(activations).requires_grad_(True)

    def _step(self) -> None:
        self.optimizer.step()
        self.scheduler.step()
        self.steps += 1
        self.imprinter.hold_head(self.steps)

    def _buffers(self) -> dict[str, torch.Tensor]:
        """Batch-norm statistics change in a training forward: saved so that a refused step leaves no trace."""
        return {f"{i}.{k}": v.clone() for i, m in enumerate((self.tail, self.classifier))
                for k, v in m.named_buffers()}

    def _restore(self, saved: dict[str, torch.Tensor]) -> None:
        self.optimizer.zero_grad(set_to_none=True)
        with torch.no_grad():
            for i, m in enumerate((self.tail, self.classifier)):
                for k, v in m.named_buffers():
                    v.copy_(saved[f"{i}.{k}"])

    def _clip_statistics(self, saved: dict[str, torch.Tensor]) -> None:
        """Bound what this training batch did to the batch norms' running statistics (`saved`: them before it):
        each mean moves by at most momentum x stat_clip_sigmas running standard deviations, each variance rises by
        at most momentum x STAT_VAR_RATIO - momentum of itself. Within the bounds torch's update is kept bit for
        bit; a running statistic still near its placeholder is not clipped (PLACEHOLDER_WEIGHT)."""
        k = self.guard.stat_clip_sigmas
        self.statistics_clipped = 0
        if not k:
            return
        with torch.no_grad():
            for i, part in enumerate((self.tail, self.classifier)):
                for name, bn in part.named_modules():
                    if not isinstance(bn, _BatchNorm) or bn.running_mean is None or not bn.momentum:
                        continue
                    key = f"{i}.{name}." if name else f"{i}."
                    m = float(bn.momentum)
                    if (1 - m) ** int(saved[key + "num_batches_tracked"]) > PLACEHOLDER_WEIGHT:
                        continue
                    mean, var = saved[key + "running_mean"], saved[key + "running_var"]
                    reach = m * k * (var + bn.eps).sqrt()
                    most = var * (1 - m + m * STAT_VAR_RATIO)
                    outside = ((bn.running_mean - mean).abs() > reach) | (bn.running_var > most)
                    self.statistics_clipped += int(outside.sum())
                    torch.clamp(bn.running_mean, mean - reach, mean + reach, out=bn.running_mean)
                    torch.minimum(bn.running_var, most, out=bn.running_var)

    def _batch_norms(self) -> list[tuple[str, _BatchNorm]]:
        return [(f"{i}.{name}", bn) for i, part in enumerate((self.tail, self.classifier))
                for name, bn in part.named_modules() if isinstance(bn, _BatchNorm) and bn.running_mean is not None]

    def statistics(self) -> dict[str, tuple[torch.Tensor, torch.Tensor, int]]:
        """Each batch norm's (running mean, running variance, batches tracked), copied: the reference of the
        next checkpoint's check (`statistics_beyond`)."""
        return {name: (bn.running_mean.clone(), bn.running_var.clone(), int(bn.num_batches_tracked))
                for name, bn in self._batch_norms()}

    def statistics_beyond(self, reference: dict[str, tuple[torch.Tensor, torch.Tensor, int]]) -> list[str]:
        """The batch norms whose running statistics are further from `reference` (those of the last checkpoint)
        than the clipped updates of the n batches tracked since could take them: each update multiplies a
        variance by at most g = 1 - m + m STAT_VAR_RATIO and at least 1 - m, and moves a mean by at most
        m k sqrt(variance + eps), so |mean - mean0| <= n m k sqrt(var0 g^n + eps). Updates not clipped (during
        the placeholders, or with the clip off) are not bounded: those batch norms are not checked. Empty: fine."""
        k = self.guard.stat_clip_sigmas
        beyond = []
        for name, bn in self._batch_norms():
            if name not in reference or not k or not bn.momentum:
                continue
            mean0, var0, tracked0 = reference[name]
            m, n = float(bn.momentum), int(bn.num_batches_tracked) - tracked0
            if n < 0 or (1 - m) ** tracked0 > PLACEHOLDER_WEIGHT:
                continue
            mean, var = bn.running_mean.double(), bn.running_var.double()
            mean0, var0 = mean0.double(), var0.double()
            g = 1 - m + m * STAT_VAR_RATIO
            slack = 1 + 1e-4   # float32 updates, n of them: far above their rounding (n 2^-24 each)
            # plus float32's rounding of each update's mean: 2^-24 of its size, taken as 2^-20 of mean0's and reach's
            reach = n * m * k * (var0 * g ** n + bn.eps).sqrt() * slack
            reach = reach + n * 2.0 ** -20 * (mean0.abs() + reach)
            if not (bool(((mean - mean0).abs() <= reach).all())
                    and bool((var <= var0 * g ** n * slack).all()) and bool((var >= var0 * (1 - m) ** n / slack).all())):
                beyond.append(name)
        return beyond

    def _check_gradients(self, x: torch.Tensor) -> None:
        """Refuse a step whose gradients are not finite or beyond the plausible norm."""
        grads = [p.grad for p in self._trained if p.grad is not None]
        norm = float(torch.linalg.vector_norm(torch.stack([torch.linalg.vector_norm(g.float()) for g in grads]))) \
            if grads else 0.0
        if not math.isfinite(norm) or not bool(torch.isfinite(x.grad).all()):
            raise StepRefused("the batch gives non-finite gradients; not applied")
        if self.guard.max_grad_norm and norm > self.guard.max_grad_norm:
            raise StepRefused(f"the batch's gradient norm {norm:.3g} exceeds the server's bound of "
                              f"{self.guard.max_grad_norm:.3g}; not applied")

    def train_server_head(self, activations: np.ndarray, labels: np.ndarray) -> tuple[np.ndarray, float, int]:
        """One step on a labelled batch; returns (gradient wrt activations, loss, correct predictions)."""
        self._train_mode(True)
        self.optimizer.zero_grad(set_to_none=True)
        x = self._input(activations)
        y = torch.as_tensor(labels, device=self.device)
        saved = self._buffers()
        imprinting = self.imprinter.active(self.steps)
        if imprinting:
            saved_head = self.imprinter.state_dict(), {k: v.clone() for k, v in self.classifier.state_dict().items()}
        try:
            with self._autocast():
                embeddings = mirror_averaged(self.tail, self.train_mirror, x)
                if imprinting:
                    self.imprinter.add(embeddings, y)
                logits = self.classifier(embeddings)
            loss = F.cross_entropy(logits.float(), y)
            if not torch.isfinite(loss):
                raise StepRefused(f"the batch gives a non-finite loss ({loss.item()}); not applied")
            loss.backward()   # before the clip: the backward needs the statistics' tensors as the forward left them
            self._check_gradients(x)
        except Exception:   # refused, or failed (out of memory, say): either way the batch leaves no trace
            self._restore(saved)
            if imprinting:
                self.imprinter.load_state_dict(saved_head[0])
                self.classifier.load_state_dict(saved_head[1])
            raise
        self._clip_statistics(saved)
        if imprinting and self.imprinter.holds_tail(self.steps):   # checked by the guard above, not applied
            for p in self.tail.parameters():
                p.grad = None
        self._step()
        n_correct = int((logits.argmax(1) == y).sum())
        return _numpy(x.grad), loss.item(), n_correct

    def evaluate(self, activations: np.ndarray, labels: np.ndarray) -> tuple[float, int]:
        self._train_mode(False)
        with torch.no_grad(), self._autocast():
            # with the mirror average the head, linear, averages the logits too
            logits = self.classifier(mirror_averaged(self.tail, self.mirror, self._tensor(activations)))
        y = torch.as_tensor(labels, device=self.device)
        loss = float(F.cross_entropy(logits.float(), y))
        if not math.isfinite(loss):
            raise StepRefused(f"the batch gives a non-finite loss ({loss})")
        return loss, int((logits.argmax(1) == y).sum())

    def test_embedding(self) -> dict[str, bool]:
        """How a release is embedded outside training, for metrics.json (`research evaluate` embeds the same way)."""
        return {"mirror_average": self.mirror is not None}

    def train_embedding(self) -> dict[str, bool]:
        """How a release is embedded in training (`--mirror-train`), for metrics.json."""
        return {"mirror_average": self.train_mirror is not None}

    def embed(self, activations: np.ndarray, train: bool) -> np.ndarray:
        """Device head: embeddings for the device's classifier; in training the graph waits for `train_tail`."""
        self._train_mode(train)
        if not train:
            with torch.no_grad(), self._autocast():
                return _finite_embeddings(mirror_averaged(self.tail, self.mirror, self._tensor(activations)).float())
        self.drop_pending()   # a FORWARD again before its EMBEDDING_GRAD: the earlier one leaves nothing
        self.optimizer.zero_grad(set_to_none=True)
        x = self._input(activations)
        saved = self._buffers()
        try:
            with self._autocast():
                embeddings = mirror_averaged(self.tail, self.train_mirror, x).float()
            out = _finite_embeddings(embeddings.detach())
        except Exception:   # refused, or failed (out of memory, say): the forward's statistics are undone
            self._restore(saved)
            raise
        self._pending = (x, embeddings, saved)
        return out

    def train_tail(self, embedding_grad: np.ndarray) -> np.ndarray:
        """Device head: backward from the device's embedding gradient, step; gradient wrt activations."""
        if self._pending is None:
            raise RuntimeError("train_tail without a pending embed")
        x, embeddings, saved = self._pending
        self._pending = None
        try:
            embeddings.backward(self._tensor(embedding_grad, "embedding gradients"))
            self._check_gradients(x)
        except StepRefused:
            self._restore(saved)
            raise
        self._clip_statistics(saved)
        self._step()
        return _numpy(x.grad)

    def drop_pending(self) -> None:
        """Forget a device-head batch whose EMBEDDING_GRAD never came (or was refused): nothing of it is applied,
        so its forward's update of the running statistics is undone too."""
        if self._pending is not None:
            self._restore(self._pending[2])
        self._pending = None

    def _train_mode(self, train: bool) -> None:
        self.tail.train(train and self.train_only == "all")  # a frozen tail keeps its BN statistics too
        self.classifier.train(train)

    def state_dict(self) -> dict[str, Any]:
        return {"tail": self.tail.state_dict(), "classifier": self.classifier.state_dict(),
                "optimizer": self.optimizer.state_dict(), "scheduler": self.scheduler.state_dict(), "steps": self.steps,
                "rng": torch.get_rng_state(), "imprint": self.imprinter.state_dict()}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.tail.load_state_dict(state["tail"])
        self.classifier.load_state_dict(state["classifier"])
        self.optimizer.load_state_dict(state["optimizer"])
        self.scheduler.load_state_dict(state["scheduler"])
        self.steps = state["steps"]
        torch.set_rng_state(state["rng"])
        # the run's imprinting schedule is the checkpoint's: a checkpoint from before imprinting imprinted nothing, and
        # its trained rows must not be overwritten now
        self.imprinter.load_state_dict(state.get("imprint", {"steps": 0}))
        self.imprinter.hold_head(self.steps)


def _finite_embeddings(embeddings: torch.Tensor) -> np.ndarray:
    if not bool(torch.isfinite(embeddings).all()):
        raise StepRefused("the batch gives non-finite embeddings; not applied")
    return _numpy(embeddings)


def _numpy(t: torch.Tensor) -> np.ndarray:
    return t.detach().to("cpu", torch.float32).numpy()
