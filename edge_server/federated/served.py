"""A federated run hosted by `splitface-server serve` beside its split sessions (issue 13: one server hosts
split and federated sessions; a session declares its mode in HELLO).

The server keeps the main thread and its event loop (and its SIGINT/SIGTERM handling); the round logic --
loading the public backbone and the users, the rounds, View 1 -- runs on a thread of its own and publishes
each round on the server's RoundBoard through the websocket backend, exactly as `python -m edge_server.federated
--backend websocket` does. Its devices (`python -m device_sdk.federated`, ids client-0, client-1, ...) need
tokens in the server's --tokens file. When the run ends its devices are told so; split sessions go on being
served until the server is stopped.
"""
from __future__ import annotations

import asyncio
import json
import logging
import os
import sys
import threading
from pathlib import Path
from types import SimpleNamespace
from typing import Any

from protocol.session import RoundBoard

from ..app import EdgeServer
from .engine import CRASH_EXIT_CODE, SimulatedCrash
from .experiment import run_federated
from .options import config_from, shared_from, spec_from
from .websocket import ServedLoop, WebsocketBackend

log = logging.getLogger("splitface.federated")


class HostedRun:
    """One federated run for an EdgeServer that also serves split sessions: give the server `board`, then
    `start` once it listens. Bad options fail in the constructor, before the server starts."""

    def __init__(self, args: SimpleNamespace, max_message_bytes: int, retry_after_s: float = 0.5):
        if args.method == "centralized":
            raise ValueError("centralized training is not a federated run: use python -m edge_server.federated")
        if args.data is None:
            raise ValueError("a hosted federated run needs its data (the LFW folder)")
        self.args, self.config, self.spec = args, config_from(args), spec_from(args)
        self.out: Path = args.out
        self.board = RoundBoard(self.spec.to_dict(), retry_after_s=retry_after_s, max_message_bytes=max_message_bytes)
        self.result: dict[str, Any] | None = None
        self.error: BaseException | None = None

    def start(self, server: EdgeServer, loop: asyncio.AbstractEventLoop) -> threading.Thread:
        """Run the rounds on a daemon thread (the server's stop does not wait for a round to finish: a round
        not checkpointed is run again by the next start, never applied twice)."""
        if server.board is not self.board:
            raise ValueError("the server does not host this run's board")
        thread = threading.Thread(target=self._run, args=(ServedLoop(server, loop),), name="federated", daemon=True)
        thread.start()
        return thread

    def _run(self, served: ServedLoop) -> None:
        try:
            shared = shared_from(self.args, self.spec)
            backend = WebsocketBackend(served, self.args.quorum, self.args.round_deadline_s)
            log.info("federated rounds of %s at %s (devices client-0, client-1, ...)", self.config.method, served.url)
            self.result = run_federated(shared, self.config, self.out, self.args.eval_every,
                                        self.args.crash_in_round, log=lambda line: print(line, flush=True),
                                        backend=backend)
            backend.finish()
            print(json.dumps({k: v for k, v in self.result.items() if k not in ("history", "config")}), flush=True)
            log.info("federated run finished; split sessions are still served")
        except SimulatedCrash:  # tests: a hard stop mid-round, devices not told
            sys.stdout.flush()
            os._exit(CRASH_EXIT_CODE)
        except BaseException as exc:  # the run cannot go on: stop the server rather than serve half of it
            self.error = exc
            log.exception("federated run failed; stopping the server")
            served.loop.call_soon_threadsafe(served.server.stop)
