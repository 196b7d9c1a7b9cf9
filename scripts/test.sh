#!/usr/bin/env bash
# Sets up, builds everything (GPU code too, where nvcc exists) and runs every
# test that does not need a GPU. GPU tests (tag `gpu`) run with
#   bazel test //... --test_tag_filters=gpu
# on a machine with one. Ends with a plain "tests: N passed, M failed" line.
set -uo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh || exit 1

bazel build //... || { echo "tests: 0 passed, 1 failed (build failed)"; exit 1; }
log=$(mktemp)
bazel test //... --config=cpu 2>&1 | tee "$log"
rc=${PIPESTATUS[0]}
passed=$(grep -cE '^//[^ ]+ +(\(cached\) )?PASSED' "$log")
failed=$(grep -cE '^//[^ ]+ +(FAILED|TIMEOUT|NO STATUS|FAILED TO BUILD)' "$log")
rm -f "$log"
echo "tests: ${passed} passed, ${failed} failed"
exit "$rc"
