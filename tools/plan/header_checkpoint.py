#!/usr/bin/env python3
"""Writes a header-only DeepSeek-V3.2-layout checkpoint: config.json and safetensors shards whose
headers name every tensor with its shape, and whose data is a hole (sparse files: a 1.3 TB model
takes a few MB of disk). `krait plan` reads nothing but headers, so it plans such a directory as it
would the real checkpoint; nothing else can load it.

  header_checkpoint.py --config CONFIG.json --out DIR [--shards 64]

The tensor names and shapes are the HF deepseek_v32 layout (those of tests/fixtures/deepseek_v32,
scaled by the config); every matrix is written as BF16 (krait dequantizes FP8 weights to bf16 at
load, so the plan is the same either way). The multi-token-prediction layers are left out (krait
skips them)."""

import argparse
import json
import os
import struct


def layer_tensors(c, i):
    H, d = c["num_attention_heads"], c["hidden_size"]
    ql, kl = c["q_lora_rank"], c["kv_lora_rank"]
    dn, dr, dv = c["qk_nope_head_dim"], c["qk_rope_head_dim"], c["v_head_dim"]
    ih, idim = c["index_n_heads"], c["index_head_dim"]
    p = f"model.layers.{i}."
    t = {
        p + "input_layernorm.weight": [d],
        p + "post_attention_layernorm.weight": [d],
        p + "self_attn.q_a_proj.weight": [ql, d],
        p + "self_attn.q_a_layernorm.weight": [ql],
        p + "self_attn.q_b_proj.weight": [H * (dn + dr), ql],
        p + "self_attn.kv_a_proj_with_mqa.weight": [kl + dr, d],
        p + "self_attn.kv_a_layernorm.weight": [kl],
        p + "self_attn.kv_b_proj.weight": [H * (dn + dv), kl],
        p + "self_attn.o_proj.weight": [d, H * dv],
        p + "self_attn.indexer.wq_b.weight": [ih * idim, ql],
        p + "self_attn.indexer.wk.weight": [idim, d],
        p + "self_attn.indexer.k_norm.weight": [idim],
        p + "self_attn.indexer.k_norm.bias": [idim],
        p + "self_attn.indexer.weights_proj.weight": [ih, d],
    }
    if i < c["first_k_dense_replace"]:
        f = c["intermediate_size"]
        t.update({p + "mlp.gate_proj.weight": [f, d], p + "mlp.up_proj.weight": [f, d],
                  p + "mlp.down_proj.weight": [d, f]})
    else:
        f, e = c["moe_intermediate_size"], c["n_routed_experts"]
        t[p + "mlp.gate.weight"] = [e, d]
        t[p + "mlp.gate.e_score_correction_bias"] = [e]
        for x in range(e):
            q = f"{p}mlp.experts.{x}."
            t.update({q + "gate_proj.weight": [f, d], q + "up_proj.weight": [f, d], q + "down_proj.weight": [d, f]})
        fs = f * c.get("n_shared_experts", 1)
        q = p + "mlp.shared_experts."
        t.update({q + "gate_proj.weight": [fs, d], q + "up_proj.weight": [fs, d], q + "down_proj.weight": [d, fs]})
    return t


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--config", required=True)
    ap.add_argument("--out", required=True)
    ap.add_argument("--shards", type=int, default=64)
    a = ap.parse_args()
    c = json.load(open(a.config))
    os.makedirs(a.out, exist_ok=True)
    with open(os.path.join(a.out, "config.json"), "w") as f:
        json.dump(c, f, indent=2)
    tensors = {"model.embed_tokens.weight": [c["vocab_size"], c["hidden_size"]],
               "model.norm.weight": [c["hidden_size"]],
               "lm_head.weight": [c["vocab_size"], c["hidden_size"]]}
    for i in range(c["num_hidden_layers"]):
        tensors.update(layer_tensors(c, i))
    names = list(tensors)
    per = (len(names) + a.shards - 1) // a.shards
    total, weight_map = 0, {}
    for s in range(a.shards):
        part = names[s * per:(s + 1) * per]
        if not part:
            break
        header, off = {"__metadata__": {"format": "pt"}}, 0
        for n in part:
            size = 2
            for x in tensors[n]:
                size *= x
            header[n] = {"dtype": "BF16", "shape": tensors[n], "data_offsets": [off, off + size]}
            off += size
        h = json.dumps(header, separators=(",", ":")).encode()
        h += b" " * (-len(h) % 8)
        fname = f"model-{s + 1:05d}-of-{a.shards:05d}.safetensors"
        weight_map.update({n: fname for n in part})
        path = os.path.join(a.out, fname)
        with open(path, "wb") as f:
            f.write(struct.pack("<Q", len(h)))
            f.write(h)
            f.truncate(8 + len(h) + off)  # the data: a hole
        total += off
    with open(os.path.join(a.out, "model.safetensors.index.json"), "w") as f:
        json.dump({"metadata": {"total_size": total}, "weight_map": weight_map}, f)
    print(f"{a.out}: {len(names)} tensors, {total / 2**30:.1f} GiB of bf16 in {min(a.shards, (len(names) + per - 1) // per)} sparse shards")


if __name__ == "__main__":
    main()
