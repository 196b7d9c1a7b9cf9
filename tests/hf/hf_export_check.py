#!/usr/bin/env python3
"""baton's export, loaded by transformers itself.

For the whole and the sharded golden directory (tests/hf/testdata, written by
gen_hf_golden.py): `batonctl checkpoint import-hf` into a baton checkpoint,
`batonctl checkpoint export-hf` back out, then
`GPT2LMHeadModel.from_pretrained(exported)` must load without missing or
unexpected keys, hold the original weights bit for bit, and give the golden's
float64 logits and loss on the golden's batch. Also exports with
--seq_len=8 (n_positions 8 in the export) and checks the logits of the first
8 positions.

Runs under the venv scripts/setup.sh prepares (PyTorch from Debian's
python3-torch, transformers from PyPI): $BATON_HF_VENV, else
~/.cache/baton/hf-venv. Without it the check FAILS (it does not skip), saying
how to create it.

  python3 tests/hf/hf_export_check.py --batonctl=bazel-bin/cli/batonctl --testdata=tests/hf/testdata
"""
import argparse
import json
import os
import struct
import subprocess
import sys
import tempfile


def venv_python():
    venv = os.environ.get("BATON_HF_VENV") or os.path.join(os.environ.get("HOME", "/root"), ".cache/baton/hf-venv")
    return venv, os.path.join(venv, "bin", "python")


def reexec_in_venv(script=__file__):
    """Runs `script` (this file by default) again under the venv's python,
    with the same arguments, unless already there; FAILS without the venv."""
    venv, python = venv_python()
    if os.path.realpath(sys.prefix) == os.path.realpath(venv):
        return
    if not os.path.exists(python):
        print(f"FAIL: no Hugging Face venv at {venv} (needs torch and transformers): run scripts/setup.sh")
        sys.exit(1)
    os.execv(python, [python, os.path.abspath(script)] + sys.argv[1:])


def read_safetensors(path):
    with open(path, "rb") as f:
        data = f.read()
    n = struct.unpack("<Q", data[:8])[0]
    header = json.loads(data[8:8 + n])
    out = {}
    for name, e in header.items():
        if name == "__metadata__":
            continue
        b, end = e["data_offsets"]
        raw = data[8 + n + b:8 + n + end]
        fmt = {"F64": "d", "F32": "f", "I32": "i"}[e["dtype"]]
        out[name] = (e["shape"], list(struct.unpack("<%d%s" % (len(raw) // struct.calcsize(fmt), fmt), raw)))
    return out


def run(cmd):
    p = subprocess.run(cmd, capture_output=True, text=True)
    if p.returncode != 0:
        print("FAIL:", " ".join(cmd), "exited", p.returncode, "\n", p.stdout, p.stderr)
        sys.exit(1)
    print(p.stdout.strip())


def main():
    reexec_in_venv()
    import torch
    import transformers
    from transformers import GPT2LMHeadModel

    parser = argparse.ArgumentParser()
    parser.add_argument("--batonctl", required=True)
    parser.add_argument("--testdata", required=True)
    args = parser.parse_args()
    print("transformers", transformers.__version__, "torch", torch.__version__)

    golden = read_safetensors(os.path.join(args.testdata, "gpt2_tiny_golden.safetensors"))
    tshape, tvals = golden["tokens"]
    tokens = torch.tensor(tvals, dtype=torch.long).view(*tshape)
    logits_shape, logits_vals = golden["logits"]
    want_logits = torch.tensor(logits_vals, dtype=torch.float64).view(*logits_shape)
    want_loss = golden["loss"][1][0]

    failures = []
    tmp = tempfile.mkdtemp(dir=os.environ.get("TEST_TMPDIR"))
    original = GPT2LMHeadModel.from_pretrained(os.path.join(args.testdata, "gpt2_tiny")).state_dict()
    for sub, seq_len in (("gpt2_tiny", None), ("gpt2_tiny_sharded", None), ("gpt2_tiny", 8)):
        tag = f"{sub}" + (f" --seq_len={seq_len}" if seq_len else "")
        ckpt = os.path.join(tmp, f"ckpt-{sub}-{seq_len}")
        out = os.path.join(tmp, f"hf-{sub}-{seq_len}")
        run([args.batonctl, "checkpoint", "import-hf", os.path.join(args.testdata, sub), f"--out={ckpt}"] +
            ([f"--seq_len={seq_len}"] if seq_len else []))
        run([args.batonctl, "checkpoint", "export-hf", ckpt, f"--out={out}"])
        model, info = GPT2LMHeadModel.from_pretrained(out, output_loading_info=True)
        missing = [k for k in info["missing_keys"] if not k.endswith(("attn.bias", "attn.masked_bias"))]
        if missing or info["unexpected_keys"] or info["mismatched_keys"] or info["error_msgs"]:
            failures.append(f"{tag}: loading info {info}")
        if model.lm_head.weight.data_ptr() != model.transformer.wte.weight.data_ptr():
            failures.append(f"{tag}: lm_head is not tied to wte")
        for name, value in model.state_dict().items():
            if name.endswith(("attn.bias", "attn.masked_bias")):
                continue
            want = original[name][:seq_len] if (seq_len and name == "transformer.wpe.weight") else original[name]
            if not torch.equal(value, want):
                failures.append(f"{tag}: {name} differs from the original")
        model = model.double().eval()
        t = seq_len or tokens.shape[1]
        with torch.no_grad():
            got = model(input_ids=tokens[:, :t], labels=tokens[:, :t])
        err = (got.logits - want_logits[:, :t]).abs().max().item()
        print(f"{tag}: max |logits - golden| = {err:.3g}, loss {got.loss.item():.12g} (golden {want_loss:.12g})")
        if err > 1e-9:
            failures.append(f"{tag}: logits differ from the golden by {err}")
        if seq_len is None and abs(got.loss.item() - want_loss) > 1e-9 * abs(want_loss):
            failures.append(f"{tag}: loss {got.loss.item()} but the golden's is {want_loss}")
    for f in failures:
        print("FAIL:", f)
    if failures:
        sys.exit(1)
    print("PASS")


if __name__ == "__main__":
    main()
