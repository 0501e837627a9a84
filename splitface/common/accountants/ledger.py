"""Per-image and per-identity privacy ledger, composed with dp_accounting's accountants.

Every figure here comes from dp_accounting (PLDAccountant under REPLACE_ONE; its RdpAccountant for a
history holding a zCDP event, i.e. the exact option's discrete Gaussian, which has no PLD of its own
for a vector release); this module only keeps the books: which release touched which image, counted as ``event -> count`` so that
thousands of images with tens of releases reduce to a handful of distinct histories, each
composed once and cached.
"""
from __future__ import annotations

import math
import statistics
from collections import Counter, defaultdict
from typing import Any, Iterable, Sequence

import attr
from dp_accounting import dp_event
from dp_accounting.pld.pld_privacy_accountant import PLDAccountant
from dp_accounting.privacy_accountant import NeighboringRelation

from splitface.common.accountants.base import Accountant, is_non_private, rdp_epsilon

DpEvent = dp_event.DpEvent
LEVELS = ("image", "identity")
# PLD's discretisation interval is raised to this fraction of the (RDP-estimated) epsilon when that
# is coarser than the base interval: a per-activation release of a 64x224x224 tensor has epsilon
# ~1e5-1e7, whose PLD at a 1e-3 interval takes minutes and gigabytes. PLD stays pessimistic (an
# upper bound) at any interval; the relative loss of tightness is about this fraction.
RELATIVE_INTERVAL = 1e-5
MAX_INTERVAL = 100.0  # the library computes expm1(interval): far above this it overflows


# ---- epsilon of one event, from the library ---------------------------------------------

def _has_zcdp(event: DpEvent) -> bool:
    if isinstance(event, dp_event.ZCDpEvent):
        return True
    if isinstance(event, dp_event.SelfComposedDpEvent):
        return _has_zcdp(event.event)
    if isinstance(event, dp_event.ComposedDpEvent):
        return any(_has_zcdp(e) for e in event.events)
    return False


def epsilon_of(event: DpEvent, delta: float, value_discretization_interval: float = 1e-3) -> float:
    """PLDAccountant(REPLACE_ONE) epsilon of ``event`` at ``delta``; math.inf if any part is non-private.
    A history with a zCDP event (the discrete Gaussian) is composed by RdpAccountant instead, whole:
    PLD has no curve for it, and RDP's conversion is valid for every part.

    The interval is coarsened for huge epsilons (see RELATIVE_INTERVAL), using RDP's epsilon,
    which is never below PLD's, as the scale.
    """
    if is_non_private(event):
        return math.inf
    if _has_zcdp(event):
        return rdp_epsilon(event, delta, NeighboringRelation.REPLACE_ONE)
    interval = value_discretization_interval
    try:
        interval = max(interval, min(MAX_INTERVAL, RELATIVE_INTERVAL * rdp_epsilon(event, delta,
                                                                              NeighboringRelation.REPLACE_ONE)))
    except ValueError:
        pass  # not a Gaussian composition: keep the base interval
    acc = PLDAccountant(NeighboringRelation.REPLACE_ONE, value_discretization_interval=interval)
    acc.compose(event)
    return float(acc.get_epsilon(delta))


def compose(history: Counter | dict) -> DpEvent:
    """A history ``{event: count}`` as one ComposedDpEvent of SelfComposedDpEvents (sorted: deterministic)."""
    items = sorted(((e, c) for e, c in history.items() if c > 0), key=lambda kv: repr(kv[0]))
    return dp_event.ComposedDpEvent([dp_event.SelfComposedDpEvent(e, c) for e, c in items])


# ---- JSON encoding of events ----------------------------------------------------------

def encode_event(event: DpEvent) -> dict[str, Any]:
    """A dp_event (attrs class) as a plain dict {"class": name, field: value, ...}."""
    def value(v: Any) -> Any:
        if isinstance(v, DpEvent):
            return encode_event(v)
        if isinstance(v, (list, tuple)):
            return [value(x) for x in v]
        return v
    return {"class": type(event).__name__, **{f.name: value(getattr(event, f.name)) for f in attr.fields(type(event))}}


