#!/usr/bin/env bash
# Runs every libFuzzer target (tag "fuzz", built with --config=fuzz: clang,
# ASan, UBSan) for BATON_FUZZ_SECONDS each (default 16:
# 7 targets, about 2 min of fuzzing in CI) on a copy of its seed
# corpus (<target>_corpus/ beside it). A crash, leak, sanitizer report,
# timeout (> 10 s on one input) or RSS above 2 GiB fails the target; the
# input is left in $BATON_FUZZ_ARTIFACTS (default /tmp/baton-fuzz) — add it to
# the corpus once fixed, so the replay test keeps it. Prints one line
# "fuzz: //pkg:target PASSED|FAILED" per target.
set -uo pipefail
cd "$(dirname "$0")/.."
seconds=${BATON_FUZZ_SECONDS:-16}
artifacts=${BATON_FUZZ_ARTIFACTS:-/tmp/baton-fuzz}
bazel_cmd=(bazel)
if [ -n "${BATON_BAZEL_OUTPUT_BASE:-}" ]; then bazel_cmd+=("--output_base=$BATON_BAZEL_OUTPUT_BASE"); fi
targets=$("${bazel_cmd[@]}" query 'attr(tags, "\bfuzz\b", tests(//...))' 2>/dev/null)
if [ -z "$targets" ]; then echo "fuzz: no targets found"; exit 1; fi
# shellcheck disable=SC2086
"${bazel_cmd[@]}" build --symlink_prefix=/ --config=fuzz $targets || {
  for t in $targets; do echo "fuzz: $t FAILED (build)"; done
  exit 1
}
bin=$("${bazel_cmd[@]}" info --config=fuzz bazel-bin 2>/dev/null)
mkdir -p "$artifacts"
# Leaks inside Debian's uninstrumented libraries (each entry says why).
export LSAN_OPTIONS="suppressions=$PWD/third_party/sanitizers/lsan.supp:print_suppressions=0"
rc=0
for t in $targets; do
  pkg=${t#//}; pkg=${pkg%%:*}; name=${t##*:}
  work=$(mktemp -d)
  cp -r "$pkg/${name}_corpus/." "$work/" 2>/dev/null
  echo "fuzz: running $t for ${seconds}s"
  if "$bin/$pkg/$name" -max_total_time="$seconds" -timeout=10 -rss_limit_mb=2048 -max_len=65536 \
      -print_final_stats=1 -artifact_prefix="$artifacts/${name}-" "$work" > "$artifacts/$name.log" 2>&1; then
    echo "fuzz: $t PASSED ($(grep -a -m1 -oE 'stat::number_of_executed_units: *[0-9]+' "$artifacts/$name.log" | grep -oE '[0-9]+$') runs)"
  else
    echo "fuzz: $t FAILED (log and input in $artifacts/${name}*)"
    tail -40 "$artifacts/$name.log"
    rc=1
  fi
  rm -rf "$work"
done
exit $rc
