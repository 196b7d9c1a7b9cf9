#!/usr/bin/env python3
"""Writes a Mixture-of-Experts golden file for //tests/golden:golden_check.

Builds baton's GPT-2 (as gen_golden.py) or Llama (RMSNorm, rotary positions,
grouped-query attention, SwiGLU, no biases, untied head unless
--tie_embeddings) in PyTorch with the MLP of every --every_n_layers-th block
(block i iff (i + 1) % every_n_layers == 0) replaced by an MoE MLP, the
contract of proto/baton/v1/job.proto MoeSpec:

  probs  = softmax(x @ Wr^T) over the E experts, per token (x: the block's
           second norm output, [N, C], N = batch * seq_len tokens)
  top-k  the K largest probs per token, descending; equal ones: lower expert
  gates  K > 1: the chosen probs over their sum; K = 1: the prob itself
  drops  capacity_factor 0: none. Else Cap = ceil(cf * N * K / E) (snapped to
         an integer within relative 1e-9); all tokens' choice 0 in token
         order claim rows first, then choice 1, ...; a choice whose expert
         has Cap rows already is dropped
  y[t]   sum over t's kept choices j of gate[t, j] * expert_{e_j}(x[t])
         (expert: the dense MLP without biases; GPT-2 c_proj(gelu_tanh(c_fc
         x)), Llama w2(silu(w1 x) * w3 x)); every choice dropped: y[t] = 0
  aux    per MoE block: coef * E * sum_e f_e * P_e, f_e = choices of e
         before drops / (N * K) (a constant), P_e = mean_t probs[t, e]

One forward and backward in float64 on a random batch of one microbatch. The
safetensors file holds, as gen_golden.py's: config in the metadata (plus
arch, the Llama fields and moe_experts, moe_top_k, moe_every_n_layers,
moe_capacity_factor, moe_aux_loss_coef); tokens and targets (I32 [batch,
seq_len]; with --ignore_last the last position of each row is -1, not
scored); every parameter as "param/<name>" (F32); the mean cross-entropy over
the scored tokens as "loss", the sum of the blocks' aux losses as "aux_loss"
(F64 [1]) and the gradient of loss + aux_loss as "grad/<name>" (F64).

Names ([out, in] as torch.nn.Linear): GPT-2 as gen_golden.py, an MoE block
holding h.i.mlp.router.weight [E, C], h.i.mlp.experts.e.c_fc.weight [4C, C]
and h.i.mlp.experts.e.c_proj.weight [C, 4C] instead of its mlp.c_fc/c_proj;
Llama as Hugging Face less "model." (tests/hf/gen_hf_llama_golden.py), an
MoE block holding Mixtral's layers.i.block_sparse_moe.gate.weight [E, C] and
layers.i.block_sparse_moe.experts.e.w1 (gate) / w3 (up) [F, C], w2 (down)
[C, F] instead of its mlp.*_proj.

Parameters are float32, small (0.02 scale; norm weights near 1) with the
routers and the experts at --router_scale (0.5) and --expert_scale (0.2), so
the routing is decisive and both the language-model loss (through the gates)
and the aux loss give the routers a visible share of their gradients (the
script prints both norms). The float config fields baton holds as float32
(rope_theta, norm_eps, aux_loss_coef) enter the math rounded to float32. The
script refuses a batch whose top-k order is within --min_gap of a tie (a
float32 model could route differently), one where an expert of a block keeps
no token, and, when capacity_factor > 0, one where no choice is dropped: pick
another --seed. It prints those facts per MoE block.

  python3 tests/golden/gen_moe_golden.py --self_check
checks the dense paths: the GPT-2 forward against gpt_a.safetensors and the
Llama forward against transformers' tests/hf/testdata/llama_tiny golden.

Needs PyTorch and NumPy (Debian: python3-torch; PyPI: torch numpy). The
committed goldens (d_model 16 keeps each file near 200 KB: every expert is a
whole MLP):

  python3 tests/golden/gen_moe_golden.py --arch gpt2 --layers 2 --d_model 16 \\
      --heads 4 --vocab 64 --seq_len 16 --batch 2 --experts 4 --top_k 2 \\
      --every_n_layers 1 --capacity_factor 0 --aux_loss_coef 0.01 --seed 2 \\
      --out tests/golden/moe_gpt2_top2.safetensors
  python3 tests/golden/gen_moe_golden.py --arch gpt2 --layers 2 --d_model 16 \\
      --heads 4 --vocab 64 --seq_len 16 --batch 2 --experts 4 --top_k 1 \\
      --every_n_layers 2 --capacity_factor 1.0 --aux_loss_coef 0.05 \\
      --ignore_last --seed 2 --out tests/golden/moe_gpt2_top1_cap.safetensors
  python3 tests/golden/gen_moe_golden.py --arch llama --layers 2 --d_model 16 \\
      --heads 4 --kv_heads 2 --ffn_dim 32 --vocab 64 --seq_len 16 --batch 2 \\
      --rope_theta 500000 --norm_eps 1e-6 --experts 4 --top_k 2 \\
      --every_n_layers 1 --capacity_factor 1.25 --aux_loss_coef 0.02 \\
      --ignore_last --seed 2 --out tests/golden/moe_llama_top2_cap.safetensors
"""

