#!/usr/bin/env python3
"""A DeepSeek-V3.2-dimension slice in DeepSeek's FP8 checkpoint format, for krait benchmarks.

Usage:
    python3 tools/bench/synth_fp8_slice.py --out DIR [--dense 1] [--moe 3] [--seed 0] [--first K]

Writes a `deepseek_v32` checkpoint with the full model's dimensions and fewer layers: hidden 7168,
MLA with 128 heads (q_lora 1536, kv_lora 512, nope 128, rope 64, v 128), the V3.2 lightning indexer
(64 heads x 128, top-k 2048), `--dense` dense layers (SwiGLU 18432) and then `--moe` MoE layers (256
routed experts of 2048, top 8 in 8 groups of which 4 are kept, sigmoid scoring with a correction
bias, one shared expert), vocab 129280, YaRN RoPE to 163840 positions. The full model has 3 dense
and 58 MoE layers (and one MTP layer, left out here).

The matrices are E4M3 codes with one fp32 `weight_scale_inv` per 128 x 128 block, as DeepSeek ships
them (`quantization_config` fp8 e4m3, blocks [128, 128], scale_fmt ue8m0): random normal values of
standard deviation 1/sqrt(cols), quantized per block on the GPU (amax / 448). The norms, the router,
the indexer's head weights, the embedding and the LM head are bf16 as in the release. One safetensors
shard per layer plus one for the embedding and head, with model.safetensors.index.json.

--first K also writes DIR/first-K, a checkpoint of the first K layers only (its config and index,
the shards linked): the difference of two slices' step times is the time of the layers between them.

Sizes: a dense layer is 0.59 GB, an MoE layer 11.5 GB, the embedding and head 3.7 GB (bf16); the
default slice (1 dense, 3 MoE) is about 39 GB on disk.

Needs torch (with float8_e4m3fn) and safetensors; a CUDA GPU. No network.
"""

import argparse
import json
import math
import os
import sys
import time

import torch
from safetensors.torch import save_file

T0 = time.perf_counter()

DIM = dict(
    hidden=7168, vocab=129280, ffn=18432, moe_ffn=2048, heads=128, q_lora=1536, kv_lora=512, nope=128,
    rope=64, v=128, experts=256, top_k=8, n_group=8, topk_group=4, idx_heads=64, idx_dim=128, idx_topk=2048,
    max_pos=163840,
)


def log(msg):
    print(f"[{time.perf_counter() - T0:7.1f}s] {msg}", flush=True)


def config(n_dense, n_moe):
    d = DIM
    return {
        "architectures": ["DeepseekV32ForCausalLM"],
        "model_type": "deepseek_v32",
        "vocab_size": d["vocab"],
        "hidden_size": d["hidden"],
        "intermediate_size": d["ffn"],
        "moe_intermediate_size": d["moe_ffn"],
        "num_hidden_layers": n_dense + n_moe,
        "num_nextn_predict_layers": 0,
        "num_attention_heads": d["heads"],
        "num_key_value_heads": d["heads"],
        "n_shared_experts": 1,
        "n_routed_experts": d["experts"],
        "ep_size": 1,
        "routed_scaling_factor": 2.5,
        "kv_lora_rank": d["kv_lora"],
        "q_lora_rank": d["q_lora"],
        "qk_rope_head_dim": d["rope"],
        "v_head_dim": d["v"],
        "qk_nope_head_dim": d["nope"],
        "topk_method": "noaux_tc",
        "n_group": d["n_group"],
        "topk_group": d["topk_group"],
        "num_experts_per_tok": d["top_k"],
        "moe_layer_freq": 1,
        "first_k_dense_replace": n_dense,
        "norm_topk_prob": True,
        "scoring_func": "sigmoid",
        "hidden_act": "silu",
        "max_position_embeddings": d["max_pos"],
        "rms_norm_eps": 1e-06,
        "bos_token_id": 0,
        "eos_token_id": 1,
        "tie_word_embeddings": False,
        "rope_theta": 10000.0,
        "rope_scaling": {"type": "yarn", "factor": 40.0, "original_max_position_embeddings": 4096,
                         "beta_fast": 32, "beta_slow": 1, "mscale": 1.0, "mscale_all_dim": 1.0},
        "attention_bias": False,
        "index_topk": d["idx_topk"],
        "index_head_dim": d["idx_dim"],
        "index_n_heads": d["idx_heads"],
        "torch_dtype": "bfloat16",
        "quantization_config": {"quant_method": "fp8", "fmt": "e4m3", "weight_block_size": [128, 128],
                                "activation_scheme": "dynamic", "scale_fmt": "ue8m0"},
        "krait_synthetic": f"tools/bench/synth_fp8_slice.py --dense {n_dense} --moe {n_moe} (random weights)",
    }


