#!/usr/bin/env python3
"""Synthetic 8B-class checkpoints for krait benchmarks, and HF transformers timings on them.

Usage:
    python3 tools/bench/synth_model.py make --shape nemotron_h_8b --out DIR [--layers N] [--seed S]
    python3 tools/bench/synth_model.py make --shape hybrid_dsa_8b --out DIR
    python3 tools/bench/synth_model.py make --shape hybrid_mla_8b --out DIR
    python3 tools/bench/synth_model.py hf-bench --model DIR --out results.json [--budget-s 150]

make: builds the model with HF's NemotronHForCausalLM on the meta device, allocates it in bf16 on the
GPU, gives every parameter realistic random values (GPU generator), runs a short forward pass as a
sanity check (finite logits, residual RMS per layer) and writes it with save_pretrained (safetensors
shards of at most 5 GB, `backbone.` names as on the Hub). Shapes (random weights of real size):

  nemotron_h_8b  Nemotron-H-8B: hidden 4096, 52 layers M-M-M-M*-M-M-M-M-M*-M-M-M-M-M*-M-M-M-M-M*-M-M-M-M-M-,
                 Mamba-2 128 heads x 64, state 128, 8 groups, conv 4, chunk 128; relu2 MLP 21504;
                 GQA 32 / 8 KV heads x 128; vocab 131072, untied lm_head; bf16, 8.10e9 parameters (16.2 GB).
                 config.json is the one HF writes.
  hybrid_dsa_8b  the same with every '*' a DeepSeek-V3.2 DSA layer ('D'): MLA with q_lora 1536,
                 kv_lora 512, nope 128, rope 64, v 128, 32 heads (plain RoPE, theta 10000), lightning
                 indexer 64 heads x 128, index_topk 2048 (16.3 GB).  The HF model is NemotronH whose 'D' mixers are
                 HF DeepseekV32Attention modules (as tools/reference/make_dsa_fixtures.py composes it);
                 config.json is krait's hybrid layout (nemotron_h with 'D' in hybrid_override_pattern and
                 the MLA/DSA keys at the top level, MODEL_SPEC 6.3).
  hybrid_mla_8b  the same with dense MLA ('+', HF DeepseekV3Attention, no indexer; 16.2 GB).

hf-bench: loads a checkpoint written by `make` in HF (bf16, CUDA; nemotron_h through from_pretrained,
hybrids through the same composition as `make`) and times, with CUDA events after a warm-up:
decode ms/step at batch 1 and 16 (HF DynamicCache, a 16-token random prompt, then single-token
greedy steps) and prefill tok/s of one 2048- and one 8192-token prompt.  The whole subcommand keeps
to --budget-s: a measurement that would not fit is skipped with a note.  HF has no cached decode
path for DSA/MLA mixers inside nemotron_h, so hybrids get prefill figures only (full forward, no
cache).  The JSON is rewritten after every figure, so a run cut short still leaves what it measured.

Needs torch, transformers (written against 5.17), safetensors; a CUDA GPU.  No network.
"""

import argparse
import contextlib
import gc
import json
import math
import os
import re
import shutil
import statistics
import struct
import sys
import time

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

SCRIPT = "tools/bench/synth_model.py"
T0 = time.perf_counter()
INF = float("inf")

# Nemotron-H-8B (nvidia/Nemotron-H-8B-Base-8K): 52 layers, 24 M, 24 -, 4 *.
NEMOTRON_H_8B_PATTERN = "M-M-M-M*-M-M-M-M-M*-M-M-M-M-M*-M-M-M-M-M*-M-M-M-M-M-"

BASE = dict(
    hidden=4096, vocab=131072,
    m_heads=128, m_head_dim=64, m_state=128, m_groups=8, m_conv=4, m_chunk=128,
    ffn=21504,
    n_head=32, n_kv=8, head_dim=128,
    mla=dict(heads=32, q_lora=1536, kv_lora=512, nope=128, rope=64, v=128, idx_heads=64, idx_dim=128,
             topk=2048, rope_theta=10000.0),
    norm_eps=1e-5, mla_eps=1e-6,
)
SHAPES = {
    "nemotron_h_8b": NEMOTRON_H_8B_PATTERN,
    "hybrid_dsa_8b": NEMOTRON_H_8B_PATTERN.replace("*", "D"),
    "hybrid_mla_8b": NEMOTRON_H_8B_PATTERN.replace("*", "+"),
}
# HF NemotronH block types; 'D' / '+' get an "mlp" placeholder block whose mixer is then replaced.
HF_TYPE = {"M": "linear_attention", "*": "full_attention", "-": "mlp", "D": "mlp", "+": "mlp"}
# config.c's layers_block_type vocabulary
NAME_TO_LETTER = {"mamba": "M", "linear_attention": "M", "attention": "*", "full_attention": "*", "mlp": "-",
                  "moe": "E", "dsa": "D", "deepseek_sparse_attention": "D", "indexed_attention": "D", "mla": "+"}
ST_DTYPE_SIZE = {"BF16": 2, "F16": 2, "F32": 4, "F64": 8, "F8_E4M3": 1, "F8_E5M2": 1, "I8": 1, "U8": 1,
                 "I16": 2, "I32": 4, "I64": 8, "BOOL": 1}


class Fail(Exception):
    """A check failed or the input is unusable; main() prints the message and exits 1."""


def fail(msg):
    raise Fail(msg)


def check(cond, msg):
    if not cond:
        fail(msg)


def log(msg):
    print(f"[{time.perf_counter() - T0:7.1f}s] {msg}", flush=True)


def import_torch():
    try:
        import torch  # noqa: F401
    except Exception as e:  # noqa: BLE001
        fail(f"cannot import torch: {type(e).__name__}: {e}")
    import torch
    if not torch.cuda.is_available():
        fail("CUDA is not available (torch.cuda.is_available() is False); this script needs a GPU")
    return torch


HF = {}


def import_hf():
    """transformers pieces used here, imported once (clear message when something is missing)."""
    if HF:
        return HF
    torch = import_torch()
    try:
        import safetensors
        import safetensors.torch
        import transformers
        from transformers import NemotronHConfig, NemotronHForCausalLM
        from transformers.models.nemotron_h import modeling_nemotron_h as mnh
    except Exception as e:  # noqa: BLE001
        fail(f"cannot import transformers / safetensors / nemotron_h: {type(e).__name__}: {e}")
    HF.update(torch=torch, transformers=transformers, safetensors=safetensors, st=safetensors.torch,
              NHCfg=NemotronHConfig, NHLM=NemotronHForCausalLM, mnh=mnh)
    try:
        transformers.logging.set_verbosity_error()
        transformers.utils.logging.disable_progress_bar()
    except Exception:  # noqa: BLE001
        pass
    if not transformers.__version__.startswith("5."):
        log(f"warning: written for transformers 5.17, running {transformers.__version__}")
    return HF


def import_deepseek():
    hf = import_hf()
    if "mds" not in hf:
        try:
            from transformers.models.deepseek_v32 import modeling_deepseek_v32 as mds
            from transformers.models.deepseek_v32.configuration_deepseek_v32 import DeepseekV32Config
            from transformers.models.deepseek_v3 import modeling_deepseek_v3 as mdv3
            from transformers.models.deepseek_v3.configuration_deepseek_v3 import DeepseekV3Config
        except Exception as e:  # noqa: BLE001
            fail(f"cannot import transformers deepseek_v32 / deepseek_v3 (needed for D / + layers): "
                 f"{type(e).__name__}: {e}")
        hf.update(mds=mds, mdv3=mdv3, DSCfg=DeepseekV32Config, DS3Cfg=DeepseekV3Config)
    return hf


@contextlib.contextmanager
def default_dtype(dt):
    torch = HF["torch"]
    old = torch.get_default_dtype()
    torch.set_default_dtype(dt)
    try:
        yield
    finally:
        torch.set_default_dtype(old)


