#!/usr/bin/env bash
# baton's runtime beside PyTorch's torch.distributed.pipelining, same run,
# same synthetic cost model (docs/BENCHMARKS.md, "Side by side with PyTorch's
# pipelining"):
#   p = 4, m = 16, activation 65536 bytes, F = I = W = 10 ms per stage
#   (interleaved v = 2: 8 chunks, F = I = W = 5 ms per chunk);
#   schedules gpipe, 1f1b, interleaved (v=2), zb-h1 (PyTorch:
#   ScheduleGPipe, Schedule1F1B, ScheduleInterleaved1F1B,
#   ScheduleInterleavedZeroBubble with one stage per rank = ZB1P/ZB-H1).
# Per schedule and round, interleaved: baton (`batonctl local`, 8 steps, the
# first dropped), then PyTorch (bench/pipeline_torch_bench.py, 4 Gloo
# processes on loopback, 2 warm-up + 7 timed steps); the ideal makespan comes
# from baton's simulator (`batonctl schedule simulate`). Prints one table and
# one JSON object (the last line).
#
# PyTorch lives in a private venv, $TORCH_VENV (default
# ~/.cache/baton/torch2-venv). If it has no torch, the script creates it and
# pip-installs torch from PyPI: the CUDA build, SEVERAL GB of download. Never
# run this in CI.
#
# Usage: bash bench/pipeline_side_by_side.sh
#   RUNS=3 (rounds, default 2)   SCHEDULES="1f1b zb-h1" (subset)
#   BATON_ONLY=1 (baton's side alone, no PyTorch and no venv: step / ideal
#   and bubble; the PyTorch columns print as -)
#   KEEP=/some/dir (keep baton's --out directories: steps.jsonl, summary.json,
#   trace.json, per round and schedule; PyTorch's compute order as CSV; and
#   results.jsonl, one line per round and schedule)
set -euo pipefail
cd "$(dirname "$0")/.."
venv=${TORCH_VENV:-$HOME/.cache/baton/torch2-venv}
runs=${RUNS:-2}
schedules=${SCHEDULES:-gpipe 1f1b interleaved zb-h1}
[[ "$runs" =~ ^[1-9][0-9]*$ ]] || { echo "RUNS=$runs: want a positive integer" >&2; exit 2; }
for s in $schedules; do
  case $s in gpipe|1f1b|interleaved|zb-h1) ;; *) echo "SCHEDULES: unknown schedule $s (gpipe 1f1b interleaved zb-h1)" >&2; exit 2;; esac
done

baton_only=${BATON_ONLY:-0}
# torch's pipelining sends its shape metadata with recv_object_list, which
# needs numpy (torch 2.15 does not install it): without it every stage dies.
if [[ "$baton_only" != 1 ]] && ! "$venv/bin/python" -c 'import numpy, torch.distributed.pipelining' >/dev/null 2>&1; then
  echo "no torch or numpy in $venv: creating it and installing torch and numpy from PyPI (several GB download)" >&2
  python3 -m venv "$venv"
  "$venv/bin/pip" install --quiet 'torch>=2.6' numpy
fi
torch_py="$venv/bin/python"

# Release binaries (-c opt, as scripts/package.sh builds them: NDEBUG, so
# without Abseil's debug lock-order checks), not the test build.
bazel build -c opt //cli:batonctl //coordinator:baton-coordinator //worker:baton-worker >/dev/null 2>&1
ctl=$(bazel info -c opt bazel-bin 2>/dev/null)/cli/batonctl
tmp=$(mktemp -d /tmp/baton-side.XXXXXX)
trap 'rm -rf "$tmp"' EXIT
p=4 m=16 act=65536

for run in $(seq 1 "$runs"); do
  for s in $schedules; do
    v=1 ms=10
    if [[ $s == interleaved ]]; then v=2 ms=5; fi
    name="$s-run$run"
    load_before=$(cut -d' ' -f1-3 /proc/loadavg)
    # (c) ideal makespan: the simulator takes per-stage costs and divides them by v.
    ideal=$("$ctl" schedule simulate --schedule="$s" --pp=$p --microbatches=$m --virtual=$v \
      --forward=10 --backward_input=10 --backward_weight=10 --format=json)
    # (a) baton
    cat > "$tmp/$name.textproto" <<EOF
name: "side-$name"
model { layers: $((p * v)) synthetic { forward_ms: $ms backward_input_ms: $ms backward_weight_ms: $ms activation_bytes: $act } }
parallel { pp: $p virtual_stages: $v }
schedule { kind: "$s" microbatches: $m }
train { steps: 8 micro_batch_size: 1 lr: 0.001 }
EOF
    "$ctl" local --job="$tmp/$name.textproto" --out="$tmp/$name" > "$tmp/$name.log" 2>&1 ||
      { cat "$tmp/$name.log" >&2; exit 1; }
    # (b) PyTorch
    echo '{}' > "$tmp/$name.torch.json"
    if [[ "$baton_only" != 1 ]]; then
      # Bounded: a stage that dies can leave the others waiting on Gloo.
      CUDA_VISIBLE_DEVICES="" OMP_NUM_THREADS=1 timeout 600 "$torch_py" bench/pipeline_torch_bench.py --schedule="$s" \
        --pp=$p --virtual=$v --microbatches=$m --forward_ms=$ms --backward_input_ms=$ms \
        --backward_weight_ms=$ms --activation_bytes=$act --warmup=2 --steps=7 \
        --dump_order="$tmp/$name.torch.csv" > "$tmp/$name.torch.json"
    fi
    # the makespan of the order PyTorch ran (interleaved, zb-h1), on baton's simulator, same costs
    torch_ideal='{"makespan": null}'
    if [[ -s "$tmp/$name.torch.csv" ]]; then
      torch_ideal=$("$ctl" schedule simulate --file="$tmp/$name.torch.csv" \
        --forward=10 --backward_input=10 --backward_weight=10 --format=json)
    fi
    load_after=$(cut -d' ' -f1-3 /proc/loadavg)
    python3 - "$s" "$run" "$ideal" "$tmp/$name" "$tmp/$name.torch.json" "$load_before" "$load_after" "$torch_ideal" \
      >> "$tmp/results.jsonl" <<'PY'