class Gen:
    def __init__(self, seed):
        self.g = torch.Generator(device="cuda")
        self.g.manual_seed(seed)

    def normal(self, rows, cols, std):
        return torch.randn((rows, cols), generator=self.g, device="cuda", dtype=torch.float32) * std

    def fp8(self, rows, cols):
        """E4M3 codes [rows, cols] and fp32 scales [ceil(rows/128), ceil(cols/128)] of N(0, 1/cols)."""
        w = self.normal(rows, cols, 1.0 / math.sqrt(cols))
        br, bc = (rows + 127) // 128, (cols + 127) // 128
        pad = torch.zeros((br * 128, bc * 128), device="cuda", dtype=torch.float32)
        pad[:rows, :cols] = w
        blocks = pad.view(br, 128, bc, 128).abs().amax(dim=(1, 3)).clamp_min(1e-4)
        s = blocks / 448.0
        q = (pad.view(br, 128, bc, 128) / s[:, None, :, None]).view(br * 128, bc * 128)[:rows, :cols]
        return q.to(torch.float8_e4m3fn).cpu(), s.to(torch.float32).cpu()

    def bf16(self, shape, std=None, const=None):
        if const is not None:
            return torch.full(shape, const, dtype=torch.bfloat16)
        return (torch.randn(shape, generator=self.g, device="cuda") * std).to(torch.bfloat16).cpu()


def add_fp8(t, name, rows, cols, gen):
    q, s = gen.fp8(rows, cols)
    t[name + ".weight"] = q
    t[name + ".weight_scale_inv"] = s


