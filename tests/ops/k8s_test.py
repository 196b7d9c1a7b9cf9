#!/usr/bin/env python3
"""Kubernetes manifests: renders deploy/k8s (base and every overlay) and
deploy/grafana with kustomize (`kubectl kustomize`), validates every object
against the Kubernetes OpenAPI schema (PyPI `kubernetes-validate`, strict,
installed by scripts/setup.sh into a venv) and checks what the schema cannot:
names and ports that refer to each other, probes, security context,
resources, GPU scheduling, the data-plane NetworkPolicy, the flags the
containers pass (against the binaries' --helpfull), and the job spec in the
ConfigMap (validated by the real coordinator). Then, per overlay, it starts
the coordinator and a worker with the containers' own arguments (certificates
from tests/security/gen_certs.sh) and checks the worker registers: mutual TLS
and the join token as deployed work together.
"""
import glob
import os
import re
import shutil
import subprocess
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import opslib  # noqa: E402
import yaml  # noqa: E402

K8S_VERSION = "1.30.0"  # the oldest version the manifests are written for (policy/v1, gRPC probes GA)
failures = []


def fail(where, msg):
    print(f"FAIL: {where}: {msg}", flush=True)
    failures.append(msg)


def kustomize_cmd():
    for tool in ("kubectl", "kustomize"):
        path = shutil.which(tool)
        if path:
            return [path, "kustomize"] if tool == "kubectl" else [path, "build"]
    return None


def validator():
    venv = os.environ.get("BATON_VENV") or os.path.join(os.environ.get("HOME", "/root"), ".cache/baton/venv")
    path = os.path.join(venv, "bin", "kubernetes-validate")
    return path if os.access(path, os.X_OK) else None


def render(cmd, directory):
    r = subprocess.run(cmd + [directory], capture_output=True, text=True, timeout=120)
    if r.returncode != 0:
        fail(directory, f"kustomize failed: {r.stderr}")
        return []
    return [d for d in yaml.safe_load_all(r.stdout) if d]


def selects(selector, labels):
    for k, v in (selector.get("matchLabels") or {}).items():
        if labels.get(k) != v:
            return False
    for e in selector.get("matchExpressions") or []:
        val = labels.get(e["key"])
        if e["operator"] == "In" and val not in e["values"]:
            return False
        if e["operator"] == "NotIn" and val in e["values"]:
            return False
        if e["operator"] == "Exists" and val is None:
            return False
    return True


def workloads(objs):
    """(name, pod template) of Deployments and StatefulSets."""
    return [(o["metadata"]["name"], o["spec"]["template"]) for o in objs if o["kind"] in ("Deployment", "StatefulSet")]


def helpfull(binary, cache={}):  # noqa: B006 - memo
    if binary not in cache:
        r = subprocess.run([opslib.runfile(binary), "--helpfull"], capture_output=True, text=True, timeout=60)
        cache[binary] = set(re.findall(r"^\s+--([a-z_0-9]+) ", r.stdout + r.stderr, re.M))
    return cache[binary]


BINARIES = {"/usr/local/bin/baton-coordinator": "coordinator/baton-coordinator",
            "/usr/local/bin/baton-worker": "worker/baton-worker"}


