#!/usr/bin/env python3
"""Writes the Hugging Face Llama goldens for //tests/hf:hf_llama_golden_test.

transformers itself builds two tiny LlamaForCausalLM models with random
weights — every matrix scaled up from the 0.02 init and every RMSNorm weight
perturbed away from 1, so the norms matter and the logits are far from
uniform — and saves each with save_pretrained (safetensors):

  llama_tiny          2 layers, hidden 32, 4 heads, 2 key/value heads (GQA),
                      intermediate 48, vocab 64, 16 positions, rope_theta
                      500000, rms_norm_eps 1e-6, an untied lm_head
  llama_tiny_sharded  the same model saved with a small max_shard_size
                      (model.safetensors.index.json and several shards)
  llama_tiny_tied     4 key/value heads (plain multi-head attention),
                      tie_word_embeddings true, rope_theta 10000

Each model runs forward and backward in float64 (eager attention) on a fixed
token batch with labels = tokens. <model>_golden.safetensors holds the tokens
and next-token targets (I32 [batch, seq]; the last position of each row is
-1, not scored), the logits (F64 [batch, seq, vocab]), the mean
cross-entropy (F64 [1]) and, under "grad/<baton name>", the gradient of the
loss with respect to every parameter (F64, the parameter's shape). baton's
name is HF's without "model." ("embed_tokens.weight", "layers.0.mlp.up_proj.weight",
"norm.weight", "lm_head.weight"); the tied model has no lm_head, and its
embed_tokens gradient is the sum of both uses. Written with the standard
library, as gen_hf_golden.py does.

Needs PyTorch and transformers (scripts/setup.sh prepares a venv):

  ~/.cache/baton/hf-venv/bin/python tests/hf/gen_hf_llama_golden.py --out tests/hf/testdata
"""

import argparse
import json
import os
import shutil
import struct

import torch
import transformers
from transformers import LlamaConfig, LlamaForCausalLM

from gen_hf_golden import pack, write_safetensors  # the same writer as the GPT-2 goldens

BATCH = 2
COMMON = dict(
    num_hidden_layers=2, hidden_size=32, num_attention_heads=4, intermediate_size=48, vocab_size=64,
    max_position_embeddings=16, rms_norm_eps=1e-6, hidden_act="silu",
)
MODELS = {
    "llama_tiny": dict(COMMON, num_key_value_heads=2, rope_theta=500000.0, tie_word_embeddings=False),
    "llama_tiny_tied": dict(COMMON, num_key_value_heads=4, rope_theta=10000.0, tie_word_embeddings=True),
}


def baton_name(hf_name):
    return hf_name[len("model."):] if hf_name.startswith("model.") else hf_name


def generate(out_dir, name, kwargs, seed, sharded):
    torch.manual_seed(seed)
    config = LlamaConfig(**kwargs)
    config._attn_implementation = "eager"
    model = LlamaForCausalLM(config).eval()
    with torch.no_grad():
        for pname, p in model.named_parameters():
            if pname.endswith("norm.weight"):
                p.copy_(1.0 + 0.3 * torch.randn_like(p))  # RMSNorm weights away from 1
            elif pname.endswith("embed_tokens.weight"):
                p.mul_(25.0)
            else:
                p.mul_(10.0)
    subs = [(name, {})] + ([(name + "_sharded", {"max_shard_size": "30KB"})] if sharded else [])
    for sub, save_kwargs in subs:
        path = os.path.join(out_dir, sub)
        shutil.rmtree(path, ignore_errors=True)
        model.save_pretrained(path, safe_serialization=True, **save_kwargs)
    if sharded:
        assert os.path.exists(os.path.join(out_dir, name + "_sharded", "model.safetensors.index.json"))

    vocab = kwargs["vocab_size"]
    seq = kwargs["max_position_embeddings"]
    g = torch.Generator().manual_seed(seed + 1)
    tokens = torch.randint(0, vocab, (BATCH, seq), generator=g)
    targets = torch.full_like(tokens, -1)
    targets[:, :-1] = tokens[:, 1:]
    model64 = model.double()
    model64.zero_grad()
    out = model64(input_ids=tokens, labels=tokens)
    out.loss.backward()
    logits = out.logits.detach()
    mine = torch.nn.functional.cross_entropy(logits.reshape(-1, vocab), targets.reshape(-1), ignore_index=-1)
    assert abs(mine.item() - out.loss.item()) <= 1e-12 * abs(out.loss.item()), (mine.item(), out.loss.item())

    tensors = {
        "tokens": ("I32", tokens.shape, pack("i", tokens.flatten().tolist())),
        "targets": ("I32", targets.shape, pack("i", targets.flatten().tolist())),
        "logits": ("F64", logits.shape, pack("d", logits.flatten().tolist())),
        "loss": ("F64", (1,), pack("d", [out.loss.item()])),
    }
    for pname, p in model64.named_parameters():  # the tied lm_head is not listed twice
        tensors["grad/" + baton_name(pname)] = ("F64", p.shape, pack("d", p.grad.flatten().tolist()))
    write_safetensors(
        os.path.join(out_dir, name + "_golden.safetensors"),
        tensors,
        {
            "batch": str(BATCH), "seq_len": str(seq), "vocab": str(vocab), "seed": str(seed),
            "transformers": transformers.__version__, "torch": torch.__version__,
        },
    )
    print(name, "loss", out.loss.item(), "parameters", sum(1 for _ in model64.parameters()))


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", required=True, help="directory for llama_tiny*/ and the goldens")
    parser.add_argument("--seed", type=int, default=4321)
    args = parser.parse_args()
    for i, (name, kwargs) in enumerate(MODELS.items()):
        generate(args.out, name, kwargs, args.seed + 10 * i, sharded=(name == "llama_tiny"))


if __name__ == "__main__":
    main()
