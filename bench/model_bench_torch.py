#!/usr/bin/env python3
"""PyTorch eager, one thread: tokens per second of one full training step
(forward, backward, AdamW) of the same GPT (or, with --arch=llama, the same
Llama: RMSNorm, rotary positions, grouped-query attention, SwiGLU, untied
head) as bench/model_bench.cc. Prints one "torch ..." line that
bench/model_bench.sh compares with baton."""

import argparse
import math
import statistics
import time

import torch
import torch.nn as nn
import torch.nn.functional as F


class Block(nn.Module):
    def __init__(self, c, heads):
        super().__init__()
        self.heads = heads
        self.ln_1 = nn.LayerNorm(c)
        self.c_attn = nn.Linear(c, 3 * c)
        self.attn_proj = nn.Linear(c, c)
        self.ln_2 = nn.LayerNorm(c)
        self.c_fc = nn.Linear(c, 4 * c)
        self.mlp_proj = nn.Linear(4 * c, c)

    def forward(self, x, mask):
        b, t, c = x.shape
        hd = c // self.heads
        q, k, v = self.c_attn(self.ln_1(x)).split(c, dim=2)
        q, k, v = (z.view(b, t, self.heads, hd).transpose(1, 2) for z in (q, k, v))
        att = ((q @ k.transpose(-2, -1)) / math.sqrt(hd)).masked_fill(~mask, float("-inf"))
        y = (att.softmax(dim=-1) @ v).transpose(1, 2).reshape(b, t, c)
        x = x + self.attn_proj(y)
        return x + self.mlp_proj(F.gelu(self.c_fc(self.ln_2(x)), approximate="tanh"))


class Gpt(nn.Module):
    def __init__(self, layers, c, heads, vocab, seq_len):
        super().__init__()
        self.wte = nn.Embedding(vocab, c)
        self.wpe = nn.Embedding(seq_len, c)
        self.blocks = nn.ModuleList(Block(c, heads) for _ in range(layers))
        self.ln_f = nn.LayerNorm(c)
        self.register_buffer("mask", torch.ones(seq_len, seq_len, dtype=torch.bool).tril())
        # GPT-2 initialisation, as baton's: N(0, 0.02) matrices and embeddings,
        # zero biases (LayerNorm keeps ones and zeros).
        for name, p in self.named_parameters():
            if name.endswith("weight") and p.dim() == 2:
                nn.init.normal_(p, std=0.02)
            elif name.endswith("bias") and "ln" not in name:
                nn.init.zeros_(p)

    def forward(self, tokens, targets):
        t = tokens.shape[1]
        x = self.wte(tokens) + self.wpe.weight[:t]
        for block in self.blocks:
            x = block(x, self.mask[:t, :t])
        logits = self.ln_f(x) @ self.wte.weight.t()  # tied head
        return F.cross_entropy(logits.view(-1, logits.shape[-1]), targets.view(-1))


def rotate_half(x):
    half = x.shape[-1] // 2
    return torch.cat((-x[..., half:], x[..., :half]), dim=-1)


class LlamaBlock(nn.Module):
    def __init__(self, c, heads, kv_heads, ffn):
        super().__init__()
        self.heads, self.kv_heads, self.hd = heads, kv_heads, c // heads
        self.norm_1 = nn.RMSNorm(c) if hasattr(nn, "RMSNorm") else RmsNorm(c)
        self.q = nn.Linear(c, heads * self.hd, bias=False)
        self.k = nn.Linear(c, kv_heads * self.hd, bias=False)
        self.v = nn.Linear(c, kv_heads * self.hd, bias=False)
        self.o = nn.Linear(heads * self.hd, c, bias=False)
        self.norm_2 = nn.RMSNorm(c) if hasattr(nn, "RMSNorm") else RmsNorm(c)
        self.gate = nn.Linear(c, ffn, bias=False)
        self.up = nn.Linear(c, ffn, bias=False)
        self.down = nn.Linear(ffn, c, bias=False)

    def forward(self, x, mask, cos, sin):
        b, t, c = x.shape
        h = self.norm_1(x)
        q = self.q(h).view(b, t, self.heads, self.hd).transpose(1, 2)
        k = self.k(h).view(b, t, self.kv_heads, self.hd).transpose(1, 2)
        v = self.v(h).view(b, t, self.kv_heads, self.hd).transpose(1, 2)
        q, k = q * cos + rotate_half(q) * sin, k * cos + rotate_half(k) * sin
        rep = self.heads // self.kv_heads
        k, v = k.repeat_interleave(rep, dim=1), v.repeat_interleave(rep, dim=1)
        att = ((q @ k.transpose(-2, -1)) / math.sqrt(self.hd)).masked_fill(~mask, float("-inf"))
        y = (att.softmax(dim=-1) @ v).transpose(1, 2).reshape(b, t, -1)
        x = x + self.o(y)
        h = self.norm_2(x)
        return x + self.down(F.silu(self.gate(h)) * self.up(h))


