#!/usr/bin/env python3
"""baton's Llama export, loaded by transformers itself.

For each Llama golden directory in tests/hf/testdata (gen_hf_llama_golden.py:
llama_tiny, its sharded save, llama_tiny_tied): `batonctl checkpoint
import-hf` into a baton checkpoint, `batonctl checkpoint export-hf` back out,
then `LlamaForCausalLM.from_pretrained(exported)` must load without missing,
unexpected or mismatched keys, tie (or not) its head as the original does,
read the original's config (sizes, kv heads, rope_theta, rms_norm_eps,
tie_word_embeddings, silu, no rope_scaling; torch_dtype float32), hold the
original weights bit for bit, and give the golden's float64 logits and loss
on the golden's batch (max |logits - golden| <= 1e-9; it is 0 when the
weights are bit-identical).

Runs under the venv scripts/setup.sh prepares, as hf_export_check.py does
(whose safetensors reader it uses): $BATON_HF_VENV, else ~/.cache/baton/hf-venv; FAILS
without it.

  python3 tests/hf/hf_llama_export_check.py --batonctl=bazel-bin/cli/batonctl --testdata=tests/hf/testdata
"""
import argparse
import json
import os
import sys
import tempfile

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from hf_export_check import read_safetensors, reexec_in_venv, run  # noqa: E402

CONFIG_FIELDS = (
    "hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads", "num_key_value_heads",
    "vocab_size", "max_position_embeddings", "rms_norm_eps", "rope_theta", "tie_word_embeddings", "hidden_act",
    "rope_scaling", "attention_bias",
)
CASES = (("llama_tiny", "llama_tiny"), ("llama_tiny_sharded", "llama_tiny"), ("llama_tiny_tied", "llama_tiny_tied"))


def main():
    reexec_in_venv(__file__)
    import torch
    import transformers
    from transformers import LlamaForCausalLM

    parser = argparse.ArgumentParser()
    parser.add_argument("--batonctl", required=True)
    parser.add_argument("--testdata", required=True)
    args = parser.parse_args()
    print("transformers", transformers.__version__, "torch", torch.__version__)

    failures = []
    tmp = tempfile.mkdtemp(dir=os.environ.get("TEST_TMPDIR"))
    for sub, golden_name in CASES:
        golden = read_safetensors(os.path.join(args.testdata, f"{golden_name}_golden.safetensors"))
        tshape, tvals = golden["tokens"]
        tokens = torch.tensor(tvals, dtype=torch.long).view(*tshape)
        lshape, lvals = golden["logits"]
        want_logits = torch.tensor(lvals, dtype=torch.float64).view(*lshape)
        want_loss = golden["loss"][1][0]

        src = os.path.join(args.testdata, sub)
        ckpt = os.path.join(tmp, f"ckpt-{sub}")
        out = os.path.join(tmp, f"hf-{sub}")
        run([args.batonctl, "checkpoint", "import-hf", src, f"--out={ckpt}"])
        run([args.batonctl, "checkpoint", "export-hf", ckpt, f"--out={out}"])

        with open(os.path.join(src, "config.json")) as f:
            want_config = json.load(f)
        with open(os.path.join(out, "config.json")) as f:
            got_config = json.load(f)
        if got_config.get("model_type") != "llama" or got_config.get("architectures") != ["LlamaForCausalLM"]:
            failures.append(f"{sub}: config.json model_type/architectures {got_config.get('model_type')} "
                            f"{got_config.get('architectures')}")
        if got_config.get("torch_dtype") != "float32":
            failures.append(f"{sub}: config.json torch_dtype {got_config.get('torch_dtype')}")
        for field in CONFIG_FIELDS:
            if got_config.get(field) != want_config.get(field):
                failures.append(f"{sub}: config.json {field} {got_config.get(field)!r}, "
                                f"the original's {want_config.get(field)!r}")

        original = LlamaForCausalLM.from_pretrained(src).state_dict()
        model, info = LlamaForCausalLM.from_pretrained(out, output_loading_info=True, attn_implementation="eager")
        if info["missing_keys"] or info["unexpected_keys"] or info["mismatched_keys"] or info["error_msgs"]:
            failures.append(f"{sub}: loading info {info}")
        tied = model.lm_head.weight.data_ptr() == model.model.embed_tokens.weight.data_ptr()
        if tied != want_config["tie_word_embeddings"]:
            failures.append(f"{sub}: lm_head tied {tied}, the original's tie_word_embeddings "
                            f"{want_config['tie_word_embeddings']}")
        state = model.state_dict()
        if set(state) != set(original):
            failures.append(f"{sub}: parameters {sorted(set(state) ^ set(original))} differ from the original's")
        for name, value in state.items():
            if name in original and not torch.equal(value, original[name]):
                failures.append(f"{sub}: {name} differs from the original")
        model = model.double().eval()
        with torch.no_grad():
            got = model(input_ids=tokens, labels=tokens)
        err = (got.logits - want_logits).abs().max().item()
        print(f"{sub}: max |logits - golden| = {err:.3g}, loss {got.loss.item():.12g} (golden {want_loss:.12g})")
        if err > 1e-9:
            failures.append(f"{sub}: logits differ from the golden by {err}")
        if abs(got.loss.item() - want_loss) > 1e-9 * abs(want_loss):
            failures.append(f"{sub}: loss {got.loss.item()} but the golden's is {want_loss}")
    for f in failures:
        print("FAIL:", f)
    if failures:
        sys.exit(1)
    print("PASS")


if __name__ == "__main__":
    main()
