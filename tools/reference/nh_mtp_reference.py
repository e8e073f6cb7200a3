#!/usr/bin/env python3
"""A nemotron_h fixture with an MTP layer in Nemotron 3's released layout, and the float64 reference of the
layer's logits, for krait's C tests (tests/model/test_mtp.c).

    python3 tools/reference/nh_mtp_reference.py tests/fixtures/nemotron_h/nh_moe tests/fixtures/nemotron_h/nh_mtp

(any python3 with torch and numpy: no transformers or safetensors; torch 1.13 suffices.)

SRC is a nemotron_h fixture of tools/reference/make_nemotron_h_fixtures.py: config.json, model.safetensors and
HF's reference.json / reference.bin (float32 log-probabilities of the main model). OUT receives:
  * config.json: SRC's, with "num_nextn_predict_layers": 1 and "mtp_layers_block_type": ["attention", "moe"]
    (what Nemotron 3's config.json says);
  * model.safetensors: SRC's tensors byte for byte, and the MTP layer's, named as Nemotron 3's checkpoints
    (and vLLM's NemotronHMTP loader) name them: block j of the layer is mtp.layers.j.{norm.weight, mixer.*};
    block 0 also carries enorm, hnorm and eh_proj [hidden, 2 hidden], the last block final_layernorm; the
    embedding and LM head are the main model's. The new tensors are random (seeded), stored in SRC's dtype,
    each with the spread of the main model's tensor of the same role;
  * mtp.json: the layer's logits, teacher-forced, in the format of tools/default-model/mtp_reference.py.

The reference is float64 from the stored values. Main model: h = emb[ids]; for each block h = h + mixer(rms(h,
norm)) (Mamba-2 as a recurrence, GQA attention without RoPE, relu2 MLP, the DeepSeek-style routed relu2 MoE with a
shared expert; the spec mixers of make_dsa_fixtures.py and spec_gqa below); hf = rms(h, norm_f). Its
log-probabilities (hf @ lm_head^T) are checked against SRC's reference.bin, HF's float32 forward, which is what
vouches for the mixers (checks.main_vs_reference_bin_max_abs). MTP head, for rows i = 0 .. T-2:
    g_i = eh_proj([rms(emb(t[i+1]), enorm) ; rms(hf_i, hnorm)])
    g   = g + mixer(rms(g, norm)) for the blocks, over the MTP rows as their own causal stream
    logits_i = rms(g_i, final_layernorm) @ lm_head^T                (predicts t[i+2])
rms(x, w) = w * x / sqrt(mean(x^2) + eps), eps = layer_norm_epsilon. Prompts: reference.json's of at least two
tokens, then two longer ones of seeded random ids (the head's attention over more rows than one chunk).
"""
import argparse
import json
import math
import os
import struct
import sys

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
sys.path.insert(0, os.path.join(HERE, "..", "default-model"))

import torch  # noqa: E402

import make_dsa_fixtures as S  # noqa: E402
from mtp_reference import dump, g6, prompt_entry  # noqa: E402

F64 = torch.float64
DTYPES = {"F16": torch.float16, "BF16": torch.bfloat16, "F32": torch.float32}
NAMES = {"mamba": "M", "linear_attention": "M", "attention": "*", "full_attention": "*", "mlp": "-", "moe": "E"}
MTP_BLOCKS = ["attention", "moe"]
EXTRA_LENGTHS = (96, 160)


def read_st(path):
    """-> (header without __metadata__, data bytes, {name: float64 tensor})."""
    with open(path, "rb") as f:
        n = struct.unpack("<Q", f.read(8))[0]
        header = json.loads(f.read(n))
        data = f.read()
    header.pop("__metadata__", None)
    W = {}
    for name, h in header.items():
        a, b = h["data_offsets"]
        S.check(h["dtype"] in DTYPES, f"{name}: dtype {h['dtype']}")
        t = torch.frombuffer(bytearray(data[a:b]), dtype=DTYPES[h["dtype"]])
        W[name] = t.reshape(h["shape"]).to(F64)
    return header, data, W


def write_st(path, entries):
    """entries: [(name, dtype name, shape, bytes)] in file order."""
    header, off = {"__metadata__": {"format": "pt"}}, 0
    for name, dt, shape, b in entries:
        header[name] = {"dtype": dt, "shape": list(shape), "data_offsets": [off, off + len(b)]}
        off += len(b)
    hb = json.dumps(header, separators=(",", ":")).encode()
    hb += b" " * (-len(hb) % 8)
    with open(path, "wb") as f:
        f.write(struct.pack("<Q", len(hb)))
        f.write(hb)
        for e in entries:
            f.write(e[3])


def pattern(names, key):
    for n in names:
        S.check(n in NAMES, f"{key}: unknown layer type {n!r}")
    return "".join(NAMES[n] for n in names)


