#!/usr/bin/env bash
# The arm64 tests' tools, after scripts/setup.sh (test.sh runs both; the main job needs none of this): Debian's arm64
# cross compiler and qemu-user, Debian's arm64 JRE by multiarch (the Android demo's Java device on arm64, under
# qemu; it also brings the arm64 loader and libraries that qemu runs the runner with), when missing; and the
# installed executorch release's aarch64 wheel from PyPI, unpacked (not installed) where
# splitface.device.runtimes.native.arm64_runtime_dir says: its prebuilt C++ runtime for the runner's arm64 build.
set -euo pipefail
cd "$(dirname "$0")/.."
ARM64_JAVA=/usr/lib/jvm/java-17-openjdk-arm64/bin/java
SUDO=""
[ "$(id -u)" -ne 0 ] && SUDO="sudo"

if ! command -v aarch64-linux-gnu-g++ >/dev/null || ! command -v qemu-aarch64 >/dev/null || [ ! -x "$ARM64_JAVA" ]; then
  if ! command -v apt-get >/dev/null; then
    echo "the arm64 tests need Debian's g++-aarch64-linux-gnu, qemu-user and openjdk-17-jre-headless:arm64 (dpkg --add-architecture arm64)" >&2
    exit 1
  fi
  ADDED=""
  if ! dpkg --print-foreign-architectures | grep -qx arm64; then
    $SUDO dpkg --add-architecture arm64
    ADDED=1
  fi
  if ! { $SUDO apt-get update -q >/dev/null \
         && $SUDO apt-get install -y -q --no-install-recommends g++-aarch64-linux-gnu qemu-user \
              openjdk-17-jre-headless:arm64 >/dev/null; }; then
    [ -n "$ADDED" ] && $SUDO dpkg --remove-architecture arm64   # leave apt as it was
    echo "could not install the arm64 tests' tools (g++-aarch64-linux-gnu, qemu-user, openjdk-17-jre-headless:arm64)" >&2
    exit 1
  fi
fi

ET_ARM64=$(.venv/bin/python -c "from splitface.device.runtimes.native import arm64_runtime_dir; print(arm64_runtime_dir())")
if [ ! -f "$ET_ARM64/executorch/lib/cmake/executorch/executorch-config.cmake" ]; then
  if [ -e "$ET_ARM64" ]; then   # never remove what this script did not make
    echo "$ET_ARM64 exists but holds no executorch/lib/cmake/executorch: move it away (or set SPLITFACE_EXECUTORCH_ARM64)" >&2
    exit 1
  fi
  VERSION=$(.venv/bin/python -c 'from importlib.metadata import version; print(version("executorch"))')
  PYVER=$(.venv/bin/python -c 'import sys; print(f"{sys.version_info[0]}{sys.version_info[1]}")')
  mkdir -p "$(dirname "$ET_ARM64")"
  WORK=$(mktemp -d "$ET_ARM64.XXXXXX")   # beside it, so that the last step is a rename; gone on any exit
  trap 'rm -rf "$WORK"' EXIT
  .venv/bin/pip download -q --no-deps --only-binary=:all: --platform manylinux_2_28_aarch64 --python-version "$PYVER" \
    -d "$WORK/wheel" "executorch==$VERSION"
  .venv/bin/python -m zipfile -e "$WORK"/wheel/executorch-*.whl "$WORK/unpacked"
  mv -T "$WORK/unpacked" "$ET_ARM64" 2>/dev/null || [ -f "$ET_ARM64/executorch/lib/cmake/executorch/executorch-config.cmake" ]
fi