def write_json(path, obj):
    tmp = path + ".tmp"
    with open(tmp, "w") as f:
        f.write(json.dumps(obj, indent=2, allow_nan=True) + "\n")
    os.replace(tmp, path)


# --------------------------------------------------------------------------------------------------
# Model description
# --------------------------------------------------------------------------------------------------


def make_spec(shape, layers, max_pos):
    check(shape in SHAPES, f"unknown shape {shape!r}; known: {sorted(SHAPES)}")
    pattern = SHAPES[shape]
    if layers is not None:
        check(1 <= layers <= len(pattern), f"--layers must be in 1..{len(pattern)}, got {layers}")
        pattern = pattern[:layers]
    s = dict(BASE)
    s["mla"] = dict(BASE["mla"])
    s.update(shape=shape, pattern=pattern, max_pos=max_pos)
    return s


def has_mla(spec):
    return any(c in "D+" for c in spec["pattern"])


def mamba_dims(s):
    d_in = s["m_heads"] * s["m_head_dim"]
    conv_dim = d_in + 2 * s["m_groups"] * s["m_state"]
    return d_in, conv_dim, d_in + conv_dim + s["m_heads"]


def mla_layout(pre, s, indexer):
    m, H = s["mla"], s["hidden"]
    nh, dq = m["heads"], m["nope"] + m["rope"]
    out = [(pre + "q_a_proj.weight", (m["q_lora"], H)),
           (pre + "q_a_layernorm.weight", (m["q_lora"],)),
           (pre + "q_b_proj.weight", (nh * dq, m["q_lora"])),
           (pre + "kv_a_proj_with_mqa.weight", (m["kv_lora"] + m["rope"], H)),
           (pre + "kv_a_layernorm.weight", (m["kv_lora"],)),
           (pre + "kv_b_proj.weight", (nh * (m["nope"] + m["v"]), m["kv_lora"])),
           (pre + "o_proj.weight", (H, nh * m["v"]))]
    if indexer:
        out += [(pre + "indexer.wq_b.weight", (m["idx_heads"] * m["idx_dim"], m["q_lora"])),
                (pre + "indexer.wk.weight", (m["idx_dim"], H)),
                (pre + "indexer.k_norm.weight", (m["idx_dim"],)),
                (pre + "indexer.k_norm.bias", (m["idx_dim"],)),
                (pre + "indexer.weights_proj.weight", (m["idx_heads"], H))]
    return out


def layout(s, prefix):
    """[(stored name, shape)] of the checkpoint, independent of HF (what krait's loader reads)."""
    H, V = s["hidden"], s["vocab"]
    d_in, conv_dim, in_proj = mamba_dims(s)
    out = [(prefix + "embeddings.weight", (V, H))]
    for i, c in enumerate(s["pattern"]):
        pre = f"{prefix}layers.{i}."
        out.append((pre + "norm.weight", (H,)))
        mx = pre + "mixer."
        if c == "M":
            out += [(mx + "in_proj.weight", (in_proj, H)),
                    (mx + "conv1d.weight", (conv_dim, 1, s["m_conv"])), (mx + "conv1d.bias", (conv_dim,)),
                    (mx + "dt_bias", (s["m_heads"],)), (mx + "A_log", (s["m_heads"],)), (mx + "D", (s["m_heads"],)),
                    (mx + "norm.weight", (d_in,)), (mx + "out_proj.weight", (H, d_in))]
        elif c == "*":
            q, kv = s["n_head"] * s["head_dim"], s["n_kv"] * s["head_dim"]
            out += [(mx + "q_proj.weight", (q, H)), (mx + "k_proj.weight", (kv, H)),
                    (mx + "v_proj.weight", (kv, H)), (mx + "o_proj.weight", (H, q))]
        elif c == "-":
            out += [(mx + "up_proj.weight", (s["ffn"], H)), (mx + "down_proj.weight", (H, s["ffn"]))]
        elif c in "D+":
            out += mla_layout(mx, s, c == "D")
        else:
            fail(f"unsupported layer letter {c!r}")
    out.append((prefix + "norm_f.weight", (H,)))
    out.append(("lm_head.weight", (V, H)))
    return out


def n_params(s):
    return sum(math.prod(shape) for _, shape in layout(s, ""))


# --------------------------------------------------------------------------------------------------
# HF model construction (meta device -> bf16 on the GPU)
# --------------------------------------------------------------------------------------------------


def hf_config(s, attn_impl):
    hf = import_hf()
    kw = dict(
        vocab_size=s["vocab"], hidden_size=s["hidden"],
        layers_block_type=[HF_TYPE[c] for c in s["pattern"]],
        tie_word_embeddings=False,
        num_attention_heads=s["n_head"], num_key_value_heads=s["n_kv"], head_dim=s["head_dim"],
        max_position_embeddings=s["max_pos"], attention_bias=False,
        intermediate_size=s["ffn"], mlp_hidden_act="relu2", mlp_bias=False,
        use_mamba_kernels=False, ssm_state_size=s["m_state"], mamba_num_heads=s["m_heads"],
        mamba_head_dim=s["m_head_dim"], mamba_hidden_act="silu", n_groups=s["m_groups"],
        conv_kernel=s["m_conv"], use_conv_bias=True, chunk_size=s["m_chunk"],
        expand=(s["m_heads"] * s["m_head_dim"]) // s["hidden"],
        use_bias=False, layer_norm_epsilon=s["norm_eps"],
        pad_token_id=0, bos_token_id=1, eos_token_id=2, use_cache=True,
        attn_implementation=attn_impl,
    )
    cfg = hf["NHCfg"](**kw)
    check(list(cfg.layers_block_type) == kw["layers_block_type"], "HF NemotronHConfig did not take layers_block_type")
    check(cfg.num_hidden_layers == len(s["pattern"]), "HF NemotronHConfig num_hidden_layers != pattern length")
    return cfg


def causal_mask_like_model(create_causal_mask, cfg, h, pos):
    """The 4-D causal mask as DeepseekV32Model / DeepseekV3Model build it (no cache, no padding)."""
    import inspect
    params = inspect.signature(create_causal_mask).parameters
    kw = dict(config=cfg, inputs_embeds=h, attention_mask=None, past_key_values=None, position_ids=pos)
    if "cache_position" in params:
        kw["cache_position"] = pos[0]
    if "allow_is_causal_skip" in params:
        kw["allow_is_causal_skip"] = False
    if not any(p.kind == p.VAR_KEYWORD for p in params.values()):
        kw = {k: v for k, v in kw.items() if k in params}
    return create_causal_mask(**kw)


MIXERS = {}


