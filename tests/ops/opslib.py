"""Helpers shared by the ops tests: runfiles, daemons on loopback, PromQL
expressions of rules and dashboards, and Grafana's variable substitution."""
import json
import os
import re
import signal
import socket
import subprocess
import time
import urllib.parse
import urllib.request

import yaml


def runfile(path):
    """Path of a runfile given relative to the workspace root."""
    base = os.environ.get("TEST_SRCDIR")
    if base:
        return os.path.join(base, os.environ.get("TEST_WORKSPACE", "baton"), path)
    root = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "..")
    built = os.path.join(root, "bazel-bin", path)  # run by hand after `bazel build`
    return built if os.path.isfile(built) else os.path.join(root, path)


def tmpdir(name):
    d = os.path.join(os.environ.get("TEST_TMPDIR", "/tmp"), name)
    os.makedirs(d, exist_ok=True)
    return d


class Daemon:
    """A baton daemon started with --port_file; its log is kept for failures."""

    def __init__(self, name, argv, workdir, env=None):
        self.name = name
        self.log_path = os.path.join(workdir, name + ".log")
        self.port_file = os.path.join(workdir, name + ".ports")
        if os.path.exists(self.port_file):
            os.remove(self.port_file)
        self.argv = argv + ["--port_file=" + self.port_file]
        self.env = env
        self.proc = None
        self.grpc_port = self.http_port = None

    def start(self, wait=True):
        log = open(self.log_path, "ab")
        self.proc = subprocess.Popen(self.argv, stdout=log, stderr=subprocess.STDOUT, env=self.env)
        if wait:
            self.wait_ports()
        return self

    def wait_ports(self, timeout=20):
        deadline = time.time() + timeout
        while time.time() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"{self.name} exited with {self.proc.returncode}:\n{self.log()}")
            try:
                with open(self.port_file) as f:
                    ports = json.load(f)
                self.grpc_port, self.http_port = ports["grpc"], ports["http"]
                return
            except (OSError, ValueError, KeyError):
                time.sleep(0.05)
        raise RuntimeError(f"{self.name} wrote no port file in {timeout}s:\n{self.log()}")

    def signal(self, sig):
        if self.proc and self.proc.poll() is None:
            self.proc.send_signal(sig)

    def stop(self, timeout=10):
        if self.proc and self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(timeout)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()

    def log(self):
        try:
            with open(self.log_path, errors="replace") as f:
                return f.read()[-4000:]
        except OSError:
            return ""


def free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def http_get(url, timeout=5):
    with urllib.request.urlopen(url, timeout=timeout) as r:
        return r.status, r.read().decode()


# --- PromQL in rules and dashboards -------------------------------------------------------

def load_rules(path):
    """[(kind, name, expr)] for every rule: kind is "record" or "alert"."""
    with open(path) as f:
        doc = yaml.safe_load(f)
    out = []
    for group in doc["groups"]:
        for rule in group["rules"]:
            kind = "record" if "record" in rule else "alert"
            out.append((kind, rule[kind], rule["expr"]))
    return out


def panels(dashboard):
    """Every panel, rows' nested panels included."""
    for p in dashboard.get("panels", []):
        yield p
        for q in p.get("panels", []):
            yield q


PROMQL_WORDS = {
    "by", "without", "on", "ignoring", "group_left", "group_right", "and", "or", "unless", "bool", "offset",
    "sum", "min", "max", "avg", "count", "stddev", "stdvar", "topk", "bottomk", "quantile", "count_values", "group",
    "rate", "irate", "increase", "delta", "idelta", "deriv", "absent", "absent_over_time", "vector", "scalar",
    "histogram_quantile", "label_replace", "label_join", "clamp_min", "clamp_max", "abs", "time", "sort",
    "sort_desc", "avg_over_time", "max_over_time", "min_over_time", "sum_over_time", "count_over_time",
    "last_over_time", "changes", "resets", "predict_linear", "timestamp", "inf", "nan", "e",
}


def metric_names(expr):
    """Metric names a PromQL expression selects (best effort: identifiers that are not
    keywords, functions, label names inside braces or durations)."""
    stripped = re.sub(r'"(?:[^"\\]|\\.)*"', '""', expr)           # string literals
    stripped = re.sub(r"\{[^}]*\}", "{}", stripped)               # label matchers
    stripped = re.sub(r"\[[^\]]*\]", "[]", stripped)              # ranges
    stripped = re.sub(r"\((?:by|without|on|ignoring|group_left|group_right)?\s*\([^()]*\)", "(", stripped)
    stripped = re.sub(r"\b(by|without|on|ignoring|group_left|group_right)\s*\([^()]*\)", " ", stripped)
    names = set()
    for m in re.finditer(r"(?<![\w.$])([a-zA-Z_:][a-zA-Z0-9_:]*)\s*(\()?", stripped):
        word, call = m.group(1), m.group(2)
        if call or word in PROMQL_WORDS:
            continue
        names.add(word)
    return names


def selectors(expr):
    """The vector selectors (`name{matchers}`) of an expression, as strings."""
    out = []
    for name in sorted(metric_names(expr)):
        for m in re.finditer(r"(?<![\w:])" + re.escape(name) + r"(\{[^}]*\})?", expr):
            out.append(name + (m.group(1) or ""))
    return sorted(set(out))


