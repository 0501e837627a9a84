"""Choose noise before a run: what noise meets a per-image target, and what the paper's
per-activation epsilon actually means for a whole image."""
from __future__ import annotations

import math

from dp_accounting import dp_event, mechanism_calibration
from dp_accounting.pld.pld_privacy_accountant import PLDAccountant
from dp_accounting.privacy_accountant import NeighboringRelation
from dp_accounting.rdp.rdp_privacy_accountant import RdpAccountant

from splitface.common.accountants.ledger import epsilon_of, to_add_or_remove
from splitface.device.privacy.mechanisms import PAPER_LRN_SENSITIVITY, PerActivationGaussian


def plan_per_image(target_epsilon: float, delta: float, releases_per_image: int,
                   value_discretization_interval: float = 1e-3) -> float:
    """Noise multiplier z such that ``releases_per_image`` compositions of GaussianDpEvent(z) reach
    ``target_epsilon`` at ``delta`` (PLD, REPLACE_ONE, via dp_accounting's calibrate_dp_mechanism)."""
    if releases_per_image < 1:
        raise ValueError(f"releases_per_image must be >= 1, got {releases_per_image}")

    def event(z: float) -> dp_event.DpEvent:
        return dp_event.SelfComposedDpEvent(dp_event.GaussianDpEvent(z), releases_per_image)

    # Bracket first with RDP (milliseconds; its z is never below PLD's): PLDs of tiny z are huge and
    # slow, and the library's default search would start there.
    z_rdp = mechanism_calibration.calibrate_dp_mechanism(
        lambda: RdpAccountant(neighboring_relation=NeighboringRelation.ADD_OR_REMOVE_ONE),
        lambda z: to_add_or_remove(event(z)), target_epsilon, delta,
        bracket_interval=mechanism_calibration.LowerEndpointAndGuess(1e-3, 1.0), tol=1e-6)
    return float(mechanism_calibration.calibrate_dp_mechanism(
        lambda: PLDAccountant(NeighboringRelation.REPLACE_ONE, value_discretization_interval=value_discretization_interval),
        event, target_epsilon, delta,
        bracket_interval=mechanism_calibration.LowerEndpointAndGuess(z_rdp / 2, z_rdp),
        tol=1e-6,
    ))


def per_activation_view(epsilon: float, delta: float, numel: int, releases_per_image: int,
                        sensitivity: float = PAPER_LRN_SENSITIVITY) -> dict:
    """What the paper's per-activation (epsilon, delta) buys: the true epsilon of one value (PLD), and
    of one image's whole tensor per release and over the run."""
    m = PerActivationGaussian(epsilon, delta, sensitivity)
    one = m.image_event(numel)
    return {
        "epsilon_requested": epsilon,
        "delta": delta,
        "sensitivity": sensitivity,
        "sigma": m.sigma,
        "noise_std": m.std,
        "numel": numel,
        "epsilon_activation": epsilon_of(m.activation_event(), delta),
        "image_noise_multiplier": one.noise_multiplier,
        "epsilon_image_per_release": epsilon_of(one, delta),
        "releases_per_image": releases_per_image,
        "epsilon_image_run": epsilon_of(dp_event.SelfComposedDpEvent(one, releases_per_image), delta),
    }


def per_image_view(epsilon: float, delta: float, numel: int, releases_per_image: int,
                   clip_norm: float = 1.0) -> dict:
    """The clipped per-image mechanism that meets ``epsilon`` per image over the run."""
    z = plan_per_image(epsilon, delta, releases_per_image)
    return {
        "epsilon_target": epsilon,
        "delta": delta,
        "releases_per_image": releases_per_image,
        "noise_multiplier": z,
        "clip_norm": clip_norm,
        "noise_std": z * clip_norm,
        "numel": numel,
        # E||noise|| ~ z C sqrt(numel) against a signal of norm at most C.
        "noise_to_signal_l2": z * math.sqrt(numel),
        "epsilon_check": epsilon_of(dp_event.SelfComposedDpEvent(dp_event.GaussianDpEvent(z), releases_per_image), delta),
    }


def release_schedule(epsilon: float, delta: float, numel: int, releases: int,
                     sensitivity: float = PAPER_LRN_SENSITIVITY) -> list[float]:
    """Per-image epsilon after k = 1..releases releases of the per-activation mechanism (PLD, REPLACE_ONE).

    A device without dp_accounting (the Android app) enforces its budget from this table instead of
    composing anything itself.
    """
    event = PerActivationGaussian(epsilon, delta, sensitivity).image_event(numel)
    return [epsilon_of(dp_event.SelfComposedDpEvent(event, k), delta) for k in range(1, releases + 1)]
