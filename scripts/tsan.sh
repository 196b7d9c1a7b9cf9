#!/usr/bin/env bash
# ThreadSanitizer run of the CPU tests (docs/build.md, "ThreadSanitizer").
#
# Debian's Abseil is built with GCC and without -fsanitize=thread, so TSan
# would not see absl::Mutex lock/unlock and would report every
# ABSL_GUARDED_BY field as a race. This script therefore:
#   1. once, builds Debian 12's own Abseil source (apt-get source, the
#      package's patches applied: same version, options.h, inline namespace
#      and SONAMEs as libabsl20220623) as shared libraries with clang
#      -fsanitize=thread, cached in $BATON_TSAN_CACHE/absl-<version>/lib;
#   2. runs `bazel test --config=tsan --config=cpu` (own output base) with
#      LD_LIBRARY_PATH pointing there, so the tests, the daemons they start and
#      Debian's gRPC/protobuf (which link libabsl dynamically) all load the
#      instrumented copy. The link still uses Debian's libabsl-dev (same ABI).
#   3. checks first that the instrumentation took: a racy program must be
#      reported, an absl::Mutex-protected one must not.
# Usage: scripts/tsan.sh [bazel test flags and targets...]   (default //...)
# Env: BATON_TSAN_CACHE (default $HOME/.cache/baton-tsan),
#      BATON_TSAN_OUTPUT_BASE (default $HOME/.cache/baton-bazel-tsan),
#      BATON_TSAN_JOBS (default 2: jobs of the Abseil build).
set -euo pipefail
cd "$(dirname "$0")/.."
repo=$PWD
cache=${BATON_TSAN_CACHE:-$HOME/.cache/baton-tsan}
output_base=${BATON_TSAN_OUTPUT_BASE:-$HOME/.cache/baton-bazel-tsan}
jobs=${BATON_TSAN_JOBS:-2}
# The Abseil that Debian's gRPC and protobuf were linked against.
absl_version=$(dpkg-query -W -f='${Version}' libabsl20220623 2>/dev/null) || {
  echo "tsan.sh: libabsl20220623 is not installed (scripts/setup.sh)" >&2; exit 1; }
absl_dir=$cache/absl-$absl_version
absl_lib=$absl_dir/lib

log() { echo "tsan.sh: $*"; }

build_absl() {
  local work=$absl_dir/work apt=$cache/apt
  rm -rf "$work" "$absl_lib"
  mkdir -p "$work" "$apt/lists/partial" "$apt/cache/archives/partial"
  # A private apt configuration with deb-src lines: nothing in /etc changes.
  cat > "$apt/sources.list" <<'EOF'
deb-src [signed-by=/usr/share/keyrings/debian-archive-keyring.gpg] http://deb.debian.org/debian bookworm main
deb-src [signed-by=/usr/share/keyrings/debian-archive-keyring.gpg] http://deb.debian.org/debian bookworm-updates main
deb-src [signed-by=/usr/share/keyrings/debian-archive-keyring.gpg] http://deb.debian.org/debian-security bookworm-security main
EOF
  local opts=(-o "Dir::Etc::SourceList=$apt/sources.list" -o Dir::Etc::SourceParts=/dev/null
              -o "Dir::State::Lists=$apt/lists" -o "Dir::Cache=$apt/cache"
              -o APT::Sandbox::User=root -qq)
  log "fetching the source of abseil $absl_version (apt-get source)"
  apt-get "${opts[@]}" update
  (cd "$work" && apt-get "${opts[@]}" source --only-source "abseil=$absl_version")
  local src
  src=$(find "$work" -mindepth 1 -maxdepth 1 -type d -name 'abseil-*' | head -n1)
  [ -n "$src" ] || { echo "tsan.sh: apt-get source left no abseil-* directory" >&2; exit 1; }
  # Same configuration as debian/rules' shared build (C++17, shared, no
  # NDEBUG), compiled by clang with -fsanitize=thread. The libraries leave
  # the __tsan_* symbols undefined; the test executables provide them.
  log "building instrumented Abseil (clang -fsanitize=thread, $jobs jobs)"
  local start=$SECONDS
  cmake -S "$src" -B "$work/build" -G Ninja \
    -DCMAKE_C_COMPILER=clang-14 -DCMAKE_CXX_COMPILER=clang++-14 \
    -DCMAKE_BUILD_TYPE=None -DCMAKE_CXX_STANDARD=17 -DBUILD_SHARED_LIBS=ON \
    -DBUILD_TESTING=OFF -DABSL_PROPAGATE_CXX_STD=ON \
    "-DCMAKE_C_FLAGS=-O2 -gline-tables-only -fsanitize=thread" \
    "-DCMAKE_CXX_FLAGS=-O2 -gline-tables-only -fsanitize=thread" \
    "-DCMAKE_INSTALL_PREFIX=$work/install" -DCMAKE_INSTALL_LIBDIR=lib > "$work/cmake.log"
  ninja -C "$work/build" -j "$jobs" install > "$work/ninja.log" \
    || { tail -n 30 "$work/ninja.log" >&2; exit 1; }
  # Keep only what the loader needs: the versioned shared objects and their
  # SONAME links.
  mkdir -p "$absl_lib.tmp"
  cp -a "$work"/install/lib/libabsl_*.so.* "$absl_lib.tmp/"
  mv "$absl_lib.tmp" "$absl_lib"
  rm -rf "$work"
  log "instrumented Abseil built in $((SECONDS - start)) s: $absl_lib"
}