def nh_fx(cfg):
    """The spec mixers' description of a nemotron_h config."""
    names = cfg.get("layers_block_type")
    pat = pattern(names, "layers_block_type") if names else cfg["hybrid_override_pattern"]
    return dict(
        kind="hybrid", pattern=pat, hidden=cfg["hidden_size"], vocab=cfg["vocab_size"],
        mamba=dict(heads=cfg["mamba_num_heads"], head_dim=cfg["mamba_head_dim"], groups=cfg["n_groups"],
                   state=cfg["ssm_state_size"], conv=cfg["conv_kernel"]),
        attn=dict(heads=cfg["num_attention_heads"], kv=cfg.get("num_key_value_heads", cfg["num_attention_heads"]),
                  head_dim=cfg.get("head_dim") or cfg["hidden_size"] // cfg["num_attention_heads"]),
        moe=dict(E=cfg["n_routed_experts"], top_k=cfg["num_experts_per_tok"], n_group=cfg["n_group"],
                 topk_group=cfg["topk_group"], scale=cfg["routed_scaling_factor"], norm=cfg["norm_topk_prob"]))


def spec_gqa(W, pre, fx, u):
    """Nemotron-H attention: GQA without RoPE, scale head_dim^-0.5, causal over the rows of u [T, hidden]."""
    a, T = fx["attn"], u.shape[0]
    H, KV, hd = a["heads"], a["kv"], a["head_dim"]

    def proj(name, x):
        y = x @ W[pre + name + ".weight"].T
        return y + W[pre + name + ".bias"] if pre + name + ".bias" in W else y

    q = proj("q_proj", u).reshape(T, H, hd)
    k = proj("k_proj", u).reshape(T, KV, hd).repeat_interleave(H // KV, dim=1)
    v = proj("v_proj", u).reshape(T, KV, hd).repeat_interleave(H // KV, dim=1)
    s = torch.einsum("thd,shd->hts", q, k) * hd ** -0.5
    s = s.masked_fill(torch.ones(T, T, dtype=torch.bool).triu(1), -math.inf)
    o = torch.einsum("hts,shd->thd", torch.softmax(s, -1), v).reshape(T, H * hd)
    return proj("o_proj", o)


def run_blocks(W, fx, h, blocks, eps):
    """Pre-norm residual blocks [(letter, norm name, mixer prefix)] over h -> (h, smallest router margin)."""
    rmin = math.inf
    for c, norm, pre in blocks:
        u = S.rms(h, W[norm], eps)
        if c == "*":
            y = spec_gqa(W, pre, fx, u)
        elif c == "M":
            y = S.spec_mamba(W, pre, fx, u)
        elif c == "-":
            y = S.spec_mlp(W, pre, u, False)
        else:
            S.check(c == "E", f"block {c!r}")
            y, mg = S.spec_moe(W, pre, fx, u, False)
            rmin = min(rmin, mg.min().item())
        h = h + y
    return h, rmin


def spec_mtp(W, fx, cfg, ids):
    eps = cfg["layer_norm_epsilon"]
    emb, head = W["backbone.embeddings.weight"], W["lm_head.weight"]
    t = torch.tensor(ids)
    main = [(c, f"backbone.layers.{i}.norm.weight", f"backbone.layers.{i}.mixer.") for i, c in enumerate(fx["pattern"])]
    h, _ = run_blocks(W, fx, emb[t], main, eps)
    hf = S.rms(h, W["backbone.norm_f.weight"], eps)
    main_lp = torch.log_softmax(hf @ head.T, -1)
    e = S.rms(emb[t[1:]], W["mtp.layers.0.enorm.weight"], eps)
    g = torch.cat([e, S.rms(hf[:-1], W["mtp.layers.0.hnorm.weight"], eps)], -1) @ W["mtp.layers.0.eh_proj.weight"].T
    mp = pattern(MTP_BLOCKS, "mtp_layers_block_type")
    blocks = [(c, f"mtp.layers.{j}.norm.weight", f"mtp.layers.{j}.mixer.") for j, c in enumerate(mp)]
    g, rmin = run_blocks(W, fx, g, blocks, eps)
    logits = S.rms(g, W[f"mtp.layers.{len(mp) - 1}.final_layernorm.weight"], eps) @ head.T
    return main_lp, logits, rmin


def mtp_tensors(header, W, fx, dtype, gen):
    """The MTP layer's tensors {name: (dtype name, shape, float tensor)}, each drawn like the main tensor of its role."""
    H = fx["hidden"]
    pat = fx["pattern"]
    like = {"*": pat.index("*"), "E": pat.index("E")}
    out = {}

    def draw(shape, mean, std):
        return (torch.randn(*shape, generator=gen, dtype=F64) * std + mean).to(DTYPES[dtype]).to(F64)

    def norm_w():
        return draw([H], 1.0, 0.1)

    out["mtp.layers.0.enorm.weight"] = norm_w()
    out["mtp.layers.0.hnorm.weight"] = norm_w()
    out["mtp.layers.0.eh_proj.weight"] = draw([H, 2 * H], 0.0, (2 * H) ** -0.5)
    for j, name in enumerate(MTP_BLOCKS):
        c = NAMES[name]
        out[f"mtp.layers.{j}.norm.weight"] = norm_w()
        src = f"backbone.layers.{like[c]}.mixer."
        for k in sorted(header):
            if k.startswith(src):
                ref = W[k]
                mean = ref.mean().item() if k.endswith("e_score_correction_bias") else 0.0
                std = ref.std().item() if ref.numel() > 1 else 0.02
                out[f"mtp.layers.{j}.mixer." + k[len(src):]] = draw(list(ref.shape), mean, std)
    out[f"mtp.layers.{len(MTP_BLOCKS) - 1}.final_layernorm.weight"] = norm_w()
    return out


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("src")
    ap.add_argument("out")
    ap.add_argument("--seed", type=int, default=20261206)
    a = ap.parse_args()
    torch.set_num_threads(max(1, min(8, os.cpu_count() or 1)))
    with open(os.path.join(a.src, "config.json")) as f:
        cfg = json.load(f)
    S.check(cfg["model_type"] == "nemotron_h", "a nemotron_h fixture expected")
    fx = nh_fx(cfg)
    S.check("*" in fx["pattern"] and "E" in fx["pattern"], "the main pattern needs attention and MoE blocks")
    header, data, W = read_st(os.path.join(a.src, "model.safetensors"))
    dtype = header["backbone.embeddings.weight"]["dtype"]
    gen = torch.Generator().manual_seed(a.seed)
    new = mtp_tensors(header, W, fx, dtype, gen)
    W.update(new)
    if "lm_head.weight" not in W:
        W["lm_head.weight"] = W["backbone.embeddings.weight"]

    os.makedirs(a.out, exist_ok=True)
    entries = []
    for name, h in sorted(header.items(), key=lambda kv: kv[1]["data_offsets"][0]):
        s0, s1 = h["data_offsets"]
        entries.append((name, h["dtype"], h["shape"], data[s0:s1]))
    for name, t in new.items():
        b = t.to(DTYPES[dtype]).contiguous().view(torch.int16 if dtype != "F32" else torch.int32).numpy().tobytes()
        entries.append((name, dtype, list(t.shape), b))
    write_st(os.path.join(a.out, "model.safetensors"), entries)
    cfg_out = dict(cfg)
    cfg_out["num_nextn_predict_layers"] = 1
    cfg_out["mtp_layers_block_type"] = MTP_BLOCKS
    with open(os.path.join(a.out, "config.json"), "w") as f:
        f.write(json.dumps(cfg_out, indent=2) + "\n")

    ref, hf_refs = S.read_reference(a.src)
    prompts = [(p["ids"], lp) for p, lp in hf_refs if len(p["ids"]) >= 2]
    for L in EXTRA_LENGTHS:
        prompts.append((torch.randint(0, cfg["vocab_size"], (L,), generator=gen).tolist(), None))
    out_prompts, worst = [], 0.0
    for ids, hf_lp in prompts:
        main_lp, logits, rmin = spec_mtp(W, fx, cfg, ids)
        if hf_lp is not None:
            d = (main_lp[-hf_lp.shape[0]:] - hf_lp.double()).abs().max().item()
            worst = max(worst, d)
        entry = prompt_entry(ids, logits, rmin, [], 0)
        out_prompts.append(entry)
        print(f"T {len(ids)}: rows {len(ids) - 1}, min logit margin {min(entry['margin']):.4g}, router margin "
              f"{entry['router_margin_min']:.4g}, logits range {logits.min().item():.3f} .. {logits.max().item():.3f}",
              flush=True)
    S.check(worst < 1e-4, f"the float64 main model differs from HF's reference.bin by {worst:.3g}")
    res = {
        "generator": f"tools/reference/nh_mtp_reference.py (torch {torch.__version__}, float64, CPU; seed {a.seed})",
        "fixture": os.path.basename(os.path.normpath(a.out)),
        "description": "MTP head logits of a nemotron_h checkpoint in Nemotron 3's layout (mtp.layers.j.*, blocks "
                       "attention then moe), teacher-forced: row i (i = 0 .. T-2) takes the main model's final-normed "
                       "hidden state at position i and token ids[i+1] and predicts ids[i+2]; the head's blocks run "
                       "over rows 0..i causally. Float64 from the stored weights. Fields as in "
                       "tools/default-model/mtp_reference.py's mtp.json (no indexer: no index margins).",
        "eps": cfg["layer_norm_epsilon"],
        "index_topk": 0,
        "mtp_pattern": pattern(MTP_BLOCKS, "mtp_layers_block_type"),
        "vocab_size": cfg["vocab_size"],
        "prompts": out_prompts,
        "checks": {"main_vs_reference_bin_max_abs": g6(worst),
                   "reference_bin": os.path.basename(os.path.normpath(a.src)) + "/reference.bin"},
    }
    path = os.path.join(a.out, "mtp.json")
    with open(path, "w") as f:
        f.write(dump(res) + "\n")
    print(json.dumps(res["checks"]), f"-> {path} ({os.path.getsize(path)} bytes)", flush=True)


if __name__ == "__main__":
    main()
