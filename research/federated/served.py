"""A federated run hosted by an edge server beside its split sessions (issue 13: one server hosts
split and federated sessions; a session declares its mode in HELLO). `python -m research.federated.served`
takes `splitface-server serve`'s options and the run's, prefixed `--federated-`.

The server keeps the main thread and its event loop (and its SIGINT/SIGTERM handling); the round logic --
loading the public backbone and the users, the rounds, View 1 -- runs on a thread of its own and publishes
each round on the server's RoundBoard through the websocket backend, exactly as `python -m research.federated
--backend websocket` does. Its devices (`python -m splitface.device.federated`, ids client-0, client-1, ...) need
tokens in the server's --tokens file. When the run ends its devices are told so; split sessions go on being
served until the server is stopped.
"""
from __future__ import annotations

import argparse
import asyncio
import json
import logging
import os
import sys
import threading
from pathlib import Path
from types import SimpleNamespace
from typing import Any

from splitface.protocol.round_board import RoundBoard
from splitface.server.app import EdgeServer
from splitface.server.cli import add_serve_args, serve
from research.federated.rounds import CRASH_EXIT_CODE, SimulatedCrash
from research.federated.experiment import run_federated
from research.federated.options import SERVE_PREFIX, add_run_args, config_from, run_args, shared_from, spec_from
from research.federated.websocket import ServedLoop, WebsocketBackend

log = logging.getLogger("splitface.federated")


class HostedRun:
    """One federated run for an EdgeServer that also serves split sessions: give the server `board`, then
    `start` once it listens. Bad options fail in the constructor, before the server starts."""

    def __init__(self, args: SimpleNamespace, max_message_bytes: int, retry_after_s: float = 0.5):
        if args.method == "centralized":
            raise ValueError("centralized training is not a federated run: use python -m research.federated")
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


def main(argv: list[str] | None = None) -> None:
    """An edge server (every option of `splitface-server serve`) hosting one federated run (--federated-*)."""
    parser = argparse.ArgumentParser(prog="splitface-research federated-serve", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    add_serve_args(parser)
    add_run_args(parser, SERVE_PREFIX)
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(message)s", stream=sys.stdout)
    if args.federated_out is None:
        parser.error(f"--{SERVE_PREFIX}out is required: it is the federated run's folder")

    def hosted(max_message_bytes: int) -> HostedRun:
        try:
            return HostedRun(run_args(args, SERVE_PREFIX), max_message_bytes)
        except ValueError as exc:
            parser.error(f"--{SERVE_PREFIX}...: {exc}")
    serve(args, parser, hosted)


if __name__ == "__main__":
    main()
