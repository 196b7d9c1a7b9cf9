#!/usr/bin/env bash
# Token files larger than memory (docs/BENCHMARKS.md): writes an llm.c shard
# of GIB GiB (default 4) under DIR (default /tmp/baton_token_files_bench) and
# reads STEPS steps (default 500) of it as a worker does, printing the
# process's resident memory. Checks the free disk first and writes a smaller
# shard (saying so) when there is not room for GIB GiB plus 1 GiB.
# Extra arguments go to the reading run (e.g. --steps=2000). Set SPARSE=1 to
# leave the ids a hole instead of writing them (no disk used).
set -euo pipefail
cd "$(dirname "$0")/.."
gib=${GIB:-4}
dir=${DIR:-/tmp/baton_token_files_bench}
mkdir -p "$dir"
free_gib=$(df --output=avail -B1G "$dir" | tail -1 | tr -d ' ')
echo "free disk under $dir: ${free_gib} GiB"
if [[ "${SPARSE:-0}" != 1 ]] && (( free_gib < gib + 1 )); then
  gib=$(( free_gib > 2 ? free_gib - 1 : 1 ))
  echo "not enough room for ${GIB:-4} GiB: writing ${gib} GiB instead"
fi

bazel build //bench/data:token_files_bench >/dev/null 2>&1 || bazel build //bench/data:token_files_bench
bin=bazel-bin/bench/data/token_files_bench
sparse=()
[[ "${SPARSE:-0}" == 1 ]] && sparse=(--sparse)
"$bin" --dir="$dir" --make --gib="$gib" "${sparse[@]}"
ls -ls "$dir"
/usr/bin/time -f "time: max resident %M KiB, %e s wall, %F major faults" "$bin" --dir="$dir" --read "$@"
[[ "${KEEP:-0}" == 1 ]] || rm -f "$dir"/train_000000.bin