def check_objects(where, objs, overlay):
    by_kind = {}
    for o in objs:
        by_kind.setdefault(o["kind"], {})[o["metadata"]["name"]] = o
    pods = workloads(objs)
    if not pods:
        fail(where, "no workloads rendered")
    for o in objs:
        labels = o["metadata"].get("labels", {})
        for key in ("app.kubernetes.io/name", "app.kubernetes.io/part-of", "app.kubernetes.io/managed-by"):
            if key not in labels:
                fail(where, f"{o['kind']}/{o['metadata']['name']} lacks label {key}")

    for name, tpl in pods:
        spec, labels = tpl["spec"], tpl["metadata"]["labels"]
        what = f"{where}: {name}"
        for key in ("app.kubernetes.io/name", "app.kubernetes.io/instance", "app.kubernetes.io/component",
                    "app.kubernetes.io/version"):
            if key not in labels:
                fail(what, f"pod template lacks label {key}")
        psc = spec.get("securityContext", {})
        if psc.get("runAsNonRoot") is not True or not psc.get("runAsUser"):
            fail(what, "pod securityContext must set runAsNonRoot and a runAsUser")
        if psc.get("seccompProfile", {}).get("type") != "RuntimeDefault":
            fail(what, "pod securityContext must use the RuntimeDefault seccomp profile")
        volumes = {v["name"]: v for v in spec.get("volumes", [])}
        for c in spec["containers"]:
            cw = f"{what}/{c['name']}"
            sc = c.get("securityContext", {})
            if sc.get("allowPrivilegeEscalation") is not False or sc.get("readOnlyRootFilesystem") is not True \
                    or sc.get("privileged", False) or sc.get("capabilities", {}).get("drop") != ["ALL"]:
                fail(cw, f"securityContext must forbid privilege escalation, make / read-only and drop ALL: {sc}")
            res = c.get("resources", {})
            for kind in ("requests", "limits"):
                for r in ("cpu", "memory"):
                    if r not in res.get(kind, {}):
                        fail(cw, f"no {kind}.{r}")
            image = c.get("image", "")
            if ":" not in image.rsplit("/", 1)[-1] or image.endswith(":latest"):
                fail(cw, f"image {image!r} is not pinned to a tag")
            for m in c.get("volumeMounts", []):
                if m["name"] not in volumes:
                    fail(cw, f"mounts volume {m['name']} that the pod does not have")
            ports = {p["name"]: p["containerPort"] for p in c.get("ports", [])}
            # Probes on declared ports; gRPC probes on the gRPC port.
            for probe in ("startupProbe", "livenessProbe", "readinessProbe"):
                p = c.get(probe)
                if p is None:
                    fail(cw, f"no {probe}")
                    continue
                if "grpc" not in p:
                    fail(cw, f"{probe} must be a gRPC health (grpc.health.v1) probe")
                elif p["grpc"]["port"] != ports.get("health"):
                    fail(cw, f"{probe} checks port {p['grpc']['port']}, not the plaintext health port "
                             f"{ports.get('health')} (kubelet cannot present a client certificate)")
            # Flags exist, listen ports are the declared ones, $(VARS) are defined.
            binary = BINARIES.get((c.get("command") or [""])[0])
            if binary is None:
                fail(cw, f"command {c.get('command')} is not a baton binary")
                continue
            env = {e["name"]: e for e in c.get("env", [])}
            flags = {}
            for a in c.get("args", []):
                m = re.fullmatch(r"--([a-z_0-9]+)=(.*)", a)
                if not m:
                    fail(cw, f"argument {a!r} is not --flag=value")
                    continue
                flags[m.group(1)] = m.group(2)
                if m.group(1) not in helpfull(binary):
                    fail(cw, f"--{m.group(1)} is not a flag of {os.path.basename(binary)}")
                for var in re.findall(r"\$\((\w+)\)", m.group(2)):
                    if var not in env:
                        fail(cw, f"{a} uses $({var}), which is not in env")
            for flag, port_name in (("listen", "grpc"), ("http_listen", "http"), ("health_listen", "health")):
                port = flags.get(flag, ":").rsplit(":", 1)[1]
                if port != str(ports.get(port_name)):
                    fail(cw, f"--{flag} port {port} is not containerPort {port_name}={ports.get(port_name)}")
            # gRPC beyond loopback: mutual TLS and the join token (docs/security.md), files on Secrets.
            if flags.get("insecure", "false") != "false":
                fail(cw, "--insecure: plaintext gRPC beyond loopback (use the TLS flags)")
            for flag in ("tls_cert", "tls_key", "tls_ca", "join_token_file"):
                path = flags.get(flag)
                mount = next((m for m in c.get("volumeMounts", []) if path and path.startswith(m["mountPath"] + "/")),
                             None)
                secret = volumes.get(mount["name"], {}).get("secret", {}).get("secretName") if mount else None
                if secret is None:
                    fail(cw, f"--{flag}={path} is not on a Secret volume")
                elif secret not in documented_secrets():
                    fail(cw, f"Secret {secret} is not described in docs/operations.md (operators create it)")
            for mount in c.get("volumeMounts", []):
                if mount["mountPath"] == "/var/lib/baton/checkpoints" and \
                        "persistentVolumeClaim" not in volumes.get(mount["name"], {}):
                    fail(cw, "checkpoints must be on a PersistentVolumeClaim")
            if not any(m["mountPath"] == "/var/lib/baton/checkpoints" for m in c.get("volumeMounts", [])):
                fail(cw, "no checkpoint volume at /var/lib/baton/checkpoints")
            if "worker" in binary:
                if flags.get("comm_host") != "$(POD_IP)" or \
                        env.get("POD_IP", {}).get("valueFrom", {}).get("fieldRef", {}).get("fieldPath") != "status.podIP":
                    fail(cw, "--comm_host must be the pod IP ($(POD_IP) from status.podIP)")
                if flags.get("name") != "$(POD_NAME)" or \
                        env.get("POD_NAME", {}).get("valueFrom", {}).get("fieldRef", {}).get("fieldPath") != "metadata.name":
                    fail(cw, "--name must be the pod name ($(POD_NAME) from metadata.name)")
                if c.get("livenessProbe", {}).get("grpc", {}).get("service") != "liveness":
                    fail(cw, "the liveness probe must check the \"liveness\" service (readiness follows the coordinator)")
                if "service" in c.get("readinessProbe", {}).get("grpc", {}):
                    fail(cw, "the readiness probe must check the overall health (service \"\")")
                shm = [m for m in c.get("volumeMounts", []) if m["mountPath"] == "/dev/shm"]
                if not shm or volumes.get(shm[0]["name"], {}).get("emptyDir", {}).get("medium") != "Memory":
                    fail(cw, "/dev/shm must be a memory-backed emptyDir")
                gpus = str(res.get("limits", {}).get("nvidia.com/gpu", "0"))
                if overlay == "gpu":
                    if gpus != "1" or flags.get("device") != "cuda:0":
                        fail(cw, f"GPU workers need nvidia.com/gpu: 1 and --device=cuda:0 (have {gpus}, {flags.get('device')})")
                    if flags.get("host") != "$(NODE_NAME)" or \
                            env.get("NODE_NAME", {}).get("valueFrom", {}).get("fieldRef", {}).get("fieldPath") != "spec.nodeName":
                        fail(cw, "GPU workers need --host=$(NODE_NAME) from spec.nodeName (TP groups on one node)")
                    tolerated = any(t.get("key") == "nvidia.com/gpu" for t in spec.get("tolerations", []))
                    if not tolerated or not any("nvidia.com" in k for k in spec.get("nodeSelector", {})):
                        fail(cw, "GPU workers need a nodeSelector and a toleration for GPU nodes")
                elif gpus != "0" or flags.get("device") != "cpu":
                    fail(cw, f"CPU workers ask for no GPU and run --device=cpu (have {gpus}, {flags.get('device')})")
            if flags.get("job"):
                mount = next((m for m in c.get("volumeMounts", []) if flags["job"].startswith(m["mountPath"] + "/")), None)
                cm = volumes.get(mount["name"], {}).get("configMap", {}).get("name") if mount else None
                if cm not in by_kind.get("ConfigMap", {}):
                    fail(cw, f"--job={flags['job']} is not on a ConfigMap of this render")
                else:
                    check_job(where, by_kind["ConfigMap"][cm]["data"][os.path.basename(flags["job"])], objs)
        for v in volumes.values():
            if "configMap" in v and v["configMap"]["name"] not in by_kind.get("ConfigMap", {}):
                fail(what, f"volume {v['name']}: no ConfigMap {v['configMap']['name']}")
            if "persistentVolumeClaim" in v and \
                    v["persistentVolumeClaim"]["claimName"] not in by_kind.get("PersistentVolumeClaim", {}):
                fail(what, f"volume {v['name']}: no PersistentVolumeClaim {v['persistentVolumeClaim']['claimName']}")

    def pods_selected(selector):
        return [(n, t) for n, t in pods if selects(selector, t["metadata"]["labels"])]

    def container_ports(tpls):
        return {(p.get("name"), p["containerPort"]) for _, t in tpls for c in t["spec"]["containers"]
                for p in c.get("ports", [])}

    for name, svc in by_kind.get("Service", {}).items():
        selected = pods_selected({"matchLabels": svc["spec"]["selector"]})
        if not selected:
            fail(where, f"Service {name} selects no pods")
        ports = container_ports(selected)
        for p in svc["spec"]["ports"]:
            t = p.get("targetPort", p["port"])
            if not any(t in (n, num) for n, num in ports):
                fail(where, f"Service {name} port {p['name']}: targetPort {t} is not a port of its pods")
    for name, ss in by_kind.get("StatefulSet", {}).items():
        svc = by_kind.get("Service", {}).get(ss["spec"]["serviceName"])
        if svc is None or svc["spec"].get("clusterIP") != "None":
            fail(where, f"StatefulSet {name}: serviceName {ss['spec']['serviceName']} is not a headless Service")
    for kind in ("PodDisruptionBudget", "NetworkPolicy"):
        for name, o in by_kind.get(kind, {}).items():
            sel = o["spec"]["selector"] if kind == "PodDisruptionBudget" else o["spec"]["podSelector"]
            if not pods_selected(sel):
                fail(where, f"{kind} {name} selects no pods")
    # Data plane: the worker policy's rules without a port list admit only this job's pods.
    worker_pods = [t for n, t in pods if t["metadata"]["labels"].get("app.kubernetes.io/component") == "worker"]
    policies = [o for o in by_kind.get("NetworkPolicy", {}).values()
                if worker_pods and selects(o["spec"]["podSelector"], worker_pods[0]["metadata"]["labels"])]
    if not policies:
        fail(where, "no NetworkPolicy covers the workers' data-plane ports")
    for o in policies:
        instance = worker_pods[0]["metadata"]["labels"]["app.kubernetes.io/instance"]
        for rule in o["spec"].get("ingress", []):
            if rule.get("ports"):
                continue
            for peer in rule.get("from", []):
                ok = set(peer) == {"podSelector"} and \
                    (peer["podSelector"].get("matchLabels") or {}).get("app.kubernetes.io/instance") == instance
                if not ok:
                    fail(where, f"NetworkPolicy {o['metadata']['name']} opens every port to {peer}")
    # PodMonitor: selects coordinator and workers, on a port they have, and labels baton_component.
    for name, pm in by_kind.get("PodMonitor", {}).items():
        selected = pods_selected(pm["spec"]["selector"])
        comps = {t["metadata"]["labels"].get("app.kubernetes.io/component") for _, t in selected}
        if comps != {"coordinator", "worker"}:
            fail(where, f"PodMonitor {name} selects {comps}, not the coordinator and the workers")
        for ep in pm["spec"]["podMetricsEndpoints"]:
            for n, t in selected:
                if ep["port"] not in {p.get("name") for c in t["spec"]["containers"] for p in c.get("ports", [])}:
                    fail(where, f"PodMonitor {name}: {n} has no port {ep['port']}")
            if not any(r.get("targetLabel") == "baton_component" for r in ep.get("relabelings", [])):
                fail(where, f"PodMonitor {name}: no baton_component label (the alerts select on it)")


