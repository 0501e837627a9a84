"""The options of one federated experiment, declared once: `python -m research.federated` takes them as they
are, `splitface-server serve` with the prefix `--federated-` (its own --model, --seed, --batch-size ... are the
split server's), so a run started by one command can be resumed by the other."""
from __future__ import annotations

import argparse
import dataclasses
import json
from pathlib import Path
from types import SimpleNamespace

from splitface.common.models import ModelSpec, resolve_spec

from research.federated.rounds import METHODS, FederatedConfig
from research.federated.experiment import STARTS, Shared, load_shared
from research.federated.population import SINGLE_PHOTO_METHODS, check_single_photo

# the option defaults are FederatedConfig's fields' (one definition; the defaults alone are not a valid run: dp-*
# methods need a noise multiplier)
DEFAULTS = SimpleNamespace(**{f.name: f.default for f in dataclasses.fields(FederatedConfig)})
SERVE_PREFIX = "federated-"


def add_run_args(p: argparse.ArgumentParser, prefix: str = "") -> None:
    """The experiment's options as `--<prefix><name>`. Without a prefix --out is required (the experiment
    command runs nothing else); with one, giving --<prefix>out is what turns the run on."""
    g = p.add_argument_group("federated run" + (f" (hosted beside split sessions when --{prefix}out is given)"
                                                if prefix else ""))

    def opt(name: str, **kw) -> None:
        g.add_argument(f"--{prefix}{name}", **kw)

    opt("data", default=None, help="LFW (the folder holding the people and View 1's list files)")
    opt("model", default="iresnet_small", help="model preset (iresnet_small: 64 px, the CPU size) or a ModelSpec as JSON")
    opt("method", choices=(*METHODS, "centralized"), default=DEFAULTS.method)
    opt("out", type=Path, required=not prefix, default=None,
        help="run folder (holds the checkpoint: a rerun resumes)")
    opt("start", choices=STARTS, default="public-split",
        help="where every run starts: public-split (the backbone pre-trained on the public DevTrain people, --init) "
             "or distilled (distilled from dlib's recognizer on public faces that hold no private user; built on "
             "first use and cached, docs/pretrain.md)")
    opt("init", type=Path, default=None,
        help="public-split start: its backbone (default: <out>/public_backbone.pt, pre-trained there if missing)")
    opt("pretrain-epochs", type=int, default=2, help="epochs of public pre-training when it is made")
    opt("max-users", type=int, default=None, help="a seeded random subset of the private users")
    opt("single-photo-users", action="store_true",
        help=f"DevTrain people with one photo are users too ({', '.join(SINGLE_PHOTO_METHODS)} only: a local "
             "head gives each a class for one round; there is no global class for them)")
    opt("rounds", type=int, default=DEFAULTS.rounds)
    opt("users-per-client", type=int, default=DEFAULTS.users_per_client, help="k: users grouped in one virtual client")
    opt("clients-per-round", type=float, default=DEFAULTS.clients_per_round,
        help="expected virtual clients per round (Poisson rate = this / number of virtual clients)")
    opt("local-epochs", type=int, default=DEFAULTS.local_epochs)
    opt("batch-size", type=int, default=DEFAULTS.batch_size)
    opt("client-lr", type=float, default=DEFAULTS.client_lr)
    opt("head-lr-scale", type=float, default=DEFAULTS.head_lr_scale, help="the local (or global) head's lr / client lr")
    opt("server-lr", type=float, default=DEFAULTS.server_lr)
    opt("server-momentum", type=float, default=DEFAULTS.server_momentum)
    opt("noise-multiplier", type=float, default=DEFAULTS.noise_multiplier,
        help="z (dp-* methods): noise std z * C on the sum")
    opt("clip-norm", type=float, default=DEFAULTS.clip_norm, help="C (the start value with --target-quantile)")
    opt("target-quantile", type=float, default=DEFAULTS.target_quantile,
        help="adaptive clipping (Andrew et al. 2021): the quantile of update norms C tracks")
    opt("clip-lr", type=float, default=DEFAULTS.clip_lr)
    opt("count-noise-std", type=float, default=DEFAULTS.count_noise_std,
        help="adaptive clipping's count noise (default: max(expected clients / 20, 2z))")
    opt("delta", type=float, default=DEFAULTS.delta, help="default 1 / users^1.1")
    opt("seed", type=int, default=DEFAULTS.seed)
    opt("eval-every", type=int, default=0,
        help="score View 1 every N rounds too (the final score after the last round is always made)")
    opt("progress-pairs", type=int, default=None,
        help="score the every-N-rounds curve on only this many DevTest pairs (the final score uses all)")
    opt("view1-limit", type=int, default=None, help="only this many DevTest pairs (quick checks)")
    opt("centralized-epochs", type=int, default=1)
    opt("quorum", type=float, default=1.0,
        help="over websockets: a round closes once this fraction of its sampled devices uploaded")
    opt("round-deadline-s", type=float, default=600.0,
        help="over websockets: a round closes after this long whatever arrived; the rest are left out")
    opt("crash-in-round", type=int, default=None, help=argparse.SUPPRESS)  # tests: exactly-once rounds


def run_args(args: argparse.Namespace, prefix: str = "") -> SimpleNamespace:
    """The options of `add_run_args(p, prefix)` under their own names."""
    dest = prefix.replace("-", "_")
    return SimpleNamespace(**{k[len(dest):]: v for k, v in vars(args).items() if k.startswith(dest)})


def config_from(args: SimpleNamespace | argparse.Namespace) -> FederatedConfig:
    """The run's FederatedConfig (bad values fail here, before any data is loaded)."""
    check_users(args)
    return FederatedConfig(**{f.name: getattr(args, f.name) for f in dataclasses.fields(FederatedConfig)})


def check_users(args: SimpleNamespace | argparse.Namespace) -> None:
    """--single-photo-users only with a method that takes one-photo users."""
    if args.single_photo_users:
        check_single_photo(args.method)


def spec_from(args: SimpleNamespace | argparse.Namespace) -> ModelSpec:
    return resolve_spec(json.loads(args.model) if args.model.startswith("{") else args.model)


def shared_from(args: SimpleNamespace | argparse.Namespace, spec: ModelSpec) -> Shared:
    """The public backbone (pre-trained if missing), the private users and the View 1 evaluators."""
    return load_shared(spec, args.data, args.init or args.out / "public_backbone.pt", args.pretrain_epochs,
                       args.max_users, view1_limit=args.view1_limit, progress_pairs=args.progress_pairs,
                       seed=args.seed, single_photo=args.single_photo_users, start=args.start)