def mixer_classes():
    """HF DeepseekV32Attention / DeepseekV3Attention as nemotron_h mixers (parameter names unchanged).

    Same composition as tools/reference/make_dsa_fixtures.py: each call builds the rotary table and the
    causal mask as DeepseekV32Model / DeepseekV3Model would, positions 0..T-1, no cache."""
    if MIXERS:
        return MIXERS["D"], MIXERS["+"]
    hf = import_deepseek()
    torch, mds, mdv3 = hf["torch"], hf["mds"], hf["mdv3"]

    class _Ctx:
        """Rotary + mask provider, kept out of the module tree (no state-dict entries, not on meta)."""

        def __init__(self, cfg, rope_cls, create_mask):
            self.cfg, self.rope_cls, self.create_mask, self.rope = cfg, rope_cls, create_mask, None

        def inputs(self, h):
            if self.rope is None:
                self.rope = self.rope_cls(config=self.cfg)
            self.rope.to(h.device)
            T = h.shape[1]
            pos = torch.arange(T, device=h.device).unsqueeze(0)
            cos, sin = self.rope(h, pos)
            return pos, (cos, sin), causal_mask_like_model(self.create_mask, self.cfg, h, pos)

    class HybridDSAMixer(mds.DeepseekV32Attention):
        def __init__(self, cfg, layer_idx):
            super().__init__(cfg, layer_idx)
            object.__setattr__(self, "_kr_ctx", _Ctx(cfg, mds.DeepseekV32RotaryEmbedding, mds.create_causal_mask))

        def forward(self, hidden_states, *args, **kwargs):
            pos, pe, mask = self._kr_ctx.inputs(hidden_states)
            out = mds.DeepseekV32Attention.forward(self, hidden_states=hidden_states, position_embeddings=pe,
                                                   attention_mask=mask, past_key_values=None, position_ids=pos)
            return out[0] if isinstance(out, tuple) else out

    class HybridMLAMixer(mdv3.DeepseekV3Attention):
        def __init__(self, cfg, layer_idx):
            super().__init__(cfg, layer_idx)
            object.__setattr__(self, "_kr_ctx", _Ctx(cfg, mdv3.DeepseekV3RotaryEmbedding, mdv3.create_causal_mask))

        def forward(self, hidden_states, *args, **kwargs):
            pos, pe, mask = self._kr_ctx.inputs(hidden_states)
            out = mdv3.DeepseekV3Attention.forward(self, hidden_states=hidden_states, position_embeddings=pe,
                                                   attention_mask=mask, past_key_values=None, position_ids=pos)
            return out[0] if isinstance(out, tuple) else out

    MIXERS.update({"D": HybridDSAMixer, "+": HybridMLAMixer})
    return HybridDSAMixer, HybridMLAMixer


def ds_configs(s):
    hf = import_deepseek()
    m = s["mla"]
    kw = dict(vocab_size=s["vocab"], hidden_size=s["hidden"], num_hidden_layers=len(s["pattern"]),
              num_attention_heads=m["heads"], num_key_value_heads=m["heads"], q_lora_rank=m["q_lora"],
              kv_lora_rank=m["kv_lora"], qk_nope_head_dim=m["nope"], qk_rope_head_dim=m["rope"],
              v_head_dim=m["v"], rope_theta=m["rope_theta"], max_position_embeddings=s["max_pos"],
              rms_norm_eps=s["mla_eps"], attention_bias=False, use_cache=False, attn_implementation="eager")
    dsa = hf["DSCfg"](**kw, index_n_heads=m["idx_heads"], index_head_dim=m["idx_dim"], index_topk=m["topk"],
                      first_k_dense_replace=len(s["pattern"]))
    mla = hf["DS3Cfg"](**kw)
    return dsa, mla


def build_model(s, attn_impl="sdpa"):
    """HF model with the spec's shapes, bf16 on cuda, parameters uninitialised."""
    hf = import_hf()
    torch = hf["torch"]
    cfg = hf_config(s, attn_impl)
    with torch.device("meta"), default_dtype(torch.bfloat16):
        model = hf["NHLM"](cfg)
        if has_mla(s):
            dsa_cfg, mla_cfg = ds_configs(s)
            DSA, MLA = mixer_classes()
            for i, c in enumerate(s["pattern"]):
                if c == "D":
                    model.model.layers[i].mixer = DSA(dsa_cfg, i)
                elif c == "+":
                    model.model.layers[i].mixer = MLA(mla_cfg, i)
    model.to_empty(device="cuda")
    model.eval()
    mnh = hf["mnh"]
    want = {"M": mnh.NemotronHMamba2Mixer, "*": mnh.NemotronHAttention, "-": mnh.NemotronHMLP}
    if has_mla(s):
        want.update(MIXERS)
    for i, c in enumerate(s["pattern"]):
        mix = model.model.layers[i].mixer
        check(type(mix) is want[c], f"layer {i} ('{c}'): HF mixer is {type(mix).__name__}, want {want[c].__name__}")
    bufs = [n for n, _ in model.named_buffers()]
    check(not bufs, f"unexpected buffers {bufs[:5]} (to_empty leaves them uninitialised): HF layout changed?")
    for n, p in model.named_parameters():
        check(p.dtype == torch.bfloat16 and p.device.type == "cuda", f"{n}: {p.dtype} on {p.device}, want bf16 cuda")
    try:
        model.config.dtype = torch.bfloat16
    except Exception:  # noqa: BLE001
        pass
    return model, cfg


# --------------------------------------------------------------------------------------------------
# Random weights
# --------------------------------------------------------------------------------------------------

OUT_PROJ_RE = re.compile(r"\.mixer\.(out_proj|o_proj|down_proj)\.weight$")
NORM_RE = re.compile(r"(^|\.)(norm|norm_f|q_a_layernorm|kv_a_layernorm|k_norm)\.weight$")


def randomize(model, s, seed):
    """Realistic random values for every parameter, generated on the GPU.

    Linear weights ~ N(0, 1/sqrt(fan_in)) (about 0.016 for fan_in 4096), and the projections that write
    into the residual stream (out_proj, o_proj, down_proj) a further 1/sqrt(n_layers) smaller, so the
    residual stays O(1) through the stack; embeddings N(0, 1); lm_head N(0, 1/sqrt(hidden)) (logits
    ~ N(0, 1)); norm weights 1 + N(0, 0.1); Mamba A_log = log(U(1, 16)), dt_bias = softplus^-1 of a
    log-uniform dt in [1e-3, 1e-1], D = 1 + N(0, 0.1), conv1d N(0, 1/sqrt(kernel)), conv bias N(0, 0.1)."""
    torch = HF["torch"]
    g = torch.Generator(device="cuda")
    g.manual_seed(seed)
    L = max(1, len(s["pattern"]))
    unknown = []

    def uniform(shape):
        return torch.rand(shape, generator=g, device="cuda", dtype=torch.float32)

    with torch.no_grad():
        for name, p in model.named_parameters():
            shape = tuple(p.shape)
            if name.endswith("embeddings.weight"):
                p.normal_(0.0, 1.0, generator=g)
            elif name == "lm_head.weight":
                p.normal_(0.0, 1.0 / math.sqrt(shape[1]), generator=g)
            elif NORM_RE.search(name):
                p.normal_(1.0, 0.1, generator=g)
            elif name.endswith("k_norm.bias"):
                p.normal_(0.0, 0.1, generator=g)
            elif name.endswith(".A_log"):
                p.copy_(torch.log(1.0 + 15.0 * uniform(shape)))
            elif name.endswith(".dt_bias"):
                lo, hi = math.log(1e-3), math.log(1e-1)
                dt = torch.exp(lo + (hi - lo) * uniform(shape))
                p.copy_(dt + torch.log(-torch.expm1(-dt)))  # inverse softplus
            elif name.endswith(".D"):
                p.normal_(1.0, 0.1, generator=g)
            elif name.endswith("conv1d.weight"):
                p.normal_(0.0, 1.0 / math.sqrt(shape[-1]), generator=g)
            elif name.endswith("conv1d.bias"):
                p.normal_(0.0, 0.1, generator=g)
            elif name.endswith(".weight") and len(shape) == 2:
                std = 1.0 / math.sqrt(shape[1])
                if OUT_PROJ_RE.search(name):
                    std /= math.sqrt(L)
                p.normal_(0.0, std, generator=g)
            else:
                unknown.append(f"{name} {shape}")
    check(not unknown, f"no randomisation rule for {unknown[:6]}: HF module layout differs from what this script expects")
    bad = [n for n, p in model.named_parameters() if not bool(torch.isfinite(p).all())]
    check(not bad, f"non-finite values after randomisation in {bad[:5]}")