def documented_secrets(cache=[]):  # noqa: B006 - memo
    if not cache:
        kustomization = os.path.realpath(opslib.runfile("deploy/k8s/base/kustomization.yaml"))
        root = kustomization
        for _ in range(4):  # deploy/k8s/base/kustomization.yaml
            root = os.path.dirname(root)
        docs = os.path.join(root, "docs/operations.md")
        with open(docs) as f:
            cache.append(set(re.findall(r"\b(baton-[a-z-]+)\b", f.read())))
    return cache[0]


def check_job(where, text, objs):
    """The job spec in the ConfigMap: valid for the real coordinator, and enough workers."""
    path = os.path.join(opslib.tmpdir("k8s_job"), "job.textproto")
    with open(path, "w") as f:
        f.write(text)
    c = opslib.Daemon("coordinator-" + where.replace("/", "_"), [
        opslib.runfile("coordinator/baton-coordinator"), "--job=" + path, "--listen=127.0.0.1:0",
        "--http_listen=127.0.0.1:0"], opslib.tmpdir("k8s_job"))
    c.start(wait=False)
    deadline = time.time() + 30
    while time.time() < deadline and c.proc.poll() is None and "is valid" not in c.log():
        time.sleep(0.1)
    if "is valid" not in c.log():
        fail(where, f"the job spec in the ConfigMap is rejected by the coordinator:\n{c.log()}")
    c.stop()
    dims = 1
    for d in ("pp", "tp", "dp"):
        m = re.search(rf"\b{d}:\s*(\d+)", text)
        dims *= int(m.group(1)) if m else 1
    for o in objs:
        if o["kind"] == "StatefulSet" and o["spec"]["replicas"] < dims:
            fail(where, f"StatefulSet {o['metadata']['name']}: {o['spec']['replicas']} replicas for pp*tp*dp = {dims}")


