"""The device's decision after WELCOME (SPEC.md section 10), from the shared cases in
splitface/protocol/vectors/reconnect/welcome_decisions.json (the JVM core runs the same cases)."""
from __future__ import annotations

import json
from dataclasses import asdict

import msgpack
import pytest

from splitface.protocol.client_session import CannotResume, Resume, Rollback, welcome_decision
from splitface.protocol.errors import ProtocolError
from splitface.protocol.vectors import generate as gen

CASES = json.loads((gen.HERE / gen.RECONNECT_FILE).read_text())["cases"]


def welcome_bytes(resume_from: int, durable_through: int) -> bytes:
    """The WELCOME vector with these two fields (canonical msgpack, the other fields as sent)."""
    welcome = msgpack.unpackb((gen.HERE / "03_welcome.msgpack").read_bytes())
    welcome.update(resume_from=resume_from, durable_through=durable_through)
    return msgpack.packb(welcome, use_bin_type=True)


def test_the_cases_cover_every_kind_of_decision():
    kinds = [c["decision"]["type"] for c in CASES]
    assert {"resume", "rollback", "invalid"} == set(kinds)
    resumes = [c["decision"] for c in CASES if c["decision"]["type"] == "resume"]
    assert {(d["resend"], d["replay"]) for d in resumes} == {(False, False), (True, False), (True, True), (False, True)}
    assert {c["decision"]["reason"] for c in CASES if c["decision"]["type"] == "invalid"} == {"server_ahead",
                                                                                              "durable_ahead"}
    assert len({c["name"] for c in CASES}) == len(CASES)


@pytest.mark.parametrize("case", CASES, ids=[c["name"] for c in CASES])
def test_the_client_session_decides_every_case(case):
    device, welcome, want = case["device"], case["welcome"], case["decision"]
    session = gen.client("server")
    session.accept_welcome(welcome_bytes(welcome["resume_from"], welcome["durable_through"]))
    if want["type"] == "invalid":
        with pytest.raises(CannotResume) as exc:
            session.reconcile(device["committed"], device["in_flight"])
        assert exc.value.reason == want["reason"] and exc.value.code.value == want["error_code"]
        assert isinstance(exc.value, ProtocolError)
        return
    decision = session.reconcile(device["committed"], device["in_flight"])
    assert isinstance(decision, Resume if want["type"] == "resume" else Rollback)
    assert {"type": want["type"], **asdict(decision)} == want
    assert decision == welcome_decision(device["committed"], device["in_flight"], **welcome)


def test_a_decision_is_a_frozen_value():
    decision = welcome_decision(5, 6, 7, 5)
    with pytest.raises(AttributeError):
        decision.next_batch = 9   # type: ignore[misc]


def test_only_the_next_batch_can_be_in_flight():
    with pytest.raises(ValueError, match="only batch 6"):
        welcome_decision(5, 7, 6, 5)


def test_reconcile_needs_a_welcome():
    with pytest.raises(ProtocolError, match="no welcome"):
        gen.client("server").reconcile(0)
