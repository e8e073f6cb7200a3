#!/usr/bin/env python3
"""Trains krait's embedded default model: a small hybrid of Mamba-2 (M), DeepSeek sparse attention
(D), MLP (-) and MoE (E) layers with one multi-token-prediction layer in DeepSeek's form, on the
text that tools/default-model/data.py builds, with its own byte-level BPE tokenizer.

    python3 tools/default-model/train.py DATA_DIR OUT_DIR [--steps N] [--seed S] [--ckpt DIR] [--resume]

DATA_DIR is data.py's output. OUT_DIR gets a checkpoint krait serves (config.json, model.safetensors
in bf16, tokenizer.json, tokenizer_config.json with the chat template) and train-log.json. With
--ckpt the full training state is saved there every --save-every steps; --resume continues from it,
and the result equals an uninterrupted run's up to the order of GPU reductions.

The forward pass is MODEL_SPEC's math (the float64 spec model of tools/reference/make_dsa_fixtures.py
written batched): Mamba-2 through the chunked state-space-duality form, MLA with interleaved RoPE,
the lightning indexer with half-split RoPE and ReLU-weighted scores choosing index_topk keys, relu2
MLPs, a sigmoid-routed MoE with a shared expert and aux-loss-free balancing (the correction bias
moves against each expert's load). The indexer is trained as DeepSeek-V3.2 trains it: its input
detached, a KL divergence to the attention's head-summed distribution, dense attention for the first
--dense-frac of the steps, then top-k selection by the indexer. The MTP layer predicts token i+2
from the main model's final hidden state at i (after norm_f) and the embedding of token i+1:
eh_proj([enorm(emb(t[i+1])); hnorm(h[i])]), then its own D and E layers and final_layernorm, and
the tied embedding as head. Needs torch; the tokenizer step needs HF tokenizers and jinja2.
"""
import argparse
import json
import math
import os
import random
import struct
import sys
import time

import torch
import torch.nn as nn
import torch.nn.functional as F

HERE = os.path.dirname(os.path.abspath(__file__))
SPECIALS = ["<|bos|>", "<|end|>", "<|pad|>", "<|system|>", "<|user|>", "<|assistant|>", "<|tool|>"]
SPLIT_REGEX = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*|"
               r"\s*[\r\n]+|\s+(?!\S)|\s+")
VOCAB = 4096
PATTERN = "MDM-EMDM-E"
MTP_PATTERN = "DE"
CFG = {
    "architectures": ["NemotronHForCausalLM"],
    "model_type": "nemotron_h",
    "hybrid_override_pattern": PATTERN,
    "num_hidden_layers": len(PATTERN),
    "vocab_size": VOCAB,
    "hidden_size": 256,
    "layer_norm_epsilon": 1e-5,
    "tie_word_embeddings": True,
    "max_position_embeddings": 4096,
    "bos_token_id": 0,
    "eos_token_id": 1,
    "pad_token_id": 2,
    "mamba_num_heads": 8, "mamba_head_dim": 64, "n_groups": 1, "ssm_state_size": 64,
    "conv_kernel": 4, "chunk_size": 64, "use_conv_bias": True, "use_bias": False,
    "time_step_limit": [0.0, float("inf")],
    "num_attention_heads": 4, "num_key_value_heads": 4, "q_lora_rank": 128, "kv_lora_rank": 128,
    "qk_nope_head_dim": 32, "qk_rope_head_dim": 32, "v_head_dim": 32,
    "index_n_heads": 4, "index_head_dim": 64, "index_topk": 64, "rope_theta": 10000.0,
    "intermediate_size": 1024, "mlp_hidden_act": "relu2",
    "n_routed_experts": 8, "num_experts_per_tok": 2, "moe_intermediate_size": 128,
    "moe_shared_expert_intermediate_size": 256, "n_group": 1, "topk_group": 1,
    "routed_scaling_factor": 1.0, "norm_topk_prob": True,
    "num_nextn_predict_layers": 1, "mtp_hybrid_override_pattern": MTP_PATTERN,
}


# --------------------------------------------------------------------------------------------------
# tokenizer and data


def render_template():
    import jinja2
    with open(os.path.join(HERE, "chat_template.jinja")) as f:
        src = f.read()
    env = jinja2.Environment(trim_blocks=True, lstrip_blocks=True, extensions=["jinja2.ext.loopcontrols"])

    def tojson(x, ensure_ascii=False, indent=None, separators=None, sort_keys=False):
        return json.dumps(x, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)
    env.filters["tojson"] = tojson
    tpl = env.from_string(src)
    return src, (lambda messages, tools=None, add_generation_prompt=False:
                 tpl.render(messages=messages, tools=tools, add_generation_prompt=add_generation_prompt,
                            bos_token=SPECIALS[0], eos_token=SPECIALS[1]))


def read_docs(path):
    with open(path, encoding="utf-8") as f:
        return [d for d in f.read().split("\n\x1e\n") if d.strip()]


def read_convs(path):
    with open(path, encoding="utf-8") as f:
        return [json.loads(line) for line in f if line.strip()]