def sanity_forward(model, s, n_tok, seed):
    """Short forward pass (no cache): finite logits, residual RMS after every layer. Returns a summary."""
    torch = HF["torch"]
    g = torch.Generator(device="cuda")
    g.manual_seed(seed + 1)
    ids = torch.randint(0, s["vocab"], (1, n_tok), generator=g, device="cuda")
    rms = []
    hooks = [blk.register_forward_hook(lambda m, a, o: rms.append(o.float().pow(2).mean().sqrt()))
             for blk in model.model.layers]
    try:
        with torch.inference_mode():
            out = model(input_ids=ids, use_cache=False, logits_to_keep=n_tok)
    finally:
        for h in hooks:
            h.remove()
    logits = out.logits.float()
    check(bool(torch.isfinite(logits).all()), "sanity forward: non-finite logits")
    r = torch.stack(rms).tolist()
    check(len(r) == len(s["pattern"]), f"sanity forward: {len(r)} layer outputs for {len(s['pattern'])} layers")
    check(all(math.isfinite(x) for x in r), "sanity forward: non-finite residual stream")
    lstd = logits.std().item()
    top = logits[0].softmax(-1).max(-1).values.mean().item()
    if max(r) > 100 or lstd > 30:
        log(f"warning: activations are large (max residual RMS {max(r):.1f}, logits std {lstd:.1f})")
    return dict(tokens=n_tok, residual_rms_first=r[0], residual_rms_last=r[-1], residual_rms_max=max(r),
                logits_std=lstd, mean_top1_prob=top)


# --------------------------------------------------------------------------------------------------
# config.json: krait's hybrid layout, and the checks of what krait's loader (model/config.c) reads
# --------------------------------------------------------------------------------------------------


def hybrid_config_json(s, transformers_version):
    """nemotron_h config whose pattern holds D / + (as tools/reference/make_dsa_fixtures.py writes it)."""
    m = s["mla"]
    c = {
        "architectures": ["NemotronHForCausalLM"],
        "model_type": "nemotron_h",
        "vocab_size": s["vocab"],
        "hidden_size": s["hidden"],
        "num_hidden_layers": len(s["pattern"]),
        "hybrid_override_pattern": s["pattern"],
        "num_attention_heads": m["heads"],
        "num_key_value_heads": m["heads"],
        "attention_bias": False,
        "q_lora_rank": m["q_lora"],
        "kv_lora_rank": m["kv_lora"],
        "qk_nope_head_dim": m["nope"],
        "qk_rope_head_dim": m["rope"],
        "v_head_dim": m["v"],
    }
    if "D" in s["pattern"]:
        c.update({"index_n_heads": m["idx_heads"], "index_head_dim": m["idx_dim"], "index_topk": m["topk"]})
    c.update({
        "rope_theta": m["rope_theta"],
        "rms_norm_eps": s["mla_eps"],
        "max_position_embeddings": s["max_pos"],
        "intermediate_size": s["ffn"],
        "mlp_hidden_act": "relu2",
        "mlp_bias": False,
        "mamba_num_heads": s["m_heads"],
        "mamba_head_dim": s["m_head_dim"],
        "ssm_state_size": s["m_state"],
        "n_groups": s["m_groups"],
        "conv_kernel": s["m_conv"],
        "chunk_size": s["m_chunk"],
        "use_conv_bias": True,
        "mamba_hidden_act": "silu",
        "time_step_min": 0.001,
        "time_step_max": 0.1,
        "time_step_floor": 0.0001,
        "time_step_limit": [0.0, INF],
        "layer_norm_epsilon": s["norm_eps"],
        "use_bias": False,
        "residual_in_fp32": False,
        "rescale_prenorm_residual": True,
        "mamba_ssm_cache_dtype": "float32",
        "tie_word_embeddings": False,
        "bos_token_id": 1,
        "eos_token_id": 2,
        "pad_token_id": 0,
        "use_cache": True,
        "initializer_range": 0.02,
        "dtype": "bfloat16",
        "torch_dtype": "bfloat16",
        "transformers_version": transformers_version,
        "krait_synthetic": f"{SCRIPT} make --shape {s['shape']} (random weights)",
    })
    return c


def first_key(cfgd, keys):
    for k in keys:
        if k in cfgd:
            return k, cfgd[k]
    return None, None


def config_pattern(cfgd):
    """The layer pattern as model/config.c derives it (layers_block_type list wins; both must agree)."""
    _, lst = first_key(cfgd, ("layers_block_type", "layer_types"))
    pat = cfgd.get("hybrid_override_pattern")
    from_list = None
    if lst is not None:
        check(isinstance(lst, list), "config: layers_block_type must be a list")
        bad = [x for x in lst if NAME_TO_LETTER.get(x) is None]
        check(not bad, f"config: layers_block_type has names krait does not know: {bad[:4]}")
        from_list = "".join(NAME_TO_LETTER[x] for x in lst)
    from_str = None
    if isinstance(pat, str):
        from_str = "".join({"S": "D"}.get(c, c) for c in pat if c != "|")
        bad = sorted(set(from_str) - set("M*-ED+"))
        check(not bad, f"config: hybrid_override_pattern has letters krait does not know: {bad}")
    check(from_list is not None or from_str is not None,
          "config: no layer pattern (hybrid_override_pattern or layers_block_type)")
    if from_list is not None and from_str is not None:
        check(from_list == from_str, f"config: hybrid_override_pattern {from_str} and layers_block_type {from_list} disagree")
    return from_list if from_list is not None else from_str


def json_double(x):
    """A JSON value as util/json.c's kr_json_as_double reads it (numbers, "Infinity"/"inf"/"nan" strings,
    transformers-5 {"__float__": ...} objects); None when it is not a number."""
    if isinstance(x, dict):
        x = x.get("__float__")
    if isinstance(x, bool):
        return None
    if isinstance(x, (int, float)):
        return float(x)
    if isinstance(x, str):
        return {"infinity": INF, "inf": INF, "-infinity": -INF, "-inf": -INF, "nan": math.nan}.get(x.lower())
    return None


