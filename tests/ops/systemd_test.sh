#!/usr/bin/env bash
# The systemd units (deploy/systemd): `systemd-analyze verify` (with the real
# binaries at the paths the units name, in a scratch root), `systemd-analyze
# security --offline=yes` exposure <= 4.0 for both, and the settings the
# operations guide promises (Type=notify + WatchdogSec, a dedicated user,
# DeviceAllow only for the worker's own GPU and the NVIDIA control nodes,
# ProtectSystem=strict, ProtectHome, PrivateTmp, NoNewPrivileges, a state
# directory, exit code 2 not restarted, ports by --port_offset, mTLS flags);
# then runs the units' ExecStart lines: worker 13 must register with the
# coordinator on ports base + 13.
set -uo pipefail
if [ -n "${TEST_SRCDIR:-}" ]; then
  root_dir=$TEST_SRCDIR/${TEST_WORKSPACE:-baton}
else
  root_dir=$(cd "$(dirname "$0")/../.." && pwd)
fi
units=$root_dir/deploy/systemd
fail=0
say() { echo "FAIL: $*"; fail=1; }
if ! command -v systemd-analyze >/dev/null; then
  echo "FAIL: systemd-analyze not found: run scripts/setup.sh (Debian package systemd)"; exit 1
fi
bin() { for d in "$root_dir" "$root_dir/bazel-bin"; do [ -x "$d/$1" ] && { echo "$d/$1"; return; }; done; }

