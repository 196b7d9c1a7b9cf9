#!/usr/bin/env bash
# chaos_bench: seeded random fault schedules against real daemons on loopback.
#
#   bash bench/chaos_bench.sh [RUNS=100] [SEED=1] [STEPS=120]
#
# Run r draws its schedule from random.Random("SEED-r"): a layout from
#   PP=3 1F1B, PP=2xTP=2 1F1B, PP=2xTP=2xDP=2 1F1B, PP=3xTP=2 interleaved v=2,
#   PP=2xTP=2xDP=2 interleaved v=3, the same under ZeRO-1 (zero_stage 1)
#   (6 layers, 6 microbatches)
# and one fault: kind (SIGKILL 70%, SIGSTOP past the lease 30%, half of those
# thawed with SIGCONT 4-6 s later), a random rank (stage, tp, dp), a step N in
# [5, STEPS*2/3] and an offset of 0-40 ms after `batonctl local` saw step N
# commit (a point inside a later step: forward, backward, optimizer,
# all-reduce or a snapshot transfer), all through
#   batonctl local --spares=1 --inject=KIND:stage=P,tp=T,dp=D@step=N,after_ms=M[,for=S]
# Each run must: finish (a run past 300 s is a hang), record every step
# exactly once in steps.jsonl (a missing step is a committed step lost), and
# end with final weights bitwise equal to the fault-free run of its layout
# (`batonctl checkpoint diff`, measured first, in the same invocation).
#
# Reported over all runs:
#   detection: injection instant (batonctl's "injecting ... at T" line) to the
#     coordinator logging the worker lost ("... was lost: ..."), per kind;
#     targets: a killed worker <= 1 s, a frozen one <= the lease (3 s);
#   recovery: fault detected -> first step completed after the recovery
#     (steps.jsonl "recovered" seconds, = baton_recovery_seconds);
#   loss to next step: injection -> that first completed step;
#   steps replayed, committed steps lost (must be 0), hangs (must be 0),
#   where the survivors were when the fault hit (the op their step failed in,
#   from their logs: which phases the random offsets reached), and each
#   failure with the command that reproduces it. Every recorded per-step loss
#   must also equal the fault-free run's.
# Every number is wall time on this machine: on a shared machine other
# processes' load shows up in them.
set -u
runs=${1:-100}
seed=${2:-1}
steps=${3:-120}
root=$(cd "$(dirname "$0")/.." && pwd)
cd "$root" || exit 1
bazel build //cli:batonctl //coordinator:baton-coordinator //worker:baton-worker >/dev/null 2>&1 ||
  { echo "build failed"; exit 1; }
bin=$root/bazel-bin
work=$(mktemp -d /tmp/chaos_bench.XXXXXX)
echo "chaos_bench: $runs runs, seed $seed, $steps steps per run; work dir $work"

python3 - "$bin" "$work" "$runs" "$seed" "$steps" <<'PY'
import datetime, json, os, random, re, shutil, statistics, subprocess, sys, time

bin_dir, work, runs, seed, steps = sys.argv[1], sys.argv[2], int(sys.argv[3]), sys.argv[4], int(sys.argv[5])
batonctl = os.path.join(bin_dir, "cli/batonctl")
LEASE_S = 3.0  # baton-coordinator's default --lease_ms
RUN_LIMIT_S = 300

# name, pp, tp, dp, virtual_stages, schedule, microbatches[, zero_stage]
LAYOUTS = [
    ("pp3_1f1b", 3, 1, 1, 1, "1f1b", 4),
    ("pp2tp2_1f1b", 2, 2, 1, 1, "1f1b", 4),
    ("pp2tp2dp2_1f1b", 2, 2, 2, 1, "1f1b", 4),
    ("pp3tp2_interleaved", 3, 2, 1, 2, "interleaved", 6),
    ("pp2tp2dp2_interleaved", 2, 2, 2, 3, "interleaved", 6),
    ("pp2tp2dp2_interleaved_zero1", 2, 2, 2, 3, "interleaved", 6, 1),
]

def job_text(l):
    name, pp, tp, dp, v, kind, mb = l[:7]
    zero = l[7] if len(l) > 7 else 0
    return f'''name: "chaos"
model {{ layers: 6 d_model: 32 heads: 4 vocab: 16 seq_len: 20 }}
parallel {{ pp: {pp} tp: {tp} dp: {dp} virtual_stages: {v} zero_stage: {zero} }}
schedule {{ kind: "{kind}" microbatches: {mb} }}
train {{ steps: {steps} micro_batch_size: 2 lr: 0.003 weight_decay: 0.01 grad_clip: 1.0 seed: 5 }}
data {{ synthetic {{ task: "addition" }} }}
'''