def loader_config_problems(cfgd, s):
    """Everything model/config.c requires for nemotron_h, and the effective values compared with the spec."""
    probs = []

    def need(keys, want, default=None, required=True):
        k, v = first_key(cfgd, keys)
        if k is None:
            if required:
                probs.append(f"missing required key {keys[0]!r}")
                return
            v = default
        if v != want:
            probs.append(f"{k or keys[0]} = {v!r} (default {default!r} when absent), expected {want!r}")

    if cfgd.get("model_type") != "nemotron_h":
        probs.append(f"model_type = {cfgd.get('model_type')!r}, expected 'nemotron_h'")
    try:
        pat = config_pattern(cfgd)
        if pat != s["pattern"]:
            probs.append(f"pattern {pat} != expected {s['pattern']}")
        if "*" in pat and any(c in "D+" for c in pat):
            probs.append("pattern mixes '*' with D/+ (config.c rejects it)")
    except Fail as e:
        probs.append(str(e))
        pat = s["pattern"]
    need(("vocab_size",), s["vocab"])
    need(("hidden_size",), s["hidden"])
    need(("layer_norm_epsilon", "rms_norm_eps", "norm_eps"), s["norm_eps"], 1e-5, required=False)
    need(("tie_word_embeddings",), False, False, required=False)
    k, mp = first_key(cfgd, ("max_position_embeddings",))
    if mp is not None and not (isinstance(mp, int) and mp > 0):
        probs.append(f"max_position_embeddings = {mp!r} is not a positive integer")
    if "M" in pat:
        need(("mamba_num_heads",), s["m_heads"])
        need(("mamba_head_dim",), s["m_head_dim"])
        need(("n_groups", "mamba_n_groups"), s["m_groups"], 8, required=False)
        need(("ssm_state_size", "mamba_d_state"), s["m_state"], 128, required=False)
        need(("conv_kernel", "mamba_d_conv"), s["m_conv"], 4, required=False)
        need(("chunk_size", "mamba_chunk_size"), s["m_chunk"], 128, required=False)
        need(("use_conv_bias", "mamba_conv_bias"), True, True, required=False)
        need(("use_bias",), False, False, required=False)
        k, lim = first_key(cfgd, ("time_step_limit", "mamba_dt_limit"))
        if k is not None:
            vals = [json_double(x) for x in lim] if isinstance(lim, list) and len(lim) == 2 else [None]
            if None in vals or any(math.isnan(v) for v in vals) or vals[0] < 0 or vals[1] < vals[0]:
                probs.append(f"{k} = {lim!r} is not a valid [min, max] list")
    if "*" in pat:
        need(("num_attention_heads",), s["n_head"])
        need(("num_key_value_heads",), s["n_kv"], s["n_head"], required=False)
        need(("head_dim", "attention_head_dim"), s["head_dim"], s["hidden"] // s["n_head"], required=False)
        need(("attention_bias",), False, False, required=False)
    need(("mlp_hidden_act", "hidden_act"), "relu2", "relu2", required=False)
    need(("mlp_bias",), False, False, required=False)
    if "-" in pat:
        need(("intermediate_size",), s["ffn"])
    if any(c in "D+" for c in pat):
        m = s["mla"]
        need(("num_attention_heads",), m["heads"])
        need(("q_lora_rank",), m["q_lora"], 0, required=False)
        need(("kv_lora_rank",), m["kv_lora"])
        need(("qk_nope_head_dim",), m["nope"])
        need(("qk_rope_head_dim",), m["rope"])
        need(("v_head_dim",), m["v"])
        need(("rope_theta",), m["rope_theta"], 10000.0, required=False)
        if "rope_scaling" in cfgd and cfgd["rope_scaling"] is not None:
            probs.append(f"rope_scaling = {cfgd['rope_scaling']!r}, expected none (plain RoPE)")
        if "D" in pat:
            need(("index_n_heads",), m["idx_heads"])
            need(("index_head_dim",), m["idx_dim"])
            need(("index_topk",), m["topk"])
    return probs


# --------------------------------------------------------------------------------------------------
# Checkpoint verification from the files alone (safetensors headers, index, config.json)
# --------------------------------------------------------------------------------------------------


def read_st_header(path):
    size = os.path.getsize(path)
    with open(path, "rb") as f:
        head = f.read(8)
        check(len(head) == 8, f"{path}: shorter than a safetensors header")
        n = struct.unpack("<Q", head)[0]
        check(0 < n < 100_000_000 and 8 + n <= size, f"{path}: bad safetensors header length {n}")
        hdr = json.loads(f.read(n))
    hdr.pop("__metadata__", None)
    end = 0
    for name, e in hdr.items():
        b, e_ = e["data_offsets"]
        nb = math.prod(e["shape"]) * ST_DTYPE_SIZE.get(e["dtype"], 0)
        check(e_ - b == nb, f"{path}: {name} holds {e_ - b} bytes for {e['dtype']} {e['shape']}")
        end = max(end, e_)
    check(8 + n + end == size, f"{path}: file is {size} bytes, header says {8 + n + end} (truncated write?)")
    return hdr


def checkpoint_files(d):
    idx_path = os.path.join(d, "model.safetensors.index.json")
    if os.path.exists(idx_path):
        with open(idx_path) as f:
            idx = json.load(f)
        files = sorted(set(idx["weight_map"].values()))
        return files, idx
    check(os.path.exists(os.path.join(d, "model.safetensors")), f"{d}: no model.safetensors(.index.json)")
    return ["model.safetensors"], None


def verify_checkpoint(d, s):
    """Names, shapes, dtypes of every stored tensor against the spec; index and config.json. Returns a summary."""
    files, idx = checkpoint_files(d)
    stored = {}
    for fn in files:
        p = os.path.join(d, fn)
        check(os.path.exists(p), f"{d}: {fn} listed in the index but missing")
        for name, e in read_st_header(p).items():
            check(name not in stored, f"{d}: {name} stored twice")
            stored[name] = (fn, e["dtype"], tuple(e["shape"]))
    if idx is not None:
        wm = idx["weight_map"]
        check(set(wm) == set(stored), f"{d}: index weight_map and stored tensors differ: "
                                      f"{sorted(set(wm) ^ set(stored))[:5]}")
        for k, fn in wm.items():
            check(stored[k][0] == fn, f"{d}: index maps {k} to {fn}, it is in {stored[k][0]}")
        total = sum(math.prod(sh) * ST_DTYPE_SIZE[dt] for _, dt, sh in stored.values())
        ts = idx.get("metadata", {}).get("total_size")
        check(ts is None or ts == total, f"{d}: index total_size {ts} != {total}")
    prefix = "backbone." if "backbone.embeddings.weight" in stored else "model."
    want = dict(layout(s, prefix))
    missing = sorted(set(want) - set(stored))
    extra = sorted(set(stored) - set(want))
    check(not missing and not extra, f"{d}: tensors differ from the {s['shape']} layout: missing {missing[:5]} "
                                     f"extra {extra[:5]}")
    for k, shape in want.items():
        check(stored[k][2] == shape, f"{d}: {k} has shape {list(stored[k][2])}, expected {list(shape)}")
        check(stored[k][1] == "BF16", f"{d}: {k} stored as {stored[k][1]}, expected BF16")
    with open(os.path.join(d, "config.json")) as f:
        cfgd = json.load(f)
    probs = loader_config_problems(cfgd, s)
    check(not probs, f"{d}/config.json: " + "; ".join(probs))
    nbytes = sum(math.prod(sh) * 2 for sh in want.values())
    return dict(files=len(files), tensors=len(stored), prefix=prefix, bytes=nbytes)


# --------------------------------------------------------------------------------------------------
# make
# --------------------------------------------------------------------------------------------------


def cmd_make(a):
    s = make_spec(a.shape, a.layers, a.max_pos)
    out = os.path.abspath(a.out)
    nbytes = n_params(s) * 2
    log(f"make {s['shape']}: {len(s['pattern'])} layers {s['pattern']}, {n_params(s) / 1e9:.3f}e9 parameters, "
        f"{nbytes / 1e9:.2f} GB bf16 -> {out}")
    if a.skip_existing and os.path.exists(os.path.join(out, "config.json")):
        try:
            info = verify_checkpoint(out, s)
            log(f"--skip-existing: {out} already holds a valid {s['shape']} checkpoint ({info['files']} files); nothing to do")
            return 0
        except (Fail, OSError, ValueError, KeyError) as e:
            log(f"--skip-existing: existing files do not verify ({e}); rebuilding")
    hf = import_hf()
    torch = hf["torch"]
    os.makedirs(out, exist_ok=True)
    for fn in os.listdir(out):
        if re.fullmatch(r"model(-\d+-of-\d+)?\.safetensors|model\.safetensors\.index\.json|config\.json|"
                        r"generation_config\.json", fn):
            os.remove(os.path.join(out, fn))
    free = shutil.disk_usage(out).free
    check(free > nbytes * 1.02 + 2**28, f"{out}: {free / 1e9:.1f} GB free on disk, the checkpoint needs {nbytes / 1e9:.1f} GB")
    gpu_free = torch.cuda.mem_get_info()[0]
    check(gpu_free > nbytes * 1.1, f"GPU has {gpu_free / 1e9:.1f} GB free, the model needs {nbytes / 1e9:.1f} GB")
    log(f"torch {torch.__version__}, transformers {hf['transformers'].__version__}, "
        f"safetensors {hf['safetensors'].__version__}, GPU {torch.cuda.get_device_name()}")

    t = time.perf_counter()
    model, cfg = build_model(s)
    torch.cuda.synchronize()
    log(f"built HF model on the GPU (meta init, to_empty) in {time.perf_counter() - t:.1f}s; "
        f"{torch.cuda.memory_allocated() / 1e9:.2f} GB allocated")
    got = sum(p.numel() for p in model.parameters())
    check(got == n_params(s), f"HF model has {got} parameters, the layout says {n_params(s)}")

    t = time.perf_counter()
    randomize(model, s, a.seed)
    torch.cuda.synchronize()
    log(f"random weights (seed {a.seed}) in {time.perf_counter() - t:.1f}s")

    sanity = None
    if a.check_tokens > 0:
        t = time.perf_counter()
        sanity = sanity_forward(model, s, a.check_tokens, a.seed)
        log(f"sanity forward ({a.check_tokens} tokens, no cache) in {time.perf_counter() - t:.1f}s: residual RMS "
            f"first {sanity['residual_rms_first']:.2f} last {sanity['residual_rms_last']:.2f} max "
            f"{sanity['residual_rms_max']:.2f}; logits std {sanity['logits_std']:.2f}, mean top-1 prob "
            f"{sanity['mean_top1_prob']:.3g}")

    t = time.perf_counter()
    import inspect
    kw = {"max_shard_size": a.max_shard_size}
    if "safe_serialization" in inspect.signature(model.save_pretrained).parameters:
        kw["safe_serialization"] = True  # transformers 4.x; 5.x always writes safetensors
    model.save_pretrained(out, **kw)
    dt = time.perf_counter() - t
    log(f"save_pretrained wrote {nbytes / 1e9:.2f} GB in {dt:.1f}s ({nbytes / 1e9 / max(dt, 1e-9):.2f} GB/s)")
    del model
    gc.collect()
    torch.cuda.empty_cache()

    if has_mla(s):
        # HF wrote its placeholder config (D/+ as mlp); replace it with krait's hybrid layout
        write_json(os.path.join(out, "config.json"), hybrid_config_json(s, hf["transformers"].__version__))
        gen = os.path.join(out, "generation_config.json")
        if os.path.exists(gen):
            os.remove(gen)
    info = verify_checkpoint(out, s)
    for fn in os.listdir(out):
        if os.path.isfile(os.path.join(out, fn)):
            os.chmod(os.path.join(out, fn), 0o644)
    log(f"OK: {out}: {info['files']} safetensors files, {info['tensors']} tensors (prefix {info['prefix']}), "
        f"config.json has every key krait's loader reads [{time.perf_counter() - T0:.1f}s total]")
    return 0


# --------------------------------------------------------------------------------------------------
# hf-bench
# --------------------------------------------------------------------------------------------------


def spec_from_config(cfgd):
    """Rebuild the spec from a config.json written by `make` (HF's for nemotron_h, ours for hybrids)."""
    pat = config_pattern(cfgd)
    bad = sorted(set(pat) - set("M*-D+"))
    check(not bad, f"config.json: layer letters {bad} are not supported by hf-bench")
    s = dict(BASE)
    s["mla"] = dict(BASE["mla"])

    def g(keys, default):
        k, v = first_key(cfgd, keys)
        return default if k is None else v

    s.update(pattern=pat, hidden=g(("hidden_size",), None), vocab=g(("vocab_size",), None),
             m_heads=g(("mamba_num_heads",), BASE["m_heads"]), m_head_dim=g(("mamba_head_dim",), BASE["m_head_dim"]),
             m_state=g(("ssm_state_size", "mamba_d_state"), 128), m_groups=g(("n_groups", "mamba_n_groups"), 8),
             m_conv=g(("conv_kernel", "mamba_d_conv"), 4), m_chunk=g(("chunk_size", "mamba_chunk_size"), 128),
             ffn=g(("intermediate_size",), BASE["ffn"]), max_pos=g(("max_position_embeddings",), 4096),
             norm_eps=g(("layer_norm_epsilon", "rms_norm_eps"), 1e-5))
    check(isinstance(s["hidden"], int) and isinstance(s["vocab"], int), "config.json: hidden_size / vocab_size missing")
    if any(c in "D+" for c in pat):
        m = s["mla"]
        m.update(heads=g(("num_attention_heads",), m["heads"]), q_lora=g(("q_lora_rank",), m["q_lora"]),
                 kv_lora=g(("kv_lora_rank",), m["kv_lora"]), nope=g(("qk_nope_head_dim",), m["nope"]),
                 rope=g(("qk_rope_head_dim",), m["rope"]), v=g(("v_head_dim",), m["v"]),
                 idx_heads=g(("index_n_heads",), m["idx_heads"]), idx_dim=g(("index_head_dim",), m["idx_dim"]),
                 topk=g(("index_topk",), m["topk"]), rope_theta=float(g(("rope_theta",), m["rope_theta"])))
        s["mla_eps"] = g(("rms_norm_eps",), 1e-6)
        s["shape"] = "hybrid_dsa" if "D" in pat else "hybrid_mla"
        check(m["q_lora"], "hf-bench: hybrids need q_lora_rank (HF DeepseekV32Attention has no q_proj path)")
    else:
        s.update(n_head=g(("num_attention_heads",), 32), n_kv=g(("num_key_value_heads",), 8),
                 head_dim=g(("head_dim", "attention_head_dim"), 128))
        s["shape"] = "nemotron_h"
    return s


def load_direct(d, s, attn_impl):
    """Build the HF model (composition for D/+) and copy the safetensors shards into it on the GPU."""
    hf = import_hf()
    torch = hf["torch"]
    model, _ = build_model(s, attn_impl)
    params = dict(model.named_parameters())
    seen = set()
    files, _ = checkpoint_files(d)
    with torch.no_grad():
        for fn in files:
            part = hf["st"].load_file(os.path.join(d, fn), device="cuda")
            for name, t in part.items():
                key = "model." + name[len("backbone."):] if name.startswith("backbone.") else name
                check(key in params, f"{fn}: tensor {name} has no place in the HF model")
                p = params[key]
                check(tuple(t.shape) == tuple(p.shape), f"{fn}: {name} shape {list(t.shape)} != {list(p.shape)}")
                p.copy_(t)
                seen.add(key)
            del part
    missing = sorted(set(params) - seen)
    check(not missing, f"{d}: the checkpoint lacks {missing[:5]}")
    return model


def load_hf(d, attn_impl):
    hf = import_hf()
    torch = hf["torch"]
    model, info = hf["NHLM"].from_pretrained(d, dtype=torch.bfloat16, device_map="cuda", attn_implementation=attn_impl,
                                             local_files_only=True, output_loading_info=True)
    probs = []
    for key, val in (info or {}).items():
        if val:
            probs.append(f"{key}={sorted(map(str, val))[:4]}")
    check(not probs, f"HF from_pretrained: {'; '.join(probs)}")
    model.eval()
    return model


class Bench:
    def __init__(self, a, torch):
        self.a, self.torch = a, torch
        self.deadline = T0 + a.budget_s
        self.errors = []

    def left(self):
        return self.deadline - time.perf_counter()

    def save(self, doc):
        doc["wall_s"] = round(time.perf_counter() - T0, 2)
        write_json(self.a.out, doc)

    def timed(self, fn):
        """(result, ms) of one call, measured with CUDA events."""
        torch = self.torch
        e0, e1 = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        e0.record()
        r = fn()
        e1.record()
        e1.synchronize()
        return r, e0.elapsed_time(e1)


def free_gpu(torch):
    gc.collect()
    torch.cuda.empty_cache()


def bench_prefill(b, model, vocab, T, use_cache, est_s):
    """Prefill of one T-token prompt (logits of the last token only). Returns the result dict."""
    torch = b.torch
    if b.left() <= 0 or (est_s is not None and b.left() < 2.2 * est_s):
        return dict(tokens=T, skipped=f"time budget: one call estimated {est_s or 0:.1f}s, {b.left():.1f}s left")
    g = torch.Generator(device="cuda")
    g.manual_seed(1000 + T)
    ids = torch.randint(0, vocab, (1, T), generator=g, device="cuda")
    torch.cuda.reset_peak_memory_stats()

    def call():
        with torch.inference_mode():
            out = model(input_ids=ids, use_cache=use_cache, logits_to_keep=1)
            return out.logits[:, -1].argmax(-1)

    t = time.perf_counter()
    _, warm_ms = b.timed(call)  # warm-up (allocator growth, cuBLAS heuristics)
    warm_s = time.perf_counter() - t
    ms = []
    while len(ms) < b.a.repeats and b.left() > 1.2 * warm_s:
        ms.append(b.timed(call)[1])
    r = dict(tokens=T, batch=1, use_cache=use_cache, warmup_ms=round(warm_ms, 2),
             peak_mem_gb=round(torch.cuda.max_memory_allocated() / 1e9, 2))
    if ms:
        med = statistics.median(ms)
        r.update(ms=round(med, 2), tok_per_s=round(T / (med / 1e3), 1), repeats=len(ms),
                 ms_all=[round(x, 2) for x in ms])
    else:
        r.update(ms=round(warm_ms, 2), tok_per_s=round(T / (warm_ms / 1e3), 1), repeats=0,
                 note="time budget allowed the warm-up call only; figure is from the warm-up")
    return r


def bench_decode(b, model, vocab, B, est_s):
    """Decode ms/step at batch B: prompt of --prompt-len tokens with HF's cache, then timed greedy steps."""
    torch = b.torch
    a = b.a
    if b.left() <= 0 or (est_s is not None and b.left() < 2.2 * est_s):
        return dict(batch=B, skipped=f"time budget: one repeat estimated {est_s or 0:.1f}s, {b.left():.1f}s left")
    g = torch.Generator(device="cuda")
    g.manual_seed(2000 + B)
    torch.cuda.reset_peak_memory_stats()

    def one_repeat():
        ids = torch.randint(0, vocab, (B, a.prompt_len), generator=g, device="cuda")
        with torch.inference_mode():
            out = model(input_ids=ids, use_cache=True, logits_to_keep=1)
            cache = out.past_key_values
            check(cache is not None, "HF returned no cache (past_key_values) from the prompt pass")
            tok = out.logits[:, -1].argmax(-1, keepdim=True)
            for _ in range(a.warmup_steps):
                out = model(input_ids=tok, past_key_values=cache, use_cache=True, logits_to_keep=1)
                tok = out.logits[:, -1].argmax(-1, keepdim=True)
            ev = [torch.cuda.Event(enable_timing=True) for _ in range(a.steps + 1)]
            ev[0].record()
            for i in range(a.steps):
                out = model(input_ids=tok, past_key_values=cache, use_cache=True, logits_to_keep=1)
                tok = out.logits[:, -1].argmax(-1, keepdim=True)
                ev[i + 1].record()
            ev[-1].synchronize()
        steps = [ev[i].elapsed_time(ev[i + 1]) for i in range(a.steps)]
        n_pos = a.prompt_len + a.warmup_steps + a.steps
        check(cache.get_seq_length() == n_pos, f"HF cache holds {cache.get_seq_length()} positions, expected {n_pos}")
        return ev[0].elapsed_time(ev[-1]) / a.steps, steps

    t = time.perf_counter()
    one_repeat()  # warm-up repeat
    rep_s = time.perf_counter() - t
    means, all_steps = [], []
    while len(means) < a.decode_repeats and b.left() > 1.2 * rep_s:
        m, st = one_repeat()
        means.append(m)
        all_steps += st
    r = dict(batch=B, prompt_tokens=a.prompt_len, warmup_steps=a.warmup_steps, steps=a.steps,
             repeat_s=round(rep_s, 2), peak_mem_gb=round(torch.cuda.max_memory_allocated() / 1e9, 2))
    if means:
        med = statistics.median(means)
        r.update(ms_per_step=round(med, 3), tok_per_s=round(B * 1e3 / med, 1), repeats=len(means),
                 ms_per_step_repeats=[round(x, 3) for x in means],
                 ms_per_step_median_single=round(statistics.median(all_steps), 3),
                 ms_per_step_min=round(min(all_steps), 3), ms_per_step_max=round(max(all_steps), 3))
    else:
        r.update(skipped=f"time budget: the warm-up repeat took {rep_s:.1f}s, {b.left():.1f}s left")
    return r


def warm_up(model, vocab, cached, seconds, torch):
    """Keep the GPU and HF's Python paths busy for `seconds` (clocks up, kernels and allocator warm):
    greedy decode steps at batch 1 when HF has a cached path, else 256-token forward passes."""
    g = torch.Generator(device="cuda")
    g.manual_seed(7)
    n = 0
    t = time.perf_counter()
    with torch.inference_mode():
        ids = torch.randint(0, vocab, (1, 16 if cached else 256), generator=g, device="cuda")
        out = model(input_ids=ids, use_cache=cached, logits_to_keep=1)
        check(bool(torch.isfinite(out.logits).all()), "warm-up forward gave non-finite logits")
        cache = out.past_key_values if cached else None
        tok = out.logits[:, -1].argmax(-1, keepdim=True)
        while time.perf_counter() - t < seconds:
            if cached:
                out = model(input_ids=tok, past_key_values=cache, use_cache=True, logits_to_keep=1)
                tok = out.logits[:, -1].argmax(-1, keepdim=True)
            else:
                out = model(input_ids=ids, use_cache=False, logits_to_keep=1)
            n += 1
            if n % 8 == 0:
                torch.cuda.synchronize()
        torch.cuda.synchronize()
    del out, cache
    return n


def cmd_hf_bench(a):
    d = os.path.abspath(a.model)
    cfg_path = os.path.join(d, "config.json")
    check(os.path.exists(cfg_path), f"{d}: no config.json (write one with `{SCRIPT} make`)")
    with open(cfg_path) as f:
        cfgd = json.load(f)
    s = spec_from_config(cfgd)
    hf = import_hf()
    torch = hf["torch"]
    import importlib.util
    fast = {n: importlib.util.find_spec(n) is not None for n in ("mamba_ssm", "causal_conv1d", "flash_attn")}
    b = Bench(a, torch)
    a.out = os.path.abspath(a.out)
    os.makedirs(os.path.dirname(a.out), exist_ok=True)
    doc = dict(
        generator=f"{SCRIPT} hf-bench",
        model_dir=d, shape=s["shape"], pattern=s["pattern"], n_layers=len(s["pattern"]),
        hidden_size=s["hidden"], vocab_size=s["vocab"], n_params=n_params(s),
        torch=torch.__version__, transformers=hf["transformers"].__version__, cuda=torch.version.cuda,
        gpu=torch.cuda.get_device_name(), gpu_count=torch.cuda.device_count(),
        dtype="bfloat16", attn_implementation=a.attn, fast_kernel_packages_present=fast,
        mamba_path="HF pure-PyTorch (torch_forward: chunked scan for prompts, recurrent step for decode)"
        if not (fast["mamba_ssm"] or fast["causal_conv1d"]) else "HF with mamba_ssm / causal_conv1d kernels",
        budget_s=a.budget_s, results={}, notes=[],
    )
    log(f"hf-bench {d}: {s['shape']} {len(s['pattern'])} layers, {n_params(s) / 1e9:.2f}e9 params; torch "
        f"{torch.__version__}, transformers {hf['transformers'].__version__}, {doc['gpu']}; budget {a.budget_s:.0f}s")

    t = time.perf_counter()
    hybrid = any(c in "D+" for c in s["pattern"])
    # HF's DynamicCache for nemotron_h takes the sequence length from a '*' layer: no '*' (a --layers
    # cut, or a hybrid), no cached path
    cached = "*" in s["pattern"] and not hybrid
    if hybrid:
        model = load_direct(d, s, a.attn)
        doc["loader"] = ("direct: NemotronH with HF DeepseekV32Attention ('D') / DeepseekV3Attention ('+') "
                         "mixers (eager attention), weights copied from the safetensors shards")
    else:
        try:
            model = load_hf(d, a.attn)
            doc["loader"] = "HF NemotronHForCausalLM.from_pretrained(dtype=bfloat16, device_map='cuda')"
        except Exception as e:  # noqa: BLE001
            msg = f"from_pretrained failed ({type(e).__name__}: {str(e)[:300]}); loaded directly instead"
            log("warning: " + msg)
            doc["notes"].append(msg)
            free_gpu(torch)
            model = load_direct(d, s, a.attn)
            doc["loader"] = "direct: HF NemotronHForCausalLM built from the config, weights copied from the shards"
    torch.cuda.synchronize()
    doc["load_s"] = round(time.perf_counter() - t, 2)
    doc["weights_gb_on_gpu"] = round(torch.cuda.memory_allocated() / 1e9, 2)
    log(f"loaded in {doc['load_s']:.1f}s ({doc['loader'].split(':')[0]}), {doc['weights_gb_on_gpu']:.2f} GB on the GPU")

    # warm-up (CUDA context, cuBLAS, allocator, GPU clocks); not counted in any figure
    t = time.perf_counter()
    n = warm_up(model, s["vocab"], cached, a.warmup_s, torch)
    doc["warmup_s"] = round(time.perf_counter() - t, 2)
    log(f"warm-up: {n} {'decode steps' if cached else 'forward passes'} in {doc['warmup_s']:.1f}s")
    free_gpu(torch)
    b.save(doc)

    plan = []
    for B in a.batches:
        plan.append(("decode", B))
    for T in a.prefill:
        plan.append(("prefill", T))
    # cheap first: decode b=1, smallest prefill, then the rest (each estimate comes from the figure before)
    order = {("decode", min(a.batches)): 0, ("prefill", min(a.prefill)): 1}
    plan.sort(key=lambda x: (order.get(x, 2), x[1]))
    if hybrid:
        doc["notes"].append("decode not measured: HF has no cached decode path for DSA/MLA mixers inside nemotron_h "
                            "(the composed mixers recompute from position 0); prefill is a full forward without cache")
    elif not cached:
        doc["notes"].append("decode not measured: no '*' layer, and HF's nemotron_h cache needs one for positions")
    est = {}
    for kind, n in plan:
        name = f"{kind}_b{n}" if kind == "decode" else f"prefill_{n}"
        if kind == "decode" and not cached:
            doc["results"][name] = dict(batch=n, skipped="no HF cached decode for this pattern (see notes)")
            log(f"hf {name}: skipped (no HF cached decode for this pattern)")
            continue
        try:
            if kind == "decode":
                prev = [v for (k2, n2), v in est.items() if k2 == "decode"]
                e = max(prev) * max(1.0, n / 8) if prev else None
                r = bench_decode(b, model, s["vocab"], n, e)
                if "repeat_s" in r:
                    est[(kind, n)] = r["repeat_s"]
            else:
                prev = [(n2, v) for (k2, n2), v in est.items() if k2 == "prefill"]
                e = max(v * (n / n2) ** 1.2 for n2, v in prev) if prev else None
                r = bench_prefill(b, model, s["vocab"], n, cached, e)
                if "warmup_ms" in r:
                    est[(kind, n)] = r["warmup_ms"] / 1e3
        except Exception as e:  # noqa: BLE001
            oom = isinstance(e, torch.cuda.OutOfMemoryError)
            r = dict(skipped=f"out of GPU memory: {str(e)[:200]}") if oom else dict(error=f"{type(e).__name__}: {str(e)[:400]}")
            if not oom:
                b.errors.append(name)
        free_gpu(torch)
        doc["results"][name] = r
        if "skipped" in r or "error" in r:
            log(f"hf {name}: {'skipped' if 'skipped' in r else 'ERROR'}: {r.get('skipped') or r.get('error')}")
        elif kind == "decode":
            log(f"hf decode batch {n}: {r['ms_per_step']:.2f} ms/step ({r['tok_per_s']:.1f} tok/s), median of "
                f"{r['repeats']} repeats x {r['steps']} steps after a {r['prompt_tokens']}-token prompt; "
                f"peak {r['peak_mem_gb']:.1f} GB")
        else:
            log(f"hf prefill {n} tokens: {r['tok_per_s']:.0f} tok/s ({r['ms']:.1f} ms), median of {r['repeats']}"
                f"{' (warm-up only)' if r['repeats'] == 0 else ''}; peak {r['peak_mem_gb']:.1f} GB")
        b.save(doc)
    if b.left() < 0:
        doc["notes"].append(f"ran {-b.left():.1f}s past the budget")
    b.save(doc)
    log(f"wrote {a.out} [{time.perf_counter() - T0:.1f}s]")
    if b.errors:
        log(f"FAILED measurements: {b.errors}")
        return 1
    return 0


# --------------------------------------------------------------------------------------------------


def int_list(x):
    try:
        v = [int(t) for t in x.split(",") if t.strip()]
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected comma-separated integers, got {x!r}")
    if not v or min(v) < 1:
        raise argparse.ArgumentTypeError(f"expected positive integers, got {x!r}")
    return v


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = ap.add_subparsers(dest="cmd", required=True)
    m = sub.add_parser("make", help="write a synthetic checkpoint")
    m.add_argument("--shape", required=True, choices=sorted(SHAPES))
    m.add_argument("--out", required=True, help="output directory")
    m.add_argument("--layers", type=int, default=None, help="keep only the first N letters of the pattern")
    m.add_argument("--seed", type=int, default=1234)
    m.add_argument("--max-pos", type=int, default=16384, help="max_position_embeddings (default 16384)")
    m.add_argument("--max-shard-size", default="5GB")
    m.add_argument("--check-tokens", type=int, default=64,
                   help="tokens of the sanity forward pass before saving (0: skip it)")
    m.add_argument("--skip-existing", action="store_true",
                   help="do nothing when OUT already holds a checkpoint of this shape that verifies")
    h = sub.add_parser("hf-bench", help="time HF transformers on a checkpoint written by make")
    h.add_argument("--model", required=True)
    h.add_argument("--out", required=True, help="results JSON")
    h.add_argument("--budget-s", type=float, default=150.0, help="wall-time budget of the whole subcommand")
    h.add_argument("--batches", type=int_list, default=[1, 16], help="decode batch sizes (default 1,16)")
    h.add_argument("--prefill", type=int_list, default=[2048, 8192], help="prefill lengths (default 2048,8192)")
    h.add_argument("--prompt-len", type=int, default=16, help="prompt tokens before the decode steps")
    h.add_argument("--steps", type=int, default=16, help="timed decode steps per repeat")
    h.add_argument("--warmup-steps", type=int, default=3)
    h.add_argument("--repeats", type=int, default=3, help="timed prefill calls (median reported)")
    h.add_argument("--decode-repeats", type=int, default=5, help="timed decode repeats (median reported)")
    h.add_argument("--warmup-s", type=float, default=3.0, help="seconds of warm-up before the first figure")
    h.add_argument("--attn", default="sdpa", choices=["sdpa", "eager"], help="HF attention for '*' layers")
    a = ap.parse_args()
    try:
        rc = cmd_make(a) if a.cmd == "make" else cmd_hf_bench(a)
    except Fail as e:
        print(f"{SCRIPT} {a.cmd}: ERROR: {e}", file=sys.stderr, flush=True)
        rc = 1
    except Exception as e:  # noqa: BLE001
        import traceback
        traceback.print_exc()
        print(f"{SCRIPT} {a.cmd}: ERROR: {type(e).__name__}: {e}", file=sys.stderr, flush=True)
        rc = 1
    sys.exit(rc)


if __name__ == "__main__":
    main()
