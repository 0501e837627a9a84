#!/usr/bin/env bash
# Sets up .venv (first run only) and runs the whole test suite.
set -euo pipefail
cd "$(dirname "$0")"
bash scripts/setup.sh
exec .venv/bin/python -m pytest -q "$@"
