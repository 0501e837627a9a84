"""Spent epsilon on the wire (issue #16; SPEC.md section 5.11), in the sans-I/O sessions: a FORWARD's claim is
validated, refused when it goes down, recorded once accepted, and handed back in WELCOME; a device whose own
books say less than that figure refuses to start. The real-socket and real-process checks are in
test_metrics_endpoint (gauge, server restart, regression over loopback) and test_privacy_state (a deleted file)."""
from __future__ import annotations

import math

import msgpack
import pytest

from splitface.device.privacy.state import LostPrivacyState, StateFileError, check_server_figure
from splitface.protocol import messages as m
from splitface.protocol.errors import ErrorCode
from splitface.protocol.server_session import Reply, Train
from splitface.protocol.vectors import generate as gen

DEVICE = gen.DEVICE_ID


def _admitted(epsilon: dict[str, float], last_applied: int = 0):
    device = gen.client("server")
    return device, gen.server(device, last_applied=last_applied, epsilon=epsilon)


def _error(action) -> str:
    assert isinstance(action, Reply) and not action.close
    return m.decode(action.data)["code"]


def test_a_claim_is_recorded_once_accepted_and_returned_in_welcome():
    epsilon: dict[str, float] = {}
    device, server = _admitted(epsilon)
    assert "spent_epsilon" not in m.decode(server.welcome())  # no report yet: no figure
    assert isinstance(server.receive(device.forward(1, gen.ACTIVATIONS, gen.LABELS, spent_epsilon=0.5)), Train)
    assert epsilon == {DEVICE: 0.5}
    server.applied(1, gen.ACT_GRAD)
    # a device without a formal mechanism sends no figure: the last one stands
    assert isinstance(server.receive(device.forward(2, gen.ACTIVATIONS, gen.LABELS)), Train)
    assert epsilon == {DEVICE: 0.5}
    server.applied(2, gen.ACT_GRAD)
    assert m.decode(gen.server(device, epsilon=epsilon).welcome())["spent_epsilon"] == 0.5


def test_a_lower_claim_is_refused_and_nothing_is_applied():
    epsilon = {DEVICE: 2.5}
    device, server = _admitted(epsilon, last_applied=5)
    assert _error(server.receive(device.forward(6, gen.ACTIVATIONS, gen.LABELS, spent_epsilon=1.25))) == \
        ErrorCode.EPSILON_REGRESSED.value
    assert epsilon == {DEVICE: 2.5} and server.record.last_applied == 5
    assert _error(server.receive(device.forward(1, gen.ACTIVATIONS, gen.LABELS, spent_epsilon=1.0, eval=True))) == \
        ErrorCode.EPSILON_REGRESSED.value  # an evaluation batch is a release too
    assert isinstance(server.receive(device.forward(6, gen.ACTIVATIONS, gen.LABELS, spent_epsilon=2.5)), Train)


@pytest.mark.parametrize("bad", [-0.5, math.nan, math.inf, "1", True, None])
def test_a_malformed_claim_is_bad_message_and_nothing_is_applied(bad):
    epsilon = {DEVICE: 1.0}
    device, server = _admitted(epsilon)
    wire = msgpack.unpackb(device.forward(1, gen.ACTIVATIONS, gen.LABELS, spent_epsilon=1.0), raw=False)
    wire["spent_epsilon"] = bad
    assert _error(server.receive(msgpack.packb(wire, use_bin_type=True))) == ErrorCode.BAD_MESSAGE.value
    assert epsilon == {DEVICE: 1.0} and server.record.last_applied == 0
    with pytest.raises(ValueError, match="finite"):
        device.forward(1, gen.ACTIVATIONS, gen.LABELS, spent_epsilon=-1.0)  # the builder refuses to send one


def test_a_device_below_the_servers_figure_has_lost_its_state(tmp_path):
    path = tmp_path / "phone-01.privacy.json"
    check_server_figure(DEVICE, path, 2.0, None)      # nothing reported before
    check_server_figure(DEVICE, path, 2.0, 2.0)       # resumed exactly where it was
    check_server_figure(DEVICE, path, math.inf, 3.0)  # no formal mechanism now: nothing to compare
    with pytest.raises(LostPrivacyState, match=r"phone-01\.privacy\.json says epsilon 0 spent, but the server "
                                               r"recorded 3\.5") as caught:
        check_server_figure(DEVICE, path, 0.0, 3.5)
    assert isinstance(caught.value, StateFileError)  # the CLI reports it like any untrustworthy state file
    with pytest.raises(LostPrivacyState, match="no privacy state file"):
        check_server_figure(DEVICE, None, 0.0, 3.5)
