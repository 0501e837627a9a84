"""Injected faults for tests: a process that dies at an exact step, as a power cut or kill -9 would.

Both sides use them (a server step, a device batch), so they live in the shared core."""
from __future__ import annotations

import logging
import os
from dataclasses import dataclass

log = logging.getLogger("splitface.faults")

FAULT_EXIT = 86  # exit status of a process ended by an injected fault (tests only)


@dataclass(frozen=True)
class Fault:
    """A deterministic fault for tests, `kind:N`: at an exact point of batch (or server step) N the process
    exits hard (`crash-...`, exit status FAULT_EXIT, nothing flushed or saved) or, on a device, the
    connection is aborted (`drop-...`, then the client's own recovery runs). Each fault fires once."""
    kind: str
    at: int

    @classmethod
    def parse(cls, text: str, kinds: tuple[str, ...]) -> "Fault":
        kind, sep, at = text.partition(":")
        if kind not in kinds or not sep or not at.isdigit() or int(at) < 1:
            raise ValueError(f"fault {text!r}: expected KIND:N with N >= 1 and KIND one of {', '.join(kinds)}")
        return cls(kind, int(at))

    def __str__(self) -> str:
        return f"{self.kind}:{self.at}"


def crash(what: str) -> None:
    """End this process at once, as a power cut or kill -9 would: no cleanup, no checkpoint, no close frame."""
    log.error("fault injection: %s; exiting hard", what)
    for handler in logging.getLogger().handlers:
        handler.flush()
    os._exit(FAULT_EXIT)