import argparse
import json
import math
import os
import struct
import sys

import numpy as np
import torch
import torch.nn.functional as F

from gen_golden import raw, write_safetensors  # the dense golden's writer


def f32(value):
    """The float32 value nearest `value`, as a Python float."""
    return float(np.float32(value))


class Config:
    def __init__(self, a):
        self.arch = a.arch
        self.layers, self.c, self.heads = a.layers, a.d_model, a.heads
        self.vocab, self.seq_len = a.vocab, a.seq_len
        self.kv_heads = a.kv_heads or a.heads
        self.ffn = a.ffn_dim or 4 * a.d_model
        self.rope_theta, self.norm_eps = f32(a.rope_theta), f32(a.norm_eps)
        self.tied = a.arch == "gpt2" or a.tie_embeddings
        self.experts, self.top_k = a.experts, a.top_k
        self.every, self.capacity_factor = a.every_n_layers, a.capacity_factor
        self.aux_coef = f32(a.aux_loss_coef)
        # transformers' float32 islands inside its float64 Llama (RMSNorm,
        # rotary angles, attention softmax, logits and loss): only
        # --self_check sets it, to meet tests/hf's golden bit for bit.
        self.hf_float32 = False

    def moe_block(self, i):
        return self.experts > 0 and (i + 1) % self.every == 0

    def mlp_prefix(self, i):
        if self.arch == "gpt2":
            return f"h.{i}.mlp."
        return f"layers.{i}.block_sparse_moe." if self.moe_block(i) else f"layers.{i}.mlp."


def parameter_shapes(cfg):
    """Names and shapes in baton's order and layout (Linear weights [out, in])."""
    c, f, e = cfg.c, cfg.ffn, cfg.experts
    if cfg.arch == "gpt2":
        shapes = [("wte", (cfg.vocab, c)), ("wpe", (cfg.seq_len, c))]
    else:
        shapes = [("embed_tokens.weight", (cfg.vocab, c))]
    hd = c // cfg.heads
    for i in range(cfg.layers):
        m = cfg.mlp_prefix(i)
        if cfg.arch == "gpt2":
            p = f"h.{i}."
            shapes += [
                (p + "ln_1.weight", (c,)), (p + "ln_1.bias", (c,)),
                (p + "attn.c_attn.weight", (3 * c, c)), (p + "attn.c_attn.bias", (3 * c,)),
                (p + "attn.c_proj.weight", (c, c)), (p + "attn.c_proj.bias", (c,)),
                (p + "ln_2.weight", (c,)), (p + "ln_2.bias", (c,)),
            ]
            if cfg.moe_block(i):
                shapes.append((m + "router.weight", (e, c)))
                for x in range(e):
                    shapes += [(m + f"experts.{x}.c_fc.weight", (f, c)),
                               (m + f"experts.{x}.c_proj.weight", (c, f))]
            else:
                shapes += [(m + "c_fc.weight", (f, c)), (m + "c_fc.bias", (f,)),
                           (m + "c_proj.weight", (c, f)), (m + "c_proj.bias", (c,))]
        else:
            p = f"layers.{i}."
            shapes += [
                (p + "input_layernorm.weight", (c,)),
                (p + "self_attn.q_proj.weight", (cfg.heads * hd, c)),
                (p + "self_attn.k_proj.weight", (cfg.kv_heads * hd, c)),
                (p + "self_attn.v_proj.weight", (cfg.kv_heads * hd, c)),
                (p + "self_attn.o_proj.weight", (c, cfg.heads * hd)),
                (p + "post_attention_layernorm.weight", (c,)),
            ]
            if cfg.moe_block(i):
                shapes.append((m + "gate.weight", (e, c)))
                for x in range(e):
                    shapes += [(m + f"experts.{x}.w1.weight", (f, c)),
                               (m + f"experts.{x}.w3.weight", (f, c)),
                               (m + f"experts.{x}.w2.weight", (c, f))]
            else:
                shapes += [(m + "gate_proj.weight", (f, c)), (m + "up_proj.weight", (f, c)),
                           (m + "down_proj.weight", (c, f))]
    if cfg.arch == "gpt2":
        return shapes + [("ln_f.weight", (c,)), ("ln_f.bias", (c,))]
    shapes.append(("norm.weight", (c,)))
    return shapes + ([] if cfg.tied else [("lm_head.weight", (cfg.vocab, c))])


