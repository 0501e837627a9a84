#!/usr/bin/env bash
# Builds the Android demo's pure-JVM core with javac and runs its JUnit tests (no Gradle, no Android SDK).
# Jars from Debian: junit4, libmsgpack-java (scripts/setup.sh installs them).
set -euo pipefail
cd "$(dirname "$0")"
JARS=/usr/share/java
CP="$JARS/msgpack-core.jar"
TEST_CP="$CP:$JARS/junit4.jar:$JARS/hamcrest-core.jar"
for jar in msgpack-core.jar junit4.jar hamcrest-core.jar; do
  [ -f "$JARS/$jar" ] || { echo "missing $JARS/$jar: run scripts/setup.sh (apt-get install junit4 libmsgpack-java)" >&2; exit 1; }
done
rm -rf core/build && mkdir -p core/build
find core/src/main/java -name '*.java' > core/build/main.txt
javac -Xlint:unchecked -d core/build/main -cp "$CP" @core/build/main.txt
find core/src/test/java -name '*.java' > core/build/test.txt
javac -d core/build/test -cp "core/build/main:$TEST_CP" @core/build/test.txt
tests=$(cd core/src/test/java && find . -name '*Test.java' | sed 's|^\./||; s|\.java$||; s|/|.|g')
[ "${1:-}" = "--build-only" ] && exit 0
java -Dsplitface.vectors=../protocol/vectors -cp "core/build/main:core/build/test:$TEST_CP" org.junit.runner.JUnitCore $tests