class Grafana:
    """Substitutes dashboard variables the way Grafana's Prometheus data source does."""

    def __init__(self, prom, scrape_interval_s, range_s=300, max_points=1000):
        self.prom = prom
        self.scrape = scrape_interval_s
        self.range_s = range_s
        # $__interval: range / max data points, never below the data source's scrape interval.
        self.interval = max(scrape_interval_s, range_s / max_points)
        # $__rate_interval = max($__interval + scrape interval, 4 * scrape interval).
        self.rate_interval = max(self.interval + scrape_interval_s, 4 * scrape_interval_s)

    @staticmethod
    def _regex_escape(v):
        return re.sub(r"([\\^$*+?.()|{}\[\]])", r"\\\\\1", v)

    def format(self, var, values, is_all):
        if is_all and var.get("allValue"):
            return var["allValue"]
        if not var.get("multi") and not var.get("includeAll"):
            return values[0]
        esc = [self._regex_escape(v) for v in values]
        return esc[0] if len(esc) == 1 else "(" + "|".join(esc) + ")"

    def builtins(self):
        return {"__rate_interval": f"{int(self.rate_interval)}s", "__interval": f"{int(self.interval)}s",
                "__range": f"{self.range_s}s", "__interval_ms": str(int(self.interval * 1000)),
                "__range_s": str(self.range_s)}

    def substitute(self, text, bindings):
        all_vars = dict(self.builtins())
        all_vars.update(bindings)

        def repl(m):
            name = m.group(1) or m.group(2) or m.group(3)
            if name not in all_vars:
                raise KeyError(name)
            return all_vars[name]

        return re.sub(r"\$\{(\w+)(?::\w+)?\}|\[\[(\w+)\]\]|\$(\w+)", repl, text)

    def variable_values(self, var, bindings):
        """Values of a query variable: label_values(selector, label) or label_values(label)."""
        query = var["query"]["query"] if isinstance(var["query"], dict) else var["query"]
        query = self.substitute(query, bindings)
        m = re.fullmatch(r"\s*label_values\((?:(.*),\s*)?(\w+)\)\s*", query)
        if not m:
            raise ValueError(f"variable {var['name']}: unsupported query {query!r}")
        params = {}
        if m.group(1):
            params["match[]"] = m.group(1)
        return self.prom.label_values(m.group(2), params), query

    def bindings_for(self, dashboard, choice, prefer=None):
        """Binds every variable. `choice` is "all" (the All option) or "first" (one value: the first,
        or the one `prefer` names for the variable, e.g. {"training_job": "x"}, when it is a value)."""
        bindings = {}
        for var in dashboard.get("templating", {}).get("list", []):
            if var["type"] == "datasource":
                bindings[var["name"]] = "prometheus"
                continue
            values, query = self.variable_values(var, bindings)
            if not values:
                raise ValueError(f"variable ${var['name']} resolves to nothing: {query}")
            if choice == "all" and var.get("includeAll"):
                bindings[var["name"]] = self.format(var, values, True)
            else:
                one = (prefer or {}).get(var["name"])
                bindings[var["name"]] = self.format(var, [one] if one in values else values[:1], False)
        return bindings


class Prometheus:
    """A real Prometheus server (Debian's `prometheus`) on loopback."""

    def __init__(self, workdir, config):
        self.workdir = workdir
        self.config_path = os.path.join(workdir, "prometheus.yml")
        self.write_config(config)
        self.port = free_port()
        self.log_path = os.path.join(workdir, "prometheus.log")
        self.proc = subprocess.Popen(
            ["prometheus", "--config.file=" + self.config_path, "--storage.tsdb.path=" + os.path.join(workdir, "data"),
             f"--web.listen-address=127.0.0.1:{self.port}", "--log.level=warn"],
            stdout=open(self.log_path, "ab"), stderr=subprocess.STDOUT)
        deadline = time.time() + 30
        while True:
            if self.proc.poll() is not None:
                raise RuntimeError("prometheus exited:\n" + self.log())
            try:
                if http_get(self.url("/-/ready"))[0] == 200:
                    break
            except OSError:
                pass
            if time.time() > deadline:
                raise RuntimeError("prometheus not ready in 30s:\n" + self.log())
            time.sleep(0.1)

    def write_config(self, config):
        with open(self.config_path, "w") as f:
            yaml.safe_dump(config, f)

    def reload(self, config):
        self.write_config(config)
        self.proc.send_signal(signal.SIGHUP)

    def url(self, path, params=None):
        u = f"http://127.0.0.1:{self.port}{path}"
        return u + ("?" + urllib.parse.urlencode(params, doseq=True) if params else "")

    def api(self, path, params):
        try:
            _, body = http_get(self.url(path, params))
        except urllib.error.HTTPError as e:
            body = e.read().decode()
        doc = json.loads(body)
        if doc.get("status") != "success":
            raise ValueError(f"{doc.get('errorType')}: {doc.get('error')}")
        return doc["data"]

    def query(self, expr):
        """Instant query: the result list (raises on a PromQL error)."""
        return self.api("/api/v1/query", {"query": expr})["result"]

    def query_range(self, expr, seconds, step):
        now = time.time()
        return self.api("/api/v1/query_range", {"query": expr, "start": now - seconds, "end": now, "step": step})["result"]

    def label_values(self, label, params):
        return sorted(self.api(f"/api/v1/label/{label}/values", params))

    def alerts(self):
        return self.api("/api/v1/alerts", {})["alerts"]

    def stop(self):
        if self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(10)
            except subprocess.TimeoutExpired:
                self.proc.kill()

    def log(self):
        try:
            with open(self.log_path, errors="replace") as f:
                return f.read()[-4000:]
        except OSError:
            return ""