def is_norm_weight(name):
    module, _, leaf = name.rpartition(".")
    return leaf == "weight" and module.rpartition(".")[2] in (
        "ln_1", "ln_2", "ln_f", "input_layernorm", "post_attention_layernorm", "norm")


def init_parameters(shapes, generator, embed_scale, router_scale, expert_scale):
    """Float32 values: norm weights near 1, the token and position embeddings,
    routers and experts at their scales, everything else small and non-zero."""
    params = {}
    for name, shape in shapes:
        values = torch.randn(shape, generator=generator, dtype=torch.float32)
        if is_norm_weight(name):
            values = 1.0 + 0.1 * values
        elif name in ("wte", "wpe", "embed_tokens.weight"):
            values = embed_scale * values
        elif name.endswith("router.weight") or name.endswith("block_sparse_moe.gate.weight"):
            values = router_scale * values
        elif ".experts." in name:
            values = expert_scale * values
        else:
            values = 0.02 * values
        params[name] = values
    return params


def gelu_expert(p, prefix, x):
    h = F.gelu(F.linear(x, p[prefix + "c_fc.weight"]), approximate="tanh")
    return F.linear(h, p[prefix + "c_proj.weight"])


def swiglu_expert(p, prefix, x):
    h = F.silu(F.linear(x, p[prefix + "w1.weight"])) * F.linear(x, p[prefix + "w3.weight"])
    return F.linear(h, p[prefix + "w2.weight"])


def capacity(cfg, tokens):
    """Rows per expert (None: dropless), as MoeSpec computes it."""
    if cfg.capacity_factor == 0:
        return None
    cap = cfg.capacity_factor * tokens * cfg.top_k / cfg.experts
    nearest = round(cap)
    if abs(cap - nearest) <= 1e-9 * abs(nearest):
        cap = nearest
    return math.ceil(cap)


def moe_mlp(cfg, p, prefix, x, facts):
    """The MoE MLP of x [N, C]; returns (y [N, C], aux loss) and appends this
    block's routing facts to `facts`."""
    n, e, k = x.shape[0], cfg.experts, cfg.top_k
    router = prefix + ("router.weight" if cfg.arch == "gpt2" else "gate.weight")
    probs = F.linear(x, p[router]).softmax(dim=-1)
    # Descending; a stable sort keeps equal probabilities in expert order.
    ranked, order = torch.sort(probs.detach(), dim=-1, descending=True, stable=True)
    choice = order[:, :k]  # [N, K]; the selection has no gradient
    chosen = probs.gather(1, choice)
    gates = chosen / chosen.sum(dim=-1, keepdim=True) if k > 1 else chosen
    # The closest call: a gap between consecutive ranks 0..K (the order of
    # the K choices decides the dispatch order, rank K the selection).
    last = min(k, e - 1)
    gap = (ranked[:, :last] - ranked[:, 1:last + 1]).min().item()

    cap = capacity(cfg, n)
    rows = [0] * e
    kept = torch.zeros(n, k, dtype=torch.bool)
    for j in range(k):  # every token's choice j before any choice j + 1
        for t in range(n):
            x_e = choice[t, j].item()
            if cap is None or rows[x_e] < cap:
                rows[x_e] += 1
                kept[t, j] = True

    y = torch.zeros_like(x)
    expert = gelu_expert if cfg.arch == "gpt2" else swiglu_expert
    for x_e in range(e):
        t_idx, j_idx = ((choice == x_e) & kept).nonzero(as_tuple=True)
        if len(t_idx) == 0:
            continue
        out = expert(p, f"{prefix}experts.{x_e}.", x[t_idx])
        y = y.index_add(0, t_idx, gates[t_idx, j_idx].unsqueeze(1) * out)

    chosen_counts = torch.bincount(choice.flatten(), minlength=e)
    f_e = chosen_counts.double() / (n * k)
    aux = cfg.aux_coef * e * (f_e * probs.mean(dim=0)).sum()
    facts.append(dict(block=prefix, capacity=cap, chosen=chosen_counts.tolist(), kept=rows,
                      dropped=int((~kept).sum()), all_dropped=int((~kept).all(dim=1).sum()),
                      min_gap=gap, aux=aux.item()))
    return y, aux


