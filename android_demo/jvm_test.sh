#!/usr/bin/env bash
# Builds the Android demo's pure-JVM core with javac and runs its JUnit tests (no Gradle, no Android SDK).
# Jars from Debian: junit4, libmsgpack-java (scripts/setup.sh installs them).
# JVM_BUILD_DIR (default core/build) puts the classes elsewhere: tests/test_android_core.py builds into its own
# temporary folder, so that a build running beside it cannot delete the classes its Java processes load.
set -euo pipefail
cd "$(dirname "$0")"
BUILD="${JVM_BUILD_DIR:-core/build}"
JARS=/usr/share/java
CP="$JARS/msgpack-core.jar"
TEST_CP="$CP:$JARS/junit4.jar:$JARS/hamcrest-core.jar"
for jar in msgpack-core.jar junit4.jar hamcrest-core.jar; do
  [ -f "$JARS/$jar" ] || { echo "missing $JARS/$jar: run scripts/setup.sh (apt-get install junit4 libmsgpack-java)" >&2; exit 1; }
done
rm -rf "$BUILD" && mkdir -p "$BUILD"
find core/src/main/java -name '*.java' > "$BUILD/main.txt"
javac -Xlint:unchecked -d "$BUILD/main" -cp "$CP" @"$BUILD/main.txt"
find core/src/test/java -name '*.java' > "$BUILD/test.txt"
javac -d "$BUILD/test" -cp "$BUILD/main:$TEST_CP" @"$BUILD/test.txt"
tests=$(cd core/src/test/java && find . -name '*Test.java' | sed 's|^\./||; s|\.java$||; s|/|.|g')
[ "${1:-}" = "--build-only" ] && exit 0
java -Dsplitface.vectors=../splitface/protocol/vectors -cp "$BUILD/main:$BUILD/test:$TEST_CP" org.junit.runner.JUnitCore $tests
