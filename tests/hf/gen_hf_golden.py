#!/usr/bin/env python3
"""Writes the Hugging Face goldens for //tests/hf:hf_golden_test.

transformers itself builds a tiny GPT2LMHeadModel with random weights (every
parameter perturbed or scaled up, so biases and LayerNorms are not at their
trivial initial values and the logits are far from uniform), saves it with save_pretrained (safetensors) twice — whole,
and sharded with a small max_shard_size so that model.safetensors.index.json
and several shards are written — and runs it in float64 on a fixed token
batch. The golden file holds the tokens and next-token targets (I32
[batch, seq]; the last position of each row is -1, not scored), the logits
(F64 [batch, seq, vocab]) and the mean cross-entropy (F64 [1]), the loss
transformers computes with labels=tokens. It is written with the standard
library, as tests/golden/gen_golden.py does.

Needs PyTorch and transformers (scripts/setup.sh prepares a venv):

  ~/.cache/baton/hf-venv/bin/python tests/hf/gen_hf_golden.py --out tests/hf/testdata
"""

import argparse
import json
import os
import shutil
import struct

import torch
import transformers
from transformers import GPT2Config, GPT2LMHeadModel

LAYERS, D_MODEL, HEADS, VOCAB, POSITIONS = 2, 32, 4, 64, 16
BATCH = 2


def write_safetensors(path, tensors, metadata):
    """tensors: name -> (dtype, shape, bytes); header padded to 8 bytes."""
    header = {"__metadata__": metadata}
    offset = 0
    for name, (dtype, shape, data) in sorted(tensors.items()):
        header[name] = {"dtype": dtype, "shape": list(shape), "data_offsets": [offset, offset + len(data)]}
        offset += len(data)
    text = json.dumps(header, separators=(",", ":")).encode()
    text += b" " * ((8 - len(text) % 8) % 8)
    with open(path, "wb") as f:
        f.write(struct.pack("<Q", len(text)))
        f.write(text)
        for name, (_, _, data) in sorted(tensors.items()):
            f.write(data)


def pack(fmt, values):
    return struct.pack("<%d%s" % (len(values), fmt), *values)


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", required=True, help="directory for gpt2_tiny/, gpt2_tiny_sharded/ and the golden")
    parser.add_argument("--seed", type=int, default=1234)
    args = parser.parse_args()

    torch.manual_seed(args.seed)
    config = GPT2Config(n_layer=LAYERS, n_embd=D_MODEL, n_head=HEADS, vocab_size=VOCAB, n_positions=POSITIONS)
    model = GPT2LMHeadModel(config).eval()
    with torch.no_grad():
        # Weights well above the default 0.02 init, so the logits are far
        # from uniform and a wrong transpose or mapping moves the loss a lot.
        for name, p in model.named_parameters():
            if name.endswith(".bias") or "ln_" in name:
                p.add_(0.1 * torch.randn_like(p))
            elif name.endswith("wte.weight") or name.endswith("wpe.weight"):
                p.mul_(25.0)
            else:
                p.mul_(10.0)

    for sub, kwargs in (("gpt2_tiny", {}), ("gpt2_tiny_sharded", {"max_shard_size": "40KB"})):
        path = os.path.join(args.out, sub)
        shutil.rmtree(path, ignore_errors=True)
        model.save_pretrained(path, safe_serialization=True, **kwargs)
    assert os.path.exists(os.path.join(args.out, "gpt2_tiny_sharded", "model.safetensors.index.json"))

    g = torch.Generator().manual_seed(args.seed + 1)
    tokens = torch.randint(0, VOCAB, (BATCH, POSITIONS), generator=g)
    targets = torch.full_like(tokens, -1)
    targets[:, :-1] = tokens[:, 1:]
    model64 = model.double()
    with torch.no_grad():
        out = model64(input_ids=tokens, labels=tokens)
    logits = out.logits
    mine = torch.nn.functional.cross_entropy(logits.reshape(-1, VOCAB), targets.reshape(-1), ignore_index=-1)
    assert abs(mine.item() - out.loss.item()) <= 1e-12 * abs(out.loss.item()), (mine.item(), out.loss.item())

    write_safetensors(
        os.path.join(args.out, "gpt2_tiny_golden.safetensors"),
        {
            "tokens": ("I32", tokens.shape, pack("i", tokens.flatten().tolist())),
            "targets": ("I32", targets.shape, pack("i", targets.flatten().tolist())),
            "logits": ("F64", logits.shape, pack("d", logits.flatten().tolist())),
            "loss": ("F64", (1,), pack("d", [out.loss.item()])),
        },
        {
            "batch": str(BATCH), "seq_len": str(POSITIONS), "vocab": str(VOCAB), "seed": str(args.seed),
            "transformers": transformers.__version__, "torch": torch.__version__,
        },
    )
    print("loss", out.loss.item())


if __name__ == "__main__":
    main()
