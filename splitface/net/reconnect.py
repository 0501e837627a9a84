"""Connect with back-off: every client that must reach a server that may be down for a while (restarting,
overloaded, not yet up) retries the same way, and gives up the same way.

What is retried: a refused or dropped connection, a failed websocket handshake (e.g. HTTP 503 from a full
server), a timeout. What is not: a certificate the device does not trust (`UntrustedServer`: retrying cannot
change it) and anything the caller's attempt raises otherwise (an ERROR from the server, a protocol violation).
"""
from __future__ import annotations

import asyncio
import random
import ssl
import time
from dataclasses import dataclass
from typing import Awaitable, Callable, Iterator, TypeVar

from websockets.exceptions import ConnectionClosed, InvalidHandshake

from splitface.net.tls import UntrustedServer

T = TypeVar("T")

# OSError covers a refused or reset connection; asyncio's timeouts are TimeoutError (itself an OSError).
RETRYABLE: tuple[type[BaseException], ...] = (OSError, ConnectionClosed, InvalidHandshake, TimeoutError)


@dataclass(frozen=True)
class Backoff:
    """Delays between attempts: `first_s`, multiplied by `factor` after each failure up to `max_s`; each delay is
    then scaled by a uniform factor in [1 - jitter, 1 + jitter], so that devices dropped together (a server
    restart) do not all come back in the same instant."""
    first_s: float = 0.2
    factor: float = 2.0
    max_s: float = 2.0
    jitter: float = 0.1

    def __post_init__(self) -> None:
        if not (self.first_s >= 0 and self.factor >= 1 and self.max_s >= self.first_s and 0 <= self.jitter < 1):
            raise ValueError(f"a back-off needs first_s >= 0, factor >= 1, max_s >= first_s, 0 <= jitter < 1: {self}")

    def delays(self, rng: random.Random | None = None) -> Iterator[float]:
        rng = rng or random.Random()
        delay = self.first_s
        while True:
            yield delay * (1 + self.jitter * (2 * rng.random() - 1)) if self.jitter else delay
            delay = min(delay * self.factor, self.max_s)


async def connect_with_backoff(attempt: Callable[[], Awaitable[T]], *, url: str, name: str,
                               timeout_s: float | None = 120.0, attempts: int | None = None,
                               backoff: Backoff = Backoff(),
                               retryable: tuple[type[BaseException], ...] = RETRYABLE,
                               cleanup: Callable[[], Awaitable[None]] | None = None,
                               rng: random.Random | None = None) -> T:
    """`attempt()`'s result (it opens a connection to `url` and handshakes), retried with back-off.

    After every failed attempt `cleanup()` runs (close what the attempt opened). A failure in `retryable` is
    retried while attempts (None: no limit) and the deadline (`timeout_s` from now; None: none) allow; no attempt
    starts after the deadline, and a wait is cut short to end at it. Then ConnectionError("<name>: cannot reach
    <url>: ...") is raised from the last failure. A certificate that does not verify raises UntrustedServer at once;
    any other exception propagates at once. `name` (the device) heads the messages."""
    if attempts is not None and attempts < 1:
        raise ValueError(f"attempts must be at least 1 (None: no limit), not {attempts}")
    deadline = None if timeout_s is None else time.monotonic() + timeout_s
    delays = backoff.delays(rng)
    tried = 0
    while True:
        tried += 1
        try:
            return await attempt()
        except Exception as exc:
            if cleanup is not None:
                await cleanup()
            if isinstance(exc, ssl.SSLCertVerificationError):
                raise UntrustedServer(f"{name}: TLS certificate of {url} not accepted: "
                                      f"{exc.verify_message or exc}") from exc
            if isinstance(exc, UntrustedServer) or not isinstance(exc, retryable):
                raise
            left = None if deadline is None else deadline - time.monotonic()
            if (attempts is not None and tried >= attempts) or (left is not None and left <= 0):
                raise ConnectionError(f"{name}: cannot reach {url} after {tried} attempt{'s' * (tried > 1)}: "
                                      f"{exc}") from exc
            delay = next(delays)
            await asyncio.sleep(delay if left is None else min(delay, left))
