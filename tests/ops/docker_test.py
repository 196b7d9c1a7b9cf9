#!/usr/bin/env python3
"""The container image (deploy/docker/Dockerfile) without a container engine:
  - multi-stage, every final stage runs as a non-root USER, the GPU stage
    takes CUDA from a *runtime* (not devel) image;
  - every file a COPY takes from the build context exists in the source tree
    and is not excluded by .dockerignore;
  - every package an `apt-get install` names exists in Debian 12's package
    lists (apt-cache on this Debian 12 machine: a bookworm candidate);
  - the runtime stage names the Debian package of every shared library the
    built binaries link (libc6 too: nothing is left to the base image), and the GPU
    stage copies every CUDA library they link.
"""
import fnmatch
import glob
import os
import re
import subprocess
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import opslib  # noqa: E402

failures = []


def fail(msg):
    print("FAIL:", msg)
    failures.append(msg)


def instructions(text):
    """(stage, instruction, arguments), continuation lines joined, comments dropped."""
    lines, cur = [], ""
    for raw in text.splitlines():
        if not cur and raw.lstrip().startswith("#"):
            continue
        if raw.rstrip().endswith("\\"):
            cur += raw.rstrip()[:-1] + " "
            continue
        cur += raw
        if cur.strip():
            lines.append(cur.strip())
        cur = ""
    out, stage, args = [], None, {}
    for line in lines:
        word, _, rest = line.partition(" ")
        word = word.upper()
        if word == "ARG" and stage is None:
            k, _, v = rest.partition("=")
            args[k.strip()] = v.strip()
        if word == "FROM":
            m = re.fullmatch(r"(\S+)(?:\s+AS\s+(\S+))?", rest.strip(), re.I)
            image = re.sub(r"\$\{(\w+)\}", lambda a: args.get(a.group(1), a.group(0)), m.group(1))
            stage = m.group(2) or image
            out.append((stage, "FROM", image))
            continue
        out.append((stage, word, rest))
    return out


def dockerignore(root):
    path = os.path.join(root, ".dockerignore")
    if not os.path.exists(path):
        fail(".dockerignore is missing: the whole tree (bazel-*, .git) would be sent as the build context")
        return []
    with open(path) as f:
        return [l.strip() for l in f if l.strip() and not l.startswith("#")]


def ignored(rel, patterns):
    return any(fnmatch.fnmatch(rel, p) or fnmatch.fnmatch(rel.split("/")[0], p) or
               (p.startswith("**/") and fnmatch.fnmatch(os.path.basename(rel), p[3:])) for p in patterns)


def main():
    dockerfile = opslib.runfile("deploy/docker/Dockerfile")
    # The build context is the repository root: the source tree behind the runfile's symlink.
    root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.realpath(dockerfile))))
    with open(dockerfile) as f:
        ins = instructions(f.read())
    stages = [(s, image) for s, w, image in ins if w == "FROM"]
    names = [s for s, _ in stages]
    if len(stages) < 3:
        fail(f"not multi-stage: {names}")
    for target in ("runtime-cpu", "runtime-gpu"):
        if target not in names:
            fail(f"no stage {target}")
            continue
        users = [a for s, w, a in ins if s == target and w == "USER"]
        if not users or users[-1].split(":")[0] in ("0", "root"):
            fail(f"{target} must end as a non-root USER (has {users})")
    cuda = {s: image for s, image in stages if "nvidia/cuda" in image}
    for s, w, a in ins:
        if s == "runtime-gpu" and w == "COPY":
            m = re.search(r"--from=(\S+)", a)
            if m and m.group(1) in cuda and "-runtime-" not in cuda[m.group(1)]:
                fail(f"runtime-gpu copies from {cuda[m.group(1)]}, not a CUDA runtime image")

    patterns = dockerignore(root)
    for s, w, a in ins:
        if w not in ("COPY", "ADD") or "--from=" in a:
            continue
        parts = [p for p in a.split() if not p.startswith("--")]
        for src in parts[:-1]:
            src = src.rstrip("/")
            if src == ".":
                continue
            hits = glob.glob(os.path.join(root, src))
            if not hits:
                fail(f"stage {s}: COPY {src}: no such file in the build context")
            elif ignored(src, patterns):
                fail(f"stage {s}: COPY {src}: excluded by .dockerignore")

    installs = {}
    for s, w, a in ins:
        if w != "RUN":
            continue
        for m in re.finditer(r"apt-get install ([^&;|]*)", a):
            pkgs = [p for p in m.group(1).split() if not p.startswith("-") and "=" not in p]
            installs.setdefault(s, []).extend(pkgs)
    every = sorted({p for pkgs in installs.values() for p in pkgs})
    policy = subprocess.run(["apt-cache", "policy"] + every, capture_output=True, text=True, timeout=300).stdout
    sections = {m.group(1): m.group(2) for m in re.finditer(r"^(\S+):\n((?:\s+.*\n?)*)", policy, re.M)}
    for s, pkgs in installs.items():
        for p in pkgs:
            sec = sections.get(p, "")
            cand = re.search(r"Candidate:\s*(\S+)", sec)
            if not cand or cand.group(1) == "(none)" or "bookworm" not in sec:
                fail(f"stage {s}: apt package {p} is not in Debian 12's package lists")
    runtime = installs.get("runtime-base", [])
    if not runtime:
        fail("runtime-base installs no runtime libraries")

    # What the binaries link, and where it comes from.
    gpu_copies = " ".join(a for s, w, a in ins if s == "runtime-gpu" and w == "COPY")
    linked = {}  # path -> (binary, soname)
    for binary in ("coordinator/baton-coordinator", "worker/baton-worker", "cli/batonctl"):
        # What the image's loader would pick: without LD_LIBRARY_PATH (scripts/tsan.sh
        # points it at an instrumented Abseil, which is not in the image).
        env = {k: v for k, v in os.environ.items() if k != "LD_LIBRARY_PATH"}
        out = subprocess.run(["ldd", opslib.runfile(binary)], capture_output=True, text=True, env=env).stdout
        for lib, path in re.findall(r"^\s*(\S+) => (/\S+)", out, re.M):
            if "/cuda" in path:
                if not any(fnmatch.fnmatch(lib, os.path.basename(p)) for p in re.findall(r"(\S+\.so\S*)", gpu_copies)):
                    fail(f"{binary} links {lib} ({path}); runtime-gpu does not copy it")
                continue
            linked[path] = (binary, lib)
    # dpkg knows /usr/lib paths (merged /usr) and the real files behind alternatives.
    queries = {}
    for path in linked:
        for q in {path, os.path.realpath(path), "/usr" + path if path.startswith("/lib") else path}:
            queries[q] = path
    owners = {}
    r = subprocess.run(["dpkg", "-S"] + sorted(queries), capture_output=True, text=True, timeout=120)
    for line in r.stdout.splitlines():
        pkg, _, q = line.partition(": ")
        if q in queries:
            owners[queries[q]] = pkg.split(":")[0]
    for path, (binary, lib) in sorted(linked.items()):
        pkg = owners.get(path)
        if pkg is None:
            fail(f"{binary} links {path}, which no Debian package provides")
        elif pkg not in runtime:
            fail(f"{binary} links {lib} from Debian package {pkg}, which runtime-base does not install")
    print(f"docker: {len(stages)} stages, {sum(len(p) for p in installs.values())} apt packages checked; "
          f"{len(failures)} failure(s)")
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
