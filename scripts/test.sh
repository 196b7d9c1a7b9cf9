#!/usr/bin/env bash
# CI: sets up, then runs these stages in order (docs/build.md has their cost):
#   1. build    bazel build //... (GCC; GPU code too where nvcc exists)
#   2. test     bazel test //... --config=cpu (every test that needs no GPU)
#   3. clang    bazel build --config=clang //... (-Wthread-safety -Werror)
#   4. asan     bazel test --config=asan --config=cpu //... (ASan + UBSan + LSan;
#               not the tests tagged no_sanitizer)
#   5. fuzz     scripts/fuzz.sh: each libFuzzer target for a bounded time
# The clang stages use their own output base so they do not evict the GCC
# build. GPU tests (tag `gpu`) run with `bazel test //... --test_tag_filters=gpu`
# on a machine with one. Set BATON_CI_STAGES (e.g. "build test") to run fewer.
# Ends with one line "tests: N passed, M failed"; a failed build or stage
# counts as one failure. Exits non-zero on any failure.
set -uo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh || exit 1

stages=${BATON_CI_STAGES:-"build test clang asan fuzz"}
passed=0
failed=0
log=$(mktemp)
trap 'rm -f "$log"' EXIT
clang_base=${BATON_CLANG_OUTPUT_BASE:-$HOME/.cache/baton-bazel-clang}
clang_bazel=(bazel "--output_base=$clang_base")
sup="$PWD/third_party/sanitizers"
asan_env=(--test_env="LSAN_OPTIONS=suppressions=$sup/lsan.supp:print_suppressions=0"
          --test_env="UBSAN_OPTIONS=print_stacktrace=1:halt_on_error=1:suppressions=$sup/ubsan.supp")

stage() {  # stage NAME: prints and times a stage
  echo "=== stage $1 ($(date -u +%H:%M:%S))"
  stage_start=$SECONDS
}
stage_end() {  # stage_end NAME RC
  echo "=== stage $1: rc=$2 in $((SECONDS - stage_start)) s"
}
failures=()   # "stage //target STATUS" of every failed test, printed again at the end
fail_logs=()  # their test.log paths, whose tails are printed at the end
count_tests() {  # count_tests STAGE: adds the PASSED / FAILED lines of a bazel test log
  local bad='^//[^ ]+ +(FAILED|TIMEOUT|NO STATUS|FAILED TO BUILD|INCOMPLETE)'
  passed=$((passed + $(grep -caE '^//[^ ]+ +(\(cached\) )?PASSED' "$log")))
  failed=$((failed + $(grep -caE "$bad" "$log")))
  local line
  while IFS= read -r line; do failures+=("$1: $line"); done < <(grep -aE "$bad" "$log")
  # bazel prints each failed test's log path on the line after its status.
  while IFS= read -r line; do fail_logs+=("$line"); done \
    < <(grep -aA1 -E "$bad" "$log" | grep -aoE '^ +/[^ ]+/test\.log$' | sed 's/^ *//')
}
report_failures() {  # the failed tests again, with their logs' tails, so a CI tail shows them
  ((${#failures[@]} == 0)) && return
  local f
  for f in "${fail_logs[@]}"; do
    [ -r "$f" ] || continue
    echo "--- last 40 lines of $f"
    tail -n 40 "$f"
  done
  echo "=== failed tests:"
  for f in "${failures[@]}"; do echo "  $f"; done
}
want() { [[ " $stages " == *" $1 "* ]]; }
rc_all=0

if want build; then
  stage build
  bazel build //...; rc=$?
  stage_end build $rc
  if ((rc != 0)); then echo "tests: ${passed} passed, $((failed + 1)) failed (build failed)"; exit 1; fi
fi
if want test; then
  stage test
  bazel test //... --config=cpu 2>&1 | tee "$log"; rc=${PIPESTATUS[0]}
  count_tests test
  stage_end test $rc
  ((rc != 0)) && rc_all=1
fi
# The GCC build's convenience symlink bazel-<this directory's name> points into
# its output base; the clang server would walk into it through //... (CI
# clones into a directory of any name, so .bazelignore cannot list it). It is
# only a convenience: the next GCC build makes it again.
if want clang || want asan || want fuzz; then rm -f "bazel-$(basename "$PWD")"; fi
if want clang; then
  stage clang
  "${clang_bazel[@]}" build --symlink_prefix=/ --config=clang //...; rc=$?
  stage_end clang $rc
  if ((rc != 0)); then failed=$((failed + 1)); rc_all=1; failures+=("clang: -Werror build failed"); fi
fi
if want asan; then
  stage asan
  # Build first, then test: tests that run multi-process jobs must not share
  # the 2 cores with the sanitizer build's compile actions (on a cold cache
  # they would otherwise run while the rest of //... still compiles).
  "${clang_bazel[@]}" build --symlink_prefix=/ --config=asan "${asan_env[@]}" //...
  # Tag no_sanitizer: the two longest multi-process suites (tests/e2e:
  # training_test, tests/fault:schedule_test; 17 minutes under ASan) run in
  # the test stage only, to keep CI inside its 90 minutes. Their code runs
  # under ASan in the stage-level layout tests and the other multi-process
  # tests (recovery_test, large_state_test, resume_layout_test, ...).
  "${clang_bazel[@]}" test --symlink_prefix=/ --config=asan --config=cpu --test_tag_filters=-gpu,-no_sanitizer \
    "${asan_env[@]}" //... 2>&1 | tee "$log"
  rc=${PIPESTATUS[0]}
  count_tests asan
  stage_end asan $rc
  ((rc != 0)) && rc_all=1
fi
if want fuzz && [ -x scripts/fuzz.sh ]; then
  stage fuzz
  BATON_BAZEL_OUTPUT_BASE="$clang_base" bash scripts/fuzz.sh 2>&1 | tee "$log"; rc=${PIPESTATUS[0]}
  passed=$((passed + $(grep -caE '^fuzz: [^ ]+ PASSED' "$log")))
  failed=$((failed + $(grep -caE '^fuzz: [^ ]+ FAILED' "$log")))
  while IFS= read -r line; do failures+=("$line"); done < <(grep -aE '^fuzz: [^ ]+ FAILED' "$log")
  stage_end fuzz $rc
  ((rc != 0)) && rc_all=1
fi
report_failures
echo "tests: ${passed} passed, ${failed} failed"
if ((rc_all != 0 || failed != 0)); then exit 1; fi
exit 0
