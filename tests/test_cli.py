"""One command line per role (splitface-server, splitface-device, splitface-export, splitface-research): each
answers --help, and so does every subcommand."""
from __future__ import annotations

import importlib
import subprocess
import sys
import tomllib
from pathlib import Path

import pytest

import research.__main__ as research_cli
import splitface.device_cli as device_cli

ROOT = Path(__file__).resolve().parents[1]
ROLES = {"splitface-server": ("splitface.server.cli", ["serve", "tokens"]),
         "splitface-device": ("splitface.device_cli", list(device_cli.COMMANDS)),
         "splitface-export": ("splitface.export.cli", []),
         "splitface-research": ("research.__main__", list(research_cli.COMMANDS))}
CASES = [(role, sub) for role, (_, subs) in ROLES.items() for sub in [None, *subs]]
OWN_PROG = {("splitface-research", "federated"), ("splitface-research", "federated-serve")}  # usage: python -m ...


def test_console_scripts_are_the_role_commands():
    scripts = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["scripts"]
    assert scripts == {role: f"{module}:main" for role, (module, _) in ROLES.items()}


@pytest.mark.parametrize("role,sub", CASES, ids=[f"{r} {s or ''}".strip() for r, s in CASES])
def test_help(role, sub, capsys):
    """`ROLE [SUB] --help` exits 0 and its usage names the command it documents."""
    main = importlib.import_module(ROLES[role][0]).main
    with pytest.raises(SystemExit) as exit_:
        main([*([sub] if sub else []), "--help"])
    assert exit_.value.code in (0, None)
    out = capsys.readouterr().out
    if (role, sub) not in OWN_PROG:
        assert out.startswith(f"usage: {role}{' ' + sub if sub else ''} "), out[:200]


@pytest.mark.parametrize("module", ["splitface.device_cli", "research"])
def test_runs_as_a_module(module):
    """`python -m research demo ...` is how run.sh starts the main job."""
    done = subprocess.run([sys.executable, "-m", module, "--help"], capture_output=True, text=True, cwd=ROOT,
                          timeout=120)
    assert done.returncode == 0 and done.stdout.startswith("usage: "), done.stderr


def test_the_rest_of_the_command_line_goes_through(capsys):
    assert device_cli.main(["plan", "--epsilon", "3", "--mechanism", "per-activation", "--json"]) == 0
    assert '"per_activation"' in capsys.readouterr().out


@pytest.mark.parametrize("argv", [[], ["bogus"], ["--bogus"]])
def test_unknown_command_is_a_usage_error(argv):
    with pytest.raises(SystemExit) as exit_:
        research_cli.main(argv)
    assert exit_.value.code == 2
