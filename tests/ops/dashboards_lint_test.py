#!/usr/bin/env python3
"""Lints the Grafana dashboards (deploy/grafana/*.json) and the Prometheus
rules against the metrics baton really exports.

The known metrics are collected from the source: every
`prometheus::Build*().Name("baton_...")` in the C++ tree (histograms add
_bucket/_sum/_count), the recording rules of deploy/prometheus/baton.rules.yml,
and Prometheus' own `up` and `ALERTS`. Then:
  - every dashboard has a stable uid (its file name), a `datasource`
    variable and `training_job` / `stage` variables whose queries use known
    metrics and only variables defined before them;
  - every panel has a title, the `${datasource}` data source (panel and
    targets), a unit, thresholds and at least one query;
  - every query uses known metrics only, only defined variables, and
    `$__rate_interval` in rate()/irate();
  - every rule's expression uses known metrics only, and every alert's
    runbook is a heading of docs/operations.md.
"""
import glob
import json
import os
import re
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import opslib  # noqa: E402

failures = []
BUILTIN_VARS = {"__rate_interval", "__interval", "__interval_ms", "__range", "__range_s", "__range_ms"}


def fail(msg):
    print("FAIL:", msg)
    failures.append(msg)


def source_root():
    """The workspace's source tree, found through a runfile's symlink."""
    real = os.path.realpath(opslib.runfile("deploy/prometheus/baton.rules.yml"))
    return os.path.dirname(os.path.dirname(os.path.dirname(real)))


def known_metrics():
    root = source_root()
    names, histograms = set(), set()
    files = 0
    for dirpath, dirnames, filenames in os.walk(root):
        dirnames[:] = [d for d in dirnames if not d.startswith((".", "bazel-")) and d != "third_party"]
        for f in filenames:
            if not f.endswith((".cc", ".h")) or f.endswith("_test.cc"):
                continue
            files += 1
            with open(os.path.join(dirpath, f), errors="replace") as fh:
                text = fh.read()
            for m in re.finditer(r'Build(Counter|Gauge|Histogram|Summary)\(\)\s*\.Name\("(baton_\w+)"\)', text):
                names.add(m.group(2))
                if m.group(1) in ("Histogram", "Summary"):
                    histograms.add(m.group(2))
    if files < 20 or len(names) < 10:
        fail(f"found only {len(names)} metrics in {files} source files under {root}: is the source tree there?")
    for h in histograms:
        names.update({h + "_bucket", h + "_sum", h + "_count"})
    return names


def main():
    metrics = known_metrics()
    rules = opslib.load_rules(opslib.runfile("deploy/prometheus/baton.rules.yml"))
    known = metrics | {name for kind, name, _ in rules if kind == "record"} | {"up", "ALERTS", "ALERTS_FOR_STATE"}
    print(f"{len(metrics)} metrics in the source, {len(known)} known names in all")

    for kind, name, expr in rules:
        for m in opslib.metric_names(expr) - known:
            fail(f"rule {name}: unknown metric {m}")
    # Every alert's runbook is a heading of docs/operations.md.
    with open(os.path.join(source_root(), "docs/operations.md")) as f:
        anchors = {re.sub(r"[^a-z0-9 -]", "", h.strip().lower()).replace(" ", "-")
                   for h in re.findall(r"^#+ (.*)$", f.read(), re.M)}
    with open(opslib.runfile("deploy/prometheus/baton.rules.yml")) as f:
        import yaml  # noqa: PLC0415
        for group in yaml.safe_load(f)["groups"]:
            for rule in group["rules"]:
                if "alert" not in rule:
                    continue
                runbook = rule.get("annotations", {}).get("runbook", "")
                if not runbook.startswith("docs/operations.md#") or runbook.split("#", 1)[1] not in anchors:
                    fail(f"alert {rule['alert']}: runbook {runbook!r} is not a heading of docs/operations.md")

    paths = sorted(glob.glob(opslib.runfile("deploy/grafana/*.json")))
    if len(paths) < 2:
        fail(f"expected the cluster and training-job dashboards, found {paths}")
    uids = set()
    for path in paths:
        fname = os.path.basename(path)
        with open(path) as f:
            d = json.load(f)
        if d.get("uid") != fname[:-5] or d["uid"] in uids:
            fail(f"{fname}: uid {d.get('uid')!r} must be the file name without .json (stable links)")
        uids.add(d.get("uid"))
        if not d.get("title"):
            fail(f"{fname}: no title")
        variables = d.get("templating", {}).get("list", [])
        names = [v["name"] for v in variables]
        for want in ("datasource", "training_job", "stage"):
            if want not in names:
                fail(f"{fname}: no ${want} variable")
        defined = set(BUILTIN_VARS)
        for v in variables:
            if v["name"] == "datasource":
                if v.get("type") != "datasource" or v.get("query") != "prometheus":
                    fail(f"{fname}: $datasource must be a data source variable of type prometheus")
            else:
                q = v["query"]["query"] if isinstance(v.get("query"), dict) else v.get("query", "")
                if v.get("datasource") != {"type": "prometheus", "uid": "${datasource}"}:
                    fail(f"{fname}: ${v['name']} must query ${{datasource}}")
                m = re.fullmatch(r"label_values\((?:(.*),\s*)?(\w+)\)", q.strip())
                if not m:
                    fail(f"{fname}: ${v['name']}: query {q!r} is not label_values(...)")
                else:
                    check_expr(f"{fname}: ${v['name']}", m.group(1) or "", known, defined)
            defined.add(v["name"])
        ids = set()
        for p in opslib.panels(d):
            where = f"{fname}: panel {p.get('title')!r}"
            if p.get("id") in ids:
                fail(f"{where}: duplicate id {p.get('id')}")
            ids.add(p.get("id"))
            if "gridPos" not in p:
                fail(f"{where}: no gridPos")
            if p.get("type") == "row":
                continue
            if not p.get("title"):
                fail(f"{fname}: panel {p.get('id')} has no title")
            if p.get("datasource") != {"type": "prometheus", "uid": "${datasource}"}:
                fail(f"{where}: data source must be ${{datasource}}, is {p.get('datasource')}")
            defaults = p.get("fieldConfig", {}).get("defaults", {})
            if not defaults.get("unit"):
                fail(f"{where}: no unit")
            if not defaults.get("thresholds", {}).get("steps"):
                fail(f"{where}: no thresholds")
            if not p.get("targets"):
                fail(f"{where}: no queries")
            for t in p.get("targets", []):
                if t.get("datasource") not in (None, {"type": "prometheus", "uid": "${datasource}"}):
                    fail(f"{where} {t.get('refId')}: target data source must be ${{datasource}}")
                if not t.get("expr"):
                    fail(f"{where} {t.get('refId')}: empty query")
                    continue
                check_expr(f"{where} {t.get('refId')}", t["expr"], known, defined)
    print(f"dashboards lint: {len(failures)} failure(s)")
    return 1 if failures else 0


def check_expr(where, expr, known, defined):
    for var in re.findall(r"\$\{(\w+)(?::\w+)?\}|\[\[(\w+)\]\]|\$(\w+)", expr):
        name = next(x for x in var if x)
        if name not in defined:
            fail(f"{where}: ${name} is not defined (before this point)")
    for m in opslib.metric_names(expr) - known:
        fail(f"{where}: unknown metric {m}")
    for m in re.finditer(r"\b(i?rate)\([^()]*\[([^\]]*)\]", expr):
        if m.group(2) != "$__rate_interval":
            fail(f"{where}: {m.group(1)}() over [{m.group(2)}]: use [$__rate_interval]")


if __name__ == "__main__":
    sys.exit(main())
