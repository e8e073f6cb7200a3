#!/usr/bin/env python3
"""Build tiny random DeepSeek-V3.2 (DSA) and hybrid Mamba/DSA checkpoints + float32 reference outputs for krait.

Usage:
    python3 tools/reference/make_dsa_fixtures.py OUT_ROOT [--device cpu|cuda] [--only NAME ...] [--facts FILE]
    python3 tools/reference/make_dsa_fixtures.py OUT_ROOT --spec-only      # no transformers: dry run of the
                                                                          # weight/prompt search on the float64 spec

Fixtures are written to OUT_ROOT/deepseek_v32/<name>/ (HF `deepseek_v32` layout) and OUT_ROOT/hybrid/<name>/
(krait's hybrid layout: `nemotron_h` config whose pattern holds `D` / `+` letters, MODEL_SPEC §6.3).  Each holds
config.json, model.safetensors, reference.json and reference.bin in the format of make_nemotron_h_fixtures.py,
plus the indexer's selected key sets ("index_sets") and their score margins.

References:
  * deepseek_v32/*: HF transformers `DeepseekV32ForCausalLM` (float32, eager attention, eager experts, no cache:
    every greedy step is a full forward pass) on exactly the stored weights (bf16 / f32 values, or the
    dequantized FP8 values `fp8 * weight_scale_inv` per 128x128 block).
  * hybrid/*: HF `NemotronHForCausalLM` (use_mamba_kernels False, eager, dt clamp made a no-op as in the sibling
    script) whose `D` mixers are HF `DeepseekV32Attention` modules and whose `+` mixers are HF `DeepseekV3Attention`
    modules (dense MLA, no indexer tensors), each given the causal mask and rotary embeddings computed exactly as
    DeepseekV32Model / DeepseekV3Model compute them (same HF functions; checked against what DeepseekV32Model
    passes to its attention in the deepseek_v32 fixtures).

Self-checks (any failure raises AssertionError):
  * the declared checkpoint layout (tensor names/shapes) maps 1:1 onto HF's in-memory state dict (strict load);
  * every mixer output of HF == an independent float64 implementation of MODEL_SPEC §1.3-§1.5/§2/§5 (MLA in the
    absorbed form with interleaved RoPE, YaRN, half-split indexer RoPE, LayerNorm k, ReLU-weighted scores, top-k),
    and HF's indexer selections == the float64 selections, at every position of every prompt;
  * end-to-end float64 spec model == HF log-probs;
  * every indexer selection boundary (k-th vs (k+1)-th score, positions with t+1 > index_topk) has a relative
    margin > 1e-3 of the row's largest |score|, for the prompt and for prompt + greedy continuation
    (prompts are redrawn deterministically until this holds), so no selection depends on rounding or ties;
  * the written files are reloaded, mapped back, and reproduce reference.bin, the greedy tokens and index sets;
  * for the BF16 deepseek_v32 fixtures HF's own `from_pretrained` loads the directory and reproduces the reference.

Deterministic: fixed seeds, CPU generators.  Needs torch, transformers (written for 5.17), safetensors, numpy.
"""

import argparse
import glob
import inspect
import json
import math
import os
import re
import sys
import time
import traceback

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402

F64 = torch.float64
INF = float("inf")
N_GREEDY = 12
MIN_MARGIN = 0.05          # greedy top1-top2 logprob margin
IDX_REL_MARGIN = 1e-3      # indexer boundary margin, relative to max |score| of the row
MAX_PROMPT_TRIES = 4000    # prompt draws searched (cheap float64 index pre-check first); FIXTURES[..]["prompt_start"]
                           # holds the first good draw per length, found offline with --spec-only
EOS_ID = 2
MIXER_TOL = 1e-4
E2E_TOL = 2e-3
NEAR_TIE = 1e-4
SCRIPT = "tools/reference/make_dsa_fixtures.py"
FP8_MAX = 448.0
FP8_BLOCK = 128

YARN_DS = {"type": "yarn", "factor": 4.0, "original_max_position_embeddings": 32, "beta_fast": 32, "beta_slow": 1,
           "mscale": 1.0, "mscale_all_dim": 1.0}
YARN_V2 = {"type": "yarn", "factor": 4.0, "original_max_position_embeddings": 32, "beta_fast": 32, "beta_slow": 1,
           "mscale": 1.0, "mscale_all_dim": 0.707}

MLA = dict(heads=4, q_lora=48, kv_lora=32, nope=32, rope=16, v=32, idx_heads=4, idx_dim=32, rope_theta=10000.0,
           idx_pair_noise=0.3)
MAMBA = dict(heads=8, head_dim=16, groups=2, state=16, conv=4, chunk=16, conv_bias=True)
PROMPTS = [1, 5, 8, 9, 17, 40]

FIXTURES = [
    dict(
        name="ds_yarn", kind="ds", seed=31001,
        desc="DeepSeek-V3.2 layout, 4 layers, first_k_dense_replace 2 (krait pattern D-D-DEDE), YaRN factor 4 over "
             "original_max_position_embeddings 32, mscale = mscale_all_dim = 1 (softmax scale x m(4,1)^2), "
             "index_topk 8, 4 indexer heads of dim 32, MoE E=8 top-2 n_group 2 topk_group 1 with correction bias, "
             "scale 2.5, SwiGLU; BF16 except e_score_correction_bias and indexer.weights_proj (F32)",
        vocab=256, hidden=64, layers=4, first_k_dense=2, intermediate=128,
        mla=dict(MLA, topk=8), rope_scaling=YARN_DS, max_pos=128,
        moe=dict(E=8, top_k=2, n_group=2, topk_group=1, scale=2.5, norm=True, ffn=32, n_shared=1),
        storage="ds_bf16", mtp=False, prompts=PROMPTS,
        prompt_start={1: 0, 5: 0, 8: 4, 9: 8, 17: 2, 40: 833},
    ),
    dict(
        name="ds_fp8", kind="ds", seed=32002,
        desc="DeepSeek-V3.2 layout with FP8 (e4m3) 128x128-block weights + weight_scale_inv (ue8m0 power-of-two "
             "scales), quantization_config as V3.2; 4 layers, first_k_dense_replace 1 (D-DEDEDE), dense "
             "intermediate 160 (two scale blocks), YaRN as ds_yarn, index_topk 8; one MTP layer "
             "(num_nextn_predict_layers 1) stored as model.layers.4.* that must be ignored; norms, router, "
             "embeddings, lm_head, indexer weights_proj in BF16, e_score_correction_bias F32",
        vocab=256, hidden=64, layers=4, first_k_dense=1, intermediate=160,
        mla=dict(MLA, topk=8), rope_scaling=YARN_DS, max_pos=128,
        moe=dict(E=8, top_k=2, n_group=2, topk_group=1, scale=2.5, norm=True, ffn=32, n_shared=1),
        storage="ds_fp8", mtp=True, prompts=PROMPTS,
        prompt_start={1: 3, 5: 0, 8: 2, 9: 1, 17: 6, 40: 1116},
    ),
    dict(
        name="ds_short", kind="ds", seed=33003,
        desc="DeepSeek-V3.2 layout, 3 layers, first_k_dense_replace 1 (D-DEDE), index_topk 64 > every context "
             "(DSA == dense MLA), plain RoPE (no rope_scaling), q_lora_rank 40 (HF deepseek_v32 has no q_proj path), "
             "all BF16 (e_score_correction_bias too)",
        vocab=256, hidden=64, layers=3, first_k_dense=1, intermediate=96,
        mla=dict(MLA, topk=64, q_lora=40), rope_scaling=None, max_pos=128,
        moe=dict(E=8, top_k=2, n_group=2, topk_group=1, scale=2.5, norm=True, ffn=32, n_shared=1),
        storage="all_bf16", mtp=False, prompts=PROMPTS,
        prompt_start={1: 0, 5: 0, 8: 2, 9: 0, 17: 0, 40: 0},
    ),
    dict(
        name="hy_mdme", kind="hybrid", seed=34004,
        desc="hybrid nemotron_h layout MD-ME-D: Mamba-2, DSA (D, HF DeepseekV32Attention names under "
             "backbone.layers.N.mixer.), relu2 MLP, relu2 MoE (E=8 top-2, n_group 2, topk_group 1, correction "
             "bias, shared expert), index_topk 8, YaRN as ds_yarn; BF16",
        vocab=256, hidden=64, pattern="MD-ME-D", intermediate=128,
        mla=dict(MLA, topk=8), rope_scaling=YARN_DS, max_pos=128, mamba=MAMBA,
        moe=dict(E=8, top_k=2, n_group=2, topk_group=1, scale=2.5, norm=True, ffn=48, shared=64, n_shared=1),
        storage="all_bf16", time_step_limit="string", prompts=PROMPTS,
        prompt_start={1: 2, 5: 0, 8: 3, 9: 5, 17: 9, 40: 15},
    ),
    dict(
        name="hy_plus", kind="hybrid", seed=35005,
        desc="hybrid nemotron_h layout M+-D-+: '+' = dense MLA (HF DeepseekV3Attention, no indexer tensors), "
             "D = DSA with index_topk 8; YaRN factor 4 with mscale 1.0 and mscale_all_dim 0.707 (cos/sin "
             "multiplier m(4,1)/m(4,0.707) != 1 and softmax x m(4,0.707)^2); relu2 MLP; BF16; time_step_limit "
             "omitted",
        vocab=256, hidden=64, pattern="M+-D-+", intermediate=128,
        mla=dict(MLA, topk=8), rope_scaling=YARN_V2, max_pos=128, mamba=MAMBA,
        moe=None, storage="all_bf16", time_step_limit=None, prompts=PROMPTS,
        prompt_start={1: 10, 5: 3, 8: 6, 9: 3, 17: 4, 40: 6},
    ),
    # Megatron's DSA switches (Megatron-LM dsa.py): HF has no model for them, so the float64 spec is the
    # reference (spec_ref); its code path is the one checked against HF on the fixtures above.
    dict(
        name="hy_share", kind="hybrid", seed=36006, spec_ref=True,
        desc="hybrid nemotron_h layout MDDD-MDDE with Megatron's shared top-k selections: index_topk_freq 2, "
             "index_skip_topk_offset 3 (layer numbers 1-based: D layers 2, 3 and 7 run their indexers; 4 reuses "
             "the selection of 3 and 8 that of 7, and carry no indexer tensors); index_topk 8, YaRN as ds_yarn; "
             "BF16; reference: the float64 spec",
        vocab=256, hidden=64, pattern="MDDD-MDDE", intermediate=128,
        mla=dict(MLA, topk=8), rope_scaling=YARN_DS, max_pos=128, mamba=MAMBA,
        moe=dict(E=8, top_k=2, n_group=2, topk_group=1, scale=2.5, norm=True, ffn=48, shared=64, n_shared=1),
        storage="all_bf16", time_step_limit="string", prompts=PROMPTS, topk_freq=2, skip_offset=3,
        idx_margin=2.5e-3,  # a flipped selection reaches two layers here, and the Mamba layer after them
        prompt_start={1: 9, 5: 0, 8: 6, 9: 4, 17: 15, 40: 1674},
    ),
    dict(
        name="hy_norelu", kind="hybrid", seed=37007, spec_ref=True,
        desc="hybrid nemotron_h layout MD-D with index_scoring_relu false (Megatron's dsa_indexer_scoring_relu: "
             "the heads' q.k summed with their weights as they are); index_topk 8, YaRN as ds_yarn; BF16; "
             "reference: the float64 spec",
        vocab=256, hidden=64, pattern="MD-D", intermediate=128,
        mla=dict(MLA, topk=8), rope_scaling=YARN_DS, max_pos=128, mamba=MAMBA, moe=None,
        storage="all_bf16", time_step_limit="string", prompts=PROMPTS, relu=False,
        prompt_start={1: 2, 5: 1, 8: 10, 9: 1, 17: 2, 40: 9},
    ),
]

