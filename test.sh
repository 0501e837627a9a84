#!/usr/bin/env bash
# Sets up .venv (first run only) and the arm64 tests' tools, builds and unit-tests the Android demo's JVM core, then runs the whole test suite.
set -euo pipefail
cd "$(dirname "$0")"
bash scripts/setup.sh
bash scripts/setup_arm64.sh
android_demo/jvm_test.sh
# two workers (pytest-xdist, a test file per worker): the real-process tests spend much of their time waiting
exec .venv/bin/python -m pytest -q -rs -n "${SPLITFACE_TEST_WORKERS:-2}" --dist loadfile "$@"
