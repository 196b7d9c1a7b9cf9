#!/usr/bin/env bash
# Expert parallelism (parallel.ep) on the real system: coordinator + worker
# daemons on loopback, driven by batonctl local, Gloo, CPU. An MoE GPT
# (layers=4 d_model=128 heads=4 vocab=256 seq_len=128, every block MoE with
# 8 experts, top-2, capacity 1.25) at dp 4, pp 1, 1f1b, 2 microbatches of 4
# sequences per rank (the same global batch for every ep), for ep 1, 2 and
# 4, rounds interleaved (the machine is shared and noisy). Per ep it prints:
#   - the median step time (first step of each run skipped; the median over
#     rounds of each run's median) and the best run's median, and the median
#     over rounds of the ratio to ep 1 in the same round;
#   - the all-to-all share of the workers' step time and the all-to-all
#     bytes a rank sent per step. steps.jsonl has no all-to-all field (its
#     comm_ratio sums every comm kind), so the bench scrapes each worker's
#     /metrics while the job runs: baton_comm_seconds_total{kind=
#     "all_to_all"} over baton_step_wall_seconds_total and
#     baton_comm_bytes_total{kind="all_to_all"} per step, between the first
#     scrape after step 1 and the last one, averaged over the 4 workers;
#     against their bound, the exchange at full capacity: per MoE block
#     and microbatch 4 all-to-alls (tokens out and back, their gradients
#     back and out), each sending at most (ep-1)/ep of the rank's E x cap
#     rows of d_model floats (cap = ceil(1.25 x 512 tokens x top_k / E) =
#     160; only the kept rows travel, so the bytes are below the bound by
#     the dropped choices and the routing's skew), plus the all-gathers of
#     the counts;
#   - steps.jsonl's comm_ratio (all kinds: here all-to-all + DP) and the
#     most DP bytes a rank sent per step (max_dp_bytes): with ep the expert
#     gradients are summed over dp/ep ranks only, none at ep = dp;
#   - the expert parameter bytes per rank (formula: layers x experts/ep x
#     2 d_model ffn_dim x 4 bytes) and the drop in max_weights_bytes from
#     ep 1, which should equal the formula's (1 - 1/ep) share.
# Usage: bash bench/ep_bench.sh    (ROUNDS=5 STEPS=8 bash bench/ep_bench.sh)
set -euo pipefail
cd "$(dirname "$0")/.."
rounds=${ROUNDS:-3}
steps=${STEPS:-8}
bazel build -c opt //cli:batonctl //coordinator:baton-coordinator //worker:baton-worker >/dev/null 2>&1
ctl=$(bazel info -c opt bazel-bin 2>/dev/null)/cli/batonctl
tmp=$(mktemp -d /tmp/baton-ep-bench.XXXXXX)
trap 'rm -rf "$tmp"' EXIT
layers=4 d_model=128 experts=8

job() {  # job EP -> job text
  cat <<EOF
name: "ep-bench-ep$1"
model { layers: $layers d_model: $d_model heads: 4 vocab: 256 seq_len: 128
        moe { experts: $experts top_k: 2 capacity_factor: 1.25 aux_loss_coef: 0.01 } }
parallel { dp: 4 ep: $1 }
schedule { kind: "1f1b" microbatches: 2 }
train { steps: $steps micro_batch_size: 4 lr: 0.0003 seed: 1 }
data { synthetic { task: "addition" } }
EOF
}

