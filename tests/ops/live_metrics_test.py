#!/usr/bin/env python3
"""Live metrics test: a real Prometheus (Debian's package) with the shipped
scrape configuration (deploy/prometheus/prometheus.yml: only the targets and
the intervals are replaced, 1 s scrape and evaluation) and the shipped rules,
scraping a real coordinator and five real workers on loopback (four in the
plan, one spare) that run a synthetic job (PP=2 x DP=2, 1F1B), and a second
coordinator with one worker training a tiny Mixture-of-Experts GPT
("live_moe", capacity 0.5: it drops choices), so the MoE panels and rules
have data: their single-value check binds that job (a dense job exports no
MoE series, which is checked too).

While the job runs, then as faults are forced (a stage frozen; a worker
killed, which the spare replaces; a second worker killed with no spare left,
so the job recovers, then fails; the coordinator stopped; the coordinator gone
from the targets), it
queries through the HTTP API:
  - every recording rule,
  - every alert expression: the alerts whose condition the test forces must
    return data and show up as pending/firing in /api/v1/alerts; for the
    others every series selector they use must return data,
  - every target of every panel of every dashboard in deploy/grafana, with
    the dashboard's variables resolved and substituted as Grafana does (the
    All option, and a single value),
and fails if any query errors or never returns data. It also checks that
`batonctl status --json` carries every field the text output shows, and the
MoE job's MOE DROP column.
"""
import glob
import json
import os
import signal
import subprocess
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import opslib  # noqa: E402
import yaml  # noqa: E402

JOB = """
name: "live"
model { layers: 4 synthetic { forward_ms: 4 backward_input_ms: 4 backward_weight_ms: 4 activation_bytes: 256 } }
parallel { pp: 2 dp: 2 }
schedule { kind: "1f1b" microbatches: 4 }
train { steps: 100000 micro_batch_size: 1 lr: 0.001 }
fault_tolerance { max_restarts: 5 replacement_timeout_s: 4 }
"""
WORKERS = 5

# Mixture of Experts on the CPU: 2 MoE blocks of 4 experts, top-2, capacity
# 0.5 (half the choices an even split would give each expert: some dropped).
MOE_JOB = """
name: "live_moe"
model { layers: 2 d_model: 16 heads: 2 vocab: 16 seq_len: 16
        moe { experts: 4 top_k: 2 capacity_factor: 0.5 aux_loss_coef: 0.01 } }
schedule { kind: "1f1b" microbatches: 2 }
train { steps: 100000000 micro_batch_size: 2 lr: 0.001 }
data { synthetic { task: "addition" } }
"""
# Panels of MoE metrics: for a single training_job value they show the MoE job.
MOE_PANEL_PREFIX = "MoE "

# Alerts whose condition this test forces, and the phase that forces it.
FORCED = {
    "BatonBubbleAboveExpected": "frozen",
    "BatonWorkerLost": "killed",
    "BatonWorkerDown": "killed",
    "BatonJobRecovered": "killed",
    "BatonJobRecoveringTooLong": "no_spare",
    "BatonJobFailed": "failed",
    "BatonCoordinatorDown": "coordinator_stopped",
    "BatonWorkerDisconnected": "coordinator_stopped",
    "BatonCoordinatorAbsent": "coordinator_gone",
}

failures = []


def fail(msg):
    print("FAIL:", msg, flush=True)
    failures.append(msg)


