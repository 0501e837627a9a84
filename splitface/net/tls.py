"""TLS for the wire: which hosts may be reached over plain ws://, and the client's certificate checks."""
from __future__ import annotations

import ipaddress
import ssl
from pathlib import Path
from urllib.parse import urlsplit


class UntrustedServer(ConnectionError):
    """The server's TLS certificate does not verify against the trusted CAs or is for another host name;
    retrying cannot help."""


def is_loopback(host: str) -> bool:
    """Whether `host` names this machine only (a plain ws:// connection cannot be read on the network)."""
    if host.lower() in ("localhost", "localhost."):
        return True
    try:
        return ipaddress.ip_address(host.strip("[]")).is_loopback
    except ValueError:
        return False


def tls_context(url: str, ca_file: Path | None, insecure: bool) -> ssl.SSLContext | None:
    """The TLS settings for `url`: wss:// verifies the server's certificate (against `ca_file`, else the system's
    CAs) with host-name checks on. Plain ws:// sends the token in clear, so it is refused unless the host is
    loopback or `insecure` is set."""
    parts = urlsplit(url)
    if parts.scheme == "wss":
        return ssl.create_default_context(cafile=str(ca_file) if ca_file else None)
    if parts.scheme != "ws":
        raise ValueError(f"{url}: the server URL must start with wss:// (or ws:// on loopback)")
    if ca_file is not None:
        raise ValueError(f"{url}: a CA file was given for a plain ws:// URL; use wss://")
    if not insecure and not is_loopback(parts.hostname or ""):
        raise ValueError(f"{url}: plain ws:// to a non-loopback host would send the device token in clear; "
                         f"use wss:// (with a CA file), or allow it explicitly (insecure)")
    return None