def smoke(where, objs, work):
    """Runs the coordinator and one worker with the rendered containers' own
    arguments (paths mapped to real files: certificates made with
    tests/security/gen_certs.sh, the ConfigMap's job spec, a join token; the
    listen ports 0; the worker pointed at the coordinator): the worker must
    register (mutual TLS and the join token accepted), i.e. its /readyz is 200."""
    certs = os.path.join(work, "certs")
    if not os.path.exists(os.path.join(certs, "ca.pem")):
        r = subprocess.run(["bash", opslib.runfile("tests/security/gen_certs.sh"), certs], capture_output=True,
                           text=True, timeout=120)
        if r.returncode != 0:
            fail(where, f"gen_certs.sh failed: {r.stdout}{r.stderr}")
            return
    run_dir = opslib.tmpdir("smoke-" + where.replace("/", "_"))
    token = os.path.join(run_dir, "join_token")
    with open(token, "w") as f:
        f.write("0123456789abcdef0123456789abcdef\n")
    os.chmod(token, 0o600)
    containers = {}
    for name, tpl in workloads(objs):
        containers[tpl["metadata"]["labels"]["app.kubernetes.io/component"]] = tpl["spec"]["containers"][0]
    cms = {o["metadata"]["name"]: o for o in objs if o["kind"] == "ConfigMap"}
    job = os.path.join(run_dir, "job.textproto")
    with open(job, "w") as f:
        f.write(cms["baton-job"]["data"]["job.textproto"].replace("/var/lib/baton", run_dir))

    def mapped(args, role, coordinator_port=None):
        out = []
        for a in args:
            flag, _, value = a.partition("=")
            value = value.replace("$(POD_NAME)", "baton-worker-0").replace("$(POD_IP)", "127.0.0.1") \
                .replace("$(NODE_NAME)", "node-0")
            if flag in ("--listen", "--http_listen", "--health_listen"):
                value = value.rsplit(":", 1)[0] + ":0"
            elif flag == "--tls_cert":
                value = os.path.join(certs, role + ".pem")
            elif flag == "--tls_key":
                value = os.path.join(certs, role + ".key")
            elif flag == "--tls_ca":
                value = os.path.join(certs, "ca.pem")
            elif flag == "--join_token_file":
                value = token
            elif flag == "--job":
                value = job
            elif flag == "--out":
                value = os.path.join(run_dir, "out")
            elif flag == "--coordinator":
                value = f"127.0.0.1:{coordinator_port}"
            out.append(f"{flag}={value}")
        return out

    c = containers["coordinator"]
    coordinator = opslib.Daemon("coordinator", [opslib.runfile(BINARIES[c["command"][0]])] +
                                mapped(c["args"], "coordinator"), run_dir)
    w = containers["worker"]
    worker = None
    try:
        coordinator.start()
        worker = opslib.Daemon("worker", [opslib.runfile(BINARIES[w["command"][0]])] +
                               mapped(w["args"], "worker", coordinator.grpc_port), run_dir).start()
        deadline = time.time() + 30
        code = None
        while time.time() < deadline:
            try:
                code = opslib.http_get(f"http://127.0.0.1:{worker.http_port}/readyz")[0]
            except OSError as e:
                code = getattr(e, "code", None)
            if code == 200:
                break
            time.sleep(0.2)
        if code != 200:
            fail(where, f"a worker with the manifest's arguments did not register (readyz {code}):\n"
                        f"{worker.log()}\n--- coordinator\n{coordinator.log()}")
    except RuntimeError as e:
        fail(where, f"the manifest's arguments do not start the daemons: {e}")
    finally:
        for d in (worker, coordinator):
            if d:
                d.stop()


