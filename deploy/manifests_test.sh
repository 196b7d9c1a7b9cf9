#!/usr/bin/env bash
# Keeps deploy/ honest: every flag the k8s manifests and systemd units pass to
# a baton binary must be a flag that binary has, and dashboards must be JSON.
set -euo pipefail
root=${TEST_SRCDIR:-.}/${TEST_WORKSPACE:-baton}
cd "$root"
fail=0
check() {  # check BINARY FILE...: flags used after the binary's path
  local bin=$1; shift
  local help
  help=$("$bin" --helpfull 2>&1 || true)
  for f in "$@"; do
    for flag in $(grep -oE -- '--[a-z_]+=' "$f" | sort -u | tr -d '=' | sed 's/^--//'); do
      if ! grep -q -- "-$flag " <<<"$help" && ! grep -q -- "-$flag)" <<<"$help"; then
        echo "FAIL: $f passes --$flag, which $(basename "$bin") does not have"
        fail=1
      fi
    done
  done
}
check coordinator/baton-coordinator deploy/k8s/coordinator.yaml deploy/systemd/baton-coordinator.service
check worker/baton-worker deploy/k8s/workers.yaml deploy/systemd/baton-worker@.service
for j in deploy/grafana/*.json; do
  python3 -m json.tool "$j" >/dev/null || { echo "FAIL: $j is not JSON"; fail=1; }
done
[ "$fail" -eq 0 ] && echo "manifests ok"
exit "$fail"