def main():
    work = opslib.tmpdir("live_metrics")
    rules_path = opslib.runfile("deploy/prometheus/baton.rules.yml")
    rules = opslib.load_rules(rules_path)
    dashboards = {}
    for path in sorted(glob.glob(opslib.runfile("deploy/grafana/*.json"))):
        with open(path) as f:
            dashboards[os.path.basename(path)] = json.load(f)
    if not dashboards:
        fail("no dashboards found in deploy/grafana")

    job_file = os.path.join(work, "job.textproto")
    with open(job_file, "w") as f:
        f.write(JOB)
    coordinator = opslib.Daemon("coordinator", [
        opslib.runfile("coordinator/baton-coordinator"), "--listen=127.0.0.1:0", "--http_listen=127.0.0.1:0",
        "--job=" + job_file, "--lease_ms=8000", "--heartbeat_ms=250", "--ready_timeout_s=60"], work).start()
    workers = [opslib.Daemon(f"worker-{i}", [
        opslib.runfile("worker/baton-worker"), f"--coordinator=127.0.0.1:{coordinator.grpc_port}",
        f"--name=worker-{i}", "--listen=127.0.0.1:0", "--http_listen=127.0.0.1:0"], work).start(wait=False)
        for i in range(WORKERS)]
    for w in workers:
        w.wait_ports()
    moe_job_file = os.path.join(work, "moe_job.textproto")
    with open(moe_job_file, "w") as f:
        f.write(MOE_JOB)
    moe_coordinator = opslib.Daemon("moe-coordinator", [
        opslib.runfile("coordinator/baton-coordinator"), "--listen=127.0.0.1:0", "--http_listen=127.0.0.1:0",
        "--job=" + moe_job_file, "--lease_ms=8000", "--heartbeat_ms=250", "--ready_timeout_s=60"], work).start()
    moe_worker = opslib.Daemon("moe-worker", [
        opslib.runfile("worker/baton-worker"), f"--coordinator=127.0.0.1:{moe_coordinator.grpc_port}",
        "--name=moe-worker", "--listen=127.0.0.1:0", "--http_listen=127.0.0.1:0"], work).start()

    # The shipped configuration, with our targets and a 1 s scrape.
    with open(opslib.runfile("deploy/prometheus/prometheus.yml")) as f:
        shipped = yaml.safe_load(f)

    def config(with_coordinator=True):
        c = json.loads(json.dumps(shipped))
        c["global"]["scrape_interval"] = "1s"
        c["global"]["evaluation_interval"] = "1s"
        c["rule_files"] = [rules_path]
        for sc in c["scrape_configs"]:
            for st in sc["static_configs"]:
                component = st["labels"]["baton_component"]
                if component == "coordinator":
                    st["targets"] = ([f"127.0.0.1:{c.http_port}" for c in (coordinator, moe_coordinator)]
                                     if with_coordinator else [])
                elif component == "worker":
                    st["targets"] = [f"127.0.0.1:{w.http_port}" for w in workers + [moe_worker]]
                else:
                    fail(f"prometheus.yml: unknown baton_component {component!r}")
        return c

    prom = opslib.Prometheus(work, config())
    grafana = opslib.Grafana(prom, scrape_interval_s=1)
    everything = [coordinator] + workers + [moe_coordinator, moe_worker]
    try:
        run(prom, grafana, rules, dashboards, coordinator, workers, config, moe_coordinator)
    except Exception as e:  # noqa: BLE001 - report with the daemons' logs
        fail(f"{type(e).__name__}: {e}")
    finally:
        if failures:
            for d in everything:
                print(f"--- {d.name} log\n{d.log()}")
            print(f"--- prometheus log\n{prom.log()}")
        for d in everything:
            d.stop()
        prom.stop()
    print(f"live metrics: {len(failures)} failure(s)")
    return 1 if failures else 0


def poll(what, fn, timeout):
    deadline = time.time() + timeout
    while True:
        value = fn()
        if value:
            return value
        if time.time() > deadline:
            fail(f"{what}: not seen within {timeout}s")
            return None
        time.sleep(0.5)


