"""`splitface-device`: the device side's commands. Its subcommands span the simulator, the federated device and
the privacy planner, so it sits above all three (the server's and the exporter's commands live in their packages)."""
from __future__ import annotations

import sys
from typing import Any

from splitface.common.commands import Command, run

COMMANDS = {
    "sim": Command("run N simulated devices against a running edge server", "splitface.sim.cli:main"),
    "federated": Command("one federated device process: trains the rounds it is sampled for",
                         "splitface.device.federated.__main__:main"),
    "plan": Command("noise for a target epsilon; the per-activation mechanism's per-image view",
                    "splitface.device.privacy.planner:main", ("plan",)),
    "schedule": Command("per-image epsilon after each release, for a device's budget guard (msgpack)",
                        "splitface.device.privacy.planner:main", ("schedule",)),
}


def main(argv: list[str] | None = None) -> Any:
    return run("splitface-device", __doc__, COMMANDS, argv)


if __name__ == "__main__":
    sys.exit(main())
