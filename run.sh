#!/usr/bin/env bash
# Sets up .venv (first run only) and runs the main job: an edge server plus simulated devices
# training on LFW. Arguments go to splitface-demo (see --help), e.g. --data PATH.
set -euo pipefail
cd "$(dirname "$0")"
bash scripts/setup.sh
exec .venv/bin/python -m edge_server.demo "$@"