import json, statistics, sys
s, run, ideal, out, torch_json, load0, load1, torch_ideal = sys.argv[1:9]
ideal_s = json.loads(ideal)["makespan"] / 1e3  # cost units are ms
steps = [json.loads(l) for l in open(out + "/steps.jsonl")][1:]  # drop the first (warm-up) step
summary = json.load(open(out + "/summary.json"))
t = json.load(open(torch_json))
baton_step = statistics.median(x["wall_seconds"] for x in steps)
print(json.dumps({
    "schedule": s, "run": int(run), "load_before": load0, "load_after": load1,
    "ideal_s": ideal_s, "simulated_bubble": json.loads(ideal)["bubble_ratio"],
    "baton_step_s": baton_step, "baton_ratio": baton_step / ideal_s,
    # baton's own bubble (worker wall - compute - p2p transfer) and the idle
    # share comparable with PyTorch's (1 - compute / wall: transfers count as idle)
    "baton_bubble": statistics.median(x["bubble_ratio"] for x in steps),
    "baton_idle": statistics.median(x["bubble_ratio"] + x["comm_ratio"] for x in steps),
    "baton_steps_s": [x["wall_seconds"] for x in steps],
    "baton_summary_bubble": summary["bubble_ratio"],  # summary.json: all steps, the first included
    # (null with BATON_ONLY=1)
    "torch_step_s": t.get("median_step_s"),
    "torch_ratio": t["median_step_s"] / ideal_s if t else None,
    "torch_idle": t.get("bubble_ratio"), "torch_steps_s": t.get("steps_s"),
    "torch_op_seconds_per_rank": t.get("op_seconds_per_rank"),
    "torch_class": t.get("torch_class"), "torch": t.get("torch"),
    # PyTorch's own compute order simulated with the same costs: how much of
    # its step is the order it chose rather than its runtime
    # (null for gpipe and 1f1b: PyTorch runs the same shapes as baton there)
    "torch_order_ideal_s": None if json.loads(torch_ideal)["makespan"] is None else json.loads(torch_ideal)["makespan"] / 1e3,
}))
PY
    if [[ -n "${KEEP:-}" ]]; then
      mkdir -p "$KEEP" && cp -r "$tmp/$name" "$KEEP/" && { [[ ! -s "$tmp/$name.torch.csv" ]] || cp "$tmp/$name.torch.csv" "$KEEP/"; } && cp "$tmp/results.jsonl" "$KEEP/"
    fi
  done
done

python3 - "$tmp/results.jsonl" <<'PY'
import json, sys
rows = [json.loads(l) for l in open(sys.argv[1])]
torch = rows[0]["torch_step_s"] is not None
for r in rows:
    missed = ([f"/ideal {r['baton_ratio']:.3f} > 1.03"] if r["baton_ratio"] > 1.03 else []) + \
             (["slower than PyTorch"] if torch and r["baton_step_s"] >= r["torch_step_s"] else [])
    r["target"] = ("met" if not missed else "missed: " + ", ".join(missed)) + ("" if torch else " (baton only)")
def f(x, fmt="6.3f"):
    return "-".rjust(6) if x is None else format(x, fmt)
print(f"PyTorch {rows[0]['torch'] if torch else 'not run (BATON_ONLY=1)'}; p=4 m=16 activation 65536 B; step times in ms; idle = 1 - compute/step, mean over ranks")
print("median = median step, best = fastest step (/ideal), bubble = baton's own (transfers excluded),"
      " own = the makespan of PyTorch's own compute order on baton's simulator")
print(f"{'schedule':12} {'run':>3} {'load (1/5/15 min)':>18} {'ideal':>6} | {'baton':>6} {'/ideal':>6} {'best':>6} {'bubble':>6} {'idle':>6}"
      f" | {'torch':>6} {'/ideal':>6} {'best':>6} {'idle':>6} {'own':>6} | {'baton/torch':>11}  target (<= 1.03, < torch)")
for r in rows:
    print(f"{r['schedule']:12} {r['run']:>3} {r['load_before']:>18} {r['ideal_s']*1e3:6.1f} | {r['baton_step_s']*1e3:6.1f}"
          f" {r['baton_ratio']:6.3f} {min(r['baton_steps_s'])/r['ideal_s']:6.3f} {r['baton_bubble']:6.3f} {r['baton_idle']:6.3f}"
          f" | {f(r['torch_step_s'] and r['torch_step_s']*1e3, '6.1f')} {f(r['torch_ratio'])}"
          f" {f(r['torch_steps_s'] and min(r['torch_steps_s'])/r['ideal_s'])} {f(r['torch_idle'])}"
          f" {'-' if r['torch_order_ideal_s'] is None else format(r['torch_order_ideal_s']*1e3, '6.1f'):>6}"
          f" | {f(r['torch_step_s'] and r['baton_step_s']/r['torch_step_s'], '11.3f'):>11}  {r['target']}")
print(json.dumps({"results": rows}))
PY
