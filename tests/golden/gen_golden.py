#!/usr/bin/env python3
"""Writes a golden file for //tests/golden:golden_check.

Builds baton's GPT-2 layout in PyTorch (pre-LN blocks, causal attention, MLP
with tanh GELU, final LayerNorm, LM head tied to the token embedding), runs one
forward and backward in float64 on a random batch, and saves a safetensors
file: config in the metadata; tokens and targets (I32, [batch, seq_len]);
every parameter as "param/<name>" (F32, the values baton loads); the mean
cross-entropy as "loss" and every gradient as "grad/<name>" (F64).

Needs PyTorch and NumPy (Debian: python3-torch; PyPI: torch numpy). The
safetensors file is written with the standard library, so the `safetensors`
package is not needed.

  python3 tests/golden/gen_golden.py --layers 2 --d_model 32 --heads 4 \
      --vocab 64 --seq_len 16 --batch 2 --seed 1 --out tests/golden/gpt_a.safetensors
"""

import argparse
import json
import math
import struct

import torch
import torch.nn.functional as F


def parameter_shapes(layers, c, vocab, seq_len):
    """Names and shapes in baton's order and layout (Linear weights [out, in])."""
    shapes = [("wte", (vocab, c)), ("wpe", (seq_len, c))]
    for i in range(layers):
        p = f"h.{i}."
        shapes += [
            (p + "ln_1.weight", (c,)), (p + "ln_1.bias", (c,)),
            (p + "attn.c_attn.weight", (3 * c, c)), (p + "attn.c_attn.bias", (3 * c,)),
            (p + "attn.c_proj.weight", (c, c)), (p + "attn.c_proj.bias", (c,)),
            (p + "ln_2.weight", (c,)), (p + "ln_2.bias", (c,)),
            (p + "mlp.c_fc.weight", (4 * c, c)), (p + "mlp.c_fc.bias", (4 * c,)),
            (p + "mlp.c_proj.weight", (c, 4 * c)), (p + "mlp.c_proj.bias", (c,)),
        ]
    return shapes + [("ln_f.weight", (c,)), ("ln_f.bias", (c,))]


def init_parameters(shapes, generator):
    """Float32 values; LayerNorm weights near 1, everything else small and
    non-zero so that every gradient path is exercised."""
    params = {}
    for name, shape in shapes:
        values = torch.randn(shape, generator=generator, dtype=torch.float32)
        if name.endswith("ln_1.weight") or name.endswith("ln_2.weight") or name == "ln_f.weight":
            values = 1.0 + 0.1 * values
        else:
            values = 0.02 * values
        params[name] = values
    return params


def forward(p, tokens, targets, layers, heads):
    """Mean cross-entropy of the model with parameters p (float64 tensors)."""
    b, t = tokens.shape
    c = p["wte"].shape[1]
    hd = c // heads
    x = p["wte"][tokens] + p["wpe"][:t]
    mask = torch.ones(t, t, dtype=torch.bool).tril()
    for i in range(layers):
        q = f"h.{i}."
        h = F.layer_norm(x, (c,), p[q + "ln_1.weight"], p[q + "ln_1.bias"], eps=1e-5)
        qkv = F.linear(h, p[q + "attn.c_attn.weight"], p[q + "attn.c_attn.bias"])
        qh, kh, vh = (z.view(b, t, heads, hd).transpose(1, 2) for z in qkv.split(c, dim=2))
        scores = (qh @ kh.transpose(-2, -1)) / math.sqrt(hd)
        att = scores.masked_fill(~mask, float("-inf")).softmax(dim=-1)
        y = (att @ vh).transpose(1, 2).reshape(b, t, c)
        x = x + F.linear(y, p[q + "attn.c_proj.weight"], p[q + "attn.c_proj.bias"])
        h = F.layer_norm(x, (c,), p[q + "ln_2.weight"], p[q + "ln_2.bias"], eps=1e-5)
        h = F.gelu(F.linear(h, p[q + "mlp.c_fc.weight"], p[q + "mlp.c_fc.bias"]),
                   approximate="tanh")
        x = x + F.linear(h, p[q + "mlp.c_proj.weight"], p[q + "mlp.c_proj.bias"])
    x = F.layer_norm(x, (c,), p["ln_f.weight"], p["ln_f.bias"], eps=1e-5)
    logits = x @ p["wte"].t()
    return F.cross_entropy(logits.reshape(b * t, -1), targets.reshape(b * t))


def write_safetensors(path, tensors, metadata):
    """tensors: name -> (dtype tag, shape, raw little-endian bytes)."""
    header = {"__metadata__": metadata}
    offset = 0
    for name, (dtype, shape, data) in tensors.items():
        header[name] = {"dtype": dtype, "shape": list(shape),
                        "data_offsets": [offset, offset + len(data)]}
        offset += len(data)
    encoded = json.dumps(header, separators=(",", ":")).encode()
    encoded += b" " * (-len(encoded) % 8)
    with open(path, "wb") as f:
        f.write(struct.pack("<Q", len(encoded)))
        f.write(encoded)
        for _, _, data in tensors.values():
            f.write(data)


def raw(tensor, dtype):
    return tensor.detach().contiguous().numpy().astype(dtype).tobytes()


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    for flag in ("layers", "d_model", "heads", "vocab", "seq_len", "batch", "seed"):
        ap.add_argument("--" + flag, type=int, required=True)
    ap.add_argument("--out", required=True)
    a = ap.parse_args()
    if a.d_model % a.heads:
        ap.error("--heads must divide --d_model")

    gen = torch.Generator().manual_seed(a.seed)
    shapes = parameter_shapes(a.layers, a.d_model, a.vocab, a.seq_len)
    params32 = init_parameters(shapes, gen)
    tokens = torch.randint(0, a.vocab, (a.batch, a.seq_len), generator=gen)
    targets = torch.randint(0, a.vocab, (a.batch, a.seq_len), generator=gen)

    params64 = {n: v.double().requires_grad_(True) for n, v in params32.items()}
    loss = forward(params64, tokens, targets, a.layers, a.heads)
    loss.backward()

    tensors = {
        "tokens": ("I32", tokens.shape, raw(tokens, "<i4")),
        "targets": ("I32", targets.shape, raw(targets, "<i4")),
        "loss": ("F64", (1,), raw(loss.reshape(1), "<f8")),
    }
    for name, _ in shapes:
        tensors["param/" + name] = ("F32", params32[name].shape, raw(params32[name], "<f4"))
    for name, _ in shapes:
        g = params64[name].grad
        tensors["grad/" + name] = ("F64", g.shape, raw(g, "<f8"))
    metadata = {k: str(getattr(a, k)) for k in
                ("layers", "d_model", "heads", "vocab", "seq_len", "batch", "seed")}
    metadata["generator"] = f"gen_golden.py, torch {torch.__version__}, float64"
    write_safetensors(a.out, tensors, metadata)
    print(f"{a.out}: loss {loss.item():.6f}, {len(shapes)} parameters")


if __name__ == "__main__":
    main()
