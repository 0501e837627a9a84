#!/usr/bin/env bash
# Creates .venv with torch 2.13.0 (CPU wheel) first, then the project with its test, audit, export and ray extras; installs the
# JDK-side test jars (JUnit 4, msgpack-java) from Debian for the Android demo's JVM core, CMake and a C++
# compiler for the native device runner (splitface/device/runtimes/native), and the arm64 cross compiler with qemu-user
# for its arm64 tests, and Debian's arm64 JRE (multiarch) for the Java device on arm64, when missing; and unpacks the
# aarch64 wheel of the same executorch release (its prebuilt arm64 runtime).
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
if [ ! -x .venv/bin/python ]; then
  "$PY" -m venv .venv
fi
.venv/bin/pip install -q --upgrade pip >/dev/null 2>&1 || true
.venv/bin/pip install -q "torch==2.13.0"
.venv/bin/pip install -q -e ".[test,audit,export,ray]"

if [ ! -f /usr/share/java/junit4.jar ] || [ ! -f /usr/share/java/msgpack-core.jar ] || ! command -v javac >/dev/null \
    || ! command -v cmake >/dev/null || ! command -v c++ >/dev/null || ! command -v aarch64-linux-gnu-g++ >/dev/null \
    || ! command -v qemu-aarch64 >/dev/null; then
  if ! command -v apt-get >/dev/null; then
    echo "need a JDK (17+), JUnit 4 and msgpack-java under /usr/share/java, CMake, a C++ compiler, an arm64 cross compiler and qemu-user (Debian: apt-get install default-jdk-headless junit4 libmsgpack-java cmake g++ g++-aarch64-linux-gnu qemu-user)" >&2
    exit 1
  fi
  SUDO=""
  [ "$(id -u)" -ne 0 ] && SUDO="sudo"
  PKGS="junit4 libmsgpack-java"
  command -v javac >/dev/null || PKGS="$PKGS default-jdk-headless"
  command -v cmake >/dev/null || PKGS="$PKGS cmake"
  command -v c++ >/dev/null || PKGS="$PKGS g++"
  command -v aarch64-linux-gnu-g++ >/dev/null || PKGS="$PKGS g++-aarch64-linux-gnu"
  command -v qemu-aarch64 >/dev/null || PKGS="$PKGS qemu-user"
  $SUDO apt-get install -y -q $PKGS >/dev/null || {
    $SUDO apt-get update -q >/dev/null && $SUDO apt-get install -y -q $PKGS >/dev/null; }
fi

# Debian's arm64 JRE (multiarch), which runs the Android demo's Java device on arm64 under qemu-user in the tests
if [ ! -x /usr/lib/jvm/java-17-openjdk-arm64/bin/java ]; then
  if ! command -v apt-get >/dev/null; then
    echo "need Debian's arm64 JRE at /usr/lib/jvm/java-17-openjdk-arm64 (dpkg --add-architecture arm64; apt-get install openjdk-17-jre-headless:arm64)" >&2
    exit 1
  fi
  SUDO=""
  [ "$(id -u)" -ne 0 ] && SUDO="sudo"
  dpkg --print-foreign-architectures | grep -qx arm64 || $SUDO dpkg --add-architecture arm64
  $SUDO apt-get update -q >/dev/null
  $SUDO apt-get install -y -q --no-install-recommends openjdk-17-jre-headless:arm64 >/dev/null
fi

# ExecuTorch's prebuilt C++ runtime for arm64 Linux: the installed release's aarch64 wheel from PyPI, unpacked (not
# installed) where splitface.device.runtimes.native.arm64_runtime_dir says, for the runner's arm64 cross build.
ET_ARM64=$(.venv/bin/python -c "from splitface.device.runtimes.native import arm64_runtime_dir; print(arm64_runtime_dir())")
if [ ! -f "$ET_ARM64/executorch/lib/cmake/executorch/executorch-config.cmake" ]; then
  ET_WHEELS=$(mktemp -d)
  .venv/bin/pip download -q --no-deps --only-binary=:all: --platform manylinux_2_28_aarch64 \
    --python-version "$(.venv/bin/python -c 'import sys; print(f"{sys.version_info[0]}{sys.version_info[1]}")')" \
    -d "$ET_WHEELS" "executorch==$(.venv/bin/python -c 'from importlib.metadata import version; print(version("executorch"))')"
  rm -rf "$ET_ARM64.partial"
  .venv/bin/python -m zipfile -e "$ET_WHEELS"/executorch-*.whl "$ET_ARM64.partial"
  rm -rf "$ET_ARM64" "$ET_WHEELS"
  mv "$ET_ARM64.partial" "$ET_ARM64"
fi