check_absl() {  # every SONAME Debian's libabsl has must be in ours
  local f missing=0
  for f in /usr/lib/x86_64-linux-gnu/libabsl_*.so.20220623; do
    [ -e "$absl_lib/$(basename "$f")" ] || { echo "tsan.sh: missing $(basename "$f")" >&2; missing=1; }
  done
  return $missing
}

if [ ! -d "$absl_lib" ] || ! check_absl 2>/dev/null; then build_absl; fi
check_absl

sup=$repo/third_party/sanitizers/tsan.supp
# Every process (the tests and the daemons they start) writes its reports to
# $reports/tsan.<pid>: a race inside a coordinator or worker the test only
# talks to is counted too. A test process with a report exits 66 (fails).
reports=$cache/reports/$(date -u +%Y%m%dT%H%M%SZ)
mkdir -p "$reports"
# ignore_noninstrumented_modules: the accesses Debian's uninstrumented gRPC,
# protobuf, Gloo and OpenBLAS make through TSan's interceptors (memcpy,
# malloc/free, send/recv) are not checked; they synchronise through atomics
# TSan cannot see, so each would be a false report (tsan.supp says more).
tsan_options="halt_on_error=0:second_deadlock_stack=1:history_size=4:ignore_noninstrumented_modules=1:suppressions=$sup:log_path=$reports/tsan"

# 3. The instrumentation took: a plain race is reported, and memory guarded
# by absl::Mutex (lock/unlock inside the instrumented libabsl_synchronization)
# is not. Built outside Bazel (seconds), against Debian's headers.
selftest() {
  local dir
  dir=$(mktemp -d)
  cat > "$dir/t.cc" <<'EOF'
#include <thread>
#include "absl/synchronization/mutex.h"
absl::Mutex mu;
long guarded = 0;   // only under mu
long racy = 0;      // no lock at all
int main(int argc, char**) {
  auto body = [argc] {
    for (int i = 0; i < 1000; ++i) {
      if (argc > 1) { ++racy; continue; }
      absl::MutexLock lock(&mu);
      ++guarded;
    }
  };
  std::thread a(body), b(body);
  a.join(); b.join();
  return 0;
}
EOF
  clang++-14 -std=c++17 -fsanitize=thread -O1 -g "$dir/t.cc" -o "$dir/t" \
    -labsl_synchronization -labsl_base -lpthread
  local ok=1
  # With the tests' suppressions: Abseil's thread-identity report (tsan.supp)
  # comes now and then on this program too, and is not what this checks.
  if ! LD_LIBRARY_PATH=$absl_lib TSAN_OPTIONS="halt_on_error=1 suppressions=$repo/third_party/sanitizers/tsan.supp" \
       "$dir/t" 2> "$dir/mutex.err"; then
    echo "tsan.sh: self-test: absl::Mutex-guarded code reported (instrumented Abseil not in effect):" >&2
    cat "$dir/mutex.err" >&2; ok=0
  fi
  if LD_LIBRARY_PATH=$absl_lib TSAN_OPTIONS=halt_on_error=1 "$dir/t" racy 2> "$dir/race.err" \
     || ! grep -q 'WARNING: ThreadSanitizer: data race' "$dir/race.err"; then
    echo "tsan.sh: self-test: an unguarded race was NOT reported" >&2; ok=0
  fi
  # The loader really maps the instrumented copy.
  if [[ $(LD_LIBRARY_PATH=$absl_lib ldd "$dir/t") != *"$absl_lib/libabsl_synchronization"* ]]; then
    echo "tsan.sh: self-test: the loader does not pick $absl_lib" >&2; ok=0
  fi
  rm -rf "$dir"
  ((ok)) || exit 1
  log "self-test passed: race reported, absl::Mutex-guarded code not"
}
selftest

# The GCC build's convenience symlink would be walked by this server's //...
rm -f "bazel-$(basename "$PWD")"
# Arguments: bazel test flags and targets; //... unless a target is given.
args=("$@")
have_target=0
for a in "${args[@]}"; do [[ $a == -* ]] || have_target=1; done
((have_target)) || args+=(//...)
start=$SECONDS
rc=0
bazel "--output_base=$output_base" test --symlink_prefix=/ --config=tsan --config=cpu \
  --test_env="LD_LIBRARY_PATH=$absl_lib" \
  --test_env="TSAN_OPTIONS=$tsan_options" \
  "${args[@]}" || rc=$?
log "bazel test rc=$rc in $((SECONDS - start)) s"
shopt -s nullglob
files=("$reports"/tsan.*)
if ((${#files[@]})); then
  log "${#files[@]} process(es) reported (files in $reports); summaries:"
  grep -h '^SUMMARY: ThreadSanitizer' "${files[@]}" | sort | uniq -c | sort -rn
  ((rc != 0)) || rc=1
else
  log "no ThreadSanitizer report from any process"
  rmdir "$reports"
fi
exit $rc
