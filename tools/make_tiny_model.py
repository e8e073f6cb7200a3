#!/usr/bin/env python3
"""Writes the embedded default model: a narrow hybrid Mamba/DSA checkpoint in krait's hybrid
layout (nemotron_h config with `M`, `D`, `-`, `E` layers, tied embeddings) with random bf16 weights,
next to the DeepSeek-V3 tokenizer. Its outputs are meaningless; it exists so that `make serve`
starts a working server on any machine with nothing to download. Standard library only.

    python3 tools/make_tiny_model.py models/tiny-hybrid
"""
import json
import os
import random
import struct
import sys
from array import array

VOCAB = 129280   # DeepSeek-V3 tokenizer: 128000 BPE tokens + added tokens up to id 128814, padded
HIDDEN = 32
PATTERN = "MD-E"
CFG = {
    "architectures": ["NemotronHForCausalLM"],
    "model_type": "nemotron_h",
    "hybrid_override_pattern": PATTERN,
    "num_hidden_layers": len(PATTERN),
    "vocab_size": VOCAB,
    "hidden_size": HIDDEN,
    "layer_norm_epsilon": 1e-5,
    "rms_norm_eps": 1e-6,
    "tie_word_embeddings": True,
    "max_position_embeddings": 4096,
    "bos_token_id": 0,
    "eos_token_id": 1,
    "pad_token_id": 1,
    # Mamba-2
    "mamba_num_heads": 4, "mamba_head_dim": 16, "n_groups": 1, "ssm_state_size": 16,
    "conv_kernel": 4, "chunk_size": 64, "use_conv_bias": True, "use_bias": False,
    "time_step_limit": [0.0, float("inf")],
    # MLA + DSA indexer (deepseek_v32 names at the top level)
    "num_attention_heads": 2, "q_lora_rank": 32, "kv_lora_rank": 32, "qk_nope_head_dim": 16,
    "qk_rope_head_dim": 16, "v_head_dim": 16, "index_n_heads": 2, "index_head_dim": 32,
    "index_topk": 64, "rope_theta": 10000.0,
    # MLP and MoE (relu2, Nemotron style)
    "intermediate_size": 64, "mlp_hidden_act": "relu2",
    "n_routed_experts": 4, "num_experts_per_tok": 2, "moe_intermediate_size": 32,
    "moe_shared_expert_intermediate_size": 32, "n_group": 1, "topk_group": 1,
    "routed_scaling_factor": 1.0, "norm_topk_prob": True,
}