def local(job, out, extra, limit):
    cmd = [batonctl, "local", f"--job={job}", f"--out={out}", f"--bin_dir={bin_dir}", f"--timeout_s={limit}"] + extra
    start = time.time()
    try:
        p = subprocess.run(cmd, capture_output=True, text=True, timeout=limit + 60)
        return p.returncode, p.stdout + p.stderr, time.time() - start, cmd
    except subprocess.TimeoutExpired as e:
        return None, (e.stdout or b"").decode(errors="replace") if isinstance(e.stdout, bytes) else (e.stdout or ""), time.time() - start, cmd

def log_time(text):  # 2026-11-30T19:12:04.540Z
    return datetime.datetime.strptime(text, "%Y-%m-%dT%H:%M:%S.%fZ").replace(tzinfo=datetime.timezone.utc).timestamp()

def steps_lines(out):
    lines = []
    try:
        with open(os.path.join(out, "steps.jsonl")) as f:
            for line in f:
                try:
                    lines.append(json.loads(line))
                except ValueError:
                    pass
    except OSError:
        pass
    return lines

refs = {}
for l in LAYOUTS:
    job = os.path.join(work, f"{l[0]}.textproto")
    with open(job, "w") as f:
        f.write(job_text(l))
    out = os.path.join(work, f"ref_{l[0]}")
    code, log, wall, _ = local(job, out, [], RUN_LIMIT_S)
    if code != 0:
        print(f"reference {l[0]} failed:\n{log}")
        sys.exit(1)
    refs[l[0]] = (job, out)
    print(f"reference {l[0]}: {wall:.1f} s wall for {steps} steps (incl. start-up), "
          f"{1000 * wall / steps:.1f} ms/step")