def main():
    cmd = kustomize_cmd()
    check = validator()
    if cmd is None:
        print("FAIL: neither kubectl nor kustomize found: run scripts/setup.sh (Debian package kubernetes-client)")
        return 1
    if check is None:
        print("FAIL: kubernetes-validate not found in the venv: run scripts/setup.sh")
        return 1
    # A real copy: kustomize refuses files that resolve outside the kustomization (runfiles are symlinks).
    root = os.path.join(opslib.tmpdir("k8s"), "deploy")
    shutil.rmtree(root, ignore_errors=True)
    shutil.copytree(opslib.runfile("deploy"), root, symlinks=False)
    targets = {"base": "k8s/base"}
    for d in sorted(glob.glob(os.path.join(root, "k8s/overlays/*/"))):
        targets[os.path.basename(d.rstrip("/"))] = os.path.relpath(d, root)
    if set(targets) != {"base", "cpu-dev", "gpu"}:
        fail("deploy/k8s", f"expected base and overlays cpu-dev, gpu; found {sorted(targets)}")
    work = opslib.tmpdir("k8s")
    for overlay, rel in targets.items():
        where = f"deploy/{rel}".rstrip("/")
        objs = render(cmd, os.path.join(root, rel))
        if overlay != "base" and any(o["metadata"].get("namespace") is None for o in objs):
            fail(where, "every object of an overlay needs a namespace")
        schema_checked = [o for o in objs if o["apiVersion"] != "monitoring.coreos.com/v1"]
        out = os.path.join(work, overlay + ".yaml")
        with open(out, "w") as f:
            yaml.safe_dump_all(schema_checked, f)
        r = subprocess.run([check, "--strict", "--quiet", "-k", K8S_VERSION, out], capture_output=True, text=True,
                           timeout=120)
        if r.returncode != 0:
            fail(where, f"kubernetes-validate {K8S_VERSION} --strict:\n{r.stdout}{r.stderr}")
        check_objects(where, objs, overlay)
        if overlay != "base" and not failures:
            smoke(where, objs, work)
        print(f"{where}: {len(objs)} objects ({len(schema_checked)} schema-validated)")
    # The dashboards' ConfigMap for the Grafana sidecar.
    objs = render(cmd, os.path.join(root, "grafana"))
    cms = [o for o in objs if o["kind"] == "ConfigMap"]
    if len(cms) != 1 or cms[0]["metadata"].get("labels", {}).get("grafana_dashboard") != "1":
        fail("deploy/grafana", "expected one ConfigMap labelled grafana_dashboard=\"1\"")
    else:
        shipped = sorted(os.path.basename(p) for p in glob.glob(os.path.join(root, "grafana/*.json")))
        if sorted(cms[0]["data"]) != shipped:
            fail("deploy/grafana", f"the ConfigMap holds {sorted(cms[0]['data'])}, the dashboards are {shipped}")
        out = os.path.join(work, "grafana.yaml")
        with open(out, "w") as f:
            yaml.safe_dump_all(objs, f)
        r = subprocess.run([check, "--strict", "--quiet", "-k", K8S_VERSION, out], capture_output=True, text=True)
        if r.returncode != 0:
            fail("deploy/grafana", f"kubernetes-validate:\n{r.stdout}{r.stderr}")
    print(f"k8s: {len(failures)} failure(s)")
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