def tensors():
    c = CFG
    H, d = c["hidden_size"], {}
    d["backbone.embeddings.weight"] = ([VOCAB, H], 1.0, 0.0)
    d["backbone.norm_f.weight"] = ([H], 0.1, 1.0)
    di = c["mamba_num_heads"] * c["mamba_head_dim"]
    gn = c["n_groups"] * c["ssm_state_size"]
    for i, t in enumerate(PATTERN):
        p = f"backbone.layers.{i}."
        d[p + "norm.weight"] = ([H], 0.1, 1.0)
        m = p + "mixer."
        if t == "M":
            d[m + "in_proj.weight"] = ([2 * di + 2 * gn + c["mamba_num_heads"], H], H ** -0.5, 0.0)
            d[m + "conv1d.weight"] = ([di + 2 * gn, 1, c["conv_kernel"]], 0.5, 0.0)
            d[m + "conv1d.bias"] = ([di + 2 * gn], 0.1, 0.0)
            d[m + "dt_bias"] = ([c["mamba_num_heads"]], 1.0, -4.0)
            d[m + "A_log"] = ([c["mamba_num_heads"]], 0.5, 1.0)
            d[m + "D"] = ([c["mamba_num_heads"]], 0.1, 1.0)
            d[m + "norm.weight"] = ([di], 0.1, 1.0)
            d[m + "out_proj.weight"] = ([H, di], di ** -0.5, 0.0)
        elif t == "D":
            nh, qd = c["num_attention_heads"], c["qk_nope_head_dim"] + c["qk_rope_head_dim"]
            d[m + "q_a_proj.weight"] = ([c["q_lora_rank"], H], H ** -0.5, 0.0)
            d[m + "q_a_layernorm.weight"] = ([c["q_lora_rank"]], 0.1, 1.0)
            d[m + "q_b_proj.weight"] = ([nh * qd, c["q_lora_rank"]], c["q_lora_rank"] ** -0.5, 0.0)
            d[m + "kv_a_proj_with_mqa.weight"] = ([c["kv_lora_rank"] + c["qk_rope_head_dim"], H], H ** -0.5, 0.0)
            d[m + "kv_a_layernorm.weight"] = ([c["kv_lora_rank"]], 0.1, 1.0)
            d[m + "kv_b_proj.weight"] = ([nh * (c["qk_nope_head_dim"] + c["v_head_dim"]), c["kv_lora_rank"]],
                                         c["kv_lora_rank"] ** -0.5, 0.0)
            d[m + "o_proj.weight"] = ([H, nh * c["v_head_dim"]], (nh * c["v_head_dim"]) ** -0.5, 0.0)
            hi, hd = c["index_n_heads"], c["index_head_dim"]
            d[m + "indexer.wq_b.weight"] = ([hi * hd, c["q_lora_rank"]], c["q_lora_rank"] ** -0.5, 0.0)
            d[m + "indexer.wk.weight"] = ([hd, H], H ** -0.5, 0.0)
            d[m + "indexer.k_norm.weight"] = ([hd], 0.1, 1.0)
            d[m + "indexer.k_norm.bias"] = ([hd], 0.1, 0.0)
            d[m + "indexer.weights_proj.weight"] = ([hi, H], H ** -0.5, 0.0)
        elif t == "-":
            d[m + "up_proj.weight"] = ([c["intermediate_size"], H], H ** -0.5, 0.0)
            d[m + "down_proj.weight"] = ([H, c["intermediate_size"]], c["intermediate_size"] ** -0.5, 0.0)
        elif t == "E":
            E, F = c["n_routed_experts"], c["moe_intermediate_size"]
            d[m + "gate.weight"] = ([E, H], H ** -0.5, 0.0)
            d[m + "gate.e_score_correction_bias"] = ([E], 0.1, 0.0)
            for e in range(E):
                d[m + f"experts.{e}.up_proj.weight"] = ([F, H], H ** -0.5, 0.0)
                d[m + f"experts.{e}.down_proj.weight"] = ([H, F], F ** -0.5, 0.0)
            S = c["moe_shared_expert_intermediate_size"]
            d[m + "shared_experts.up_proj.weight"] = ([S, H], H ** -0.5, 0.0)
            d[m + "shared_experts.down_proj.weight"] = ([H, S], S ** -0.5, 0.0)
    return d


def main():
    out = sys.argv[1] if len(sys.argv) > 1 else "models/tiny-hybrid"
    os.makedirs(out, exist_ok=True)
    rng = random.Random(20261130)
    header, blobs, off = {"__metadata__": {"format": "pt"}}, [], 0
    for name, (shape, scale, shift) in tensors().items():
        n = 1
        for s in shape:
            n *= s
        f32 = array("f", (shift + scale * (2.0 * rng.random() - 1.0) for _ in range(n))).tobytes()
        # bf16 = the high half of each float32 (truncation; these are random weights anyway)
        bf = b"".join(f32[i + 2:i + 4] for i in range(0, len(f32), 4))
        header[name] = {"dtype": "BF16", "shape": shape, "data_offsets": [off, off + len(bf)]}
        blobs.append(bf)
        off += len(bf)
    hb = json.dumps(header, separators=(",", ":")).encode()
    hb += b" " * (-len(hb) % 8)
    with open(os.path.join(out, "model.safetensors"), "wb") as f:
        f.write(struct.pack("<Q", len(hb)))
        f.write(hb)
        for b in blobs:
            f.write(b)
    with open(os.path.join(out, "config.json"), "w") as f:
        f.write(json.dumps(CFG, indent=2).replace("Infinity", "Infinity"))
        f.write("\n")
    print(f"wrote {out}: {off / 1e6:.1f} MB of bf16 weights")


if __name__ == "__main__":
    main()