def decode_event(d: dict[str, Any]) -> DpEvent:
    def value(v: Any) -> Any:
        if isinstance(v, dict) and "class" in v:
            return decode_event(v)
        if isinstance(v, list):
            return [value(x) for x in v]
        return v
    cls = getattr(dp_event, d["class"])
    if not (isinstance(cls, type) and issubclass(cls, DpEvent)):
        raise ValueError(f"not a DpEvent class: {d['class']!r}")
    return cls(**{k: value(v) for k, v in d.items() if k != "class"})


def _scaled(event: DpEvent, k: int) -> DpEvent:
    """One noise draw on a sum to which k of an identity's images contribute: k times the shift."""
    if k == 1:
        return event
    if isinstance(event, dp_event.GaussianDpEvent):
        return dp_event.GaussianDpEvent(event.noise_multiplier / k)
    raise ValueError(f"joint releases are supported for GaussianDpEvent only, got {event}")


class PrivacyAccountant(Accountant):
    """Per-image and per-identity ledger of releases, composed with dp_accounting's PLD accountant.

    A release is keyed (e.g. "train:12", "eval:3:5"); recording the same key again for the same
    image is a no-op, because a replay carries the same noise (see noise_generator) and so reveals
    nothing new. Neighbouring relation: REPLACE_ONE, for one image (level "image") or for all of
    one identity's images (level "identity").

    ``joint=True`` marks a release that adds ONE noise draw to a sum over the listed images (a
    DP-SGD step). Per image it is the same event; per identity, k of its images in that sum move
    it k times as far, so the identity gets GaussianDpEvent(z / k) for that release instead of k
    independent GaussianDpEvent(z) (which would under-count). Activation releases draw
    independent noise per image and are not joint.
    """
    name = "ledger"

    def __init__(self, delta: float, value_discretization_interval: float = 1e-3) -> None:
        if not 0 < delta < 1:
            raise ValueError(f"delta must be in (0, 1), got {delta}")
        self.delta = float(delta)
        self.value_discretization_interval = float(value_discretization_interval)
        self._seen: dict[str, set[int]] = defaultdict(set)           # release -> image ids
        self._image_hist: dict[int, Counter] = {}                    # image -> {event: count}
        self._image_identity: dict[int, int] = {}
        self._identity_hist: dict[int, Counter] = {}                 # identity -> {event: count}
        self._joint: dict[tuple[str, int], tuple[DpEvent, int]] = {}  # (release, identity) -> (event, k)
        self._cache: dict[frozenset, float] = {}

    # ---- recording ----------------------------------------------------------------------
    def _plan(self, release: str | None, image_ids: Sequence[int], identities: Sequence[int],
              event: DpEvent, joint: bool) -> tuple[list[tuple[int, int]], dict[int, Counter], dict[tuple[str, int], tuple[DpEvent, int]]]:
        """What recording would change: new (image, identity) pairs, identity history deltas, joint entries."""
        image_ids, identities = [int(i) for i in image_ids], [int(i) for i in identities]
        if len(image_ids) != len(identities):
            raise ValueError(f"{len(image_ids)} image ids but {len(identities)} identities")
        if len(set(image_ids)) != len(image_ids):
            raise ValueError("an image appears twice in one release")
        for img, ident in zip(image_ids, identities):
            known = self._image_identity.get(img)
            if known is not None and known != ident:
                raise ValueError(f"image {img} was recorded for identity {known}, now {ident}")
        seen = self._seen.get(release, set()) if release is not None else set()
        new = [(img, ident) for img, ident in zip(image_ids, identities) if img not in seen]
        id_delta: dict[int, Counter] = defaultdict(Counter)
        joint_updates: dict[tuple[str, int], tuple[DpEvent, int]] = {}
        if not joint:
            for _, ident in new:
                id_delta[ident][event] += 1
        else:
            per_identity = Counter(ident for _, ident in new)
            for ident, n in per_identity.items():
                key = (release if release is not None else "", ident)
                old_event, old_k = self._joint.get(key, (event, 0))
                if old_k and old_event != event:
                    raise ValueError(f"release {release!r} was recorded with {old_event}, now {event}")
                if old_k:
                    id_delta[ident][_scaled(event, old_k)] -= 1
                id_delta[ident][_scaled(event, old_k + n)] += 1
                joint_updates[key] = (event, old_k + n)
        return new, id_delta, joint_updates

    def record(self, release: str, image_ids: Sequence[int], identities: Sequence[int], event: DpEvent,
               *, joint: bool = False) -> None:
        """Add one release for these images (identities[i] is image_ids[i]'s); replays are no-ops."""
        new, id_delta, joint_updates = self._plan(release, image_ids, identities, event, joint)
        for img, ident in new:
            self._seen[release].add(img)
            self._image_identity[img] = ident
            self._image_hist.setdefault(img, Counter())[event] += 1
        for ident, delta in id_delta.items():
            hist = self._identity_hist.setdefault(ident, Counter())
            for e, c in delta.items():
                hist[e] += c
                if hist[e] <= 0:
                    del hist[e]
        self._joint.update(joint_updates)

    # ---- figures ------------------------------------------------------------------------
    def epsilon_of_history(self, history: Counter | dict) -> float:
        """Epsilon of a composed history, cached by its (frozen) contents."""
        key = frozenset((e, c) for e, c in history.items() if c > 0)
        if key not in self._cache:
            self._cache[key] = epsilon_of(compose(history), self.delta, self.value_discretization_interval) \
                if key else 0.0
        return self._cache[key]

    def epsilon_image(self, image_id: int) -> float:
        return self.epsilon_of_history(self._image_hist.get(int(image_id), Counter()))

    def epsilon_identity(self, identity: int) -> float:
        """Every release of every image of ``identity``, composed."""
        return self.epsilon_of_history(self._identity_hist.get(int(identity), Counter()))

    def _all(self, level: str) -> list[float]:
        hists = self._image_hist if level == "image" else self._identity_hist
        return [self.epsilon_of_history(h) for h in hists.values()]

    def max_epsilon_image(self) -> float:
        return max(self._all("image"), default=0.0)

    def max_epsilon_identity(self) -> float:
        return max(self._all("identity"), default=0.0)

    def get_epsilon(self, delta: float) -> float:
        """The worst identity's epsilon at `delta` (an identity's releases include each of its images')."""
        if delta == self.delta:
            return self.max_epsilon_identity()
        return max((epsilon_of(compose(h), delta, self.value_discretization_interval) if h else 0.0
                    for h in self._identity_hist.values()), default=0.0)

    def epsilon_after(self, image_ids: Sequence[int], identities: Sequence[int], event: DpEvent, level: str,
                      *, release: str | None = None, joint: bool = False) -> dict[int, tuple[float, float, bool]]:
        """{image or identity: (epsilon now, epsilon after, whether this release adds to it)} for those it
        touches; records nothing. With ``release`` given, images that already have it count it as a replay.
        """
        if level not in LEVELS:
            raise ValueError(f"level must be one of {LEVELS}, not {level!r}")
        new, id_delta, _ = self._plan(release, image_ids, identities, event, joint)
        out: dict[int, tuple[float, float, bool]] = {}
        if level == "image":
            new_images = {img for img, _ in new}
            for img in (int(i) for i in image_ids):
                hist = self._image_hist.get(img, Counter())
                adds = img in new_images
                after = hist + Counter({event: 1}) if adds else hist
                out[img] = (self.epsilon_of_history(hist), self.epsilon_of_history(after), adds)
        else:
            for ident in {int(i) for i in identities}:
                hist = self._identity_hist.get(ident, Counter())
                after = Counter(hist)
                delta = id_delta.get(ident, Counter())
                for e, c in delta.items():
                    after[e] += c
                out[ident] = (self.epsilon_of_history(hist), self.epsilon_of_history(after), bool(delta))
        return out

    def epsilon_if(self, image_ids: Sequence[int], identities: Sequence[int], event: DpEvent, level: str,
                   *, release: str | None = None, joint: bool = False) -> float:
        """Worst epsilon (at ``level``) among those touched, after adding this release, without recording it."""
        after = self.epsilon_after(image_ids, identities, event, level, release=release, joint=joint)
        return max((a for _, a, _ in after.values()), default=0.0)

    def rdp_epsilon_image(self, image_id: int) -> float:
        """Cross-check with RdpAccountant: never below the PLD figure, typically a few % above.

        RdpAccountant's Gaussian ignores REPLACE_ONE, so the history is converted with
        :func:`to_add_or_remove` (REPLACE_ONE G(z) == ADD_OR_REMOVE G(z/2), verified with PLD).
        """
        hist = self._image_hist.get(int(image_id), Counter())
        return rdp_epsilon(compose(hist), self.delta, NeighboringRelation.REPLACE_ONE) if hist else 0.0

    def report(self) -> dict[str, Any]:
        """Summary for logs: numbers of releases and images, epsilon spread per image and per identity."""
        img, ids = self._all("image"), self._all("identity")
        return {
            "delta": self.delta,
            "releases": len(self._seen),
            "images": len(img),
            "identities": len(ids),
            "epsilon_image": {"max": max(img, default=0.0), "median": statistics.median(img) if img else 0.0,
                              "min": min(img, default=0.0)},
            "epsilon_identity": {"max": max(ids, default=0.0),
                                 "median": statistics.median(ids) if ids else 0.0},
        }

    # ---- persistence --------------------------------------------------------------------
    def state_dict(self) -> dict[str, Any]:
        """Plain JSON-able state (events stored once in a table, histories refer to them by index)."""
        table: list[dict[str, Any]] = []
        index: dict[DpEvent, int] = {}

        def ref(e: DpEvent) -> int:
            if e not in index:
                index[e] = len(table)
                table.append(encode_event(e))
            return index[e]

        def hist(h: Counter) -> list[list[int]]:
            return [[ref(e), int(c)] for e, c in h.items()]

        return {
            "version": 1,
            "delta": self.delta,
            "value_discretization_interval": self.value_discretization_interval,
            "images": [[img, self._image_identity[img], hist(h)] for img, h in self._image_hist.items()],
            "identities": [[ident, hist(h)] for ident, h in self._identity_hist.items()],
            "releases": {rel: sorted(imgs) for rel, imgs in self._seen.items()},
            "joint": [[rel, ident, ref(e), k] for (rel, ident), (e, k) in self._joint.items()],
            "events": table,
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        if state.get("version") != 1:
            raise ValueError(f"unknown accountant state version {state.get('version')!r}")
        events = [decode_event(d) for d in state["events"]]

        def hist(pairs: Iterable[Sequence[int]]) -> Counter:
            return Counter({events[i]: int(c) for i, c in pairs})

        self.delta = float(state["delta"])
        self.value_discretization_interval = float(state["value_discretization_interval"])
        self._image_hist, self._image_identity = {}, {}
        for img, ident, pairs in state["images"]:
            self._image_hist[int(img)] = hist(pairs)
            self._image_identity[int(img)] = int(ident)
        self._identity_hist = {int(ident): hist(pairs) for ident, pairs in state["identities"]}
        self._seen = defaultdict(set, {rel: set(int(i) for i in imgs) for rel, imgs in state["releases"].items()})
        self._joint = {(rel, int(ident)): (events[e], int(k)) for rel, ident, e, k in state["joint"]}
        self._cache = {}
