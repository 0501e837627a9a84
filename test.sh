#!/usr/bin/env bash
# Sets up .venv (first run only), builds and unit-tests the Android demo's JVM core, then runs the whole test suite.
set -euo pipefail
cd "$(dirname "$0")"
bash scripts/setup.sh
android_demo/jvm_test.sh
exec .venv/bin/python -m pytest -q -rs "$@"