def run(prom, grafana, rules, dashboards, coordinator, workers, config, moe_coordinator):
    seen = set()          # expressions (or selectors) that returned data at least once
    errors = {}           # expression -> PromQL error
    alert_exprs = {name: expr for kind, name, expr in rules if kind == "alert"}
    record_names = [name for kind, name, _ in rules if kind == "record"]

    def try_query(key, expr):
        try:
            if prom.query(expr):
                seen.add(key)
        except ValueError as e:
            errors[key] = f"{expr}: {e}"

    def panel_queries():
        """(key, substituted expr) for every dashboard target, All and single-value."""
        out = []
        for fname, d in dashboards.items():
            for choice in ("all", "first"):
                try:
                    bindings = grafana.bindings_for(d, choice)
                    moe_bindings = grafana.bindings_for(d, choice, prefer={"training_job": "live_moe"})
                except (ValueError, KeyError) as e:
                    out.append((f"{fname}: variables ({choice})", None, str(e)))
                    continue
                for p in opslib.panels(d):
                    for t in p.get("targets", []):
                        key = f"{fname}: panel {p.get('title')!r} {t.get('refId')} ({choice})"
                        b = moe_bindings if p.get("title", "").startswith(MOE_PANEL_PREFIX) else bindings
                        try:
                            out.append((key, grafana.substitute(t["expr"], b), None))
                        except KeyError as e:
                            out.append((key, None, f"undefined variable ${e}"))
        return out

    def sweep():
        for name in record_names:
            try_query(("record", name), name)
        for key, expr, err in panel_queries():
            if err:
                # Variables that resolve to nothing yet: retried in later sweeps.
                errors[key] = err
            else:
                errors.pop(key, None)
                try_query(key, expr)
        for name, expr in alert_exprs.items():
            try_query(("alert", name), expr)
            for sel in opslib.selectors(expr):
                try_query(("selector", sel), sel)

    def alert_active(name):
        return any(a["labels"].get("alertname") == name and a["state"] in ("pending", "firing")
                   for a in prom.alerts())

    def force(phase):
        for name, p in FORCED.items():
            if p != phase:
                continue
            if name not in alert_exprs:
                fail(f"the test forces {name}, which baton.rules.yml does not define")
                continue
            poll(f"{name}: expression returns data ({phase})",
                 lambda n=name: prom.query(alert_exprs[n]), 20)
            poll(f"{name}: pending or firing in /api/v1/alerts ({phase})", lambda n=name: alert_active(n), 10)
        sweep()

    # 1. Running: every stage reports, the rules have had a minute-window's worth of two samples.
    poll("every stage in baton:bubble_ratio",
         lambda: len(prom.query('baton:bubble_ratio{training_job="live"}')) == 2, 40)
    poll("all workers scraped", lambda: len(prom.query('up{baton_component="worker"} == 1')) == WORKERS + 1, 10)
    # The MoE job drops choices at capacity 0.5 (the rule has two samples of its counters).
    poll("the MoE job's dropped share in baton:moe_dropped_ratio",
         lambda: prom.query('baton:moe_dropped_ratio{training_job="live_moe"} > 0'), 60)
    time.sleep(3)
    sweep()
    check_status_json(coordinator)
    check_moe(prom, moe_coordinator)

    # 2. The last stage frozen for 5 s: stage 0 waits, its bubble goes over the simulator's.
    last_stage = [w for w in workers if 'stage="1"' in scrape(w) and w.name in active_workers(coordinator)]
    if not last_stage:
        fail("no worker reports stage 1")
    else:
        last_stage[0].signal(signal.SIGSTOP)
        time.sleep(5)
        last_stage[0].signal(signal.SIGCONT)
        force("frozen")

    # 3. A worker of the plan killed: lost, not scraped; the spare replaces it (a recovery).
    victim = next(w for w in workers if w.name in active_workers(coordinator))
    victim.signal(signal.SIGKILL)
    victim.proc.wait()
    force("killed")
    poll("running again after the recovery",
         lambda: prom.query('baton_job_state{training_job="live",state="running"} == 1'), 30)

    # 4. Another one killed, no spare left: recovering (waits 4 s for a replacement), then failed.
    second = next(w for w in workers if w.name in active_workers(coordinator) and w.proc.poll() is None)
    second.signal(signal.SIGKILL)
    second.proc.wait()
    force("no_spare")
    force("failed")

    # 4. The coordinator stopped: down, and the workers are cut off from it.
    coordinator.stop()
    force("coordinator_stopped")

    # 5. The coordinator gone from service discovery: absent().
    prom.reload(config(with_coordinator=False))
    force("coordinator_gone")

    # Verdict.
    for key, err in sorted(errors.items(), key=str):
        fail(f"query error: {key}: {err}")
    for name in record_names:
        if ("record", name) not in seen:
            fail(f"recording rule {name} never returned data")
    for name, expr in alert_exprs.items():
        if name in FORCED:
            if ("alert", name) not in seen:
                fail(f"alert {name}: forced, but its expression never returned data")
        else:
            for sel in opslib.selectors(expr):
                if ("selector", sel) not in seen:
                    fail(f"alert {name}: selector {sel} never returned data")
    for key, expr, err in panel_queries():
        if expr is not None and key not in seen and key not in errors:
            fail(f"{key} never returned data: {expr}")
    print(f"checked {len(record_names)} recording rules, {len(alert_exprs)} alerts "
          f"({len(FORCED)} forced), {sum(1 for k in seen if isinstance(k, str))} dashboard queries with data")


def scrape(daemon):
    try:
        return opslib.http_get(f"http://127.0.0.1:{daemon.http_port}/metrics")[1]
    except OSError:
        return ""


def active_workers(coordinator):
    """Workers the live plan uses (batonctl status --json), not spares."""
    r = subprocess.run([opslib.runfile("cli/batonctl"), "status", "--json",
                        f"--coordinator=127.0.0.1:{coordinator.grpc_port}"], capture_output=True, text=True, timeout=30)
    try:
        return {w for s in json.loads(r.stdout)["stages"] for w in s["workers"]}
    except (ValueError, KeyError):
        return set()