class RmsNorm(nn.Module):  # torch < 2.4 has no nn.RMSNorm
    def __init__(self, c, eps=1e-5):
        super().__init__()
        self.weight, self.eps = nn.Parameter(torch.ones(c)), eps

    def forward(self, x):
        return self.weight * (x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps))


class Llama(nn.Module):
    def __init__(self, layers, c, heads, kv_heads, ffn, vocab, seq_len, theta=10000.0):
        super().__init__()
        self.embed = nn.Embedding(vocab, c)
        self.blocks = nn.ModuleList(LlamaBlock(c, heads, kv_heads, ffn) for _ in range(layers))
        self.norm = nn.RMSNorm(c) if hasattr(nn, "RMSNorm") else RmsNorm(c)
        self.head = nn.Linear(c, vocab, bias=False)
        self.register_buffer("mask", torch.ones(seq_len, seq_len, dtype=torch.bool).tril())
        hd = c // heads
        inv_freq = 1.0 / (theta ** (torch.arange(0, hd, 2).float() / hd))
        angle = torch.arange(seq_len).float()[:, None] * inv_freq[None, :]
        emb = torch.cat((angle, angle), dim=-1)
        self.register_buffer("cos", emb.cos())
        self.register_buffer("sin", emb.sin())
        for name, p in self.named_parameters():
            if p.dim() == 2:
                nn.init.normal_(p, std=0.02)

    def forward(self, tokens, targets):
        t = tokens.shape[1]
        x = self.embed(tokens)
        for block in self.blocks:
            x = block(x, self.mask[:t, :t], self.cos[:t], self.sin[:t])
        logits = self.head(self.norm(x))
        return F.cross_entropy(logits.view(-1, logits.shape[-1]), targets.view(-1))


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    for flag, default in (("layers", 4), ("d_model", 256), ("heads", 8), ("vocab", 256),
                          ("seq_len", 128), ("micro_batch", 8), ("warmup", 2), ("steps", 10)):
        ap.add_argument("--" + flag, type=int, default=default)
    ap.add_argument("--arch", default="gpt2", choices=("gpt2", "llama"))
    ap.add_argument("--kv_heads", type=int, default=0, help="llama: 0 = heads")
    ap.add_argument("--ffn_dim", type=int, default=0, help="llama: 0 = 4 * d_model")
    a = ap.parse_args()
    torch.set_num_threads(1)
    torch.manual_seed(1)
    if a.arch == "llama":
        model = Llama(a.layers, a.d_model, a.heads, a.kv_heads or a.heads, a.ffn_dim or 4 * a.d_model, a.vocab,
                      a.seq_len)
    else:
        model = Gpt(a.layers, a.d_model, a.heads, a.vocab, a.seq_len)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4, weight_decay=0.1)
    tokens = torch.randint(0, a.vocab, (a.micro_batch, a.seq_len))
    targets = torch.randint(0, a.vocab, (a.micro_batch, a.seq_len))

    def step():
        opt.zero_grad(set_to_none=False)
        loss = model(tokens, targets)
        loss.backward()
        opt.step()
        return loss.item()

    for _ in range(a.warmup):
        step()
    times = []
    for _ in range(a.steps):
        start = time.perf_counter()
        loss = step()
        times.append(time.perf_counter() - start)
    # Throughput from the fastest step, as model_bench.cc does.
    best, median = min(times), statistics.median(times)
    print(f"torch tokens_per_s={a.micro_batch * a.seq_len / best:.0f} "
          f"best_step_ms={1e3 * best:.1f} median_step_ms={1e3 * median:.1f} steps={a.steps} "
          f"loss={loss:.4f} arch={a.arch} version={torch.__version__} threads={torch.get_num_threads()}")


if __name__ == "__main__":
    main()
