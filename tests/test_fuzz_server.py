"""Server-level fuzz over real websockets on loopback (bench/fuzz_server.py).

Fast tier: a few hundred messages against an in-process server (its log records are checked for
exceptions). Slow tier: the full 10,000 against a server process, as the bench runs it for
results/reliability/fuzz.json. Both: every message answered, no exception escapes the server,
and honest devices in both heads train afterwards.
"""
from __future__ import annotations

import asyncio
import logging

import pytest
import torch

from bench import fuzz_server as fz
from splitface.common.models import resolve_spec
from splitface.common.optim import TrainConfig
from splitface.server.app import EdgeServer, ServerConfig, ServerThread, server_info
from splitface.server.auth import TokenAuthenticator, hash_token
from splitface.server.trainer import ServerTrainer
from splitface.protocol.errors import ErrorCode

KNOWN = ({f"error:{c.value}" for c in ErrorCode} | {f"reply:{t}" for t in ("welcome", "backward", "embeddings",
                                                                            "eval_result")}
         | {"close:1008", "close:1009", "close:1013", "close:4000", "close:4001"})


@pytest.fixture()
def one_torch_thread():
    """The server computes in this process: two intra-op threads on a busy 2-core machine made steps take
    seconds (measured: 1.1 s a batch instead of ~0.05 s), so a fuzz answer could exceed its deadline."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


def test_fuzz_a_few_hundred_messages_in_process(tmp_path, caplog, one_torch_thread):
    trainer = ServerTrainer(resolve_spec(fz.MODEL), fz.SPLIT, fz.NUM_CLASSES, TrainConfig())
    info = server_info(trainer, fz.MAX_BATCH, fz.MAX_MESSAGE_MB << 20)
    authenticator = TokenAuthenticator({d: hash_token(t) for d, t in fz.TOKENS.items()})
    caplog.set_level(logging.INFO)
    with ServerThread(EdgeServer(trainer, info, authenticator, ServerConfig(port=0, run_dir=tmp_path))) as server:
        tally = asyncio.run(fz.fuzz(fz.Target(server.url), 300, seed=1, deadline=10.0))
        trains = asyncio.run(fz.honest_trains(server.url, batches=2))
        alive = server._thread.is_alive()
    assert alive, "the server's thread died"
    assert tally.messages >= 300 and tally.pre_hello > 20 and tally.post_hello > 200
    assert tally.hangs == 0 and tally.progress_mismatches == []
    assert set(tally.outcomes) <= KNOWN, tally.outcomes
    exceptions = [r for r in caplog.records if r.exc_info]
    assert not exceptions, [r.getMessage() for r in exceptions]
    # not vacuous: damaged tensors and messages were refused, some batches trained, sequencing was exercised
    for outcome in ("error:bad_tensor", "error:bad_message", "error:out_of_order", "reply:backward",
                    "reply:embeddings"):
        assert tally.outcomes[outcome] > 0, (outcome, tally.outcomes)
    assert trains, "an honest device could not train after the fuzz"


@pytest.mark.slow
def test_fuzz_10000_messages_against_a_server_process(tmp_path):
    result = fz.run(10_000, seed=0, deadline=10.0, workdir=tmp_path)
    assert result["messages"] >= 10_000
    assert result["crashes"] == 0 and result["hangs"] == 0 and result["progress_mismatches"] == []
    assert result["unhandled_exceptions"] == 0 and result["closes_1011"] == 0, result["tracebacks_by_kind"]
    assert set(result["outcomes"]) <= KNOWN, result["outcomes"]
    assert result["honest_client_trains_after"] is True
