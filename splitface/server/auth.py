"""Per-device tokens (the server stores only SHA-256 digests; the device holds the token), and throttling of
failed authentications so that tokens cannot be guessed at network speed."""
from __future__ import annotations

import hashlib
import hmac
import json
import logging
import math
import secrets
import time
from collections import OrderedDict
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

from splitface.protocol.errors import ErrorCode, ProtocolError

log = logging.getLogger("splitface.auth")


def hash_token(token: str) -> str:
    return "sha256:" + hashlib.sha256(token.encode()).hexdigest()


def load_tokens(path: Path) -> dict[str, str]:
    """device_id -> digest, from a JSON file written by `issue_tokens`."""
    data = json.loads(Path(path).read_text())
    if not isinstance(data, dict) or not all(isinstance(v, str) and v.startswith("sha256:") for v in data.values()):
        raise ValueError(f"{path}: expected a JSON map of device id -> 'sha256:<hex>' digests")
    return data


def issue_tokens(path: Path, device_ids: list[str]) -> dict[str, str]:
    """New random tokens for these devices; their digests are added to the file. Returns the tokens."""
    path = Path(path)
    digests = load_tokens(path) if path.exists() else {}
    tokens = {d: secrets.token_urlsafe(24) for d in device_ids}
    digests.update({d: hash_token(t) for d, t in tokens.items()})
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(digests, indent=2))
    return tokens


class TokenAuthenticator:
    def __init__(self, digests: dict[str, str]):
        self.digests = digests

    def __call__(self, device_id: str, token: str) -> bool:
        expected = self.digests.get(device_id)
        # Compare even for unknown devices so timing does not reveal which ids exist.
        return hmac.compare_digest(expected or hash_token(""), hash_token(token)) and expected is not None


@dataclass
class _Failures:
    count: int = 0
    last: float = 0.0
    locked_until: float = 0.0


class AuthThrottle:
    """Failed-authentication throttling, per address and per device id: a guesser gets `free` tries, then each
    further failure locks the key for `base_s`, doubling up to `max_s`. While locked, HELLOs for the key are refused
    without looking at the token (so a right guess does not get through either) and are not counted. A key's
    failures are forgotten after 10 x `max_s` without one. At most `capacity` keys are kept (oldest dropped), so
    a flood of made-up device ids cannot grow memory."""

    def __init__(self, free_per_device: int = 5, free_per_address: int = 20, base_s: float = 1.0,
                 max_s: float = 300.0, capacity: int = 65536, clock: Callable[[], float] = time.monotonic):
        if min(free_per_device, free_per_address) < 1 or base_s < 0 or max_s < base_s or capacity < 1:
            raise ValueError("auth throttle: free attempts >= 1 and 0 <= base_s <= max_s expected")
        self.free = {"device": free_per_device, "address": free_per_address}
        self.base_s, self.max_s, self.capacity, self.clock = base_s, max_s, capacity, clock
        self._keys: OrderedDict[tuple[str, str], _Failures] = OrderedDict()

    def _get(self, key: tuple[str, str], now: float) -> _Failures | None:
        f = self._keys.get(key)
        if f is not None and now - f.last > 10 * self.max_s:
            del self._keys[key]
            return None
        return f

    def locked_for(self, address: str, device_id: str) -> float:
        """Seconds until this address and this device id may try again (0: now)."""
        now = self.clock()
        waits = [f.locked_until - now for key in (("address", address), ("device", device_id))
                 if (f := self._get(key, now)) is not None]
        return max([0.0, *waits])

    def failed(self, address: str, device_id: str) -> tuple[int, dict[str, float]]:
        """Count a failure against both keys: (the device id's recent failures, {"address"/"device": seconds}
        for each key this failure locked)."""
        now = self.clock()
        locked: dict[str, float] = {}
        for key in (("address", address), ("device", device_id)):
            f = self._get(key, now) or _Failures()
            f.count += 1
            f.last = now
            over = f.count - self.free[key[0]]
            if over >= 0:
                locked[key[0]] = min(self.base_s * 2 ** min(over, 32), self.max_s)
                f.locked_until = now + locked[key[0]]
            self._keys[key] = f
            self._keys.move_to_end(key)
        while len(self._keys) > self.capacity:
            self._keys.popitem(last=False)
        return self._keys[("device", device_id)].count, locked

    def succeeded(self, device_id: str) -> None:
        """A right token clears its device id (not the address: one valid device must not reset a guesser)."""
        self._keys.pop(("device", device_id), None)


def throttled(authenticate: Callable[[str, str], bool], throttle: AuthThrottle,
              address: str) -> Callable[[str, str], bool]:
    """`authenticate` for one connection from `address`, behind the throttle; failures and lock-outs are logged
    at WARNING (never the token), attempts during a lock-out only at DEBUG (a guessing flood must not flood
    the log). A locked-out HELLO raises an `unauthorized` ProtocolError whose message says when to retry."""
    def check(device_id: str, token: str) -> bool:
        shown = repr(device_id[:64])
        wait = throttle.locked_for(address, device_id)
        if wait > 0:
            log.debug("authentication refused unchecked for device %s from %s: locked out for %.1f s more",
                      shown, address, wait)
            raise ProtocolError(ErrorCode.UNAUTHORIZED, f"too many failed authentications for this device or "
                                                        f"address; try again in {math.ceil(wait)} s")
        if authenticate(device_id, token):
            throttle.succeeded(device_id)
            return True
        failures, locked = throttle.failed(address, device_id)
        log.warning("authentication failed for device %s from %s (%d recent failures for this device)",
                    shown, address, failures)
        for kind, seconds in locked.items():
            log.warning("%s %s locked out for %.0f s after repeated failed authentications", kind,
                        shown if kind == "device" else address, seconds)
        return False
    return check
