#!/usr/bin/env bash
# Checks the Prometheus rules with the real promtool: syntax, then unit tests.
set -euo pipefail
if ! command -v promtool >/dev/null; then
  echo "promtool not found: run scripts/setup.sh (Debian package 'prometheus')" >&2
  exit 1
fi
dir=${TEST_SRCDIR:-.}/${TEST_WORKSPACE:-baton}/deploy/prometheus
promtool check rules "$dir/baton.rules.yml"
cd "$dir" && promtool test rules baton.rules.test.yml
