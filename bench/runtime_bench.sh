#!/usr/bin/env bash
# Runtime overhead of the real system (coordinator + worker daemons on
# loopback, driven by batonctl local), each number a ratio to a baseline
# measured in the same run:
#   1. synthetic model, p=4, m=16, F=10 ms, B=20 ms (I=W=10 ms), 1f1b:
#      measured step time / simulated makespan (target <= 1.03)
#   2. coordinator round trip per step: a one-worker job whose ops cost 0 ms
#      (RunStep -> GradsReady, then Commit; its StepDone overlaps the next
#      step, docs/protocol.md; bench/step_latency.sh compares two builds)
#   3. real GPT (layers=4 d_model=256 heads=8 vocab=256 seq_len=128,
#      micro_batch=8, m=8, one BLAS thread per worker): tokens/s at PP=2
#      against one worker (ideal 2m/(m+1) = 1.78), and at PP=4 (ideal 1F1B
#      speed-up pm/(m+p-1) = 2.91, but this machine has 2 cores, so at most
#      2 of the 4 stages compute at once: the reachable ideal is 2.0)
#   4. synthetic model on the deepest pipeline this machine holds (DEEP_PP,
#      default 16 worker processes), m = 2p, F = I = W = 5 ms: step time /
#      simulated makespan (m + p - 1) * (F + I + W)
# Usage: bash bench/runtime_bench.sh     (DEEP_PP=32 bash bench/runtime_bench.sh)
set -euo pipefail
cd "$(dirname "$0")/.."
# Release binaries (-c opt, as scripts/package.sh builds them), as
# bench/pipeline_side_by_side.sh runs; before 2026-12-02 this ran the test
# build (fastbuild).
bazel build -c opt //cli:batonctl //coordinator:baton-coordinator //worker:baton-worker >/dev/null 2>&1
ctl=$(bazel info -c opt bazel-bin 2>/dev/null)/cli/batonctl
tmp=$(mktemp -d /tmp/baton-bench.XXXXXX)
trap 'rm -rf "$tmp"' EXIT

run() {  # run NAME JOB_TEXT -> prints summary fields
  printf '%s\n' "$2" > "$tmp/$1.textproto"
  # On failure the log goes to stderr: stdout is captured by $(run ...).
  "$ctl" local --job="$tmp/$1.textproto" --out="$tmp/$1" > "$tmp/$1.log" 2>&1 || { echo "$1 failed:" >&2; tail -n 30 "$tmp/$1.log" >&2; exit 1; }
  python3 - "$tmp/$1/summary.json" "$tmp/$1/steps.jsonl" <<'PY'
import json, sys
s = json.load(open(sys.argv[1]))
steps = [json.loads(l) for l in open(sys.argv[2])]
walls = sorted(x["wall_seconds"] for x in steps[1:])  # skip the first (warm-up) step
print(json.dumps({"median_step_s": walls[len(walls) // 2], "tokens_per_second": s["tokens_per_second"],
                  "bubble_ratio": s["bubble_ratio"], "expected_bubble_ratio": s["expected_bubble_ratio"]}))
PY
}

syn=$(run synthetic 'name: "overhead"
model { layers: 4 synthetic { forward_ms: 10 backward_input_ms: 10 backward_weight_ms: 10 activation_bytes: 65536 } }
parallel { pp: 4 }
schedule { kind: "1f1b" microbatches: 16 }
train { steps: 6 micro_batch_size: 1 lr: 0.001 }')
rtt=$(run roundtrip 'name: "roundtrip"
model { layers: 1 synthetic { forward_ms: 0 backward_input_ms: 0 backward_weight_ms: 0 activation_bytes: 4 } }
schedule { kind: "1f1b" microbatches: 1 }
train { steps: 101 micro_batch_size: 1 lr: 0.001 }')
gpt='model { layers: 4 d_model: 256 heads: 8 vocab: 256 seq_len: 128 }
schedule { kind: "1f1b" microbatches: 8 }
train { steps: 6 micro_batch_size: 8 lr: 0.0003 seed: 1 }
data { synthetic { task: "addition" } }'
one=$(run gpt1 "name: \"gpt-pp1\"
$gpt")
two=$(run gpt2 "name: \"gpt-pp2\"
parallel { pp: 2 }
$gpt")

four=$(run gpt4 "name: \"gpt-pp4\"
parallel { pp: 4 }
$gpt")
deep_pp=${DEEP_PP:-16}
deep=$(run deep "name: \"deep\"
model { layers: $deep_pp synthetic { forward_ms: 5 backward_input_ms: 5 backward_weight_ms: 5 activation_bytes: 65536 } }
parallel { pp: $deep_pp }
schedule { kind: \"1f1b\" microbatches: $((2 * deep_pp)) }
train { steps: 6 micro_batch_size: 1 lr: 0.001 }")

python3 - "$syn" "$rtt" "$one" "$two" "$four" "$deep" "$deep_pp" <<'PY'
import json, sys
syn, rtt, one, two, four, deep = (json.loads(a) for a in sys.argv[1:7])
p = int(sys.argv[7])
makespan = (16 + 4 - 1) * (0.010 + 0.020)
print(f"synthetic p=4 m=16 F=10ms B=20ms: step {syn['median_step_s']*1e3:.1f} ms, simulated makespan {makespan*1e3:.1f} ms,"
      f" ratio {syn['median_step_s']/makespan:.3f}; bubble {syn['bubble_ratio']:.3f} (simulator {syn['expected_bubble_ratio']:.3f})")
print(f"coordinator round trip per step (0 ms ops, 1 worker): {rtt['median_step_s']*1e3:.2f} ms")
print(f"GPT tokens/s: 1 worker {one['tokens_per_second']:.0f}, PP=2 {two['tokens_per_second']:.0f},"
      f" ratio {two['tokens_per_second']/one['tokens_per_second']:.2f} (ideal {2*8/9:.2f})")
print(f"GPT tokens/s: PP=4 {four['tokens_per_second']:.0f}, ratio {four['tokens_per_second']/one['tokens_per_second']:.2f}"
      f" (ideal 1F1B {4*8/11:.2f}; 2 cores: at most 2.00)")
deep_makespan = (2 * p + p - 1) * 0.015
print(f"deep synthetic p={p} m={2*p} F=I=W=5ms: step {deep['median_step_s']*1e3:.1f} ms, simulated makespan"
      f" {deep_makespan*1e3:.1f} ms, ratio {deep['median_step_s']/deep_makespan:.3f}; bubble {deep['bubble_ratio']:.3f}"
      f" (simulator {deep['expected_bubble_ratio']:.3f})")
PY