def layer_tensors(i, moe, gen):
    d, t, p = DIM, {}, f"model.layers.{i}."
    H, dim = d["heads"], d["hidden"]
    t[p + "input_layernorm.weight"] = gen.bf16((dim,), const=1.0)
    t[p + "post_attention_layernorm.weight"] = gen.bf16((dim,), const=1.0)
    a = p + "self_attn."
    add_fp8(t, a + "q_a_proj", d["q_lora"], dim, gen)
    t[a + "q_a_layernorm.weight"] = gen.bf16((d["q_lora"],), const=1.0)
    add_fp8(t, a + "q_b_proj", H * (d["nope"] + d["rope"]), d["q_lora"], gen)
    add_fp8(t, a + "kv_a_proj_with_mqa", d["kv_lora"] + d["rope"], dim, gen)
    t[a + "kv_a_layernorm.weight"] = gen.bf16((d["kv_lora"],), const=1.0)
    add_fp8(t, a + "kv_b_proj", H * (d["nope"] + d["v"]), d["kv_lora"], gen)
    add_fp8(t, a + "o_proj", dim, H * d["v"], gen)
    x = a + "indexer."
    add_fp8(t, x + "wq_b", d["idx_heads"] * d["idx_dim"], d["q_lora"], gen)
    add_fp8(t, x + "wk", d["idx_dim"], dim, gen)
    t[x + "k_norm.weight"] = gen.bf16((d["idx_dim"],), const=1.0)
    t[x + "k_norm.bias"] = gen.bf16((d["idx_dim"],), const=0.0)
    t[x + "weights_proj.weight"] = gen.bf16((d["idx_heads"], dim), std=1.0 / math.sqrt(dim))
    m = p + "mlp."
    if not moe:
        add_fp8(t, m + "gate_proj", d["ffn"], dim, gen)
        add_fp8(t, m + "up_proj", d["ffn"], dim, gen)
        add_fp8(t, m + "down_proj", dim, d["ffn"], gen)
        return t
    t[m + "gate.weight"] = gen.bf16((d["experts"], dim), std=1.0 / math.sqrt(dim))
    t[m + "gate.e_score_correction_bias"] = torch.zeros((d["experts"],), dtype=torch.float32)
    for e in range(d["experts"]):
        add_fp8(t, f"{m}experts.{e}.gate_proj", d["moe_ffn"], dim, gen)
        add_fp8(t, f"{m}experts.{e}.up_proj", d["moe_ffn"], dim, gen)
        add_fp8(t, f"{m}experts.{e}.down_proj", dim, d["moe_ffn"], gen)
    add_fp8(t, m + "shared_experts.gate_proj", d["moe_ffn"], dim, gen)
    add_fp8(t, m + "shared_experts.up_proj", d["moe_ffn"], dim, gen)
    add_fp8(t, m + "shared_experts.down_proj", dim, d["moe_ffn"], gen)
    return t


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", required=True)
    ap.add_argument("--dense", type=int, default=1)
    ap.add_argument("--moe", type=int, default=3)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--first", type=int, default=0, help="also write DIR/first-K with the first K layers")
    a = ap.parse_args()
    if a.dense < 0 or a.moe < 0 or a.dense + a.moe < 1:
        sys.exit("synth_fp8_slice: --dense and --moe are counts >= 0 with at least one layer")
    if a.first < 0 or a.first >= a.dense + a.moe:
        sys.exit("synth_fp8_slice: --first K needs 0 < K < the number of layers")
    if not torch.cuda.is_available():
        sys.exit("synth_fp8_slice: needs a CUDA GPU")
    os.makedirs(a.out, exist_ok=True)
    gen = Gen(a.seed)
    weight_map, total = {}, 0

    def shard(name, tensors):
        nonlocal total
        path = os.path.join(a.out, name)
        save_file(tensors, path, metadata={"format": "pt"})
        nb = os.path.getsize(path)
        total += nb
        for k in tensors:
            weight_map[k] = name
        log(f"{name}: {len(tensors)} tensors, {nb / 1e9:.2f} GB")

    n = a.dense + a.moe
    d = DIM
    shard(f"model-00000-of-{n:05d}.safetensors", {
        "model.embed_tokens.weight": gen.bf16((d["vocab"], d["hidden"]), std=1.0),
        "model.norm.weight": gen.bf16((d["hidden"],), const=1.0),
        "lm_head.weight": gen.bf16((d["vocab"], d["hidden"]), std=1.0 / math.sqrt(d["hidden"])),
    })
    for i in range(n):
        shard(f"model-{i + 1:05d}-of-{n:05d}.safetensors", layer_tensors(i, i >= a.dense, gen))
        torch.cuda.empty_cache()
    with open(os.path.join(a.out, "model.safetensors.index.json"), "w") as f:
        json.dump({"metadata": {"total_size": total}, "weight_map": weight_map}, f, indent=1)
    with open(os.path.join(a.out, "config.json"), "w") as f:
        json.dump(config(a.dense, a.moe), f, indent=2)
    log(f"wrote {a.out}: {a.dense} dense + {a.moe} MoE layers, {total / 1e9:.1f} GB")
    if a.first:
        sub = os.path.join(a.out, f"first-{a.first}")
        os.makedirs(sub, exist_ok=True)
        keep = {f"model-00000-of-{n:05d}.safetensors"} | {f"model-{i + 1:05d}-of-{n:05d}.safetensors"
                                                          for i in range(a.first)}
        for name in keep:
            link = os.path.join(sub, name)
            if not os.path.lexists(link):
                os.symlink(os.path.join("..", name), link)
        sub_map = {k: v for k, v in weight_map.items() if v in keep}
        with open(os.path.join(sub, "model.safetensors.index.json"), "w") as f:
            json.dump({"metadata": {"total_size": sum(os.path.getsize(os.path.join(a.out, x)) for x in keep)},
                       "weight_map": sub_map}, f, indent=1)
        c = config(min(a.dense, a.first), max(0, a.first - a.dense))
        with open(os.path.join(sub, "config.json"), "w") as f:
            json.dump(c, f, indent=2)
        log(f"wrote {sub}: the first {a.first} layers")


if __name__ == "__main__":
    main()
