"""Error codes shared by every implementation of the wire protocol (see SPEC.md, "Errors")."""
from __future__ import annotations

from enum import Enum
from typing import Any


class ErrorCode(str, Enum):
    BAD_MESSAGE = "bad_message"          # not msgpack, not a map, missing or mistyped field
    UNKNOWN_TYPE = "unknown_type"        # a `type` this version does not define
    BAD_TENSOR = "bad_tensor"            # dtype, shape, byte count, scale or values are wrong
    TOO_LARGE = "too_large"              # the message exceeds the announced maximum size
    UNAUTHORIZED = "unauthorized"        # unknown device or wrong token
    VERSION_MISMATCH = "version_mismatch"
    MODEL_MISMATCH = "model_mismatch"    # model spec, split, classes or batch size differ from the server's
    UNSUPPORTED = "unsupported"          # an encoding or head placement the server does not offer
    BAD_STATE = "bad_state"              # a valid message at the wrong moment (e.g. before HELLO)
    OUT_OF_ORDER = "out_of_order"        # a batch id that is neither the next one nor a retry of the last
    BUDGET_EXCEEDED = "budget_exceeded"  # reserved for the device's privacy budget guard
    SERVER_ERROR = "server_error"        # the server failed; the batch was not applied
    ROUND_CLOSED = "round_closed"        # federated: a model request or upload for a round no longer open (late)
    EPSILON_REGRESSED = "epsilon_regressed"  # a FORWARD's spent_epsilon is below the device's last report


# Errors after which the server closes the connection: the session cannot go on.
FATAL_CODES = frozenset({
    ErrorCode.UNAUTHORIZED, ErrorCode.VERSION_MISMATCH, ErrorCode.MODEL_MISMATCH,
    ErrorCode.UNSUPPORTED, ErrorCode.TOO_LARGE,
})


class ProtocolError(Exception):
    """A violation detected locally; `code` is what goes into the ERROR reply."""

    def __init__(self, code: ErrorCode, message: str, batch_id: int | None = None):
        super().__init__(f"{code.value}: {message}")
        self.code = code
        self.message = message
        self.batch_id = batch_id

    @property
    def fatal(self) -> bool:
        return self.code in FATAL_CODES


class RemoteError(Exception):
    """An ERROR message received from the peer."""

    def __init__(self, code: str, message: str, batch_id: int | None = None):
        super().__init__(f"server refused ({code}): {message}")
        self.code = code
        self.message = message
        self.batch_id = batch_id


def brief(value: Any, limit: int = 80) -> str:
    """repr of a received value, cut short: error messages must not echo a peer's megabytes back."""
    text = repr(value)
    return text if len(text) <= limit else f"{text[:limit]}... ({len(text)} chars)"
