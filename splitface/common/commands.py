"""One command line per role, with subcommands. A subcommand is an existing program's `main(argv)`, handed the
rest of the command line untouched, so each program still declares its own options, once; the program's module is
imported only when its subcommand runs, so `--help` stays quick."""
from __future__ import annotations

import argparse
import importlib
import sys
from dataclasses import dataclass
from typing import Any


@dataclass(frozen=True)
class Command:
    """A subcommand: `target` is "module:function", a main(argv); `prefix` goes before the rest of the command line
    (a program with subcommands of its own, such as the privacy planner's plan and schedule)."""
    help: str
    target: str
    prefix: tuple[str, ...] = ()

    def main(self, argv: list[str]) -> Any:
        module, function = self.target.split(":")
        return getattr(importlib.import_module(module), function)([*self.prefix, *argv])


def parser(prog: str, description: str, commands: dict[str, Command]) -> argparse.ArgumentParser:
    listing = "\n".join(f"  {name:<17} {command.help}" for name, command in commands.items())
    p = argparse.ArgumentParser(prog=prog, description=description, formatter_class=argparse.RawDescriptionHelpFormatter,
                                epilog=f"commands:\n{listing}\n\n`{prog} COMMAND --help` lists a command's options.")
    p.add_argument("command", metavar="COMMAND", choices=list(commands), help="one of the commands below")
    p.add_argument("args", metavar="ARG", nargs="*", default=[], help="the command's own options and arguments")
    return p


def run(prog: str, description: str, commands: dict[str, Command], argv: list[str] | None = None) -> Any:
    """Runs the subcommand named by argv[0] (default: sys.argv[1:]) on the rest; returns what its main returns
    (a console script exits with it)."""
    argv = sys.argv[1:] if argv is None else list(argv)
    if not argv or argv[0].startswith("-") or argv[0] not in commands:
        parser(prog, description, commands).parse_args(argv[:1])  # help, or the usage error, then exits
    return commands[argv[0]].main(argv[1:])