# --------------------------------------------------------------------------------------------------
# helpers
# --------------------------------------------------------------------------------------------------


def fail(msg):
    raise AssertionError(msg)


def check(cond, msg):
    if not cond:
        fail(msg)


def P(t):
    return t.detach().to("cpu", F64)


def disable_tf32():
    try:
        torch.backends.fp32_precision = "ieee"
        torch.backends.cuda.matmul.fp32_precision = "ieee"
        torch.backends.cudnn.fp32_precision = "ieee"
        torch.backends.cudnn.conv.fp32_precision = "ieee"
    except Exception:
        torch.backends.cuda.matmul.allow_tf32 = False
        torch.backends.cudnn.allow_tf32 = False
    try:
        torch.set_float32_matmul_precision("highest")
    except Exception:
        pass


def fx_dir(root, fx):
    return os.path.join(root, "deepseek_v32" if fx["kind"] == "ds" else "hybrid", fx["name"])


def ds_layer_is_moe(fx, i):
    return i >= fx["first_k_dense"]  # moe_layer_freq 1


def topk_source(fx, i):
    """Pattern index of the layer whose selection D layer i attends with (Megatron dsa.py
    source_dsa_compute_layer over 1-based layer numbers; i itself unless index_topk_freq > 1)."""
    freq, off, ln = fx.get("topk_freq", 1), max(fx.get("skip_offset", 0), 1), i + 1
    if freq == 1 or ln <= off:
        return i
    return ln - (ln - off) % freq - 1


def index_layers(fx):
    """Layers carrying an indexer, in order: HF decoder layer index (ds) or pattern index (hybrid)."""
    if fx["kind"] == "ds":
        return list(range(fx["layers"]))
    return [i for i, c in enumerate(fx["pattern"]) if c == "D" and topk_source(fx, i) == i]


def krait_pattern(fx):
    if fx["kind"] == "hybrid":
        return fx["pattern"]
    return "".join("D" + ("E" if ds_layer_is_moe(fx, i) else "-") for i in range(fx["layers"]))


# --------------------------------------------------------------------------------------------------
# Declared checkpoint layout (hub names, shapes, randomisation rules)
# --------------------------------------------------------------------------------------------------


def attn_layout(pre, fx, indexer):
    m, H = fx["mla"], fx["hidden"]
    nh, dq = m["heads"], m["nope"] + m["rope"]
    out = []
    if m["q_lora"] is None:
        out.append((pre + "q_proj.weight", (nh * dq, H)))
    else:
        out += [(pre + "q_a_proj.weight", (m["q_lora"], H)),
                (pre + "q_a_layernorm.weight", (m["q_lora"],)),
                (pre + "q_b_proj.weight", (nh * dq, m["q_lora"]))]
    out += [(pre + "kv_a_proj_with_mqa.weight", (m["kv_lora"] + m["rope"], H)),
            (pre + "kv_a_layernorm.weight", (m["kv_lora"],)),
            (pre + "kv_b_proj.weight", (nh * (m["nope"] + m["v"]), m["kv_lora"])),
            (pre + "o_proj.weight", (H, nh * m["v"]))]
    if indexer:
        qin = m["q_lora"] if m["q_lora"] is not None else H
        out += [(pre + "indexer.wq_b.weight", (m["idx_heads"] * m["idx_dim"], qin)),
                (pre + "indexer.wk.weight", (m["idx_dim"], H)),
                (pre + "indexer.k_norm.weight", (m["idx_dim"],)),
                (pre + "indexer.k_norm.bias", (m["idx_dim"],)),
                (pre + "indexer.weights_proj.weight", (m["idx_heads"], H))]
    return out


def ds_moe_layout(pre, fx, gated):
    mo, H = fx["moe"], fx["hidden"]
    out = [(pre + "gate.weight", (mo["E"], H)), (pre + "gate.e_score_correction_bias", (mo["E"],))]
    for e in range(mo["E"]):
        if gated:
            out.append((f"{pre}experts.{e}.gate_proj.weight", (mo["ffn"], H)))
        out += [(f"{pre}experts.{e}.up_proj.weight", (mo["ffn"], H)),
                (f"{pre}experts.{e}.down_proj.weight", (H, mo["ffn"]))]
    sh = mo["ffn"] * mo["n_shared"] if gated else mo["shared"]
    if gated:
        out.append((pre + "shared_experts.gate_proj.weight", (sh, H)))
    out += [(pre + "shared_experts.up_proj.weight", (sh, H)), (pre + "shared_experts.down_proj.weight", (H, sh))]
    return out


def ds_decoder_layout(pre, fx, moe):
    H = fx["hidden"]
    out = [(pre + "input_layernorm.weight", (H,))]
    out += attn_layout(pre + "self_attn.", fx, True)
    out.append((pre + "post_attention_layernorm.weight", (H,)))
    if moe:
        out += ds_moe_layout(pre + "mlp.", fx, gated=True)
    else:
        I = fx["intermediate"]
        out += [(pre + "mlp.gate_proj.weight", (I, H)), (pre + "mlp.up_proj.weight", (I, H)),
                (pre + "mlp.down_proj.weight", (H, I))]
    return out


def layout(fx):
    """Ordered [(hub name, shape)] of the stored (logical, unquantized) tensors."""
    H, V = fx["hidden"], fx["vocab"]
    out = []
    if fx["kind"] == "ds":
        out.append(("model.embed_tokens.weight", (V, H)))
        for i in range(fx["layers"]):
            out += ds_decoder_layout(f"model.layers.{i}.", fx, ds_layer_is_moe(fx, i))
        out.append(("model.norm.weight", (H,)))
        out.append(("lm_head.weight", (V, H)))
        if fx["mtp"]:
            n = fx["layers"]
            pre = f"model.layers.{n}."
            out += [(pre + "embed_tokens.weight", (V, H)), (pre + "enorm.weight", (H,)), (pre + "hnorm.weight", (H,)),
                    (pre + "eh_proj.weight", (H, 2 * H))]
            out += ds_decoder_layout(pre, fx, True)
            out += [(pre + "shared_head.norm.weight", (H,)), (pre + "shared_head.head.weight", (V, H))]
        return out
    m = fx["mamba"]
    d_in = m["heads"] * m["head_dim"]
    conv_dim = d_in + 2 * m["groups"] * m["state"]
    out.append(("backbone.embeddings.weight", (V, H)))
    for i, c in enumerate(fx["pattern"]):
        pre = f"backbone.layers.{i}."
        out.append((pre + "norm.weight", (H,)))
        mx = pre + "mixer."
        if c == "M":
            out += [(mx + "in_proj.weight", (d_in + conv_dim + m["heads"], H)),
                    (mx + "conv1d.weight", (conv_dim, 1, m["conv"])), (mx + "conv1d.bias", (conv_dim,)),
                    (mx + "dt_bias", (m["heads"],)), (mx + "A_log", (m["heads"],)), (mx + "D", (m["heads"],)),
                    (mx + "norm.weight", (d_in,)), (mx + "out_proj.weight", (H, d_in))]
        elif c == "D":
            out += attn_layout(mx, fx, topk_source(fx, i) == i)
        elif c == "+":
            out += attn_layout(mx, fx, False)
        elif c == "-":
            out += [(mx + "up_proj.weight", (fx["intermediate"], H)), (mx + "down_proj.weight", (H, fx["intermediate"]))]
        elif c == "E":
            out += ds_moe_layout(mx, fx, gated=False)
        else:
            fail(f"unsupported letter {c}")
    out.append(("backbone.norm_f.weight", (H,)))
    out.append(("lm_head.weight", (V, H)))
    return out


def is_mtp(fx, name):
    return fx["kind"] == "ds" and fx["mtp"] and name.startswith(f"model.layers.{fx['layers']}.")


FP8_RE = re.compile(r"(\.self_attn\.(q_proj|q_a_proj|q_b_proj|kv_a_proj_with_mqa|kv_b_proj|o_proj)"
                    r"|\.self_attn\.indexer\.(wq_b|wk)"
                    r"|\.mlp\.(gate_proj|up_proj|down_proj)"
                    r"|\.mlp\.experts\.\d+\.(gate_proj|up_proj|down_proj)"
                    r"|\.mlp\.shared_experts\.(gate_proj|up_proj|down_proj)"
                    r"|\.eh_proj)\.weight$")


def storage_kind(fx, name):
    s = fx["storage"]
    if s == "all_bf16":
        return "bf16"
    if s == "ds_bf16":
        if name.endswith(".e_score_correction_bias") or name.endswith(".indexer.weights_proj.weight"):
            return "f32"
        return "bf16"
    if s == "ds_fp8":
        if name.endswith(".e_score_correction_bias"):
            return "f32"
        if FP8_RE.search(name):
            return "fp8"
        return "bf16"
    fail(f"unknown storage policy {s}")


