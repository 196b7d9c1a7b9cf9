#!/bin/bash
# No binary links another binary's internals: the pieces the daemons and
# batonctl share live in common/ (docs/build.md, "Visibility and layering").
# The inputs are `deps()` of each binary as XML, from genquery targets in
# BUILD; every edge that crosses into a forbidden package is named, e.g.
#   baton-worker: //worker:agent -> //coordinator:job_spec
set -u
here=tests/layering
failures=0

# check NAME BINARY FORBIDDEN [ALLOWED]: in deps(BINARY) no rule outside
# FORBIDDEN has an input matching FORBIDDEN (an ERE on labels) unless it
# matches ALLOWED.
check() {
  local name=$1 binary=$2 forbidden=$3 allowed=${4:-^$}
  local file="$here/${name}_deps"
  [[ -s "$file" ]] || { echo "FAIL $name: $file is missing or empty"; failures=$((failures + 1)); return; }
  # Not vacuous: the query holds the binary and the common/ libraries it links.
  if ! grep -q "<rule class=\"cc_binary\" [^>]*name=\"$binary\"" "$file" ||
     ! grep -q '<rule [^>]*name="//common:' "$file"; then
    echo "FAIL $name: $file does not hold deps($binary)"
    failures=$((failures + 1))
    return
  fi
  local edges
  edges=$(awk -v bad="$forbidden" -v ok="$allowed" '
    /<rule / { match($0, /name="[^"]*"/); rule = substr($0, RSTART + 6, RLENGTH - 7) }
    /<rule-input name="/ {
      match($0, /name="[^"]*"/); dep = substr($0, RSTART + 6, RLENGTH - 7)
      from_bad = (rule ~ bad && rule !~ ok)
      if (!from_bad && dep ~ bad && dep !~ ok) print "  " rule " -> " dep
    }' "$file" | sort -u)
  if [[ -n "$edges" ]]; then
    echo "FAIL $binary links packages it must not (pattern $forbidden; move what is shared to common/):"
    echo "$edges"
    failures=$((failures + 1))
  else
    echo "ok   $binary: $(grep -c '<rule ' "$file") rules, none matching $forbidden"
  fi
}

# Tests and benchmarks are never linked into a shipped binary.
no_test_code='^//(tests|bench)[/:]'
check worker //worker:baton-worker "^//(coordinator|cli)[/:]|$no_test_code"
check coordinator //coordinator:baton-coordinator "^//(worker|cli)[/:]|$no_test_code"
# batonctl reads job specs and draws schedules with the coordinator's public
# libraries for that (visibility names //cli); nothing of the worker.
check batonctl //cli:batonctl "^//(worker|coordinator)[/:]|$no_test_code" \
  '^//coordinator/schedule:|^//coordinator:job_spec(\.cc|\.h)?$'

# Private by default: of what the binaries link, only proto, the system
# libraries and common/ are public (genquery's --xml:default_values shows a
# package's default visibility as the rule's own).
public_ok='^//(proto|third_party|common)[/:]'
for name in worker coordinator batonctl; do
  public=$(awk -v ok="$public_ok" '
    /<rule / { match($0, /name="[^"]*"/); rule = substr($0, RSTART + 6, RLENGTH - 7) }
    /<list name="visibility">/ { in_vis = 1 }
    /<\/list>/ { in_vis = 0 }
    in_vis && /value="\/\/visibility:public"/ && rule ~ /^\/\// && rule !~ ok { print "  " rule }
  ' "$here/${name}_deps" | sort -u)
  if [[ -n "$public" ]]; then
    echo "FAIL public outside proto/, third_party/, common/ (give the target a visibility naming its users):"
    echo "$public"
    failures=$((failures + 1))
  fi
done

if ((failures > 0)); then
  echo "$failures layering violation(s)"
  exit 1
fi
echo "layering ok"
