#!/bin/bash
# Every example job file is valid as the coordinator loads it (LoadJobSpec:
# parse, then ValidateJobSpec): a coordinator started with --job logs
# "job 'NAME' is valid" and serves, or exits 2 naming the field to fix. Data
# files are not opened here (the workers do that, see
# tokenize_and_train_test.sh).
#   examples_valid_test.sh COORDINATOR JOB...
set -uo pipefail
coordinator=$1
shift
tmp=${TEST_TMPDIR:-$(mktemp -d)}
failed=0
for job in "$@"; do
  name=$(basename "$job" .textproto)
  log="$tmp/$name.log"
  "$coordinator" --job="$job" --listen=127.0.0.1:0 --http_listen=127.0.0.1:0 \
    --port_file="$tmp/$name.ports" >"$log" 2>&1 &
  pid=$!
  ok=0
  for _ in $(seq 200); do
    if grep -q "is valid" "$log"; then ok=1; break; fi
    kill -0 "$pid" 2>/dev/null || break
    sleep 0.1
  done
  kill "$pid" 2>/dev/null
  wait "$pid" 2>/dev/null
  if [[ $ok == 1 ]]; then
    echo "ok: $job"
  else
    echo "FAIL: $job is not a valid job:"
    cat "$log"
    failed=1
  fi
done
exit $failed