def layer_norm(x, p, prefix):
    return F.layer_norm(x, (x.shape[-1],), p[prefix + "weight"], p[prefix + "bias"], eps=1e-5)


def rms_norm(x, weight, eps, hf_float32=False):
    if hf_float32:
        x32 = x.float()
        return weight * (x32 * torch.rsqrt(x32.pow(2).mean(dim=-1, keepdim=True) + eps)).double()
    return x * torch.rsqrt(x.pow(2).mean(dim=-1, keepdim=True) + eps) * weight


def rope(x, theta, hf_float32=False):
    """Hugging Face's rotary embedding (rotate_half) of x [b, heads, t, hd]."""
    t, hd = x.shape[-2], x.shape[-1]
    dtype = torch.float32 if hf_float32 else torch.float64
    inv_freq = 1.0 / (theta ** (torch.arange(0, hd, 2, dtype=dtype) / hd))
    angles = torch.arange(t, dtype=dtype)[:, None] * inv_freq[None, :]
    angles = torch.cat([angles, angles], dim=-1)
    cos, sin = angles.cos().double(), angles.sin().double()
    rotated = torch.cat([-x[..., hd // 2:], x[..., :hd // 2]], dim=-1)
    return x * cos + rotated * sin


def attention(q, k, v, hf_float32=False):
    """Causal attention of q [b, H, t, hd] over k, v [b, H, t, hd]."""
    t, hd = q.shape[-2], q.shape[-1]
    mask = torch.ones(t, t, dtype=torch.bool).tril()
    scores = (q @ k.transpose(-2, -1)) / math.sqrt(hd)
    scores = scores.masked_fill(~mask, float("-inf"))
    if hf_float32:
        return scores.softmax(dim=-1, dtype=torch.float32).double() @ v
    return scores.softmax(dim=-1) @ v


def forward(cfg, p, tokens, targets):
    """(mean cross-entropy over scored tokens, sum of the aux losses, facts)
    of the model with parameters p (float64 tensors)."""
    b, t = tokens.shape
    c, heads, hd = cfg.c, cfg.heads, cfg.c // cfg.heads
    facts = []
    aux_total = torch.zeros((), dtype=torch.float64)
    if cfg.arch == "gpt2":
        x = p["wte"][tokens] + p["wpe"][:t]
    else:
        x = p["embed_tokens.weight"][tokens]
    for i in range(cfg.layers):
        if cfg.arch == "gpt2":
            q = f"h.{i}."
            h = layer_norm(x, p, q + "ln_1.")
            qkv = F.linear(h, p[q + "attn.c_attn.weight"], p[q + "attn.c_attn.bias"])
            qh, kh, vh = (z.view(b, t, heads, hd).transpose(1, 2) for z in qkv.split(c, dim=2))
            y = attention(qh, kh, vh).transpose(1, 2).reshape(b, t, c)
            x = x + F.linear(y, p[q + "attn.c_proj.weight"], p[q + "attn.c_proj.bias"])
            h = layer_norm(x, p, q + "ln_2.")
        else:
            q = f"layers.{i}."
            h = rms_norm(x, p[q + "input_layernorm.weight"], cfg.norm_eps, cfg.hf_float32)
            qh = F.linear(h, p[q + "self_attn.q_proj.weight"]).view(b, t, heads, hd).transpose(1, 2)
            kh = F.linear(h, p[q + "self_attn.k_proj.weight"]).view(b, t, cfg.kv_heads, hd).transpose(1, 2)
            vh = F.linear(h, p[q + "self_attn.v_proj.weight"]).view(b, t, cfg.kv_heads, hd).transpose(1, 2)
            qh, kh = rope(qh, cfg.rope_theta, cfg.hf_float32), rope(kh, cfg.rope_theta, cfg.hf_float32)
            group = heads // cfg.kv_heads  # query head h reads key/value head h // group
            kh, vh = kh.repeat_interleave(group, dim=1), vh.repeat_interleave(group, dim=1)
            y = attention(qh, kh, vh, cfg.hf_float32).transpose(1, 2).reshape(b, t, c)
            x = x + F.linear(y, p[q + "self_attn.o_proj.weight"])
            h = rms_norm(x, p[q + "post_attention_layernorm.weight"], cfg.norm_eps, cfg.hf_float32)
        m = cfg.mlp_prefix(i)
        if cfg.moe_block(i):
            y, aux = moe_mlp(cfg, p, m, h.reshape(b * t, c), facts)
            x = x + y.view(b, t, c)
            aux_total = aux_total + aux
        elif cfg.arch == "gpt2":
            h = F.gelu(F.linear(h, p[m + "c_fc.weight"], p[m + "c_fc.bias"]), approximate="tanh")
            x = x + F.linear(h, p[m + "c_proj.weight"], p[m + "c_proj.bias"])
        else:
            h = F.silu(F.linear(h, p[m + "gate_proj.weight"])) * F.linear(h, p[m + "up_proj.weight"])
            x = x + F.linear(h, p[m + "down_proj.weight"])
    if cfg.arch == "gpt2":
        x = layer_norm(x, p, "ln_f.")
        logits = x @ p["wte"].t()
    else:
        x = rms_norm(x, p["norm.weight"], cfg.norm_eps, cfg.hf_float32)
        logits = x @ p["embed_tokens.weight" if cfg.tied else "lm_head.weight"].t()
    if cfg.hf_float32:
        logits = logits.float()
    loss = F.cross_entropy(logits.reshape(b * t, -1), targets.reshape(b * t), ignore_index=-1)
    return loss, aux_total, facts


def read_safetensors(path):
    """name -> float64/int64 tensor, and the metadata."""
    with open(path, "rb") as f:
        data = f.read()
    n = struct.unpack("<Q", data[:8])[0]
    header = json.loads(data[8:8 + n])
    kinds = {"F32": "<f4", "F64": "<f8", "I32": "<i4", "I64": "<i8"}
    out = {}
    for name, entry in header.items():
        if name == "__metadata__":
            continue
        begin, end = entry["data_offsets"]
        values = np.frombuffer(data[8 + n + begin:8 + n + end], dtype=kinds[entry["dtype"]])
        tensor = torch.from_numpy(values.reshape(entry["shape"]).copy())
        out[name] = tensor.double() if entry["dtype"].startswith("F") else tensor.long()
    return out, header.get("__metadata__", {})


def check_gradients(label, p, want_loss, loss, want_grad):
    """Prints and returns the worst relative difference from a reference."""
    worst = abs(loss.item() - want_loss) / abs(want_loss)
    for name, g in want_grad.items():
        diff = (p[name].grad - g).norm() / g.norm()
        worst = max(worst, diff.item())
    print(f"self-check {label}: loss {loss.item():.12f} (reference {want_loss:.12f}); "
          f"{len(want_grad)} gradients; worst relative difference {worst:.2e}")
    return worst


def self_check():
    """The dense GPT-2 and Llama forwards against the committed references."""
    here = os.path.dirname(os.path.abspath(__file__))
    golden, meta = read_safetensors(os.path.join(here, "gpt_a.safetensors"))
    a = argparse.Namespace(arch="gpt2", layers=int(meta["layers"]), d_model=int(meta["d_model"]),
                           heads=int(meta["heads"]), vocab=int(meta["vocab"]), seq_len=int(meta["seq_len"]),
                           kv_heads=0, ffn_dim=0, rope_theta=10000.0, norm_eps=1e-5, tie_embeddings=True,
                           experts=0, top_k=0, every_n_layers=1, capacity_factor=0.0, aux_loss_coef=0.0)
    cfg = Config(a)
    p = {n[6:]: v.requires_grad_(True) for n, v in golden.items() if n.startswith("param/")}
    loss, _, _ = forward(cfg, p, golden["tokens"], golden["targets"])
    loss.backward()
    grads = {n[5:]: v for n, v in golden.items() if n.startswith("grad/")}
    worst = check_gradients("gpt_a.safetensors", p, golden["loss"].item(), loss, grads)

    hf = os.path.join(here, "..", "hf", "testdata")
    with open(os.path.join(hf, "llama_tiny", "config.json")) as f:
        hf_cfg = json.load(f)
    weights, _ = read_safetensors(os.path.join(hf, "llama_tiny", "model.safetensors"))
    golden, _ = read_safetensors(os.path.join(hf, "llama_tiny_golden.safetensors"))
    a = argparse.Namespace(arch="llama", layers=hf_cfg["num_hidden_layers"], d_model=hf_cfg["hidden_size"],
                           heads=hf_cfg["num_attention_heads"], vocab=hf_cfg["vocab_size"],
                           seq_len=hf_cfg["max_position_embeddings"], kv_heads=hf_cfg["num_key_value_heads"],
                           ffn_dim=hf_cfg["intermediate_size"], rope_theta=hf_cfg["rope_theta"],
                           norm_eps=hf_cfg["rms_norm_eps"], tie_embeddings=hf_cfg["tie_word_embeddings"],
                           experts=0, top_k=0, every_n_layers=1, capacity_factor=0.0, aux_loss_coef=0.0)
    cfg = Config(a)
    # transformers ran with the config's exact epsilon and its float32 islands.
    cfg.norm_eps, cfg.rope_theta, cfg.hf_float32 = hf_cfg["rms_norm_eps"], hf_cfg["rope_theta"], True
    p = {n[len("model."):] if n.startswith("model.") else n: v.requires_grad_(True) for n, v in weights.items()}
    loss, _, _ = forward(cfg, p, golden["tokens"], golden["targets"])
    loss.backward()
    grads = {n[5:]: v for n, v in golden.items() if n.startswith("grad/")}
    worst = max(worst, check_gradients("tests/hf llama_tiny", p, golden["loss"].item(), loss, grads))
    if worst > 1e-9:
        sys.exit("self-check failed: the dense forward is not the references' model")


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--self_check", action="store_true",
                    help="only check the dense forwards against gpt_a and tests/hf's llama_tiny")
    ap.add_argument("--arch", choices=("gpt2", "llama"), default="gpt2")
    for flag in ("layers", "d_model", "heads", "vocab", "seq_len", "batch", "seed", "experts", "top_k"):
        ap.add_argument("--" + flag, type=int)
    ap.add_argument("--every_n_layers", type=int, default=1)
    ap.add_argument("--capacity_factor", type=float, default=0.0, help="0: dropless")
    ap.add_argument("--aux_loss_coef", type=float, default=0.01)
    ap.add_argument("--kv_heads", type=int, default=0, help="Llama; 0: heads")
    ap.add_argument("--ffn_dim", type=int, default=0, help="Llama; 0: 4 * d_model (GPT-2's only width)")
    ap.add_argument("--rope_theta", type=float, default=10000.0, help="Llama")
    ap.add_argument("--norm_eps", type=float, default=1e-5, help="Llama")
    ap.add_argument("--tie_embeddings", action="store_true", help="Llama: the head is embed_tokens")
    ap.add_argument("--embed_scale", type=float, default=0.02)
    ap.add_argument("--router_scale", type=float, default=0.5)
    ap.add_argument("--expert_scale", type=float, default=0.2)
    ap.add_argument("--min_gap", type=float, default=1e-4,
                    help="smallest difference between consecutive top-k probabilities accepted")
    ap.add_argument("--ignore_last", action="store_true", help="target -1 at each row's last position")
    ap.add_argument("--out")
    a = ap.parse_args()
    if a.self_check:
        self_check()
        return
    missing = [f for f in ("layers", "d_model", "heads", "vocab", "seq_len", "batch", "seed", "experts",
                           "top_k", "out") if getattr(a, f) is None]
    if missing:
        ap.error("missing --" + ", --".join(missing))
    if a.d_model % a.heads:
        ap.error("--heads must divide --d_model")
    if a.arch == "gpt2" and (a.kv_heads or a.ffn_dim or a.tie_embeddings):
        ap.error("--kv_heads, --ffn_dim and --tie_embeddings are Llama's")
    if not (2 <= a.experts and 1 <= a.top_k <= a.experts and 1 <= a.every_n_layers <= a.layers):
        ap.error("want --experts >= 2, 1 <= --top_k <= --experts, 1 <= --every_n_layers <= --layers")

    cfg = Config(a)
    gen = torch.Generator().manual_seed(a.seed)
    shapes = parameter_shapes(cfg)
    params32 = init_parameters(shapes, gen, a.embed_scale, a.router_scale, a.expert_scale)
    tokens = torch.randint(0, a.vocab, (a.batch, a.seq_len), generator=gen)
    targets = torch.randint(0, a.vocab, (a.batch, a.seq_len), generator=gen)
    if a.ignore_last:
        targets[:, -1] = -1

    params64 = {n: v.double().requires_grad_(True) for n, v in params32.items()}
    loss, aux_loss, facts = forward(cfg, params64, tokens, targets)

    # How much of each router's gradient the language-model loss gives (the
    # rest is the aux loss's): both paths must show in the golden.
    routers = [n for n, _ in shapes if n.endswith("router.weight") or n.endswith("block_sparse_moe.gate.weight")]
    lm_part = torch.autograd.grad(loss, [params64[n] for n in routers], retain_graph=True)
    aux_part = torch.autograd.grad(aux_loss, [params64[n] for n in routers], retain_graph=True)
    (loss + aux_loss).backward()

    problems = []
    for fact, lm, aux in zip(facts, lm_part, aux_part):
        print(f"  {fact['block']}: capacity {fact['capacity'] or 'none (dropless)'}, choices per expert "
              f"{fact['chosen']}, kept {fact['kept']}, dropped {fact['dropped']} choice(s) "
              f"({fact['all_dropped']} token(s) with every choice dropped), closest top-k gap "
              f"{fact['min_gap']:.2e}, aux {fact['aux']:.9f}, router gradient |lm| {lm.norm():.2e} "
              f"|aux| {aux.norm():.2e}")
        if fact["min_gap"] < a.min_gap:
            problems.append(f"{fact['block']}: top-k probabilities {fact['min_gap']:.1e} from a tie")
        if min(fact["kept"]) == 0:
            problems.append(f"{fact['block']}: an expert keeps no token")
    if cfg.capacity_factor > 0 and sum(f["dropped"] for f in facts) == 0:
        problems.append("capacity_factor > 0 but no choice is dropped")
    if problems:
        sys.exit("refused (pick another --seed): " + "; ".join(problems))

    tensors = {
        "tokens": ("I32", tokens.shape, raw(tokens, "<i4")),
        "targets": ("I32", targets.shape, raw(targets, "<i4")),
        "loss": ("F64", (1,), raw(loss.reshape(1), "<f8")),
        "aux_loss": ("F64", (1,), raw(aux_loss.reshape(1), "<f8")),
    }
    for name, _ in shapes:
        tensors["param/" + name] = ("F32", params32[name].shape, raw(params32[name], "<f4"))
    for name, _ in shapes:
        g = params64[name].grad
        tensors["grad/" + name] = ("F64", g.shape, raw(g, "<f8"))
    metadata = {k: str(getattr(a, k)) for k in
                ("arch", "layers", "d_model", "heads", "vocab", "seq_len", "batch", "seed")}
    if a.arch == "llama":
        metadata.update(kv_heads=str(cfg.kv_heads), ffn_dim=str(cfg.ffn), rope_theta=repr(a.rope_theta),
                        norm_eps=repr(a.norm_eps), tie_embeddings=str(int(cfg.tied)))
    metadata.update(moe_experts=str(a.experts), moe_top_k=str(a.top_k),
                    moe_every_n_layers=str(a.every_n_layers), moe_capacity_factor=repr(a.capacity_factor),
                    moe_aux_loss_coef=repr(a.aux_loss_coef))
    metadata["generator"] = f"gen_moe_golden.py, torch {torch.__version__}, float64"
    write_safetensors(a.out, tensors, metadata)
    print(f"{a.out}: loss {loss.item():.9f}, aux_loss {aux_loss.item():.9f}, {len(shapes)} parameters, "
          f"{os.path.getsize(a.out)} bytes")


if __name__ == "__main__":
    main()