def rand_tensor(name, shape, fx, gen):
    H = fx["hidden"]

    def normal(std):
        return torch.randn(shape, generator=gen, dtype=F64) * std

    if name.endswith("embed_tokens.weight") or name.endswith("embeddings.weight"):
        return normal(1.0)
    if name.endswith("lm_head.weight") or name.endswith("shared_head.head.weight"):
        return normal(2.0 / math.sqrt(H))
    if name.endswith("k_norm.bias"):
        return normal(0.1)
    if re.search(r"(layernorm|norm|norm_f|k_norm|enorm|hnorm)\.weight$", name):
        return 1.0 + normal(0.1)
    if name.endswith(".e_score_correction_bias"):
        return normal(0.1)
    if name.endswith(".A_log"):
        return torch.log(1.0 + 15.0 * torch.rand(shape, generator=gen, dtype=F64))
    if name.endswith(".dt_bias"):
        lo, hi = math.log(1e-3), math.log(1e-1)
        dt = torch.exp(lo + (hi - lo) * torch.rand(shape, generator=gen, dtype=F64))
        return dt + torch.log(-torch.expm1(-dt))
    if name.endswith(".D"):
        return 1.0 + normal(0.1)
    if name.endswith("conv1d.weight"):
        return normal(1.0 / math.sqrt(shape[2]))
    if name.endswith("conv1d.bias"):
        return normal(0.2)
    if name.endswith("indexer.wq_b.weight"):
        # Indexer query heads come in near-antipodal pairs (head 2j+1 ~ -head 2j): every key then has a positive
        # q.k for at least one head of each pair, so scores of exactly 0 (all ReLUs dead -> exact ties between
        # keys) practically never occur.  Random independent heads give exact top-k ties in ~4% of rows.
        v = normal(1.0 / math.sqrt(shape[1]))
        Di, a = fx["mla"]["idx_dim"], fx["mla"]["idx_pair_noise"]
        for h in range(1, shape[0] // Di, 2):
            v[h * Di:(h + 1) * Di] = -v[(h - 1) * Di:h * Di] * math.sqrt(1 - a * a) + a * v[h * Di:(h + 1) * Di]
        return v
    if name.endswith(".weight") and len(shape) == 2:
        return normal(1.0 / math.sqrt(shape[1]))
    fail(f"no randomisation rule for {name} {shape}")


# ---------------- FP8 e4m3 (ue8m0 block scales) ----------------


def round_e4m3(x):
    """Round float64 values (|x| <= 448) to the nearest float8_e4m3fn value (ties to even)."""
    a = x.abs()
    e = torch.floor(torch.log2(a.clamp(min=2.0 ** -6)))
    step = torch.pow(2.0, e - 3)
    q = torch.round(a / step) * step
    return torch.sign(x) * q


def quant_fp8(w):
    """w float64 [out, in] -> (q float64 e4m3 values, scale float64 [ceil(out/128), ceil(in/128)])."""
    o, i = w.shape
    bo, bi = -(-o // FP8_BLOCK), -(-i // FP8_BLOCK)
    q = torch.empty_like(w)
    sc = torch.empty(bo, bi, dtype=F64)
    for a in range(bo):
        for b in range(bi):
            blk = w[a * FP8_BLOCK:(a + 1) * FP8_BLOCK, b * FP8_BLOCK:(b + 1) * FP8_BLOCK]
            amax = max(blk.abs().max().item(), 1e-4)
            s = 2.0 ** math.ceil(math.log2(amax / FP8_MAX))
            qb = round_e4m3(blk / s)
            check(qb.abs().max().item() <= FP8_MAX, "fp8 block overflow")
            q[a * FP8_BLOCK:(a + 1) * FP8_BLOCK, b * FP8_BLOCK:(b + 1) * FP8_BLOCK] = qb
            sc[a, b] = s
    return q, sc


def expand_scale(sc, shape):
    return sc.repeat_interleave(FP8_BLOCK, 0).repeat_interleave(FP8_BLOCK, 1)[:shape[0], :shape[1]]


def generate_weights(fx):
    """-> (stored: {hub name: (kind, float64 values[, float64 scale])}, W: {hub name: float64 dequantized value})."""
    gen = torch.Generator().manual_seed(fx["seed"])
    stored, W = {}, {}
    for name, shape in layout(fx):
        v = rand_tensor(name, shape, fx, gen)
        kind = storage_kind(fx, name)
        if kind == "bf16":
            v = v.to(torch.bfloat16).to(F64)
            stored[name] = ("bf16", v)
            W[name] = v
        elif kind == "f32":
            v = v.to(torch.float32).to(F64)
            stored[name] = ("f32", v)
            W[name] = v
        elif kind == "fp8":
            check(len(shape) == 2, f"{name}: fp8 only for 2-D weights")
            q, sc = quant_fp8(v)
            stored[name] = ("fp8", q, sc)
            W[name] = q * expand_scale(sc, shape)
        check(torch.isfinite(W[name]).all().item(), f"{name}: non-finite")
    return stored, W


# --------------------------------------------------------------------------------------------------
# Independent float64 implementation of MODEL_SPEC §1.3-§1.5, §2, §5
# --------------------------------------------------------------------------------------------------


def rms(x, w, eps):
    return w * (x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps))


def yarn_m(s, a):
    return 1.0 if s <= 1 else 0.1 * a * math.log(s) + 1.0


def rope_params(fx):
    """-> (inv_freq float64 [Dr/2], cos/sin multiplier, softmax scale)."""
    m = fx["mla"]
    Dr, theta = m["rope"], m["rope_theta"]
    i = torch.arange(Dr // 2, dtype=F64)
    f = theta ** (-2.0 * i / Dr)
    scale = (m["nope"] + m["rope"]) ** -0.5
    rs = fx["rope_scaling"]
    if rs is None:
        return f, 1.0, scale
    check(rs["type"] == "yarn", "only yarn scaling implemented")
    fac, L0 = rs["factor"], rs["original_max_position_embeddings"]

    def corr(r):
        return Dr * math.log(L0 / (2 * math.pi * r)) / (2 * math.log(theta))
    low = max(math.floor(corr(rs["beta_fast"])), 0)
    high = min(math.ceil(corr(rs["beta_slow"])), Dr - 1)
    if low == high:
        high += 0.001
    ramp = ((i - low) / (high - low)).clamp(0, 1)
    keep = 1 - ramp
    f2 = (f / fac) * (1 - keep) + f * keep
    attn_factor = yarn_m(fac, rs["mscale"]) / yarn_m(fac, rs["mscale_all_dim"])
    if rs["mscale_all_dim"]:
        scale = scale * yarn_m(fac, rs["mscale_all_dim"]) ** 2
    return f2, attn_factor, scale


def rope_cos_sin(fx, T):
    f, af, _ = rope_params(fx)
    ang = torch.arange(T, dtype=F64)[:, None] * f[None, :]
    return torch.cos(ang) * af, torch.sin(ang) * af


def rope_interleaved(x, c, s):
    x0, x1 = x[..., 0::2], x[..., 1::2]
    y = torch.empty_like(x)
    y[..., 0::2] = x0 * c - x1 * s
    y[..., 1::2] = x0 * s + x1 * c
    return y


def rope_half(x, c, s):
    h = x.shape[-1] // 2
    x1, x2 = x[..., :h], x[..., h:]
    return torch.cat([x1 * c - x2 * s, x2 * c + x1 * s], -1)


def spec_indexer(W, pre, fx, x, cq, cos, sin, relu=True):
    """Returns (scores I [T,T] with -inf above the diagonal, selections list[list[int]], abs margins, rel margins)."""
    m = fx["mla"]
    T = x.shape[0]
    Hi, Di, Dr, K = m["idx_heads"], m["idx_dim"], m["rope"], m["topk"]
    iq = (cq @ W[pre + "indexer.wq_b.weight"].T).reshape(T, Hi, Di)
    ik = F.layer_norm(x @ W[pre + "indexer.wk.weight"].T, (Di,), W[pre + "indexer.k_norm.weight"],
                      W[pre + "indexer.k_norm.bias"], 1e-6)
    iq = torch.cat([rope_half(iq[..., :Dr], cos[:, None, :], sin[:, None, :]), iq[..., Dr:]], -1)
    ik = torch.cat([rope_half(ik[..., :Dr], cos, sin), ik[..., Dr:]], -1)
    w = (x @ W[pre + "indexer.weights_proj.weight"].T) * Hi ** -0.5 * Di ** -0.5
    qk = torch.einsum("thd,sd->ths", iq, ik)
    I = torch.einsum("th,ths->ts", w, torch.relu(qk) if relu else qk)
    I = I.masked_fill(torch.triu(torch.ones(T, T, dtype=torch.bool), 1), -INF)
    sel, marg, rel = [], [], []
    for t in range(T):
        row = I[t, :t + 1]
        k = min(K, t + 1)
        order = torch.sort(row, descending=True)
        sel.append(sorted(order.indices[:k].tolist()))
        if t + 1 > K:
            g = (order.values[k - 1] - order.values[k]).item()
            marg.append(g)
            rel.append(g / max(row.abs().max().item(), 1e-30))
        else:
            marg.append(None)
            rel.append(None)
    return I, sel, marg, rel


def spec_mla(W, pre, fx, x, indexer, sel_in=None):
    """MLA (absorbed/MQA form) + optional lightning indexer, or the selection sel_in of an earlier layer.
    -> (out [T,H], index info or None)."""
    m = fx["mla"]
    T = x.shape[0]
    nh, Dn, Dr, Dv, Rkv = m["heads"], m["nope"], m["rope"], m["v"], m["kv_lora"]
    cos, sin = rope_cos_sin(fx, T)
    _, _, scale = rope_params(fx)
    if m["q_lora"] is None:
        q = x @ W[pre + "q_proj.weight"].T
        cq = x
    else:
        cq = rms(x @ W[pre + "q_a_proj.weight"].T, W[pre + "q_a_layernorm.weight"], 1e-6)
        q = cq @ W[pre + "q_b_proj.weight"].T
    q = q.reshape(T, nh, Dn + Dr)
    q_nope, q_pe = q[..., :Dn], rope_interleaved(q[..., Dn:], cos[:, None, :], sin[:, None, :])
    kva = x @ W[pre + "kv_a_proj_with_mqa.weight"].T
    ckv = rms(kva[:, :Rkv], W[pre + "kv_a_layernorm.weight"], 1e-6)
    kpe = rope_interleaved(kva[:, Rkv:], cos, sin)
    wkvb = W[pre + "kv_b_proj.weight"].reshape(nh, Dn + Dv, Rkv)
    WUK, WUV = wkvb[:, :Dn], wkvb[:, Dn:]
    q_abs = torch.einsum("thn,hnr->thr", q_nope, WUK)
    s = (torch.einsum("thr,sr->hts", q_abs, ckv) + torch.einsum("thd,sd->hts", q_pe, kpe)) * scale
    allowed = torch.tril(torch.ones(T, T, dtype=torch.bool))
    info = None
    if sel_in is not None:
        selm = torch.zeros(T, T, dtype=torch.bool)
        for t, st in enumerate(sel_in):
            selm[t, st] = True
        allowed = selm
    elif indexer:
        I, sel, marg, rel = spec_indexer(W, pre, fx, x, cq, cos, sin, fx.get("relu", True))
        selm = torch.zeros(T, T, dtype=torch.bool)
        for t, st in enumerate(sel):
            selm[t, st] = True
        check(not (selm & ~allowed).any().item(), "spec selected a future key")
        allowed = selm
        info = dict(sel=sel, marg=marg, rel=rel)
    s = s.masked_fill(~allowed[None], -INF)
    p = torch.softmax(s, -1)
    o_lat = torch.einsum("hts,sr->thr", p, ckv)
    o = torch.einsum("thr,hvr->thv", o_lat, WUV).reshape(T, nh * Dv)
    return o @ W[pre + "o_proj.weight"].T, info


def spec_route(u, Wr, bias, mo):
    T = u.shape[0]
    E, ng, tg, k = mo["E"], mo["n_group"], mo["topk_group"], mo["top_k"]
    per = E // ng
    s = torch.sigmoid(u @ Wr.T)
    sc = s + bias
    gscore = sc.reshape(T, ng, per).topk(2, dim=-1).values.sum(-1)
    margin = torch.full((T,), INF, dtype=F64)
    if tg < ng:
        gs = gscore.sort(dim=-1, descending=True).values
        margin = torch.minimum(margin, gs[:, tg - 1] - gs[:, tg])
    gsel = gscore.topk(tg, dim=-1).indices
    gmask = torch.zeros(T, ng, dtype=torch.bool).scatter_(1, gsel, True).repeat_interleave(per, dim=1)
    masked = sc.masked_fill(~gmask, -INF)
    if k < tg * per:
        srt = masked.sort(dim=-1, descending=True).values
        margin = torch.minimum(margin, srt[:, k - 1] - srt[:, k])
    idx = masked.topk(k, dim=-1).indices
    wts = s.gather(1, idx)
    if mo["norm"]:
        wts = wts / (wts.sum(-1, keepdim=True) + 1e-20)
    return idx, wts * mo["scale"], margin


def spec_mlp(W, pre, u, gated):
    if gated:
        return (F.silu(u @ W[pre + "gate_proj.weight"].T) * (u @ W[pre + "up_proj.weight"].T)) @ W[pre + "down_proj.weight"].T
    return torch.relu(u @ W[pre + "up_proj.weight"].T).pow(2) @ W[pre + "down_proj.weight"].T


def spec_moe(W, pre, fx, u, gated):
    mo = fx["moe"]
    idx, wts, margin = spec_route(u, W[pre + "gate.weight"], W[pre + "gate.e_score_correction_bias"], mo)
    every = torch.stack([spec_mlp(W, f"{pre}experts.{e}.", u, gated) for e in range(mo["E"])], 0)  # [E, T, H]
    tt = torch.arange(u.shape[0])
    y = torch.zeros_like(u)
    for j in range(mo["top_k"]):
        y = y + wts[:, j:j + 1] * every[idx[:, j], tt]
    return y + spec_mlp(W, pre + "shared_experts.", u, gated), margin


def spec_mamba(W, pre, fx, u, dt_min=None):
    sp, H = fx["mamba"], fx["hidden"]
    Hm, Pd, G, N, K = sp["heads"], sp["head_dim"], sp["groups"], sp["state"], sp["conv"]
    d = Hm * Pd
    conv_dim = d + 2 * G * N
    T = u.shape[0]
    zxbcdt = u @ W[pre + "in_proj.weight"].T
    z, xBC, dt_raw = zxbcdt[:, :d], zxbcdt[:, d:d + conv_dim], zxbcdt[:, d + conv_dim:]
    w = W[pre + "conv1d.weight"][:, 0, :]
    xpad = torch.cat([torch.zeros(K - 1, conv_dim, dtype=F64), xBC], 0)
    acc = sum(xpad[k:k + T] * w[:, k] for k in range(K)) + W[pre + "conv1d.bias"]
    xBC = F.silu(acc)
    x = xBC[:, :d].reshape(T, Hm, Pd)
    B = xBC[:, d:d + G * N].reshape(T, G, N).repeat_interleave(Hm // G, dim=1)
    C = xBC[:, d + G * N:].reshape(T, G, N).repeat_interleave(Hm // G, dim=1)
    dt = F.softplus(dt_raw + W[pre + "dt_bias"])
    if dt_min is not None:
        dt = dt.clamp(min=dt_min)
    A = -torch.exp(W[pre + "A_log"])
    Dv = W[pre + "D"]
    state = torch.zeros(Hm, Pd, N, dtype=F64)
    y = torch.empty(T, Hm, Pd, dtype=F64)
    for t in range(T):
        state = state * torch.exp(dt[t] * A)[:, None, None] + dt[t][:, None, None] * x[t][:, :, None] * B[t][:, None, :]
        y[t] = (state * C[t][:, None, :]).sum(-1) + Dv[:, None] * x[t]
    v = y.reshape(T, d) * F.silu(z)
    vg = v.reshape(T, G, d // G)
    vg = vg * torch.rsqrt(vg.pow(2).mean(-1, keepdim=True) + 1e-5)
    return (vg.reshape(T, d) * W[pre + "norm.weight"]) @ W[pre + "out_proj.weight"].T


def spec_sublayers(fx):
    """[(key, kind, prefix, norm name)] in execution order. kind: mla_idx | mla | mlp_gated | moe_gated | mamba |
    mlp_relu2 | moe_relu2."""
    out = []
    if fx["kind"] == "ds":
        for i in range(fx["layers"]):
            p = f"model.layers.{i}."
            out.append(((i, "attn"), "mla_idx", p + "self_attn.", p + "input_layernorm.weight"))
            out.append(((i, "mlp"), "moe_gated" if ds_layer_is_moe(fx, i) else "mlp_gated", p + "mlp.",
                        p + "post_attention_layernorm.weight"))
        return out
    kinds = {"M": "mamba", "D": "mla_idx", "+": "mla", "-": "mlp_relu2", "E": "moe_relu2"}
    for i, c in enumerate(fx["pattern"]):
        p = f"backbone.layers.{i}."
        out.append(((i, "mixer"), kinds[c], p + "mixer.", p + "norm.weight"))
    return out


def spec_apply(W, fx, kind, pre, u):
    """-> (out, index info or None, router margin or None)."""
    if kind == "mla_idx":
        y, info = spec_mla(W, pre, fx, u, True)
        return y, info, None
    if kind == "mla":
        return spec_mla(W, pre, fx, u, False)[0], None, None
    if kind == "mlp_gated":
        return spec_mlp(W, pre, u, True), None, None
    if kind == "mlp_relu2":
        return spec_mlp(W, pre, u, False), None, None
    if kind == "moe_gated":
        y, mg = spec_moe(W, pre, fx, u, True)
        return y, None, mg
    if kind == "moe_relu2":
        y, mg = spec_moe(W, pre, fx, u, False)
        return y, None, mg
    if kind == "mamba":
        return spec_mamba(W, pre, fx, u), None, None
    fail(kind)


def block_eps(fx):
    return 1e-6 if fx["kind"] == "ds" else 1e-5


def spec_forward(W, fx, ids):
    """End-to-end float64 model -> (logprobs [T,V], index infos per indexer layer, min router margin)."""
    h, infos, rmin = spec_hidden(W, fx, ids)
    return torch.log_softmax(h @ W["lm_head.weight"].T, -1), infos, rmin


def spec_hidden(W, fx, ids):
    """The float64 model up to its final norm -> (hidden states [T,H], index infos, min router margin)."""
    eps = block_eps(fx)
    emb = W["model.embed_tokens.weight"] if fx["kind"] == "ds" else W["backbone.embeddings.weight"]
    h = emb[torch.tensor(ids)]
    infos, rmin, last_sel = [], INF, None
    for key, kind, pre, norm in spec_sublayers(fx):
        u = rms(h, W[norm], eps)
        if kind == "mla_idx" and fx["kind"] == "hybrid" and topk_source(fx, key[0]) != key[0]:
            y, info, mg = spec_mla(W, pre, fx, u, False, sel_in=last_sel)[0], None, None
        else:
            y, info, mg = spec_apply(W, fx, kind, pre, u)
        if info is not None:
            last_sel = info["sel"]
        if info is not None:
            infos.append(info)
        if mg is not None:
            rmin = min(rmin, mg.min().item())
        h = h + y
    fn = W["model.norm.weight"] if fx["kind"] == "ds" else W["backbone.norm_f.weight"]
    return rms(h, fn, eps), infos, rmin


def index_ok(infos, thr=IDX_REL_MARGIN):
    rels = [r for inf in infos for r in inf["rel"] if r is not None]
    mn = min(rels) if rels else INF
    return mn > thr, mn


# --------------------------------------------------------------------------------------------------
# HF side (imported lazily so --spec-only runs without transformers)
# --------------------------------------------------------------------------------------------------

HF = {}
FACTS = {}


def import_hf():
    if HF:
        return HF
    import importlib.util
    for name in ("mamba_ssm", "causal_conv1d"):
        try:
            if importlib.util.find_spec(name) is not None:
                sys.modules[name] = None
        except (ImportError, ValueError):
            pass
    import numpy as np
    import safetensors
    import safetensors.torch
    import transformers
    from transformers.models.deepseek_v32 import modeling_deepseek_v32 as mds
    from transformers.models.deepseek_v32.configuration_deepseek_v32 import DeepseekV32Config
    from transformers.models.deepseek_v3 import modeling_deepseek_v3 as mdv3
    from transformers.models.deepseek_v3.configuration_deepseek_v3 import DeepseekV3Config
    from transformers.models.nemotron_h import modeling_nemotron_h as mnh
    from transformers import NemotronHConfig
    HF.update(np=np, safetensors=safetensors, st=safetensors.torch, transformers=transformers, mds=mds, mdv3=mdv3,
              mnh=mnh, DSCfg=DeepseekV32Config, DS3Cfg=DeepseekV3Config, NHCfg=NemotronHConfig)
    return HF


def causal_mask_like_model(create_causal_mask, cfg, h, pos):
    """The 4-D causal mask exactly as DeepseekV32Model.forward builds it (no cache, no padding mask)."""
    params = inspect.signature(create_causal_mask).parameters
    kw = dict(config=cfg, inputs_embeds=h, attention_mask=None, past_key_values=None, position_ids=pos)
    if "cache_position" in params:
        kw["cache_position"] = pos[0]
    if "allow_is_causal_skip" in params:
        kw["allow_is_causal_skip"] = False
    if not any(p.kind == p.VAR_KEYWORD for p in params.values()):
        kw = {k: v for k, v in kw.items() if k in params}
    return create_causal_mask(**kw)


def make_mixer_classes():
    hf = import_hf()
    mds, mdv3 = hf["mds"], hf["mdv3"]

    class _Ctx:
        """Rotary + mask provider shared by a wrapper (kept out of the module tree: no state-dict entries)."""

        def __init__(self, cfg, rope_cls, create_mask):
            self.cfg, self.rope, self.create_mask = cfg, rope_cls(config=cfg), create_mask

        def inputs(self, h):
            T = h.shape[1]
            pos = torch.arange(T, device=h.device).unsqueeze(0)
            self.rope.to(h.device)
            cos, sin = self.rope(h, pos)
            mask = causal_mask_like_model(self.create_mask, self.cfg, h, pos)
            return pos, (cos, sin), mask

    class HybridDSAMixer(mds.DeepseekV32Attention):
        """HF DeepseekV32Attention as a nemotron_h mixer (parameter names unchanged)."""

        def __init__(self, cfg, layer_idx):
            super().__init__(cfg, layer_idx)
            object.__setattr__(self, "_kr_ctx", _Ctx(cfg, mds.DeepseekV32RotaryEmbedding, mds.create_causal_mask))

        def forward(self, hidden_states, *args, **kwargs):
            pos, pe, mask = self._kr_ctx.inputs(hidden_states)
            out = mds.DeepseekV32Attention.forward(self, hidden_states=hidden_states, position_embeddings=pe,
                                                   attention_mask=mask, past_key_values=None, position_ids=pos)
            return out[0] if isinstance(out, tuple) else out

    class HybridMLAMixer(mdv3.DeepseekV3Attention):
        """HF DeepseekV3Attention (dense MLA) as a nemotron_h mixer."""

        def __init__(self, cfg, layer_idx):
            super().__init__(cfg, layer_idx)
            object.__setattr__(self, "_kr_ctx", _Ctx(cfg, mdv3.DeepseekV3RotaryEmbedding, mdv3.create_causal_mask))

        def forward(self, hidden_states, *args, **kwargs):
            pos, pe, mask = self._kr_ctx.inputs(hidden_states)
            out = mdv3.DeepseekV3Attention.forward(self, hidden_states=hidden_states, position_embeddings=pe,
                                                   attention_mask=mask, past_key_values=None, position_ids=pos)
            return out[0] if isinstance(out, tuple) else out

    return HybridDSAMixer, HybridMLAMixer


def rope_scaling_json(fx):
    rs = fx["rope_scaling"]
    return None if rs is None else dict(rs)


def ds_config_json(fx):
    m, mo = fx["mla"], fx["moe"]
    c = {
        "architectures": ["DeepseekV32ForCausalLM"],
        "model_type": "deepseek_v32",
        "vocab_size": fx["vocab"],
        "hidden_size": fx["hidden"],
        "intermediate_size": fx["intermediate"],
        "moe_intermediate_size": mo["ffn"],
        "num_hidden_layers": fx["layers"],
        "num_nextn_predict_layers": 1 if fx["mtp"] else 0,
        "num_attention_heads": m["heads"],
        "num_key_value_heads": m["heads"],
        "n_shared_experts": mo["n_shared"],
        "n_routed_experts": mo["E"],
        "ep_size": 1,
        "routed_scaling_factor": float(mo["scale"]),
        "kv_lora_rank": m["kv_lora"],
        "q_lora_rank": m["q_lora"],
        "qk_rope_head_dim": m["rope"],
        "v_head_dim": m["v"],
        "qk_nope_head_dim": m["nope"],
        "topk_method": "noaux_tc",
        "n_group": mo["n_group"],
        "topk_group": mo["topk_group"],
        "num_experts_per_tok": mo["top_k"],
        "moe_layer_freq": 1,
        "first_k_dense_replace": fx["first_k_dense"],
        "norm_topk_prob": mo["norm"],
        "scoring_func": "sigmoid",
        "hidden_act": "silu",
        "max_position_embeddings": fx["max_pos"],
        "initializer_range": 0.02,
        "rms_norm_eps": 1e-6,
        "use_cache": True,
        "bos_token_id": 0,
        "eos_token_id": 1,
        "tie_word_embeddings": False,
        "rope_theta": m["rope_theta"],
    }
    if fx["rope_scaling"] is not None:
        c["rope_scaling"] = rope_scaling_json(fx)
    c.update({
        "attention_bias": False,
        "attention_dropout": 0.0,
        "index_topk": m["topk"],
        "index_head_dim": m["idx_dim"],
        "index_n_heads": m["idx_heads"],
        "torch_dtype": "bfloat16",
    })
    if fx["storage"] == "ds_fp8":
        c["quantization_config"] = {"quant_method": "fp8", "fmt": "e4m3", "weight_block_size": [FP8_BLOCK, FP8_BLOCK],
                                    "activation_scheme": "dynamic", "scale_fmt": "ue8m0"}
    return c


def hybrid_config_json(fx):
    m, mb, mo = fx["mla"], fx["mamba"], fx["moe"]
    c = {
        "architectures": ["NemotronHForCausalLM"],
        "model_type": "nemotron_h",
        "vocab_size": fx["vocab"],
        "hidden_size": fx["hidden"],
        "num_hidden_layers": len(fx["pattern"]),
        "hybrid_override_pattern": fx["pattern"],
        "num_attention_heads": m["heads"],
        "num_key_value_heads": m["heads"],
        "attention_bias": False,
        "q_lora_rank": m["q_lora"],
        "kv_lora_rank": m["kv_lora"],
        "qk_nope_head_dim": m["nope"],
        "qk_rope_head_dim": m["rope"],
        "v_head_dim": m["v"],
        "index_n_heads": m["idx_heads"],
        "index_head_dim": m["idx_dim"],
        "index_topk": m["topk"],
        "rope_theta": m["rope_theta"],
    }
    if fx["rope_scaling"] is not None:
        c["rope_scaling"] = rope_scaling_json(fx)
    c.update({
        "max_position_embeddings": fx["max_pos"],
        "intermediate_size": fx["intermediate"],
        "mlp_hidden_act": "relu2",
        "mlp_bias": False,
        "mamba_num_heads": mb["heads"],
        "mamba_head_dim": mb["head_dim"],
        "ssm_state_size": mb["state"],
        "n_groups": mb["groups"],
        "conv_kernel": mb["conv"],
        "chunk_size": mb["chunk"],
        "use_conv_bias": mb["conv_bias"],
        "mamba_hidden_act": "silu",
        "time_step_min": 0.001,
        "time_step_max": 0.1,
        "time_step_floor": 0.0001,
    })
    if fx["time_step_limit"] == "string":
        c["time_step_limit"] = [0.0, "Infinity"]
    if fx.get("topk_freq", 1) != 1:
        c["index_topk_freq"] = fx["topk_freq"]
        c["index_skip_topk_offset"] = fx.get("skip_offset", 0)
    if not fx.get("relu", True):
        c["index_scoring_relu"] = False
    if mo is not None:
        c.update({
            "n_routed_experts": mo["E"], "num_experts_per_tok": mo["top_k"], "n_group": mo["n_group"],
            "topk_group": mo["topk_group"], "routed_scaling_factor": float(mo["scale"]), "norm_topk_prob": mo["norm"],
            "moe_intermediate_size": mo["ffn"], "moe_shared_expert_intermediate_size": mo["shared"],
            "n_shared_experts": mo["n_shared"],
        })
    c.update({
        "layer_norm_epsilon": 1e-5, "use_bias": False, "residual_in_fp32": False, "rescale_prenorm_residual": True,
        "mamba_ssm_cache_dtype": "float32", "tie_word_embeddings": False, "bos_token_id": 1, "eos_token_id": 2,
        "pad_token_id": 0, "use_cache": True, "initializer_range": 0.02, "torch_dtype": "bfloat16",
    })
    return c


def ds_hf_config(cfgd, hf, **extra):
    kw = {k: v for k, v in cfgd.items() if k not in ("architectures", "model_type", "quantization_config",
                                                    "torch_dtype", "transformers_version")}
    kw.update(extra)
    return hf["DSCfg"](**kw, attn_implementation="eager", experts_implementation="eager")


def expected_rope_parameters(fx):
    m = fx["mla"]
    if fx["rope_scaling"] is None:
        return {"rope_type": "default", "rope_theta": m["rope_theta"]}
    rs = dict(fx["rope_scaling"])
    rs["rope_type"] = rs.pop("type")
    rs["rope_theta"] = m["rope_theta"]
    return rs


def check_rope_parameters(cfg, fx, what):
    rp = dict(cfg.rope_parameters)
    for k, v in expected_rope_parameters(fx).items():
        check(k in rp and float(rp[k]) == float(v) if not isinstance(v, str) else rp.get(k) == v,
              f"{fx['name']}: {what}.rope_parameters[{k}] = {rp.get(k)!r}, want {v!r} (full: {rp})")
    return rp


def build_ds_model(fx):
    hf = import_hf()
    cfgd = ds_config_json(fx)
    cfg = ds_hf_config(cfgd, hf, use_cache=False)
    check(cfg.head_dim == fx["mla"]["rope"], f"HF head_dim {cfg.head_dim} != qk_rope_head_dim")
    check(list(cfg.mlp_layer_types) == ["sparse" if ds_layer_is_moe(fx, i) else "dense" for i in range(fx["layers"])],
          f"HF mlp_layer_types {cfg.mlp_layer_types}")
    FACTS.setdefault("ds_layer_types", list(cfg.layer_types))
    FACTS.setdefault(f"rope_parameters[{fx['name']}]", check_rope_parameters(cfg, fx, "DeepseekV32Config"))
    torch.manual_seed(0)
    model = hf["mds"].DeepseekV32ForCausalLM(cfg).eval()
    check(model.config._attn_implementation == "eager", "attention implementation is not eager")
    return model, cfg


def build_hybrid_model(fx):
    hf = import_hf()
    mb, mo, m = fx["mamba"], fx["moe"], fx["mla"]
    types = {"M": "linear_attention", "D": "mlp", "+": "mlp", "-": "mlp", "E": "moe"}
    kw = dict(vocab_size=fx["vocab"], hidden_size=fx["hidden"], layers_block_type=[types[c] for c in fx["pattern"]],
              tie_word_embeddings=False, num_attention_heads=m["heads"], num_key_value_heads=m["heads"],
              head_dim=m["v"], max_position_embeddings=fx["max_pos"], attention_bias=False,
              intermediate_size=fx["intermediate"], mlp_hidden_act="relu2", mlp_bias=False, use_mamba_kernels=False,
              ssm_state_size=mb["state"], mamba_num_heads=mb["heads"], mamba_head_dim=mb["head_dim"],
              mamba_hidden_act="silu", n_groups=mb["groups"], conv_kernel=mb["conv"], use_conv_bias=mb["conv_bias"],
              chunk_size=mb["chunk"], use_bias=False, layer_norm_epsilon=1e-5, pad_token_id=0, bos_token_id=1,
              eos_token_id=2, use_cache=False, attn_implementation="eager", experts_implementation="eager")
    if mo is not None:
        kw.update(n_routed_experts=mo["E"], num_experts_per_tok=mo["top_k"], n_group=mo["n_group"],
                  topk_group=mo["topk_group"], routed_scaling_factor=float(mo["scale"]), norm_topk_prob=mo["norm"],
                  moe_intermediate_size=mo["ffn"], moe_shared_expert_intermediate_size=mo["shared"],
                  n_shared_experts=mo["n_shared"])
    cfg = hf["NHCfg"](**kw)
    torch.manual_seed(0)
    model = hf["mnh"].NemotronHForCausalLM(cfg)
    # DeepSeek configs carrying the MLA/DSA hyper-parameters (the hybrid config.json's top-level keys)
    mla_kw = dict(vocab_size=fx["vocab"], hidden_size=fx["hidden"], num_hidden_layers=len(fx["pattern"]),
                  num_attention_heads=m["heads"], num_key_value_heads=m["heads"], q_lora_rank=m["q_lora"],
                  kv_lora_rank=m["kv_lora"], qk_nope_head_dim=m["nope"], qk_rope_head_dim=m["rope"],
                  v_head_dim=m["v"], rope_theta=m["rope_theta"], max_position_embeddings=fx["max_pos"],
                  rms_norm_eps=1e-6, attention_bias=False, use_cache=False, attn_implementation="eager")
    if fx["rope_scaling"] is not None:
        mla_kw["rope_scaling"] = rope_scaling_json(fx)
    ds_cfg = hf["DSCfg"](**mla_kw, index_n_heads=m["idx_heads"], index_head_dim=m["idx_dim"], index_topk=m["topk"],
                         first_k_dense_replace=len(fx["pattern"]))
    ds3_cfg = hf["DS3Cfg"](**mla_kw)
    check_rope_parameters(ds_cfg, fx, "DeepseekV32Config(hybrid)")
    check_rope_parameters(ds3_cfg, fx, "DeepseekV3Config(hybrid)")
    DSAMixer, MLAMixer = make_mixer_classes()
    for i, c in enumerate(fx["pattern"]):
        blk = model.model.layers[i]
        if c == "D":
            blk.mixer = DSAMixer(ds_cfg, i)
        elif c == "+":
            blk.mixer = MLAMixer(ds3_cfg, i)
    model.eval()
    mnh = hf["mnh"]
    for i, c in enumerate(fx["pattern"]):
        blk = model.model.layers[i]
        want = {"M": mnh.NemotronHMamba2Mixer, "D": DSAMixer, "+": MLAMixer, "-": mnh.NemotronHMLP,
                "E": mnh.NemotronHMoE}[c]
        check(type(blk.mixer) is want, f"layer {i}: mixer {type(blk.mixer).__name__}")
        check(abs(blk.norm.variance_epsilon - 1e-5) < 1e-12, "block norm eps")
    return model, cfg


def disable_dt_clamp(model):
    mnh = import_hf()["mnh"]
    orig = []
    for mod in model.modules():
        if isinstance(mod, mnh.NemotronHMamba2Mixer):
            check(hasattr(mod, "time_step_limit"), "NemotronHMamba2Mixer has no time_step_limit")
            orig.append(tuple(mod.time_step_limit))
            mod.time_step_limit = (0.0, INF)
            if hasattr(mod, "time_step_min"):
                mod.time_step_min = 0.0
    return orig


def hub_to_hf_state(W, fx):
    """float64 hub tensors (dequantized) -> HF in-memory state dict (float32), experts fused."""
    sd, experts = {}, {}
    for name, t in W.items():
        if is_mtp(fx, name):
            continue
        hfname = name
        if fx["kind"] == "hybrid" and name.startswith("backbone."):
            hfname = "model." + name[len("backbone."):]
        mm = re.match(r"^(.*\.(?:mlp|mixer)\.experts)\.(\d+)\.(gate_proj|up_proj|down_proj)\.weight$", hfname)
        if mm:
            experts.setdefault((mm.group(1), mm.group(3)), {})[int(mm.group(2))] = t
            continue
        sd[hfname] = t.to(torch.float32)
    for base in sorted({b for b, _ in experts}):
        def stack(kind):
            dct = experts.get((base, kind))
            if dct is None:
                return None
            check(sorted(dct) == list(range(len(dct))), f"{base}.{kind}: expert indices not contiguous")
            return torch.stack([dct[e] for e in range(len(dct))], 0).to(torch.float32)
        g, u, d = stack("gate_proj"), stack("up_proj"), stack("down_proj")
        if g is not None:
            sd[base + ".gate_up_proj"] = torch.cat([g, u], 1)
        else:
            sd[base + ".up_proj"] = u
        sd[base + ".down_proj"] = d
    return sd


def load_into(model, sd, fx):
    msd = model.state_dict()
    check(set(sd) == set(msd), f"{fx['name']}: declared layout does not map onto HF's state dict: missing "
                               f"{sorted(set(msd) - set(sd))[:6]} extra {sorted(set(sd) - set(msd))[:6]}")
    for k, v in sd.items():
        check(tuple(v.shape) == tuple(msd[k].shape), f"{k}: shape {tuple(v.shape)} != HF {tuple(msd[k].shape)}")
    model.load_state_dict(sd, strict=True)
    for k, v in model.state_dict().items():
        check(v.dtype == torch.float32, f"{k}: HF holds it as {v.dtype}")


def build_model(fx, W, device):
    model, cfg = build_ds_model(fx) if fx["kind"] == "ds" else build_hybrid_model(fx)
    load_into(model, hub_to_hf_state(W, fx), fx)
    model.to(device)
    if fx["kind"] == "hybrid":
        disable_dt_clamp(model)
    return model, cfg


# ---------------- HF evaluation ----------------


def hf_logprobs(model, ids, device):
    with torch.no_grad():
        out = model(input_ids=torch.tensor([ids], dtype=torch.long, device=device), use_cache=False)
    lp = torch.log_softmax(out.logits[0].float(), dim=-1)
    check(lp.shape == (len(ids), model.config.vocab_size), f"logits shape {tuple(lp.shape)}")
    check(torch.isfinite(lp).all().item(), "non-finite logprobs")
    return lp


def greedy(lp_fn, ids, first_row):
    cur, toks, margins, row = list(ids), [], [], first_row
    for step in range(N_GREEDY):
        if step > 0:
            row = lp_fn(cur)[-1]
        top = torch.topk(row, 2)
        toks.append(int(top.indices[0]))
        margins.append(float(top.values[0] - top.values[1]))
        cur.append(toks[-1])
    return toks, margins


def attn_modules(model, fx):
    """[(key, module)] of the mixers/sublayers in spec_sublayers order, plus indexer modules."""
    subs = []
    idx_mods = []
    if fx["kind"] == "ds":
        for i, layer in enumerate(model.model.layers):
            subs.append(((i, "attn"), layer.self_attn))
            subs.append(((i, "mlp"), layer.mlp))
            idx_mods.append(layer.self_attn.indexer)
    else:
        for i, blk in enumerate(model.model.layers):
            subs.append(((i, "mixer"), blk.mixer))
            if fx["pattern"][i] == "D":
                idx_mods.append(blk.mixer.indexer)
    return subs, idx_mods


def hf_selection(out, T, K):
    """Selected key sets from whatever HF's indexer returned."""
    t = out[0] if isinstance(out, tuple) else out
    if not t.is_floating_point() and t.dtype != torch.bool:
        FACTS.setdefault("indexer_output", f"integer top-k indices, dtype {t.dtype}, shape {list(t.shape)} "
                                           f"(k = min(index_topk, T) = {t.shape[-1]} for T={T})")
        idx = t.reshape(-1, t.shape[-2], t.shape[-1])[0].cpu()
        check(idx.shape[0] == T, f"indexer output rows {idx.shape[0]} != T {T}")
        sets = []
        for r in range(T):
            vals = idx[r].tolist()
            check(len(set(vals)) == len(vals), "HF indexer returned duplicate indices")
            sets.append(sorted(v for v in vals if v <= r))
        return sets
    m = t.reshape(-1, t.shape[-2], t.shape[-1])[0].cpu()
    if t.dtype == torch.bool:
        FACTS.setdefault("indexer_output", f"boolean mask shape {list(t.shape)} (True taken as selected)")
        sel = m
    else:
        FACTS.setdefault("indexer_output", f"additive float mask shape {list(t.shape)} (0 = selected)")
        sel = m == 0
    return [sorted(j for j in torch.nonzero(sel[r]).flatten().tolist() if j <= r) for r in range(T)]


def hooked_forward(model, fx, ids, device):
    subs, idx_mods = attn_modules(model, fx)
    cap, icap, akw = {}, [], {}
    handles = []
    for key, mod in subs:
        def hook(mod, args, kwargs, output, key=key):
            x = args[0] if args else kwargs["hidden_states"]
            y = output[0] if isinstance(output, tuple) else output
            cap[key] = (P(x[0]), P(y[0]))
            if key[1] == "attn":
                akw[key[0]] = kwargs
        handles.append(mod.register_forward_hook(hook, with_kwargs=True))
    for j, mod in enumerate(idx_mods):
        def ihook(mod, args, output, j=j):
            icap.append((j, output))
        handles.append(mod.register_forward_hook(ihook))
    try:
        lp = hf_logprobs(model, ids, device)
    finally:
        for h in handles:
            h.remove()
    check(len(cap) == len(subs), "hooks did not capture every sublayer")
    T, K = len(ids), fx["mla"]["topk"]
    called = [j for j, _ in icap]
    check(len(set(called)) == len(called), f"an indexer ran twice: {called}")
    outs = dict(icap)
    if T <= K:
        FACTS[f"indexer_runs_when_T<=topk (T={T}, topk={K})"] = f"{len(outs)} of {len(idx_mods)} indexer layers ran"
    sets = []
    for j in range(len(idx_mods)):
        if j in outs:
            sets.append(hf_selection(outs[j], T, K))
        else:
            check(T <= K, f"{fx['name']}: indexer layer {j} did not run although T={T} > index_topk={K}")
            sets.append([list(range(t + 1)) for t in range(T)])
    return lp, cap, sets, akw


def check_against_spec(model, fx, W, ids, cap, sets, stats):
    K = fx["mla"]["topk"]
    T = len(ids)
    ii = 0
    for key, kind, pre, norm in spec_sublayers(fx):
        u, y_hf = cap[key]
        y, info, mg = spec_apply(W, fx, kind, pre, u)
        diff = (y_hf - y).abs()
        if mg is not None:
            ok = mg > 1e-6
            stats["router_near_ties_skipped"] += int((~ok).sum())
            diff = diff[ok] if ok.any() else diff[:0]
        err = (diff.max().item() if diff.numel() else 0.0) / max(1.0, y.abs().max().item())
        stats["mixer_max_rel_err"] = max(stats["mixer_max_rel_err"], err)
        check(err < MIXER_TOL, f"{fx['name']}: {key} ({kind}) HF differs from float64 spec: rel {err:.3e} (T={T})")
        if info is not None:
            yd = spec_mla(W, pre, fx, u, False)[0]
            stats["sparse_vs_dense"] = max(stats["sparse_vs_dense"],
                                           (yd - y).abs().max().item() / max(1.0, y.abs().max().item()))
            hs = sets[ii]
            for t in range(T):
                check(len(hs[t]) == min(K, t + 1), f"{fx['name']}: {key} t={t}: HF selected {len(hs[t])} causal keys")
                if hs[t] != info["sel"][t]:
                    fail(f"{fx['name']}: {key} t={t}: HF index set {hs[t]} != spec {info['sel'][t]} "
                         f"(spec rel margin {info['rel'][t]})")
            ii += 1
        if kind == "mamba":
            y2 = spec_mamba(W, pre, fx, u, dt_min=1e-3)
            stats["clamp_sensitivity"] = max(stats["clamp_sensitivity"],
                                             (y2 - y).abs().max().item() / max(1.0, y.abs().max().item()))
    check(ii == len(sets), "indexer layer count mismatch")


# --------------------------------------------------------------------------------------------------
# Facts about the installed HF (reported, several asserted)
# --------------------------------------------------------------------------------------------------


def collect_static_facts(device):
    hf = import_hf()
    mds = hf["mds"]
    FACTS["transformers"] = hf["transformers"].__version__
    FACTS["torch"] = torch.__version__

    def fact(name, fn):
        try:
            FACTS[name] = fn()
        except Exception as e:  # noqa: BLE001
            FACTS[name] = f"error {type(e).__name__}: {str(e)[:300]}"

    def src(obj):
        return inspect.getsource(obj)
    fact("attn_masks_unselected_with", lambda: ("finfo.min" if "finfo" in src(mds.DeepseekV32Attention) else "?") +
         (" / -inf" if "-inf" in src(mds.DeepseekV32Attention) else ""))
    fact("indexer_calls_apply_rotary_pos_emb(rotate_half)", lambda: "apply_rotary_pos_emb(" in src(mds.DeepseekV32Indexer))
    fact("mla_calls_apply_rotary_pos_emb_interleave",
         lambda: "apply_rotary_pos_emb_interleave" in src(mds.DeepseekV32Attention))
    fact("indexer_mentions_hadamard_or_fp8",
         lambda: [w for w in ("hadamard", "fp8", "act_quant") if w in src(mds.DeepseekV32Indexer)])
    fact("keep_in_fp32_modules", lambda: getattr(mds.DeepseekV32PreTrainedModel, "_keep_in_fp32_modules", None))
    fact("keep_in_fp32_modules_strict",
         lambda: getattr(mds.DeepseekV32PreTrainedModel, "_keep_in_fp32_modules_strict", None))
    fact("keys_to_ignore_on_load_unexpected",
         lambda: getattr(mds.DeepseekV32PreTrainedModel, "_keys_to_ignore_on_load_unexpected", None))

    def conv():
        from transformers.conversion_mapping import get_checkpoint_conversion_mapping
        return repr(get_checkpoint_conversion_mapping("deepseek_v32"))[:1500]
    fact("conversion_mapping_deepseek_v32", conv)

    def qlora_null():
        cfgd = ds_config_json(FIXTURES[0])
        cfgd["q_lora_rank"] = None
        try:
            cfg = ds_hf_config(cfgd, hf, use_cache=False)
            mdl = mds.DeepseekV32ForCausalLM(cfg).eval()
        except Exception as e:  # noqa: BLE001
            return f"unsupported (construction): {type(e).__name__}: {str(e)[:300]}"
        names = [n for n, _ in mdl.named_parameters() if ".layers.0.self_attn." in n]
        try:
            with torch.no_grad():
                mdl(input_ids=torch.tensor([[3, 4, 5]]), use_cache=False)
        except Exception as e:  # noqa: BLE001
            return f"unsupported (forward): {type(e).__name__}: {str(e)[:300]}; params {names}"
        return f"forward OK; layer-0 attention params: {names}"
    fact("q_lora_rank_null", qlora_null)


def model_facts(model, fx):
    mds = import_hf()["mds"]
    f, af, scale = rope_params(fx)
    for mod in model.modules():
        if isinstance(mod, mds.DeepseekV32Attention):
            check(abs(mod.scaling - scale) <= 1e-12 * scale, f"{fx['name']}: HF softmax scale {mod.scaling} != spec {scale}")
            check(abs(mod.indexer.k_norm.eps - 1e-6) < 1e-15, f"indexer k_norm eps {mod.indexer.k_norm.eps}")
            FACTS["indexer_k_norm_eps"] = mod.indexer.k_norm.eps
            FACTS["latent_norm_eps"] = [mod.q_a_layernorm.variance_epsilon if mod.q_a_layernorm is not None else None,
                                        mod.kv_a_layernorm.variance_epsilon]
            check(abs(mod.kv_a_layernorm.variance_epsilon - 1e-6) < 1e-15, "kv_a_layernorm eps != 1e-6")
            if mod.q_a_layernorm is not None:
                check(abs(mod.q_a_layernorm.variance_epsilon - 1e-6) < 1e-15, "q_a_layernorm eps != 1e-6")
            FACTS[f"softmax_scale[{fx['name']}]"] = mod.scaling
        elif type(mod).__name__ == "HybridMLAMixer" or isinstance(mod, import_hf()["mdv3"].DeepseekV3Attention):
            check(abs(mod.scaling - scale) <= 1e-12 * scale, f"{fx['name']}: HF V3 softmax scale {mod.scaling} != {scale}")
    ropes = []
    if fx["kind"] == "ds":
        ropes.append(model.model.rotary_emb)
    else:
        for blk in model.model.layers:
            if hasattr(blk.mixer, "_kr_ctx"):
                ropes.append(blk.mixer._kr_ctx.rope)
    for r in ropes:
        inv = P(getattr(r, "inv_freq"))
        rel = ((inv - f).abs() / f).max().item()
        check(rel < 1e-6, f"{fx['name']}: HF inv_freq differs from spec YaRN frequencies (rel {rel:.2e}): {inv} vs {f}")
        check(abs(r.attention_scaling - af) < 1e-6, f"{fx['name']}: HF cos/sin multiplier {r.attention_scaling} != {af}")
        FACTS[f"rope_cos_sin_multiplier[{fx['name']}]"] = r.attention_scaling


# --------------------------------------------------------------------------------------------------
# Writing / reading
# --------------------------------------------------------------------------------------------------


def to_storage_tensors(stored):
    out = {}
    for name, rec in stored.items():
        if rec[0] == "bf16":
            out[name] = rec[1].to(torch.bfloat16).contiguous()
        elif rec[0] == "f32":
            out[name] = rec[1].to(torch.float32).contiguous()
        else:
            q = rec[1].to(torch.float32).to(torch.float8_e4m3fn).contiguous()
            check(torch.equal(q.to(F64), rec[1]), f"{name}: torch float8_e4m3fn rounding differs from round_e4m3")
            out[name] = q
            out[name[:-len("weight")] + "weight_scale_inv"] = rec[2].to(torch.float32).contiguous()
    return out


# A float64-spec fixture (spec_ref) needs neither transformers nor the safetensors package: it writes and
# reads the file with the converter's self-contained safetensors code (tools/megatron/common.py), and the
# versions name what ran.
SPEC_HF = {"transformers": type("none", (), {"__version__": "not used"}),
           "safetensors": type("none", (), {"__version__": "not used (tools/megatron/common.py)"})}


def st_common():
    sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "megatron"))
    import common  # noqa: E402  (tools/megatron/common.py)
    return common


def dequant_loaded(tensors):
    W = {}
    for name, t in tensors.items():
        if name.endswith(".weight_scale_inv"):
            continue
        if t.dtype == getattr(torch, "float8_e4m3fn", None):
            sc = tensors.get(name[:-len("weight")] + "weight_scale_inv")
            check(sc is not None and sc.dtype == torch.float32, f"{name}: fp8 weight without f32 weight_scale_inv")
            check(tuple(sc.shape) == (-(-t.shape[0] // FP8_BLOCK), -(-t.shape[1] // FP8_BLOCK)),
                  f"{name}: weight_scale_inv shape {tuple(sc.shape)}")
            W[name] = t.to(F64) * expand_scale(sc.to(F64), t.shape)
        else:
            W[name] = t.to(F64)
    for name in tensors:
        if name.endswith(".weight_scale_inv"):
            check(name[:-len("_scale_inv")] in tensors, f"{name}: scale without weight")
    return W


def write_json(path, obj, allow_nan=False):
    with open(path, "w") as f:
        f.write(json.dumps(obj, indent=2, allow_nan=allow_nan) + "\n")


def read_reference(d):
    import numpy as np
    ref = json.load(open(os.path.join(d, "reference.json")))
    blob = open(os.path.join(d, "reference.bin"), "rb").read()
    V = ref["vocab_size"]
    out = []
    for p in ref["prompts"]:
        n = p["n_rows"]
        arr = np.frombuffer(blob, dtype="<f4", count=n * V, offset=p["logprobs_offset"]).reshape(n, V)
        out.append((p, torch.from_numpy(arr.copy())))
    return ref, out


def check_hf_from_pretrained(d, fx, refs, device):
    hf = import_hf()
    model, info = hf["mds"].DeepseekV32ForCausalLM.from_pretrained(
        d, dtype=torch.float32, attn_implementation="eager", experts_implementation="eager",
        output_loading_info=True, local_files_only=True)
    problems = []
    for key, val in (info or {}).items():
        if val:
            problems.append(f"{key}={sorted(map(str, val))[:6]}")
    check(not problems, f"{fx['name']}: HF from_pretrained reports {'; '.join(problems)}")
    model.eval().to(device)
    worst = 0.0
    for p, lp_ref in refs:
        worst = max(worst, (hf_logprobs(model, p["ids"], device).cpu() - lp_ref).abs().max().item())
    check(worst <= 1e-5, f"{fx['name']}: HF from_pretrained logprobs differ by {worst:.3e}")
    return worst


def try_hf_from_pretrained_fp8(d, fx, refs, device):
    """Informational: how HF's own loader handles the FP8 directory."""
    hf = import_hf()
    res = {}
    for mode in ("default", "dequantize"):
        try:
            kw = {}
            if mode == "dequantize":
                from transformers import FineGrainedFP8Config
                kw["quantization_config"] = FineGrainedFP8Config(dequantize=True, weight_block_size=(128, 128))
            model, info = hf["mds"].DeepseekV32ForCausalLM.from_pretrained(
                d, dtype=torch.float32 if mode == "dequantize" else "auto", attn_implementation="eager",
                output_loading_info=True, local_files_only=True, device_map=device, **kw)
            model.eval()
            worst = 0.0
            for p, lp_ref in refs:
                worst = max(worst, (hf_logprobs(model, p["ids"], device).cpu() - lp_ref).abs().max().item())
            probs = {k: sorted(map(str, v))[:4] + ([f"... {len(v)} total"] if len(v) > 4 else [])
                     for k, v in (info or {}).items() if v}
            res[mode] = f"loads; max |logprob - reference| = {worst:.3e}; loading info {probs}"
        except Exception as e:  # noqa: BLE001
            res[mode] = f"fails: {type(e).__name__}: {str(e)[:240]}"
    return res


# --------------------------------------------------------------------------------------------------
# Per-fixture driver
# --------------------------------------------------------------------------------------------------


def draw_prompt(fx, L, attempt):
    """Prompt draw number `attempt` of length L (independent generators, so a search can resume anywhere)."""
    g = torch.Generator().manual_seed(fx["seed"] * 100003 + L * 1009 + attempt)
    return torch.randint(0, fx["vocab"], (L,), generator=g).tolist()


def choose_prompts(fx, W, lp_fn):
    """Deterministic prompt draws; conditions: indexer margins (prompt, then prompt+greedy), greedy margins, no eos."""
    prompts, stats = [], dict(index_redraws=0, greedy_redraws=0)
    for L in fx["prompts"]:
        best, best_key = None, None
        start = fx.get("prompt_start", {}).get(L, 0)
        for attempt in range(start, start + MAX_PROMPT_TRIES):
            ids = draw_prompt(fx, L, attempt)
            lp_s, infos, _ = spec_forward(W, fx, ids)
            okp, relp = index_ok(infos, fx.get("idx_margin", IDX_REL_MARGIN))
            if not okp:
                stats["index_redraws"] += 1
                if best is None:
                    best_key = (False, False, False, -INF, relp)
                continue
            lp = lp_fn(ids)
            toks, margins = greedy(lp_fn, ids, lp[-1])
            _, infos_f, _ = spec_forward(W, fx, ids + toks[:-1])
            okf, relf = index_ok(infos_f, fx.get("idx_margin", IDX_REL_MARGIN))
            gm_ok = EOS_ID not in toks and min(margins) >= MIN_MARGIN
            key = (True, okf, gm_ok, min(margins), min(relp, relf))
            if best is None or best_key is None or key > best_key:
                best, best_key = dict(ids=ids, lp=lp.cpu(), greedy=toks, margins=margins, infos=infos,
                                      rel_full=relf, attempt=attempt), key
            if okf and gm_ok:
                break
            stats["greedy_redraws"] += 1
        check(best is not None, f"{fx['name']}: no prompt of length {L} with all index margins > {IDX_REL_MARGIN} "
                                f"in {MAX_PROMPT_TRIES} draws (best {best_key}); change the seed")
        if not (best_key[1] and best_key[2]):
            print(f"  note: {fx['name']} len {L}: kept candidate with key {best_key}", flush=True)
        prompts.append(best)
    return prompts, stats


def run_fixture(fx, root, device, spec_only=False):
    t0 = time.time()
    name = fx["name"]
    stored, W = generate_weights(fx)
    W_model = {k: v for k, v in W.items() if not is_mtp(fx, k)}
    nbytes = sum(r[1].numel() * {"bf16": 2, "f32": 4, "fp8": 1}[r[0]] + (r[2].numel() * 4 if r[0] == "fp8" else 0)
                 for r in stored.values())
    if spec_only:
        def lp_fn(ids):
            return spec_forward(W_model, fx, ids)[0]
        prompts, pst = choose_prompts(fx, W_model, lp_fn)
        rels = [r for p in prompts for inf in p["infos"] for r in inf["rel"] if r is not None]
        print(f"[{name}] spec-only: pattern {krait_pattern(fx)} weights {nbytes / 1024:.0f} KiB, prompts "
              f"{[len(p['ids']) for p in prompts]}, redraws {pst}, min idx rel margin {min(rels) if rels else None}, "
              f"min greedy margin {min(m for p in prompts for m in p['margins']):.3f}, "
              f"prompt_start {dict((len(p['ids']), p['attempt']) for p in prompts)} "
              f"checksum ids {sum(sum(p['ids']) for p in prompts)} w {sum(v.sum().item() for v in W.values()):.6f} "
              f"[{time.time() - t0:.1f}s]", flush=True)
        return
    spec_ref = fx.get("spec_ref", False)
    hf = SPEC_HF if spec_ref else import_hf()
    d = fx_dir(root, fx)
    os.makedirs(d, exist_ok=True)
    for f in glob.glob(os.path.join(d, "*")):
        os.remove(f)
    if spec_ref:  # no HF model runs these switches: the float64 spec is the reference, rounded to float32
        model = None

        def lp_fn(ids):
            return spec_forward(W_model, fx, ids)[0]
    else:
        model, cfg = build_model(fx, W_model, device)
        model_facts(model, fx)

        def lp_fn(ids):
            return hf_logprobs(model, ids, device)
    prompts, pst = choose_prompts(fx, W_model, lp_fn)

    stats = dict(mixer_max_rel_err=0.0, router_near_ties_skipped=0, clamp_sensitivity=0.0, e2e_max_err=0.0,
                 e2e_skipped=0, mask_checked=0, sparse_vs_dense=0.0)
    for p in prompts:
        if spec_ref:
            p["lp"] = p["lp"].float()
            p["sets"] = [inf["sel"] for inf in p["infos"]]
            continue
        lp_h, cap, sets, akw = hooked_forward(model, fx, p["ids"], device)
        check((lp_h.cpu() - p["lp"]).abs().max().item() <= 1e-6, f"{name}: HF forward not reproducible")
        check_against_spec(model, fx, W_model, p["ids"], cap, sets, stats)
        p["sets"] = sets
        if fx["kind"] == "ds" and akw:
            # the hybrid wrappers rebuild mask + rotary with the same HF functions: prove they match DeepseekV32Model
            kw0 = akw[0]
            h = torch.zeros(1, len(p["ids"]), fx["hidden"], device=device)
            pos = torch.arange(len(p["ids"]), device=device).unsqueeze(0)
            mine = causal_mask_like_model(hf["mds"].create_causal_mask, model.config, h, pos)
            theirs = kw0.get("attention_mask")
            check(theirs is not None and mine is not None and torch.equal(mine, theirs),
                  f"{name}: causal mask rebuilt like the model differs from DeepseekV32Model's")
            cos, sin = model.model.rotary_emb(h, pos)
            pe = kw0.get("position_embeddings")
            check(pe is not None and torch.equal(pe[0], cos) and torch.equal(pe[1], sin),
                  f"{name}: rotary embeddings differ from DeepseekV32Model's")
            stats["mask_checked"] += 1
            FACTS.setdefault("causal_mask_passed_to_attention",
                             f"{theirs.dtype} shape {list(theirs.shape)}, masked value "
                             f"{theirs.min().item() if theirs.is_floating_point() else 'False'}")
        lp_ref, _, rmin = spec_forward(W_model, fx, p["ids"])
        err = (p["lp"].double() - lp_ref).abs().max().item()
        if rmin < NEAR_TIE:
            stats["e2e_skipped"] += 1
        else:
            stats["e2e_max_err"] = max(stats["e2e_max_err"], err)
            check(err < E2E_TOL, f"{name}: end-to-end float64 spec differs from HF by {err:.3e}")

    # ---- write ----
    tensors = to_storage_tensors(stored)
    if spec_ref:
        st_common().st_write(os.path.join(d, "model.safetensors"), tensors)
    else:
        hf["st"].save_file(tensors, os.path.join(d, "model.safetensors"), metadata={"format": "pt"})
    cfgd = ds_config_json(fx) if fx["kind"] == "ds" else hybrid_config_json(fx)
    cfgd["transformers_version"] = hf["transformers"].__version__
    write_json(os.path.join(d, "config.json"), cfgd)
    blob, entries = bytearray(), []
    for p in prompts:
        entries.append({"ids": p["ids"], "logprobs_offset": len(blob), "n_rows": len(p["ids"]),
                        "greedy": p["greedy"], "greedy_margin": p["margins"]})
        blob += p["lp"].numpy().astype("<f4").tobytes()
    K = fx["mla"]["topk"]
    ref = {
        "generator": f"{SCRIPT} (torch {torch.__version__}, transformers {hf['transformers'].__version__}, "
                     f"safetensors {hf['safetensors'].__version__}, device {device}, "
                     + ("the float64 spec rounded to float32" if spec_ref else "float32, no cache") + ")",
        "fixture": name,
        "description": fx["desc"],
        "pattern": krait_pattern(fx),
        "vocab_size": fx["vocab"],
        "notes": "logprobs row t = log_softmax of the next-token distribution after ids[0..t]; greedy = 12 argmax "
                 "tokens by repeated full forward passes from the whole prompt; greedy_margin = top1 - top2 logprob. "
                 "index_sets[p][l][t] = sorted key positions selected by the lightning indexer of indexer layer "
                 "index_layers[l] for query position t of prompt p (min(index_topk, t+1) of them), from HF's indexer "
                 "(the spec's for a float64-spec fixture) on the full prompt; index_margins[p][l][t] = k-th minus (k+1)-th index score (float64 spec) for "
                 "t+1 > index_topk, else null; every such margin exceeds index_margin_rel_threshold times the row's "
                 "max |score|, also over the greedy continuation." +
                 (" Mamba dt = softplus(dt_raw + dt_bias) with no clamp (time_step_limit (0, inf))."
                  if fx["kind"] == "hybrid" else ""),
        "index_topk": K,
        "index_layers": index_layers(fx),
        "index_layers_native": [2 * i for i in index_layers(fx)] if fx["kind"] == "ds" else index_layers(fx),
        "index_margin_rel_threshold": fx.get("idx_margin", IDX_REL_MARGIN),
        "prompts": entries,
        "index_sets": [p["sets"] for p in prompts],
        "index_margins": [[[None if g is None else float(f"{g:.6g}") for g in inf["marg"]] for inf in p["infos"]]
                          for p in prompts],
    }
    with open(os.path.join(d, "reference.bin"), "wb") as f:
        f.write(bytes(blob))
    write_json(os.path.join(d, "reference.json"), ref)

    # ---- reload check: files -> dequantize -> HF state -> fresh model -> same logprobs / greedy / index sets ----
    loaded = (st_common().st_read_dir_torch(d) if spec_ref
              else hf["st"].load_file(os.path.join(d, "model.safetensors")))
    check(set(loaded) == set(tensors), f"{name}: reloaded tensor names differ")
    for k, v in loaded.items():
        check(v.dtype == tensors[k].dtype and torch.equal(v.to(F64), tensors[k].to(F64)), f"{name}: {k} changed on disk")
    W2 = dequant_loaded(loaded)
    check(set(W2) == set(W), f"{name}: dequantized names differ from the logical layout")
    for k in W:
        check(torch.equal(W2[k], W[k]), f"{name}: {k} dequantizes to different values")
    W2m = {k: v for k, v in W2.items() if not is_mtp(fx, k)}
    if spec_ref:  # the files reproduce the spec's reference exactly
        _, refs = read_reference(d)
        for (pr, lp_disk), pm in zip(refs, prompts):
            check(torch.equal(lp_disk, pm["lp"]), f"{name}: reference.bin does not hold the computed logprobs")
            lp2, infos2, _ = spec_forward(W2m, fx, pr["ids"])
            check(torch.equal(lp2.float(), lp_disk), f"{name}: reloaded weights give other logprobs")
            check([inf["sel"] for inf in infos2] == pm["sets"], f"{name}: reloaded index sets differ")
        size = sum(os.path.getsize(os.path.join(d, f)) for f in os.listdir(d))
        check(size < 1_000_000, f"{name}: fixture is {size} bytes (>= 1 MB)")
        for f in os.listdir(d):
            os.chmod(os.path.join(d, f), 0o644)
        print(f"[{name}] pattern={krait_pattern(fx)} prompts={[len(p['ids']) for p in prompts]} size={size / 1024:.0f}KiB "
              f"(float64 spec reference) index_layers={index_layers(fx)} redraws={pst} "
              f"min_greedy_margin={min(m for p in prompts for m in p['margins']):.4f} [{time.time() - t0:.1f}s]",
              flush=True)
        return
    fresh, _ = build_model(fx, W2m, device)
    for k, v in fresh.state_dict().items():
        check(torch.equal(v, model.state_dict()[k]), f"{name}: reloaded {k} differs")
    _, refs = read_reference(d)
    bitwise = True
    for (pr, lp_disk), pm in zip(refs, prompts):
        check(torch.equal(lp_disk, pm["lp"]), f"{name}: reference.bin does not hold the computed logprobs")
        lp, _, sets, _ = hooked_forward(fresh, fx, pr["ids"], device)
        lp = lp.cpu()
        check((lp - lp_disk).abs().max().item() <= 1e-6, f"{name}: reloaded logprobs differ")
        bitwise = bitwise and torch.equal(lp, lp_disk)
        check(sets == pm["sets"], f"{name}: reloaded index sets differ")
        toks, _ = greedy(lambda ids: hf_logprobs(fresh, ids, device).cpu(), pr["ids"], lp[-1])
        check(toks == pr["greedy"], f"{name}: greedy continuation not reproduced from the files")
    if fx["kind"] == "ds" and fx["storage"] != "ds_fp8":
        w = check_hf_from_pretrained(d, fx, refs, device)
        hf_load = f"HF from_pretrained reproduces reference (max diff {w:.1e})"
    elif fx["kind"] == "ds":
        res = try_hf_from_pretrained_fp8(d, fx, refs, device)
        FACTS[f"from_pretrained[{name}]"] = res
        hf_load = f"HF from_pretrained (informational): {res}"
    else:
        hf_load = "HF from_pretrained n/a (nemotron_h has no D/+ layers)"
    for f in os.listdir(d):
        os.chmod(os.path.join(d, f), 0o644)
    size = sum(os.path.getsize(os.path.join(d, f)) for f in os.listdir(d))
    check(size < 1_000_000, f"{name}: fixture is {size} bytes (>= 1 MB)")
    rels = [r for p in prompts for inf in p["infos"] for r in inf["rel"] if r is not None]
    n_sel_matter = sum(1 for p in prompts for inf in p["infos"] for r in inf["rel"] if r is not None)
    print(f"[{name}] pattern={krait_pattern(fx)} prompts={[len(p['ids']) for p in prompts]} size={size / 1024:.0f}KiB "
          f"min_greedy_margin={min(m for p in prompts for m in p['margins']):.4f} redraws={pst} prompt_start={dict((len(p['ids']), p['attempt']) for p in prompts)} "
          f"rows_where_topk_selects={n_sel_matter} min_idx_rel_margin(prompt)={min(rels) if rels else None} "
          f"min_idx_rel_margin(+greedy)={min(p['rel_full'] for p in prompts)} "
          f"mixer_rel_err={stats['mixer_max_rel_err']:.1e} e2e_err={stats['e2e_max_err']:.1e} "
          f"router_ties_skipped={stats['router_near_ties_skipped']} e2e_skipped={stats['e2e_skipped']} "
          f"clamp_sens={stats['clamp_sensitivity']:.1e} masks_checked={stats['mask_checked']} "
          f"sparse_vs_dense_attn_rel_diff={stats['sparse_vs_dense']:.2e} "
          f"checksum ids {sum(sum(p['ids']) for p in prompts)} w {sum(v.sum().item() for v in W.values()):.6f} "
          f"reload_bitwise={bitwise}; {hf_load} [{time.time() - t0:.1f}s]", flush=True)


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("out_root")
    ap.add_argument("--device", default=None)
    ap.add_argument("--only", nargs="*", default=None)
    ap.add_argument("--facts", default=None, help="write the collected HF facts to this JSON file")
    ap.add_argument("--spec-only", action="store_true", help="float64 spec only: weight/prompt search dry run")
    ap.add_argument("--keep-going", action="store_true", help="continue with the next fixture after a failure")
    args = ap.parse_args()
    names = [f["name"] for f in FIXTURES]
    for n in args.only or []:
        check(n in names, f"unknown fixture {n}; known: {names}")
    todo = [fx for fx in FIXTURES if not args.only or fx["name"] in args.only]
    if args.spec_only:
        for fx in todo:
            run_fixture(fx, args.out_root, "cpu", spec_only=True)
        return
    device = args.device or ("cuda" if torch.cuda.is_available() else "cpu")
    disable_tf32()
    t0 = time.time()
    failed = []
    if any(not fx.get("spec_ref") for fx in todo):  # float64-spec fixtures need no transformers
        hf = import_hf()
        hf["transformers"].logging.set_verbosity_error()
        if not hf["transformers"].__version__.startswith("5.17"):
            print(f"warning: written for transformers 5.17, running {hf['transformers'].__version__}", flush=True)
        print(f"{SCRIPT}: torch {torch.__version__}, transformers {hf['transformers'].__version__}, device {device}",
              flush=True)
        try:
            collect_static_facts(device)
        except Exception:  # noqa: BLE001
            traceback.print_exc()
    for fx in todo:
        try:
            run_fixture(fx, args.out_root, device)
        except Exception:  # noqa: BLE001
            if not args.keep_going:
                raise
            traceback.print_exc()
            failed.append(fx["name"])
    if args.facts:
        write_json(args.facts, FACTS)
    for k, v in FACTS.items():
        print(f"fact {k}: {v}", flush=True)
    if failed:
        fail(f"FAILED fixtures: {failed}")
    print(f"ALL OK: {len(todo)} fixtures in {time.time() - t0:.1f}s under {args.out_root}", flush=True)


if __name__ == "__main__":
    main()
