"""The device's durable privacy state on disk: one JSON file per device, written atomically, checked on read.

A device that forgot what it spent would start again at epsilon 0 and re-release every image, so a
file that cannot be trusted is an error, never a reason to start afresh (docs/privacy.md, "Durable
privacy state").
"""
from __future__ import annotations

import hashlib
import json
import os
import re
from pathlib import Path
from typing import Any

from splitface.device.privacy.budget import BudgetGuard

FORMAT = "splitface-device-privacy-state"
VERSION = 1
# A device id becomes a file name: no path separators, no leading dot (the protocol's ids are short names).
_SAFE_ID = re.compile(r"^[A-Za-z0-9_][A-Za-z0-9_.@+-]{0,127}$")


class StateFileError(ValueError):
    """The state file is unreadable, corrupt, edited, or for another device; the device must not release."""


def state_path(state_dir: Path, device_id: str, kind: str = "privacy") -> Path:
    """Where a device keeps its privacy state (`kind` "privacy") or its training progress ("training") in
    `state_dir`."""
    if not _SAFE_ID.match(device_id):
        raise ValueError(f"device id {device_id!r} cannot name a state file (letters, digits and _ . @ + - only)")
    return Path(state_dir) / f"{device_id}.{kind}.json"


def _digest(state: dict[str, Any]) -> str:
    return hashlib.sha256(json.dumps(state, sort_keys=True, separators=(",", ":")).encode()).hexdigest()


def write_atomic(path: Path, data: bytes) -> None:
    """Write tmp + fsync + os.replace (+ fsync of the folder): after a crash the file is the old content or the
    new one, whole, never a mix. Readable by its owner only (the privacy state holds the noise secret)."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    try:
        with os.fdopen(fd, "wb") as f:
            f.write(data)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise
    folder = os.open(path.parent, os.O_RDONLY)
    try:
        os.fsync(folder)  # the rename itself is durable
    finally:
        os.close(folder)


def write_state(path: Path, state: dict[str, Any], fmt: str = FORMAT) -> None:
    """Write `state` atomically (write_atomic) in a JSON envelope with its checksum, which catches a file
    damaged or edited afterwards. `fmt` names the kind of state (the device's training progress has its own)."""
    envelope = {"format": fmt, "version": VERSION, "sha256": _digest(state), "state": state}
    write_atomic(path, json.dumps(envelope).encode())


def read_state(path: Path, fmt: str = FORMAT, what: str = "privacy state") -> dict[str, Any]:
    """The state written by `write_state` with this `fmt`; StateFileError (naming `what`) for anything else."""
    path = Path(path)
    try:
        envelope = json.loads(path.read_bytes())
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise StateFileError(f"{path}: {what} unreadable or corrupt ({exc}); refusing to release "
                             f"(restore the file or retire this device id, never delete it to reset)") from exc
    if not isinstance(envelope, dict) or envelope.get("format") != fmt:
        raise StateFileError(f"{path}: not a device {what} file")
    if envelope.get("version") != VERSION:
        raise StateFileError(f"{path}: {what} version {envelope.get('version')!r}, this device reads {VERSION}")
    state = envelope.get("state")
    if not isinstance(state, dict) or envelope.get("sha256") != _digest(state):
        raise StateFileError(f"{path}: {what} fails its checksum (corrupt or edited); refusing to release")
    return state


class LostPrivacyState(StateFileError):
    """The server recorded a larger spent epsilon for this device than its state file holds: the file was
    deleted, or replaced by an older copy. Restore it; starting again at a lower figure would re-spend."""


def spent_epsilon(guard: BudgetGuard) -> float:
    """The spent epsilon a device reports in FORWARD (SPEC.md section 5.11): the largest epsilon of any image (or
    identity: the guard's level) in its accountant; inf without a formal mechanism (then nothing is sent)."""
    accountant = guard.accountant
    return accountant.max_epsilon_image() if guard.level == "image" else accountant.max_epsilon_identity()


def check_server_figure(device_id: str, path: Path | None, own: float, server: float | None) -> None:
    """Refuse (LostPrivacyState) a device whose own spent epsilon `own` (inf: no formal mechanism) is below the
    figure the server's WELCOME carries for it, naming the state file and that figure."""
    if server is None or own >= server:
        return
    where = f"privacy state {path}" if path is not None else "no privacy state file (--state-dir)"
    raise LostPrivacyState(
        f"{device_id}: {where} says epsilon {own:.6g} spent, but the server recorded {server:.6g} for this device: "
        f"the state was lost or replaced by an older copy. Refusing to start: restore the file (never delete it "
        f"to reset), or retire this device id")