def chat_spans(conv, render):
    """-> (text, [(start, end)] character spans of the assistant turns, their <|end|> included)."""
    msgs, tools = conv["messages"], conv.get("tools")
    spans = []
    for j, m in enumerate(msgs):
        if m["role"] == "assistant":
            a = len(render(msgs[:j], tools, True))
            b = len(render(msgs[:j + 1], tools, False))
            spans.append((a, b))
    return render(msgs, tools, False), spans


def build_tokenizer(texts, out):
    from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers, trainers
    tok = Tokenizer(models.BPE(ignore_merges=True))
    tok.pre_tokenizer = pre_tokenizers.Sequence([
        pre_tokenizers.Split(Regex(SPLIT_REGEX), behavior="isolated"),
        pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)])
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=VOCAB, min_frequency=2, special_tokens=SPECIALS,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False)
    tok.train_from_iterator(texts, trainer)
    check(tok.get_vocab_size() == VOCAB, f"tokenizer has {tok.get_vocab_size()} tokens, wanted {VOCAB}")
    for i, s in enumerate(SPECIALS):
        check(tok.token_to_id(s) == i, f"special token {s} is not id {i}")
    tok.save(os.path.join(out, "tokenizer.json"))
    return tok


def write_tokenizer_config(out, template_src):
    tc = {"add_bos_token": True, "add_eos_token": False, "bos_token": SPECIALS[0], "eos_token": SPECIALS[1],
          "pad_token": SPECIALS[2], "unk_token": None, "clean_up_tokenization_spaces": False,
          "model_max_length": CFG["max_position_embeddings"], "tokenizer_class": "PreTrainedTokenizerFast",
          "chat_template": template_src}
    with open(os.path.join(out, "tokenizer_config.json"), "w") as f:
        json.dump(tc, f, indent=2, ensure_ascii=False)
        f.write("\n")


def encode_stream(tok, docs, convs, render):
    """-> (ids uint16-ready int list tensor, loss mask, start offsets of each document/conversation)."""
    ids, mask, starts = [], [], []
    enc = tok.encode_batch(docs, add_special_tokens=False)
    for e in enc:
        starts.append(len(ids))
        ids += [0] + e.ids + [1]
        mask += [1] * (len(e.ids) + 2)
    texts, spans = [], []
    for c in convs:
        t, s = chat_spans(c, render)
        texts.append(t)
        spans.append(s)
    enc = tok.encode_batch(texts, add_special_tokens=False)
    for e, sp in zip(enc, spans):
        starts.append(len(ids))
        ids += e.ids
        for (a, _b) in e.offsets:
            mask.append(1 if any(x <= a < y for x, y in sp) else 0)
    return torch.tensor(ids, dtype=torch.int32), torch.tensor(mask, dtype=torch.uint8), torch.tensor(starts)


def check(cond, msg):
    if not cond:
        raise AssertionError(msg)


# --------------------------------------------------------------------------------------------------
# model


def rms(x, w, eps):
    xf = x.float()
    return (w.float() * (xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps))).to(x.dtype)


