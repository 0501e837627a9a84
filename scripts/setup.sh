#!/usr/bin/env bash
# Creates .venv with torch 2.13.0 (CPU wheel) first, then the project with its test, audit, export and ray extras; installs the
# JDK-side test jars (JUnit 4, msgpack-java) from Debian for the Android demo's JVM core, and CMake and a C++
# compiler for the native device runner (splitface/device/runtimes/native), when missing. The arm64 tests' tools:
# scripts/setup_arm64.sh (test.sh runs both).
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
    || ! command -v cmake >/dev/null || ! command -v c++ >/dev/null; then
  if ! command -v apt-get >/dev/null; then
    echo "need a JDK (17+), JUnit 4 and msgpack-java under /usr/share/java, CMake and a C++ compiler (Debian: apt-get install default-jdk-headless junit4 libmsgpack-java cmake g++)" >&2
    exit 1
  fi
  SUDO=""
  [ "$(id -u)" -ne 0 ] && SUDO="sudo"
  PKGS="junit4 libmsgpack-java"
  command -v javac >/dev/null || PKGS="$PKGS default-jdk-headless"
  command -v cmake >/dev/null || PKGS="$PKGS cmake"
  command -v c++ >/dev/null || PKGS="$PKGS g++"
  $SUDO apt-get install -y -q $PKGS >/dev/null || {
    $SUDO apt-get update -q >/dev/null && $SUDO apt-get install -y -q $PKGS >/dev/null; }
fi
