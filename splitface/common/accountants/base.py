"""What every accountant answers, and the one RDP conversion they share.

An accountant keeps the books of one kind of release (the device's per-image / per-identity ledger, the
federated user-level rounds, PrivacyFace's cluster releases) and hands the composition to dp_accounting:
no epsilon here is composed by hand. `Accountant` is the interface they share, so that a caller can
record events, ask for epsilon at a delta and save or restore the state without knowing which one it
holds; `registry.create_accountant(name)` builds one by name.
"""
from __future__ import annotations

import abc
import math
from typing import Any, ClassVar

from dp_accounting import dp_event
from dp_accounting.privacy_accountant import NeighboringRelation
from dp_accounting.rdp.rdp_privacy_accountant import RdpAccountant

DpEvent = dp_event.DpEvent


class Accountant(abc.ABC):
    """An accountant: `record` one release (its arguments say what was released), `get_epsilon(delta)` the
    headline epsilon so far, `state_dict` / `load_state_dict` its whole state (plain JSON-able values)."""
    name: ClassVar[str]

    @abc.abstractmethod
    def record(self, *args: Any, **kwargs: Any) -> None:
        """Compose one release into the books."""

    @abc.abstractmethod
    def get_epsilon(self, delta: float) -> float:
        """The worst-case epsilon at `delta` of everything recorded (0 before any release, inf if not private)."""

    @abc.abstractmethod
    def state_dict(self) -> Any:
        """The whole state, JSON-able."""

    @abc.abstractmethod
    def load_state_dict(self, state: Any) -> None:
        """Replace the state by a `state_dict`'s."""


def is_non_private(event: DpEvent) -> bool:
    """Whether any part of `event` releases without noise."""
    if isinstance(event, dp_event.NonPrivateDpEvent):
        return True
    if isinstance(event, dp_event.GaussianDpEvent):
        return event.noise_multiplier == 0
    if isinstance(event, dp_event.SelfComposedDpEvent):
        return event.count > 0 and is_non_private(event.event)
    if isinstance(event, dp_event.ComposedDpEvent):
        return any(is_non_private(e) for e in event.events)
    return False


def to_add_or_remove(event: DpEvent) -> DpEvent:
    """REPLACE_ONE GaussianDpEvent(z) as the equivalent ADD_OR_REMOVE_ONE GaussianDpEvent(z / 2).

    Both have privacy loss N(mu^2/2, mu^2) with mu = 2/z (a shift of 2r against noise z r, or of
    r against z r / 2); checked with PLD: 4.3772 for both at z=2, delta=1e-5. Needed because
    RdpAccountant's GaussianDpEvent ignores the neighbouring relation (it always uses the
    add/remove sensitivity), so handing it REPLACE_ONE events directly under-reports by ~2x.
    """
    if isinstance(event, dp_event.GaussianDpEvent):
        return dp_event.GaussianDpEvent(event.noise_multiplier / 2)
    if isinstance(event, dp_event.SelfComposedDpEvent):
        return dp_event.SelfComposedDpEvent(to_add_or_remove(event.event), event.count)
    if isinstance(event, dp_event.ComposedDpEvent):
        return dp_event.ComposedDpEvent([to_add_or_remove(e) for e in event.events])
    if isinstance(event, (dp_event.NoOpDpEvent, dp_event.NonPrivateDpEvent, dp_event.ZCDpEvent)):
        return event  # a zCDP event states its Renyi curve for the relation it was derived under (here REPLACE_ONE)
    raise ValueError(f"no add/remove equivalent known for {event}")


def rdp_epsilon(event: DpEvent, delta: float,
                relation: NeighboringRelation = NeighboringRelation.ADD_OR_REMOVE_ONE) -> float:
    """dp_accounting's RdpAccountant epsilon of `event` at `delta` (math.inf if any part is not private), over
    the library's own grid of Renyi orders. `relation`: the neighbouring relation the event is stated under;
    REPLACE_ONE events are converted by `to_add_or_remove` first (the library's RDP Gaussian is add/remove only).

    Why this grid: it is dp_accounting's own (steps of 0.1 from order 1.1 to 11, then the integers to 63 and
    128..1024), it reaches down to order 1.1, where a large epsilon is minimised, and the device's ledger has
    always used it (its zCDP figures for the exact option are RDP conversions, so they stay as they were).
    The user-level accountant, and through it PrivacyFace's, used to pass a grid of their own: from order 1.5
    in steps of 0.25 to 11.75, then integers. Starting at 1.5 it overstated large epsilons (the committed
    z = 0.1 runs' RDP cross-check: 664.7 where this grid gives 275.0) and its coarser steps overstated
    moderate ones by up to a few per cent (15.71 against 15.09); the few orders it had that this grid
    lacks (11.25 to 11.75, 2.25, 2.75, ...) gain at most a hair. RDP is only the cross-check there: the
    reported user-level and identity-level epsilons come from PLD and never depended on the grid.
    """
    if is_non_private(event):
        return math.inf
    if relation == NeighboringRelation.REPLACE_ONE:
        event = to_add_or_remove(event)
    elif relation != NeighboringRelation.ADD_OR_REMOVE_ONE:
        raise ValueError(f"no RDP conversion for the relation {relation}")
    accountant = RdpAccountant(neighboring_relation=NeighboringRelation.ADD_OR_REMOVE_ONE)
    accountant.compose(event)
    return float(accountant.get_epsilon(delta))
