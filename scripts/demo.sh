#!/usr/bin/env bash
# The main job: sets up, builds, and trains the demo GPT (examples/demo.textproto,
# pipeline 2 x tensor 2 on CPU) with a local coordinator and four worker
# daemons on loopback, printing live progress (step, loss, accuracy, tokens/s,
# bubble %, comm %) and a final summary. Results land in out/demo/
# (summary.json, steps.jsonl, trace.json for ui.perfetto.dev, final/ weights).
# Ctrl-C stops everything cleanly.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
bazel build //coordinator:baton-coordinator //worker:baton-worker //cli:batonctl
out=${BATON_DEMO_OUT:-out/demo}
rm -rf "$out"
exec bazel-bin/cli/batonctl local --job=examples/demo.textproto --out="$out"
