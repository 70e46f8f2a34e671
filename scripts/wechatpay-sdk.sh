#!/usr/bin/env bash
# Builds the official wechatpay-java SDK check (tests/wechatpay-sdk) that
# tests/api/wechatpay.rs runs: its classes, and its classpath in
# target/classpath.txt. Maven fetches the SDK from Maven Central once.
set -euo pipefail
ROOT=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
DIR="$ROOT/tests/wechatpay-sdk"
if ! command -v javac >/dev/null || ! command -v mvn >/dev/null; then
  [ "$(id -u)" = 0 ] || { echo "javac or mvn not found, and not root: apt-get install maven default-jdk-headless" >&2; exit 1; }
  echo "[wechatpay-sdk] installing maven and a JDK"
  apt-get update -qq && apt-get install -y -qq --no-install-recommends maven default-jdk-headless >/dev/null
fi
if [ -f "$DIR/target/classes/SdkCheck.class" ] && [ -f "$DIR/target/classpath.txt" ] \
  && [ "$DIR/target/classes/SdkCheck.class" -nt "$DIR/src/main/java/SdkCheck.java" ] \
  && [ "$DIR/target/classes/SdkCheck.class" -nt "$DIR/pom.xml" ]; then
  exit 0
fi
for attempt in 1 2 3; do
  if mvn -B -q -f "$DIR/pom.xml" compile dependency:build-classpath \
    -Dmdep.outputFile="$DIR/target/classpath.txt"; then
    exit 0
  fi
  echo "[wechatpay-sdk] maven failed (attempt $attempt); trying again" >&2
  sleep $((attempt * 5))
done
exit 1
