"""`splitface-research` (or `python -m research`): the experiments, one subcommand each."""
from __future__ import annotations

import sys
from typing import Any

from splitface.common.commands import Command, run

COMMANDS = {
    "demo": Command("the main job: an edge server and simulated devices training on LFW", "research.demo:main"),
    "audit": Command("play the curious edge server against recorded training runs", "research.audit.cli:main"),
    "pretrain": Command("the public start: distill (from dlib's recognizer) or classify", "research.distill:main"),
    "federated": Command("one federated (or centralized) experiment on LFW", "research.federated.__main__:main"),
    "federated-serve": Command("an edge server hosting one federated run", "research.federated.served:main"),
    "evaluate": Command("finished runs' LFW View 1 verification", "research.evaluation.run:main"),
    "facemae": Command("the FaceMAE baseline: train, or score a run's re-identification risk", "research.facemae:main"),
    "ressfl": Command("the ResSFL baseline: attacker-aware pre-training", "research.ressfl:main"),
}


def main(argv: list[str] | None = None) -> Any:
    return run("splitface-research", __doc__, COMMANDS, argv)


if __name__ == "__main__":
    sys.exit(main())
