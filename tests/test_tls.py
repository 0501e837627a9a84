"""TLS with real certificates (trustme): a device trains over wss:// when it trusts the server's CA and the
host name matches; a wrong CA or host name fails at once with a clear error; plain ws:// is refused off
loopback on both sides unless explicitly allowed."""
from __future__ import annotations

import asyncio

import numpy as np
import pytest
import trustme

from device_sdk.client import DeviceClient, UntrustedServer
from device_sdk.engine import DeviceEngine
from edge_server.app import EdgeServer, ServerConfig, server_info
from edge_server.auth import TokenAuthenticator
from tests.conftest import TOKENS, serve_in_thread, small_trainer

NUM_CLASSES = 5


@pytest.fixture(scope="module")
def pki(tmp_path_factory):
    """A CA, a server certificate for the name 'localhost' only, and an unrelated CA."""
    root = tmp_path_factory.mktemp("pki")
    ca, other = trustme.CA(), trustme.CA()
    cert = ca.issue_cert("localhost")
    cert.cert_chain_pems[0].write_to_path(root / "cert.pem")
    for pem in cert.cert_chain_pems[1:]:
        pem.write_to_path(root / "cert.pem", append=True)
    cert.private_key_pem.write_to_path(root / "key.pem")
    ca.cert_pem.write_to_path(root / "ca.pem")
    other.cert_pem.write_to_path(root / "other-ca.pem")
    return root


def _client(url: str, trainer, **kw) -> DeviceClient:
    return DeviceClient(url, "device-0", TOKENS["device-0"], DeviceEngine(trainer.spec, "conv1", "server", NUM_CLASSES),
                        batch_size=8, reconnect_timeout_s=5, **kw)


def test_wss_trains_and_untrusted_servers_fail_clearly(tmp_path, pki):
    trainer = small_trainer(NUM_CLASSES)
    with serve_in_thread(trainer, tmp_path, max_batch=8, tls_cert=pki / "cert.pem", tls_key=pki / "key.pem") as server:
        port = server.server.port
        assert server.url.startswith("wss://")

        async def scenario():
            good = _client(f"wss://localhost:{port}", trainer, ca_file=pki / "ca.pem")
            await good.connect()
            rng = np.random.default_rng(0)
            result = await good.train_batch(1, rng.integers(0, 256, (4, 3, 64, 64), dtype=np.uint8),
                                            rng.integers(0, NUM_CLASSES, 4), np.arange(4))
            assert np.isfinite(result.loss)
            await good.close()
            with pytest.raises(UntrustedServer, match="certificate verify failed|unable to get local issuer"):
                await _client(f"wss://localhost:{port}", trainer, ca_file=pki / "other-ca.pem").connect()
            with pytest.raises(UntrustedServer, match="mismatch|doesn't match|not valid for"):
                await _client(f"wss://127.0.0.1:{port}", trainer, ca_file=pki / "ca.pem").connect()  # not its name
        asyncio.run(scenario())
        assert server.server.records["device-0"].last_applied == 1


def test_plain_ws_is_refused_off_loopback(tmp_path, pki):
    trainer = small_trainer(NUM_CLASSES)
    with pytest.raises(ValueError, match="token in clear"):
        _client("ws://face-edge.example:8765", trainer)
    with pytest.raises(ValueError, match="CA file was given for a plain"):
        _client("ws://127.0.0.1:8765", trainer, ca_file=pki / "ca.pem")
    assert _client("ws://face-edge.example:8765", trainer, insecure=True).ssl is None
    assert _client("ws://[::1]:8765", trainer).ssl is None and _client("ws://localhost:1", trainer).ssl is None

    info = server_info(trainer, 8, 1 << 20)
    auth = TokenAuthenticator({})
    with pytest.raises(ValueError, match="refusing to serve plain ws:// on 0.0.0.0"):
        EdgeServer(trainer, info, auth, ServerConfig(host="0.0.0.0", run_dir=tmp_path))
    assert EdgeServer(trainer, info, auth, ServerConfig(host="0.0.0.0", run_dir=tmp_path, insecure=True)).ssl is None
    served = EdgeServer(trainer, info, auth, ServerConfig(host="0.0.0.0", run_dir=tmp_path, tls_cert=pki / "cert.pem",
                                                          tls_key=pki / "key.pem"))
    assert served.ssl is not None
    with pytest.raises(ValueError, match="both --tls-cert and --tls-key"):
        EdgeServer(trainer, info, auth, ServerConfig(run_dir=tmp_path, tls_cert=pki / "cert.pem"))