results, failures = [], []
for r in range(runs):
    rng = random.Random(f"{seed}-{r}")
    l = rng.choice(LAYOUTS)
    name, pp, tp, dp = l[0], l[1], l[2], l[3]
    kind = "kill" if rng.random() < 0.7 else "stop"
    stage, t, d = rng.randrange(pp), rng.randrange(tp), rng.randrange(dp)
    at = rng.randint(5, steps * 2 // 3)
    after_ms = rng.randint(0, 40)
    thaw = kind == "stop" and rng.random() < 0.5
    inject = f"{kind}:stage={stage},tp={t},dp={d}@step={at},after_ms={after_ms}"
    if thaw:
        inject += f",for={rng.uniform(4, 6):.1f}"
    job, ref = refs[name]
    out = os.path.join(work, f"run{r}")
    code, log, wall, cmd = local(job, out, ["--spares=1", f"--inject={inject}"], RUN_LIMIT_S)
    res = {"run": r, "layout": name, "kind": kind + ("+thaw" if thaw else ""), "inject": inject, "wall": wall}
    problems = []
    hung = code is None or "no result within --timeout_s" in log
    if hung:
        problems.append("hang (no result in time)")
    elif code != 0:
        problems.append(f"exit {code}")
    lines = steps_lines(out)
    seen = {}
    for x in lines:
        if "step" in x and x.get("committed"):
            seen[x["step"]] = seen.get(x["step"], 0) + 1
    res["lost"] = sum(1 for s in range(1, steps + 1) if s not in seen) if not hung and code == 0 else 0
    res["duplicated"] = sum(1 for c in seen.values() if c > 1)
    if res["lost"]:
        problems.append(f"{res['lost']} committed steps missing from steps.jsonl")
    if res["duplicated"]:
        problems.append(f"{res['duplicated']} steps recorded twice")
    # Bitwise per step: every recorded loss equals the fault-free run's.
    ref_loss = {x["step"]: x.get("loss") for x in steps_lines(ref) if "step" in x}
    differ = [x["step"] for x in lines if "step" in x and x.get("committed") and x.get("loss") != ref_loss.get(x["step"])]
    if differ:
        problems.append(f"losses of steps {differ[:5]} differ from the fault-free run")
    # Where the survivors were when the fault hit: the op their step failed
    # in (F/B/W compute with a TP all-reduce, SEND/RECV pipeline transfers,
    # the DP gradient all-reduce), or "between steps" (commit, snapshot,
    # checkpoint, waiting for the next RunStep) when none failed.
    res["phase"] = "between steps"
    vm = re.search(r"injecting \S+ into (\S+) ", log)
    for logname in sorted(os.listdir(os.path.join(out, "logs"))) if os.path.isdir(os.path.join(out, "logs")) else []:
        if not logname.startswith("worker-") or (vm and logname == vm.group(1) + ".log"):
            continue
        try:
            with open(os.path.join(out, "logs", logname)) as f:
                text = f.read()
        except OSError:
            continue
        fm = re.search(r"step \d+ failed: [A-Z_]+: (\S+?)\(([^)]*)\)(?:: (\w+))?([^\n]*)", text)
        if fm:
            op = fm.group(1)
            kind = "all-reduce" if ("all-reduce" in fm.group(4) or "AllReduce" in fm.group(4)) else ""
            res["phase"] = (op + (" " + kind if kind else "")).strip()
            break
    recs = [x for x in lines if "recovery" in x]
    res["recoveries"] = len(recs)
    res["replayed"] = sum(x.get("replayed_steps", 0) for x in recs)
    recovered = [x["seconds"] for x in lines if "recovered" in x]
    res["recovery_s"] = recovered[0] if recovered else None
    if code == 0 and not recs:
        problems.append("no recovery recorded")
    m = re.search(r"injecting \S+ into (\S+) .* at (\S+Z)", log)
    if m:
        injected = log_time(m.group(2))
        victim = m.group(1)
        detected = None
        try:
            with open(os.path.join(out, "logs/coordinator.log")) as f:
                for line in f:
                    if f"(worker {victim}) was lost:" in line:
                        t = log_time(line.split(" ", 1)[0])
                        if t >= injected - 0.002:
                            detected = t
                            break
        except OSError:
            pass
        if detected is not None:
            res["detection_s"] = max(0.0, detected - injected)
            if res["recovery_s"] is not None:
                res["loss_to_step_s"] = res["detection_s"] + res["recovery_s"]
    elif code == 0:
        problems.append("no injection happened")
    if code == 0:
        diff = subprocess.run([batonctl, "checkpoint", "diff", os.path.join(ref, "final"), os.path.join(out, "final"),
                               "--json"], capture_output=True, text=True)
        try:
            ok = diff.returncode == 0 and json.loads(diff.stdout)["max_abs_diff"] == 0
        except (ValueError, KeyError):
            ok = False
        if not ok:
            problems.append("final weights differ from the fault-free run: " + (diff.stdout + diff.stderr)[-300:])
    res["problems"] = problems
    res["hung"] = hung
    results.append(res)
    status = "ok" if not problems else "FAILED: " + "; ".join(problems)
    print(f"run {r:3d} {name:22s} {res['kind']:9s} {inject:52s} detect "
          f"{res.get('detection_s', float('nan')):6.3f} s  recovery {res['recovery_s'] or float('nan'):6.3f} s  "
          f"replayed {res['replayed']:3d}  {status}", flush=True)
    if problems:
        failures.append((r, f"seed {seed} run {r}: " + "; ".join(problems) + "\n    reproduce: " + " ".join(cmd) +
                         f"\n    log: {out}.log"))
        with open(out + ".log", "w") as f:
            f.write(log)
    else:
        shutil.rmtree(out, ignore_errors=True)

def dist(xs):
    xs = sorted(xs)
    if not xs:
        return "n/a"
    p95 = xs[min(len(xs) - 1, int(round(0.95 * (len(xs) - 1))))]
    return f"median {statistics.median(xs):.3f}  p95 {p95:.3f}  max {xs[-1]:.3f}  (n={len(xs)})"

print()
print(f"runs {len(results)}, failures {len(failures)}, hangs {sum(r['hung'] for r in results)}, "
      f"committed steps lost {sum(r['lost'] for r in results)}, recoveries {sum(r['recoveries'] for r in results)}")
for k in ("kill", "stop", "stop+thaw"):
    sub = [r for r in results if r["kind"] == k]
    print(f"{k:9s} runs {len(sub)}")
    print(f"  detection s        {dist([r['detection_s'] for r in sub if 'detection_s' in r])}")
    print(f"  recovery s         {dist([r['recovery_s'] for r in sub if r['recovery_s'] is not None])}")
    print(f"  loss to next step  {dist([r['loss_to_step_s'] for r in sub if 'loss_to_step_s' in r])}")
kills = [r["detection_s"] for r in results if r["kind"] == "kill" and "detection_s" in r]
stops = [r["detection_s"] for r in results if r["kind"] != "kill" and "detection_s" in r]
print(f"targets: killed detected <= 1 s in {sum(x <= 1 for x in kills)}/{len(kills)}; "
      f"frozen detected <= lease {LEASE_S:.0f} s (+0.2 s sweep) in {sum(x <= LEASE_S + 0.2 for x in stops)}/{len(stops)}; "
      f"loss to next step <= 5 s (kills) in "
      f"{sum(r['loss_to_step_s'] <= 5 for r in results if r['kind'] == 'kill' and 'loss_to_step_s' in r)}/"
      f"{sum(1 for r in results if r['kind'] == 'kill' and 'loss_to_step_s' in r)}")
phases = {}
for r in results:
    phases[r.get("phase", "?")] = phases.get(r.get("phase", "?"), 0) + 1
print("where the survivors were when the fault hit (first failed op in their logs): " +
      ", ".join(f"{k} {v}" for k, v in sorted(phases.items(), key=lambda kv: -kv[1])))
replayed = [r["replayed"] for r in results]
print(f"steps replayed: total {sum(replayed)}, max per run {max(replayed) if replayed else 0}")
for _, f in failures:
    print("FAILURE " + f)
with open(os.path.join(work, "results.jsonl"), "w") as f:
    for r in results:
        f.write(json.dumps(r) + "\n")
sys.exit(1 if failures else 0)
PY
status=$?
echo "work dir: $work (results.jsonl; logs of failed runs)"
exit $status