scratch=$(mktemp -d "${TEST_TMPDIR:-/tmp}/systemd.XXXXXX")
mkdir -p "$scratch/usr/local/bin" "$scratch/etc/systemd/system" "$scratch/etc/baton" "$scratch/usr/lib"
ln -s /usr/lib/systemd "$scratch/usr/lib/systemd"   # the system's own targets (sysinit.target, ...)
cp "$(bin coordinator/baton-coordinator)" "$(bin worker/baton-worker)" "$scratch/usr/local/bin/" || say "binaries not found"
cp "$units"/*.service "$scratch/etc/systemd/system/"
cp "$units/baton.env" "$scratch/etc/baton/baton.env"

for unit in baton-coordinator.service baton-worker@0.service baton-worker@13.service; do
  out=$(systemd-analyze verify --root="$scratch" "$unit" 2>&1)
  rc=$?
  # Symlinks into the host's /usr/lib/systemd do not resolve inside the scratch root: not ours.
  ours=$(grep -v "^Failed to resolve symlink $scratch/usr/lib/systemd/" <<<"$out" | grep -v '^$')
  if [ "$rc" -ne 0 ] || [ -n "$ours" ]; then
    say "systemd-analyze verify $unit (rc $rc): $ours"
  fi
  sec=$(systemd-analyze security --offline=yes --root="$scratch" "$unit" 2>&1)
  level=$(grep -oE 'Overall exposure level for [^:]+: [0-9.]+' <<<"$sec" | grep -oE '[0-9.]+$')
  if [ -z "$level" ]; then
    say "systemd-analyze security $unit printed no exposure level: $sec"
  elif awk -v l="$level" 'BEGIN { exit !(l > 4.0) }'; then
    say "$unit: exposure $level > 4.0"; grep '✗' <<<"$sec"
  else
    echo "$unit: exposure $level"
  fi
done

need() {  # need FILE REGEX WHAT
  grep -qE "$2" "$units/$1" || say "$1: $3 (no line matching '$2')"
}
for u in baton-coordinator.service baton-worker@.service; do
  need "$u" '^Type=notify$' "Type=notify (READY=1 via sd_notify)"
  need "$u" '^WatchdogSec=[1-9]' "a watchdog"
  need "$u" '^User=baton$' "runs as the dedicated user baton"
  need "$u" '^StateDirectory=baton$' "a state directory for checkpoints"
  need "$u" '^ProtectSystem=strict$' "ProtectSystem=strict"
  need "$u" '^ProtectHome=yes$' "ProtectHome"
  need "$u" '^PrivateTmp=yes$' "PrivateTmp"
  need "$u" '^NoNewPrivileges=yes$' "NoNewPrivileges"
  need "$u" '^RestartPreventExitStatus=2$' "no restart into a bad configuration (exit 2)"
  need "$u" '^  --tls_cert=/etc/baton/tls/' "mutual TLS beyond loopback (docs/security.md)"
  need "$u" '^  --join_token_file=/etc/baton/join_token' "the join token"
done
need baton.sysusers.conf '^u baton ' "a sysusers.d entry for user baton"
need baton-worker@.service '^DevicePolicy=closed$' "DevicePolicy=closed"
need baton-worker@.service '^  --port_offset=%i' "ports by GPU index (--port_offset=%i)"
need baton-worker@.service '^  --comm_host=' "--comm_host (peers must not be told 127.0.0.1)"
need baton-worker@.service '^  --device=cuda:%i' "--device=cuda:%i"
while read -r line; do
  case "$line" in
    "DeviceAllow=/dev/nvidia%i rw"|"DeviceAllow=/dev/nvidiactl rw"|"DeviceAllow=/dev/nvidia-uvm rw"|"DeviceAllow=/dev/nvidia-uvm-tools rw") ;;
    *) say "baton-worker@.service: $line is not an NVIDIA device node of this GPU" ;;
  esac
done < <(grep '^DeviceAllow=' "$units/baton-worker@.service")
grep -q '^DeviceAllow=' "$units/baton-coordinator.service" && say "the coordinator needs no device"
# Every ${VAR} the worker unit uses is set in the shipped environment file.
for v in $(grep -oE '\$\{[A-Z_]+\}' "$units/baton-worker@.service" | tr -d '${}' | sort -u); do
  grep -q "^$v=" "$units/baton.env" || say "baton-worker@.service uses \${$v}, which baton.env does not set"
done
# Smoke: the units' own ExecStart lines (continuations joined, %i=13, %H, ${VARS} from baton.env)
# start a coordinator and worker 13 that registers over mTLS with the join token. Paths under
# /etc/baton and /var/lib/baton map to scratch files; the fixed ports become 0 (+ --port_file),
# except the worker's, which must come out as base + 13.
certs=$scratch/certs
if bash "$root_dir/tests/security/gen_certs.sh" "$certs" >/dev/null 2>&1; then
  printf '0123456789abcdef0123456789abcdef\n' > "$scratch/join_token"; chmod 600 "$scratch/join_token"
  echo 'name: "smoke" model { layers: 2 synthetic { forward_ms: 1 activation_bytes: 4096 } } parallel { pp: 2 } schedule { kind: "1f1b" microbatches: 2 } train { steps: 1 micro_batch_size: 1 lr: 0.001 }' > "$scratch/job.textproto"
  exec_line() {  # UNIT: the ExecStart command line, one line
    sed -n '/^ExecStart=/,/[^\\]$/p' "$units/$1" | sed 's/^ExecStart=//; s/\\$//' | tr -s ' \n' ' '
  }
  map() {  # stdin: a command line; maps paths, instance and variables
    sed -e "s#/usr/local/bin/#$scratch/usr/local/bin/#; s#/etc/baton/tls/#$certs/#g; s#/etc/baton/join_token#$scratch/join_token#g" \
        -e "s#/etc/baton/job.textproto#$scratch/job.textproto#; s#/var/lib/baton#$scratch/state#g; s#%i#13#g; s#%H#smokehost#g" \
        -e "s#\${BATON_COORDINATOR}#127.0.0.1:$1#; s#\${BATON_COMM_HOST}#127.0.0.1#" \
        -e "s#\${BATON_WORKER_GRPC_PORT_BASE}#$2#; s#\${BATON_WORKER_HTTP_PORT_BASE}#$3#; s#\${BATON_BLAS_THREADS}#1#"
  }
  free_port() { python3 -c 'import socket; s=socket.socket(); s.bind(("127.0.0.1", 0)); print(s.getsockname()[1])'; }
  c_line=$(exec_line baton-coordinator.service | map 0 0 0 | sed 's/0\.0\.0\.0:7070/0.0.0.0:0/; s/0\.0\.0\.0:9090/0.0.0.0:0/')
  # shellcheck disable=SC2086
  $c_line --port_file="$scratch/c.json" > "$scratch/c.log" 2>&1 &
  c_pid=$!
  for _ in $(seq 100); do [ -s "$scratch/c.json" ] && break; sleep 0.1; done
  c_grpc=$(python3 -c "import json; print(json.load(open('$scratch/c.json'))['grpc'])" 2>/dev/null)
  g=$(free_port); h=$(free_port)
  w_line=$(exec_line baton-worker@.service | map "$c_grpc" $((g - 13)) $((h - 13)))
  # shellcheck disable=SC2086
  $w_line --port_file="$scratch/w.json" > "$scratch/w.log" 2>&1 &
  w_pid=$!
  ready=""
  for _ in $(seq 150); do
    if [ -s "$scratch/w.json" ] && curl -fs "http://127.0.0.1:$h/readyz" >/dev/null 2>&1; then ready=1; break; fi
    sleep 0.2
  done
  [ -n "$ready" ] || say "worker 13 from the units' ExecStart did not register on HTTP port $h (= base + 13): $(tail -n 5 "$scratch/w.log") / $(tail -n 5 "$scratch/c.log")"
  grep -q "\"grpc\": $g" "$scratch/w.json" 2>/dev/null || say "worker 13's gRPC port is not base + 13 = $g: $(cat "$scratch/w.json" 2>/dev/null)"
  kill "$w_pid" "$c_pid" 2>/dev/null; wait "$w_pid" "$c_pid" 2>/dev/null
else
  say "tests/security/gen_certs.sh failed (openssl from scripts/setup.sh)"
fi

rm -rf "$scratch"
[ "$fail" -eq 0 ] && echo "systemd units ok"
exit "$fail"