def check_moe(prom, moe_coordinator):
    """The MoE job's experts are all used; the dense job has no MoE series; batonctl status shows the
    MoE job's dropped share per stage (text column and JSON)."""
    experts = prom.query('baton:moe_routed_per_second:by_expert{training_job="live_moe"} > 0')
    if sorted(r["metric"].get("expert") for r in experts) != ["0", "1", "2", "3"]:
        fail(f"baton:moe_routed_per_second:by_expert of live_moe: want experts 0-3 with choices, got {experts}")
    dense = prom.query('{__name__=~"baton_moe_.*", training_job="live"}')
    if dense:
        fail(f"the dense job exports MoE series: {dense}")
    batonctl = opslib.runfile("cli/batonctl")
    target = f"--coordinator=127.0.0.1:{moe_coordinator.grpc_port}"
    text = subprocess.run([batonctl, "status", target], capture_output=True, text=True, timeout=30)
    js = subprocess.run([batonctl, "status", target, "--json"], capture_output=True, text=True, timeout=30)
    if "MOE DROP" not in text.stdout:
        fail(f"batonctl status of the MoE job has no MOE DROP column:\n{text.stdout}{text.stderr}")
    try:
        stages = json.loads(js.stdout)["stages"]
    except (ValueError, KeyError) as e:
        fail(f"batonctl status --json of the MoE job ({e}): {js.stdout}{js.stderr}")
        return
    ratios = [s.get("moe_dropped_ratio") for s in stages]
    if len(ratios) != 1 or not isinstance(ratios[0], (int, float)) or not 0 < ratios[0] < 1:
        fail(f"batonctl status --json of the MoE job: moe_dropped_ratio per stage {ratios}, want one in (0, 1)")


def check_status_json(coordinator):
    """`batonctl status --json` carries every field the text output shows."""
    batonctl = opslib.runfile("cli/batonctl")
    target = f"--coordinator=127.0.0.1:{coordinator.grpc_port}"
    text = subprocess.run([batonctl, "status", target], capture_output=True, text=True, timeout=30)
    js = subprocess.run([batonctl, "status", target, "--json"], capture_output=True, text=True, timeout=30)
    if text.returncode != 0 or js.returncode != 0:
        fail(f"batonctl status failed: {text.stderr} {js.stderr}")
        return
    try:
        doc = json.loads(js.stdout)
    except ValueError as e:
        fail(f"batonctl status --json is not JSON ({e}): {js.stdout}")
        return
    for key in ("coordinator", "version", "job", "job_state", "generation", "job_error", "step", "total_steps",
                "loss", "accuracy", "tokens_per_second", "bubble_ratio", "expected_bubble_ratio", "comm_ratio",
                "recovery", "recoveries", "stages", "workers"):
        if key not in doc:
            fail(f"batonctl status --json lacks {key!r}: {js.stdout}")
    if doc.get("job") != "live" or f"job live ({doc.get('job_state')})" not in text.stdout:
        fail(f"job/job_state differ between text and JSON:\n{text.stdout}\n{js.stdout}")
    if "ACT MiB" not in text.stdout:
        fail(f"batonctl status has no ACT MiB column:\n{text.stdout}")
    if "MOE DROP" in text.stdout:
        fail(f"batonctl status of a dense job has a MOE DROP column:\n{text.stdout}")
    stages = doc.get("stages", [])
    if [s.get("stage") for s in stages] != [0, 1]:
        fail(f"batonctl status --json stages: {stages}")
    for s in stages:
        for key in ("step", "loss", "bubble_ratio", "comm_ratio", "tokens_per_second", "weights_bytes",
                    "grads_bytes", "optimizer_bytes", "activation_bytes", "workers"):
            if key not in s:
                fail(f"batonctl status --json stage lacks {key!r}: {s}")
        if s.get("moe_dropped_ratio", "absent") is not None:
            fail(f"batonctl status --json of a dense job: moe_dropped_ratio should be null: {s}")
        line = next((l for l in text.stdout.splitlines() if l.split()[:1] == [str(s.get("stage"))]), None)
        if line is None or ",".join(s.get("workers", [])) not in line:
            fail(f"stage {s.get('stage')} workers differ between text and JSON:\n{text.stdout}\n{js.stdout}")
    if sorted(w["name"] for w in doc.get("workers", [])) != [f"worker-{i}" for i in range(WORKERS)]:
        fail(f"batonctl status --json workers: {doc.get('workers')}")


if __name__ == "__main__":
    sys.exit(main())