# run CTL JOB OUT LOG -> one JSON line: batonctl local, with the workers'
# /metrics scraped every 0.2 s while it runs.
run() {
  python3 - "$@" <<'PY'
import json, re, subprocess, sys, time, urllib.request
ctl, job, out, log = sys.argv[1:5]
proc = subprocess.Popen([ctl, "local", f"--job={job}", f"--out={out}", "--workers=4"],
                        stdout=open(log, "w"), stderr=subprocess.STDOUT)
series = re.compile(r'^(baton_step_wall_seconds_total|baton_comm_seconds_total|baton_comm_bytes_total|baton_step)'
                    r'\{([^}]*)\} (\S+)$', re.M)
first, last = {}, {}  # worker -> scrape: {"wall", "a2a_s", "a2a_b", "step"}
while proc.poll() is None:
    for w in range(4):
        try:
            http = json.load(open(f"{out}/worker-{w}.ports"))["http"]
            body = urllib.request.urlopen(f"http://127.0.0.1:{http}/metrics", timeout=1).read().decode()
        except Exception:
            continue
        s = {}
        for name, labels, value in series.findall(body):
            if name == "baton_step_wall_seconds_total": s["wall"] = float(value)
            elif name == "baton_step": s["step"] = float(value)
            elif 'kind="all_to_all"' in labels:
                s["a2a_s" if name == "baton_comm_seconds_total" else "a2a_b"] = float(value)
        if s.get("step", 0) < 1 or "wall" not in s:
            continue
        s.setdefault("a2a_s", 0.0)
        s.setdefault("a2a_b", 0.0)
        first.setdefault(w, s)
        last[w] = s
    time.sleep(0.2)
if proc.returncode != 0:
    sys.exit(f"batonctl local failed ({proc.returncode}): see {log}")
share, per_step = [], []
for w, a in first.items():
    b = last[w]
    if b["step"] > a["step"] and b["wall"] > a["wall"]:
        share.append((b["a2a_s"] - a["a2a_s"]) / (b["wall"] - a["wall"]))
        per_step.append((b["a2a_b"] - a["a2a_b"]) / (b["step"] - a["step"]))
lines = [json.loads(l) for l in open(f"{out}/steps.jsonl") if '"step"' in l][1:]  # the first step warms up
med = lambda v: sorted(v)[len(v) // 2]
print(json.dumps({"step_s": med([s["wall_seconds"] for s in lines]), "comm_ratio": med([s["comm_ratio"] for s in lines]),
                  "dp_bytes": med([s["max_dp_bytes"] for s in lines]), "weights": lines[-1]["max_weights_bytes"],
                  "a2a_share": sum(share) / len(share) if share else None,
                  "a2a_bytes": sum(per_step) / len(per_step) if per_step else None,
                  "scraped_workers": len(share)}))
PY
}

results="$tmp/results.jsonl"
for ((r = 0; r < rounds; r++)); do
  for ep in 1 2 4; do
    name="r${r}-ep${ep}"
    job "$ep" > "$tmp/$name.textproto"
    line=$(run "$ctl" "$tmp/$name.textproto" "$tmp/$name" "$tmp/$name.log") ||
      { echo "ep $ep failed:"; tail -20 "$tmp/$name.log"; exit 1; }
    echo "{\"round\": $r, \"ep\": $ep, ${line#\{}" >> "$results"
    echo "round $r ep $ep: $line" >&2
  done
done

python3 - "$results" "$layers" "$d_model" "$experts" <<'PY'
import json, sys
rows = [json.loads(l) for l in open(sys.argv[1])]
layers, c, experts = map(int, sys.argv[2:5])
ffn = 4 * c  # model.ffn_dim's default
med = lambda v: sorted(v)[len(v) // 2]
mib = lambda b: b / 1048576
base = {r["round"]: r for r in rows if r["ep"] == 1}
print(f"{len(base)} rounds; step s: median over rounds of each run's median (first step skipped)")
cap = -(-5 * 512 * 2 // (4 * experts))  # ceil(1.25 x 512 tokens x top_k / E)
print("ep | step s median  best | x ep1 | a2a share  a2a MiB/step (at capacity) | comm_ratio  DP MiB/step | expert MiB/rank  weights MiB (drop from ep1)")
for ep in sorted({r["ep"] for r in rows}):
    rs = [r for r in rows if r["ep"] == ep]
    steps = [r["step_s"] for r in rs]
    ratio = med([r["step_s"] / base[r["round"]]["step_s"] for r in rs])
    a2a = [r["a2a_share"] for r in rs if r["a2a_share"] is not None]
    a2a_b = [r["a2a_bytes"] for r in rs if r["a2a_bytes"] is not None]
    expert_bytes = layers * experts // ep * 2 * c * ffn * 4
    w = rs[-1]["weights"]
    drop = base[rs[-1]["round"]]["weights"] - w
    full = 4 * layers * 2 * (ep - 1) / ep * experts * cap * c * 4  # 4 exchanges x blocks x microbatches
    print(f"{ep:>2} | {med(steps):13.3f} {min(steps):5.3f} | {ratio:5.2f} | "
          f"{med(a2a) if a2a else float('nan'):9.3f} {mib(med(a2a_b)) if a2a_b else float('nan'):13.2f} ({mib(full):5.2f}) | "
          f"{med([r['comm_ratio'] for r in rs]):10.3f} {mib(med([r['dp_bytes'] for r in rs])):12.2f} | "
          f"{mib(expert_bytes):15.2f} {mib(w):12.2f} ({mib(drop):.2f})")
PY
