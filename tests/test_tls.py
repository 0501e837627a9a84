"""TLS with real certificates (trustme): a device trains over wss:// when it trusts the server's CA and the
host name matches; a wrong CA or host name fails at once with a clear error; plain ws:// is refused off
loopback on both sides unless explicitly allowed."""
from __future__ import annotations

import asyncio
import json
import re
import subprocess
import sys
import time
import urllib.request

import numpy as np
import pytest
from PIL import Image

from splitface.device.connection import DeviceClient
from splitface.net.tls import UntrustedServer
from splitface.device.trainer import DeviceTrainer
from splitface.server.app import EdgeServer, ServerConfig, server_info
from splitface.server.auth import TokenAuthenticator, issue_tokens
from tests.conftest import TOKENS, serve_in_thread, small_trainer

NUM_CLASSES = 5


def _client(url: str, trainer, **kw) -> DeviceClient:
    return DeviceClient(url, "device-0", TOKENS["device-0"], DeviceTrainer(trainer.spec, "conv1", "server", NUM_CLASSES),
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
            assert good._ws.fast_messages >= 1   # the reply was taken over by splitface/net/fastws.py, over TLS too
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


@pytest.mark.slow
def test_serve_command_with_tls_and_metrics(tmp_path, pki):
    """`splitface-server serve` as an operator runs it: wss:// with --tls-cert/--tls-key, the limits as options,
    the Prometheus endpoint."""
    tokens = issue_tokens(tmp_path / "tokens.json", ["device-0"])
    log = tmp_path / "server.log"
    with open(log, "w") as out:
        proc = subprocess.Popen([sys.executable, "-m", "splitface.server.cli", "serve", "--model", "vgg_face_small",
                                 "--num-classes", str(NUM_CLASSES), "--tokens", str(tmp_path / "tokens.json"),
                                 "--port", "0", "--run-dir", str(tmp_path / "run"), "--max-batch", "8",
                                 "--threads", "1", "--tls-cert", str(pki / "cert.pem"), "--tls-key",
                                 str(pki / "key.pem"), "--metrics-port", "0", "--max-connections-per-address", "4",
                                 "--hello-timeout-s", "3"], stdout=out, stderr=subprocess.STDOUT)
    try:
        deadline = time.monotonic() + 120
        while not re.search(r"^READY \d+", log.read_text(), re.M):
            assert proc.poll() is None and time.monotonic() < deadline, log.read_text()
            time.sleep(0.2)
        text = log.read_text()
        port = int(re.search(r"^READY (\d+)", text, re.M).group(1))
        metrics_port = int(re.search(r"metrics on http://127\.0\.0\.1:(\d+)/metrics", text).group(1))
        trainer = small_trainer(NUM_CLASSES)

        async def scenario():
            client = DeviceClient(f"wss://localhost:{port}", "device-0", tokens["device-0"],
                                  DeviceTrainer(trainer.spec, "conv1", "server", NUM_CLASSES), batch_size=8,
                                  ca_file=pki / "ca.pem")
            await client.connect()
            rng = np.random.default_rng(0)
            await client.train_batch(1, rng.integers(0, 256, (4, 3, 64, 64), dtype=np.uint8),
                                     rng.integers(0, NUM_CLASSES, 4), np.arange(4))
            await client.close()
        asyncio.run(scenario())
        scraped = urllib.request.urlopen(f"http://127.0.0.1:{metrics_port}/metrics", timeout=10).read().decode()
        assert re.search(r"^splitface_batches_total 1\.0$", scraped, re.M), scraped
    finally:
        proc.terminate()
        proc.wait(60)
    assert "listening on wss://" in log.read_text()


@pytest.mark.slow
def test_the_simulator_trains_over_wss_with_its_ca_file(tmp_path, pki):
    """`splitface-device sim --ca-file` (a real device process) trains against a wss:// server; without the CA
    file it is refused before sending anything. The faces are noise: the test is about the channel."""
    rng = np.random.default_rng(0)
    for person in range(NUM_CLASSES):  # 4 photos each: 3 train, 1 test
        (tmp_path / "faces" / f"p{person}").mkdir(parents=True)
        for k in range(4):
            Image.fromarray(rng.integers(0, 256, (64, 64, 3), dtype=np.uint8)).save(
                tmp_path / "faces" / f"p{person}" / f"{k}.png")
    trainer = small_trainer(NUM_CLASSES)
    tokens = tmp_path / "tokens.json"
    tokens.write_text(json.dumps({"device-0": TOKENS["device-0"]}))
    with serve_in_thread(trainer, tmp_path, max_batch=8, tls_cert=pki / "cert.pem", tls_key=pki / "key.pem") as server:
        cmd = [sys.executable, "-m", "splitface.device_cli", "sim", "--server", f"wss://localhost:{server.server.port}",
               "--tokens", str(tokens), "--data", str(tmp_path / "faces"), "--image-folder", "--model", "vgg_face_small", "--devices", "1", "--epochs", "1", "--batch-size",
               "8", "--results", str(tmp_path / "results.json"), "--threads", "1", "--no-progress",
               "--reconnect-timeout", "5"]
        ok = subprocess.run([*cmd, "--ca-file", str(pki / "ca.pem")], capture_output=True, text=True, timeout=300)
        assert ok.returncode == 0, ok.stdout + ok.stderr
        applied = server.server.records["device-0"].last_applied
        refused = subprocess.run(cmd, capture_output=True, text=True, timeout=300)
    assert applied > 0 and json.loads((tmp_path / "results.json").read_text())["epochs"]
    assert refused.returncode != 0 and "certificate verify failed" in refused.stdout + refused.stderr
