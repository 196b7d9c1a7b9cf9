#!/usr/bin/env bash
# Keeps deploy/ honest: every flag the k8s manifests and systemd units pass to
# a baton binary must be a flag that binary has, and dashboards must be JSON.
# (//tests/ops:k8s_test also checks the rendered objects' flags and ports.)
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
# Kubernetes files by which binary their containers run (base and overlays).
coordinator_files=() worker_files=()
while IFS= read -r f; do
  grep -q 'baton-coordinator"\]' "$f" && coordinator_files+=("$f")
  grep -qE 'baton-worker"\]|name: worker$' "$f" && worker_files+=("$f")
done < <(find deploy/k8s -name '*.yaml' | sort)
[ "${#coordinator_files[@]}" -gt 0 ] && [ "${#worker_files[@]}" -gt 0 ] || { echo "FAIL: no k8s files found"; fail=1; }
check coordinator/baton-coordinator "${coordinator_files[@]}" deploy/systemd/baton-coordinator.service
check worker/baton-worker "${worker_files[@]}" deploy/systemd/baton-worker@.service
for j in deploy/grafana/*.json; do
  python3 -m json.tool "$j" >/dev/null || { echo "FAIL: $j is not JSON"; fail=1; }
done
[ "$fail" -eq 0 ] && echo "manifests ok"
exit "$fail"