def rope_tables(T, dim, theta, device):
    i = torch.arange(dim // 2, dtype=torch.float64, device=device)
    f = theta ** (-2.0 * i / dim)
    ang = torch.arange(T, dtype=torch.float64, device=device)[:, None] * f[None, :]
    return torch.cos(ang).float(), torch.sin(ang).float()


def rope_interleaved(x, c, s):
    x0, x1 = x[..., 0::2].float(), x[..., 1::2].float()
    return torch.stack([x0 * c - x1 * s, x0 * s + x1 * c], -1).flatten(-2).to(x.dtype)


def rope_half(x, c, s):
    h = x.shape[-1] // 2
    x1, x2 = x[..., :h].float(), x[..., h:].float()
    return torch.cat([x1 * c - x2 * s, x2 * c + x1 * s], -1).to(x.dtype)


def segsum(a):
    """a [..., L] -> [..., L, L] with out[i, j] = sum(a[j+1..i]) for i >= j, -inf above the diagonal."""
    L = a.shape[-1]
    x = a[..., None].expand(*a.shape, L)
    low = torch.tril(torch.ones(L, L, dtype=torch.bool, device=a.device), -1)
    x = x.masked_fill(~low, 0).cumsum(-2)
    return x.masked_fill(~torch.tril(torch.ones(L, L, dtype=torch.bool, device=a.device)), -math.inf)


def ssd(X, a, Bm, Cm, L):
    """Chunked Mamba-2 scan from a zero state. X [B,T,H,P] (x*dt), a [B,T,H] (dt*A), Bm/Cm [B,T,H,N]."""
    Bsz, T, H, P = X.shape
    pad = (-T) % L
    if pad:
        X = F.pad(X, (0, 0, 0, 0, 0, pad))
        a = F.pad(a, (0, 0, 0, pad))
        Bm = F.pad(Bm, (0, 0, 0, 0, 0, pad))
        Cm = F.pad(Cm, (0, 0, 0, 0, 0, pad))
    c = X.shape[1] // L
    X = X.reshape(Bsz, c, L, H, P)
    Bm = Bm.reshape(Bsz, c, L, H, -1)
    Cm = Cm.reshape(Bsz, c, L, H, -1)
    a = a.reshape(Bsz, c, L, H).permute(0, 3, 1, 2)  # [B,H,c,L]
    acs = a.cumsum(-1)
    Lm = torch.exp(segsum(a))
    scores = torch.einsum("bclhn,bcshn->bchls", Cm, Bm) * Lm.permute(0, 2, 1, 3, 4)
    y_diag = torch.einsum("bchls,bcshp->bclhp", scores, X)
    decay = torch.exp(acs[..., -1:] - acs)  # [B,H,c,L]
    states = torch.einsum("bclhn,bhcl,bclhp->bchpn", Bm, decay, X)
    states = torch.cat([torch.zeros_like(states[:, :1]), states], 1)
    dchunk = torch.exp(segsum(F.pad(acs[..., -1], (1, 0))))  # [B,H,c+1,c+1]
    states = torch.einsum("bhzc,bchpn->bzhpn", dchunk, states)[:, :-1]
    y_off = torch.einsum("bclhn,bchpn,bhcl->bclhp", Cm, states, torch.exp(acs))
    return (y_diag + y_off).reshape(Bsz, c * L, H, P)[:, :T]


def lin(o, i, std=0.02):
    return nn.Parameter(torch.randn(o, i) * std)


class Mamba(nn.Module):
    def __init__(self, c, out_std):
        super().__init__()
        H, P, G, N, K, D = (c["mamba_num_heads"], c["mamba_head_dim"], c["n_groups"], c["ssm_state_size"],
                            c["conv_kernel"], c["hidden_size"])
        self.H, self.P, self.G, self.N, self.K, self.L = H, P, G, N, K, c["chunk_size"]
        d = H * P
        cd = d + 2 * G * N
        self.in_proj = lin(2 * d + 2 * G * N + H, D)
        self.conv_w = nn.Parameter(torch.randn(cd, 1, K) * K ** -0.5)
        self.conv_b = nn.Parameter(torch.zeros(cd))
        dt = torch.exp(torch.rand(H) * (math.log(0.1) - math.log(0.001)) + math.log(0.001))
        self.dt_bias = nn.Parameter(dt + torch.log(-torch.expm1(-dt)))
        self.A_log = nn.Parameter(torch.log(torch.rand(H) * 15 + 1))
        self.D = nn.Parameter(torch.ones(H))
        self.norm = nn.Parameter(torch.ones(d))
        self.out_proj = lin(D, d, out_std)

    def forward(self, u):
        B, T, _ = u.shape
        H, P, G, N = self.H, self.P, self.G, self.N
        d = H * P
        zx = u @ self.in_proj.t()
        z, xBC, dtr = zx[..., :d], zx[..., d:2 * d + 2 * G * N], zx[..., 2 * d + 2 * G * N:]
        xBC = F.conv1d(xBC.transpose(1, 2), self.conv_w.to(xBC.dtype), self.conv_b.to(xBC.dtype),
                       padding=self.K - 1, groups=xBC.shape[-1])[..., :T].transpose(1, 2)
        xBC = F.silu(xBC)
        x = xBC[..., :d].reshape(B, T, H, P).float()
        Bm = xBC[..., d:d + G * N].reshape(B, T, G, N).float().repeat_interleave(H // G, 2)
        Cm = xBC[..., d + G * N:].reshape(B, T, G, N).float().repeat_interleave(H // G, 2)
        dt = F.softplus(dtr.float() + self.dt_bias.float())
        A = -torch.exp(self.A_log.float())
        with torch.autocast(device_type=u.device.type, enabled=False):
            y = ssd(x * dt[..., None], dt * A, Bm, Cm, self.L) + self.D.float()[:, None] * x
        v = y.reshape(B, T, d) * F.silu(z.float())
        vg = v.reshape(B, T, G, d // G)
        vg = vg * torch.rsqrt(vg.pow(2).mean(-1, keepdim=True) + 1e-5)
        v = (vg.reshape(B, T, d) * self.norm.float()).to(u.dtype)
        return v @ self.out_proj.t().to(v.dtype), None


class MLA(nn.Module):
    def __init__(self, c, out_std):
        super().__init__()
        Hd, nh, ql, kl = c["hidden_size"], c["num_attention_heads"], c["q_lora_rank"], c["kv_lora_rank"]
        dn, dr, dv, Hi, Di = (c["qk_nope_head_dim"], c["qk_rope_head_dim"], c["v_head_dim"], c["index_n_heads"],
                              c["index_head_dim"])
        self.c = c
        self.q_a_proj = lin(ql, Hd)
        self.q_a_layernorm = nn.Parameter(torch.ones(ql))
        self.q_b_proj = lin(nh * (dn + dr), ql)
        self.kv_a_proj_with_mqa = lin(kl + dr, Hd)
        self.kv_a_layernorm = nn.Parameter(torch.ones(kl))
        self.kv_b_proj = lin(nh * (dn + dv), kl)
        self.o_proj = lin(Hd, nh * dv, out_std)
        self.wq_b = lin(Hi * Di, ql)
        self.wk = lin(Di, Hd)
        self.k_norm_w = nn.Parameter(torch.ones(Di))
        self.k_norm_b = nn.Parameter(torch.zeros(Di))
        self.weights_proj = lin(Hi, Hd)

    def forward(self, x, rope, sparse):
        c = self.c
        B, T, _ = x.shape
        nh, dn, dr, dv, kl = (c["num_attention_heads"], c["qk_nope_head_dim"], c["qk_rope_head_dim"],
                              c["v_head_dim"], c["kv_lora_rank"])
        Hi, Di, K = c["index_n_heads"], c["index_head_dim"], c["index_topk"]
        cos, sin = rope[0][:T], rope[1][:T]
        cq = rms(x @ self.q_a_proj.t(), self.q_a_layernorm, 1e-6)
        q = (cq @ self.q_b_proj.t()).view(B, T, nh, dn + dr)
        q_nope, q_pe = q[..., :dn], rope_interleaved(q[..., dn:], cos[:, None], sin[:, None])
        kva = x @ self.kv_a_proj_with_mqa.t()
        ckv = rms(kva[..., :kl], self.kv_a_layernorm, 1e-6)
        kpe = rope_interleaved(kva[..., kl:], cos, sin)
        kv = (ckv @ self.kv_b_proj.t()).view(B, T, nh, dn + dv)
        k_nope, v = kv[..., :dn], kv[..., dn:]
        s = (torch.einsum("bthd,bshd->bhts", q_nope, k_nope) + torch.einsum("bthd,bsd->bhts", q_pe, kpe)).float()
        s = s * (dn + dr) ** -0.5
        causal = torch.tril(torch.ones(T, T, dtype=torch.bool, device=x.device))
        # the lightning indexer, on detached inputs
        cqd, xd = cq.detach(), x.detach()
        iq = (cqd @ self.wq_b.t()).view(B, T, Hi, Di)
        ik = F.layer_norm((xd @ self.wk.t()).float(), (Di,), self.k_norm_w.float(), self.k_norm_b.float(), 1e-6)
        ik = ik.to(iq.dtype)
        iq = torch.cat([rope_half(iq[..., :dr], cos[:, None], sin[:, None]), iq[..., dr:]], -1)
        ik = torch.cat([rope_half(ik[..., :dr], cos, sin), ik[..., dr:]], -1)
        w = (xd @ self.weights_proj.t()).float() * (Hi ** -0.5 * Di ** -0.5)
        I = torch.einsum("bth,bths->bts", w, torch.relu(torch.einsum("bthd,bsd->bths", iq, ik)).float())
        I = I.masked_fill(~causal, -math.inf)
        if sparse and T > K:
            sel = I.detach().topk(K, -1).indices
            mask = torch.zeros(B, T, T, dtype=torch.bool, device=x.device).scatter_(-1, sel, True) & causal
        else:
            mask = causal.expand(B, T, T)
        s = s.masked_fill(~mask[:, None], -math.inf)
        p = torch.softmax(s, -1)
        o = torch.einsum("bhts,bshd->bthd", p.to(v.dtype), v).reshape(B, T, nh * dv)
        target = p.detach().sum(1) / nh
        logq = torch.log_softmax(I.masked_fill(~mask, -math.inf), -1).masked_fill(~mask, 0)
        kl_loss = (target * (torch.log(target.clamp_min(1e-30)) - logq)).sum(-1).mean()
        return o @ self.o_proj.t().to(o.dtype), kl_loss


class MLP(nn.Module):
    def __init__(self, c, out_std, F_=None):
        super().__init__()
        Hd, Fi = c["hidden_size"], F_ or c["intermediate_size"]
        self.up_proj = lin(Fi, Hd)
        self.down_proj = lin(Hd, Fi, out_std)

    def forward(self, u):
        return torch.relu(u @ self.up_proj.t()).pow(2) @ self.down_proj.t(), None


class MoE(nn.Module):
    def __init__(self, c, out_std):
        super().__init__()
        Hd, E, Fe = c["hidden_size"], c["n_routed_experts"], c["moe_intermediate_size"]
        self.E, self.k, self.scale = E, c["num_experts_per_tok"], c["routed_scaling_factor"]
        self.gate = lin(E, Hd)
        self.register_buffer("bias", torch.zeros(E))
        self.up = nn.Parameter(torch.randn(E, Fe, Hd) * 0.02)
        self.down = nn.Parameter(torch.randn(E, Hd, Fe) * out_std)
        self.shared = MLP(c, out_std, c["moe_shared_expert_intermediate_size"])
        self.load = None

    def forward(self, u):
        B, T, Hd = u.shape
        x = u.reshape(-1, Hd)
        s = torch.sigmoid(x.float() @ self.gate.float().t())
        idx = (s + self.bias).topk(self.k, -1).indices
        wts = s.gather(1, idx)
        wts = wts / (wts.sum(-1, keepdim=True) + 1e-20) * self.scale
        y = self.shared(x)[0].float()
        load = torch.zeros(self.E, device=u.device)
        for e in range(self.E):
            rows, slot = (idx == e).nonzero(as_tuple=True)
            load[e] = rows.numel()
            if rows.numel():
                ye = torch.relu(x[rows] @ self.up[e].t().to(x.dtype)).pow(2) @ self.down[e].t().to(x.dtype)
                y = y.index_add(0, rows, ye.float() * wts[rows, slot, None])
        self.load = load
        return y.to(u.dtype).reshape(B, T, Hd), None


def make_mixer(kind, c, out_std):
    return {"M": Mamba, "D": MLA, "-": MLP, "E": MoE}[kind](c, out_std)


class Block(nn.Module):
    def __init__(self, kind, c, out_std):
        super().__init__()
        self.kind = kind
        self.norm = nn.Parameter(torch.ones(c["hidden_size"]))
        self.mixer = make_mixer(kind, c, out_std)

    def forward(self, h, rope, sparse):
        u = rms(h, self.norm, 1e-5)
        y, aux = self.mixer(u, rope, sparse) if self.kind == "D" else self.mixer(u)
        return h + y.to(h.dtype), aux


class Model(nn.Module):
    def __init__(self, c):
        super().__init__()
        self.c = c
        n = len(c["hybrid_override_pattern"]) + len(c["mtp_hybrid_override_pattern"])
        out_std = 0.02 / math.sqrt(2 * n)
        Hd = c["hidden_size"]
        self.emb = nn.Parameter(torch.randn(c["vocab_size"], Hd) * 0.02)
        self.layers = nn.ModuleList([Block(k, c, out_std) for k in c["hybrid_override_pattern"]])
        self.norm_f = nn.Parameter(torch.ones(Hd))
        self.enorm = nn.Parameter(torch.ones(Hd))
        self.hnorm = nn.Parameter(torch.ones(Hd))
        self.eh_proj = lin(Hd, 2 * Hd)
        self.mtp_layers = nn.ModuleList([Block(k, c, out_std) for k in c["mtp_hybrid_override_pattern"]])
        self.mtp_norm = nn.Parameter(torch.ones(Hd))
        self.rope = None

    def ropes(self, T, device):
        if self.rope is None or self.rope[0].shape[0] < T or self.rope[0].device != device:
            self.rope = rope_tables(max(T, 64), self.c["qk_rope_head_dim"], self.c["rope_theta"], device)
        return self.rope

    def forward(self, ids, nxt=None, sparse=True):
        """ids [B,T] -> (logits [B,T,V], mtp logits [B,T,V] or None, indexer losses). nxt [B,T] = ids shifted
        by one (token i+1 at position i) for the MTP layer."""
        rope = self.ropes(ids.shape[1], ids.device)
        h = F.embedding(ids, self.emb)
        aux = []
        for blk in self.layers:
            h, a = blk(h, rope, sparse)
            if a is not None:
                aux.append(a)
        hf = rms(h, self.norm_f, 1e-5)
        logits = hf @ self.emb.t().to(hf.dtype)
        if nxt is None:
            return logits, None, aux
        e = rms(F.embedding(nxt, self.emb), self.enorm, 1e-5)
        g = torch.cat([e.to(hf.dtype), rms(hf, self.hnorm, 1e-5)], -1) @ self.eh_proj.t().to(hf.dtype)
        for blk in self.mtp_layers:
            g, a = blk(g, rope, sparse)
            if a is not None:
                aux.append(a)
        g = rms(g, self.mtp_norm, 1e-5)
        return logits, g @ self.emb.t().to(g.dtype), aux

    def moes(self):
        return [b.mixer for b in list(self.layers) + list(self.mtp_layers) if b.kind == "E"]


# --------------------------------------------------------------------------------------------------
# export (krait's hybrid layout) and import


def export_tensors(model):
    c, out = model.c, {}
    out["backbone.embeddings.weight"] = model.emb
    out["backbone.norm_f.weight"] = model.norm_f

    def block(pre, blk):
        out[pre + "norm.weight"] = blk.norm
        m, p = blk.mixer, pre + "mixer."
        if blk.kind == "M":
            for n, t in (("in_proj.weight", m.in_proj), ("conv1d.weight", m.conv_w), ("conv1d.bias", m.conv_b),
                         ("dt_bias", m.dt_bias), ("A_log", m.A_log), ("D", m.D), ("norm.weight", m.norm),
                         ("out_proj.weight", m.out_proj)):
                out[p + n] = t
        elif blk.kind == "D":
            for n in ("q_a_proj", "q_b_proj", "kv_a_proj_with_mqa", "kv_b_proj", "o_proj"):
                out[p + n + ".weight"] = getattr(m, n)
            out[p + "q_a_layernorm.weight"] = m.q_a_layernorm
            out[p + "kv_a_layernorm.weight"] = m.kv_a_layernorm
            out[p + "indexer.wq_b.weight"] = m.wq_b
            out[p + "indexer.wk.weight"] = m.wk
            out[p + "indexer.k_norm.weight"] = m.k_norm_w
            out[p + "indexer.k_norm.bias"] = m.k_norm_b
            out[p + "indexer.weights_proj.weight"] = m.weights_proj
        elif blk.kind == "-":
            out[p + "up_proj.weight"] = m.up_proj
            out[p + "down_proj.weight"] = m.down_proj
        else:
            out[p + "gate.weight"] = m.gate
            out[p + "gate.e_score_correction_bias"] = m.bias
            for e in range(m.E):
                out[p + f"experts.{e}.up_proj.weight"] = m.up[e]
                out[p + f"experts.{e}.down_proj.weight"] = m.down[e]
            out[p + "shared_experts.up_proj.weight"] = m.shared.up_proj
            out[p + "shared_experts.down_proj.weight"] = m.shared.down_proj
    for i, blk in enumerate(model.layers):
        block(f"backbone.layers.{i}.", blk)
    mp = "mtp.layers.0."
    out[mp + "enorm.weight"] = model.enorm
    out[mp + "hnorm.weight"] = model.hnorm
    out[mp + "eh_proj.weight"] = model.eh_proj
    for j, blk in enumerate(model.mtp_layers):
        block(f"{mp}layers.{j}.", blk)
    out[mp + "final_layernorm.weight"] = model.mtp_norm
    return out


def write_safetensors(path, tensors):
    header, blobs, off = {"__metadata__": {"format": "pt"}}, [], 0
    for name, t in tensors.items():
        b = t.detach().to("cpu", torch.bfloat16).contiguous().view(torch.int16).numpy().tobytes()
        header[name] = {"dtype": "BF16", "shape": list(t.shape), "data_offsets": [off, off + len(b)]}
        blobs.append(b)
        off += len(b)
    hb = json.dumps(header, separators=(",", ":")).encode()
    hb += b" " * (-len(hb) % 8)
    with open(path, "wb") as f:
        f.write(struct.pack("<Q", len(hb)))
        f.write(hb)
        for b in blobs:
            f.write(b)
    return off


def read_safetensors(path):
    with open(path, "rb") as f:
        n = struct.unpack("<Q", f.read(8))[0]
        header = json.loads(f.read(n))
        data = f.read()
    out = {}
    for name, h in header.items():
        if name == "__metadata__":
            continue
        a, b = h["data_offsets"]
        check(h["dtype"] == "BF16", f"{name}: {h['dtype']}")
        t = torch.frombuffer(bytearray(data[a:b]), dtype=torch.int16).view(torch.bfloat16)
        out[name] = t.reshape(h["shape"]).float()
    return out


def load_exported(model, path):
    """Loads model.safetensors into `model` (the values as stored, in float32)."""
    st = read_safetensors(path)
    want = export_tensors(model)
    check(set(st) == set(want), f"tensor names differ: {sorted(set(st) ^ set(want))[:5]}")
    with torch.no_grad():
        for n, t in want.items():
            check(list(t.shape) == list(st[n].shape), f"{n}: shape {list(st[n].shape)}, want {list(t.shape)}")
            t.copy_(st[n])


# --------------------------------------------------------------------------------------------------
# training


def lr_at(step, total, peak, warm):
    if step < warm:
        return peak * (step + 1) / warm
    p = (step - warm) / max(1, total - warm)
    return peak * (0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * min(1.0, p))))


def batch(gen, src, B, T, device):
    """B windows of T+2 tokens: from document/conversation starts (chat) or anywhere (text)."""
    ids, mask, starts = src
    n = ids.numel()
    if starts is not None:
        pick = starts[torch.randint(len(starts), (B,), generator=gen)]
    else:
        pick = torch.randint(n - T - 3, (B,), generator=gen)
    pick = pick.clamp(max=n - T - 3)
    ix = pick[:, None] + torch.arange(T + 2)[None]
    return ids[ix].long().to(device), mask[ix].to(device)


def losses(model, x, m, sparse):
    inp, tgt, nxt, tgt2 = x[:, :-2], x[:, 1:-1], x[:, 1:-1], x[:, 2:]
    logits, mtp, aux = model(inp, nxt, sparse)
    m1, m2 = m[:, 1:-1].float(), m[:, 2:].float()
    ce = F.cross_entropy(logits.float().flatten(0, 1), tgt.flatten(), reduction="none").view_as(m1)
    ce2 = F.cross_entropy(mtp.float().flatten(0, 1), tgt2.flatten(), reduction="none").view_as(m2)
    l_main = (ce * m1).sum() / m1.sum().clamp_min(1)
    l_mtp = (ce2 * m2).sum() / m2.sum().clamp_min(1)
    acc = ((mtp[:, :-1].argmax(-1) == logits[:, 1:].argmax(-1)).float() * m2[:, :-1]).sum() / \
        m2[:, :-1].sum().clamp_min(1)
    return l_main, l_mtp, sum(aux) / max(1, len(aux)), acc


@torch.no_grad()
def evaluate(model, src, T, device, n_windows=64):
    """Mean loss over n_windows fixed windows (deterministic), MTP loss and greedy MTP acceptance."""
    model.eval()
    ids, mask, _ = src
    n = ids.numel()
    step = max(1, (n - T - 3) // n_windows)
    tot = [0.0, 0.0, 0.0, 0]
    for i in range(0, min(n_windows, (n - T - 3) // step)):
        ix = (i * step + torch.arange(T + 2))[None]
        x, m = ids[ix].long().to(device), mask[ix].to(device)
        with torch.autocast(device_type=device.type, dtype=torch.bfloat16, enabled=device.type == "cuda"):
            lm, l2, _, acc = losses(model, x, m, True)
        tot[0] += lm.item()
        tot[1] += l2.item()
        tot[2] += acc.item()
        tot[3] += 1
    model.train()
    k = max(1, tot[3])
    return {"loss": tot[0] / k, "ppl": math.exp(tot[0] / k), "mtp_loss": tot[1] / k, "mtp_greedy_accept": tot[2] / k,
            "windows": tot[3]}


@torch.no_grad()
def generate(model, tok, prompt_ids, n, device):
    ids = list(prompt_ids)
    model.eval()
    for _ in range(n):
        x = torch.tensor([ids], device=device)
        with torch.autocast(device_type=device.type, dtype=torch.bfloat16, enabled=device.type == "cuda"):
            lg, _, _ = model(x, None, True)
        t = int(lg[0, -1].float().argmax())
        ids.append(t)
        if t == 1:
            break
    model.train()
    return tok.decode(ids[len(prompt_ids):], skip_special_tokens=False)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("data")
    ap.add_argument("out")
    ap.add_argument("--steps", type=int, default=6000)
    ap.add_argument("--seed", type=int, default=20261205)
    ap.add_argument("--batch", type=int, default=32)
    ap.add_argument("--seq", type=int, default=1024)
    ap.add_argument("--lr", type=float, default=2e-3)
    ap.add_argument("--warmup", type=int, default=200)
    ap.add_argument("--dense-frac", type=float, default=0.1)
    ap.add_argument("--chat-frac", type=float, default=0.35)
    ap.add_argument("--mtp-weight", type=float, default=0.3)
    ap.add_argument("--ckpt", default=None)
    ap.add_argument("--save-every", type=int, default=500)
    ap.add_argument("--resume", action="store_true")
    ap.add_argument("--time-limit", type=float, default=0, help="stop (saving --ckpt) after this many seconds")
    ap.add_argument("--budget", type=float, default=0,
                    help="choose --steps to fill this many seconds of training, from 20 timed steps of a throwaway "
                         "model; the log records the choice (pass it as --steps to reproduce the run)")
    a = ap.parse_args()
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    torch.backends.cuda.matmul.allow_tf32 = True
    torch.backends.cudnn.allow_tf32 = True
    os.makedirs(a.out, exist_ok=True)
    t0 = time.time()

    template_src, render = render_template()
    docs = read_docs(os.path.join(a.data, "train.txt"))
    convs = read_convs(os.path.join(a.data, "chat.jsonl"))
    rnd = random.Random(a.seed)
    chat_texts = [chat_spans(c, render)[0] for c in convs]
    tok_path = os.path.join(a.out, "tokenizer.json")
    if a.resume and os.path.exists(tok_path):
        from tokenizers import Tokenizer
        tok = Tokenizer.from_file(tok_path)
    else:
        tok = build_tokenizer(docs + chat_texts, a.out)
    write_tokenizer_config(a.out, template_src)
    text_ids, text_mask, _ = encode_stream(tok, docs, [], render)
    chat_ids, chat_mask, chat_starts = encode_stream(tok, [], convs, render)
    ho_docs = read_docs(os.path.join(a.data, "heldout.txt"))
    ho_convs = read_convs(os.path.join(a.data, "chat-heldout.jsonl"))
    ho_text = encode_stream(tok, ho_docs, [], render)
    ho_chat = encode_stream(tok, [], ho_convs, render)
    print(f"tokenizer + data: {time.time() - t0:.1f} s; text {text_ids.numel()} tokens "
          f"({sum(map(len, docs)) / text_ids.numel():.2f} chars/token), chat {chat_ids.numel()} tokens "
          f"({int(chat_mask.sum())} trained), held out {ho_text[0].numel()} + {ho_chat[0].numel()}", flush=True)

    text_src = (text_ids, text_mask, None)
    chat_src = (chat_ids, chat_mask, chat_starts)
    n_chat = int(round(a.chat_frac * a.batch))
    if a.budget and not a.resume:
        trial = Model(CFG).to(device)
        topt = torch.optim.AdamW(trial.parameters(), lr=1e-4)
        tg = torch.Generator().manual_seed(1)
        for i in range(25):
            if i == 5:
                if device.type == "cuda":
                    torch.cuda.synchronize()
                tt = time.time()
            xt, mt = batch(tg, text_src, a.batch - n_chat, a.seq, device)
            xc, mc = batch(tg, chat_src, n_chat, a.seq, device)
            with torch.autocast(device_type=device.type, dtype=torch.bfloat16, enabled=device.type == "cuda"):
                lm, l2, li, _ = losses(trial, torch.cat([xt, xc]), torch.cat([mt, mc]), i % 2 == 0)
            topt.zero_grad(set_to_none=True)
            (lm + l2 + li).backward()
            topt.step()
        if device.type == "cuda":
            torch.cuda.synchronize()
        per = (time.time() - tt) / 20
        a.steps = int(a.budget / per)
        del trial, topt
        print(f"trial: {per * 1e3:.1f} ms/step; --steps {a.steps} fills {a.budget:.0f} s", flush=True)
    torch.manual_seed(a.seed)
    model = Model(CFG).to(device)
    n_params = sum(p.numel() for p in model.parameters())
    decay = [p for p in model.parameters() if p.dim() >= 2]
    nodecay = [p for p in model.parameters() if p.dim() < 2]
    opt = torch.optim.AdamW([{"params": decay, "weight_decay": 0.1}, {"params": nodecay, "weight_decay": 0.0}],
                            lr=a.lr, betas=(0.9, 0.95), eps=1e-8, **({"fused": True} if device.type == "cuda" else {}))
    gen = torch.Generator().manual_seed(a.seed)
    step, log = 0, []
    ck = os.path.join(a.ckpt, "state.pt") if a.ckpt else None
    if a.resume and ck and os.path.exists(ck):
        st = torch.load(ck, map_location=device)
        model.load_state_dict(st["model"])
        opt.load_state_dict(st["opt"])
        gen.set_state(st["gen"])
        step, log = st["step"], st["log"]
        print(f"resumed at step {step}", flush=True)
    dense_steps = int(a.dense_frac * a.steps)
    tl = time.time()
    t_train = time.time()
    while step < a.steps:
        if a.time_limit and time.time() - t0 > a.time_limit:
            break
        for g in opt.param_groups:
            g["lr"] = lr_at(step, a.steps, a.lr, a.warmup)
        xt, mt = batch(gen, text_src, a.batch - n_chat, a.seq, device)
        xc, mc = batch(gen, chat_src, n_chat, a.seq, device)
        x, m = torch.cat([xt, xc]), torch.cat([mt, mc])
        with torch.autocast(device_type=device.type, dtype=torch.bfloat16, enabled=device.type == "cuda"):
            lm, l2, li, acc = losses(model, x, m, step >= dense_steps)
        loss = lm + a.mtp_weight * l2 + li
        opt.zero_grad(set_to_none=True)
        loss.backward()
        gn = torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        with torch.no_grad():
            for moe in model.moes():
                moe.bias += 1e-3 * torch.sign(moe.load.mean() - moe.load)
        step += 1
        if step % 50 == 0 or step == 1:
            rec = {"step": step, "loss": lm.item(), "mtp": l2.item(), "idx_kl": li.item(), "mtp_acc": acc.item(),
                   "gnorm": gn.item(), "lr": opt.param_groups[0]["lr"], "s": round(time.time() - t_train, 1)}
            log.append(rec)
            dt = time.time() - tl
            tl = time.time()
            print(json.dumps(rec), f"{50 * a.batch * a.seq / max(dt, 1e-9) / 1e3:.0f}K tok/s", flush=True)
        if ck and step % a.save_every == 0:
            os.makedirs(a.ckpt, exist_ok=True)
            torch.save({"model": model.state_dict(), "opt": opt.state_dict(), "gen": gen.get_state(), "step": step,
                        "log": log}, ck)
    if ck:
        os.makedirs(a.ckpt, exist_ok=True)
        torch.save({"model": model.state_dict(), "opt": opt.state_dict(), "gen": gen.get_state(), "step": step,
                    "log": log}, ck)
    train_s = time.time() - t_train

    # export in bf16, reload the stored values and measure with them
    with open(os.path.join(a.out, "config.json"), "w") as f:
        f.write(json.dumps(CFG, indent=2))
        f.write("\n")
    nbytes = write_safetensors(os.path.join(a.out, "model.safetensors"), export_tensors(model))
    load_exported(model, os.path.join(a.out, "model.safetensors"))
    ev = {"heldout_text": evaluate(model, ho_text, a.seq, device),
          "heldout_chat": evaluate(model, ho_chat, a.seq, device, 32),
          "train_text": evaluate(model, text_src, a.seq, device)}
    samples = []
    for q in ["Hello!", "What does Genesis 1:3 say?", "What is the Python module `json` for?",
              "Tell me about transactions in SQLite.", "Who are you?"]:
        p = render([{"role": "user", "content": q}], None, True)
        samples.append({"q": q, "a": generate(model, tok, tok.encode(p, add_special_tokens=False).ids, 80, device)})
    p = render([{"role": "user", "content": "What is the weather in Oslo?"}], [TOOLS_DEMO], True)
    samples.append({"q": "weather tool", "a": generate(model, tok, tok.encode(p, add_special_tokens=False).ids, 60,
                                                         device)})
    for t in ["In the beginning", "The sqlite3 module"]:
        samples.append({"q": t, "a": generate(model, tok, [0] + tok.encode(t, add_special_tokens=False).ids, 60,
                                              device)})
    res = {"steps": step, "target_steps": a.steps, "seed": a.seed, "batch": a.batch, "seq": a.seq, "lr": a.lr,
           "params": n_params, "bytes_bf16": nbytes, "train_seconds": round(train_s, 1),
           "tokens_seen": step * a.batch * a.seq, "device": torch.cuda.get_device_name() if device.type == "cuda"
           else "cpu", "torch": torch.__version__, "eval": ev, "samples": samples, "log": log}
    with open(os.path.join(a.out, "train-log.json"), "w") as f:
        json.dump(res, f, indent=1, ensure_ascii=False)
    print(json.dumps({k: v for k, v in res.items() if k != "log"}, indent=1, ensure_ascii=False), flush=True)


TOOLS_DEMO = {"type": "function", "function": {
    "name": "get_weather", "description": "Current weather in a city",
    "parameters": {"type": "object", "properties": {"city": {"type": "string"},
                                                    "unit": {"type": "string", "enum": ["celsius", "fahrenheit"]}},
                   "required": ["city"]}}}

if __name__ == "__main__":
    main()
