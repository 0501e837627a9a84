"""Per-device tokens. The server stores only SHA-256 digests; the device holds the token."""
from __future__ import annotations

import hashlib
import hmac
import json
import secrets
from pathlib import Path


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
