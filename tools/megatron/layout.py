"""The Megatron HybridModel <-> krait name and layout mapping, both ways.

"Canonical" below means a Megatron state dict as one TP=1, PP=1 rank would hold it, with global
layer indices, whole fused tensors (`mixer.in_proj.weight` rows [z, x, B, C, dt], `mixer.conv1d.weight`
channels [x, B, C], SwiGLU `linear_fc1.weight` rows [gate; up]) and routed experts stacked as
`decoder.layers.N.mlp.experts.linear_fc{1,2}.weight` [E, out, in]. Both on-disk formats are read into
it (convert.py) and written from it (export.py).

"krait names" are the HF nemotron_h names krait's loader reads (model/loader.c), with D and +
mixers under the deepseek_v32 attention names (MODEL_SPEC.md section 6).

Sources (NVIDIA/Megatron-LM @ d98e8a6 unless noted):
  pattern symbols           megatron/core/models/hybrid/hybrid_layer_allocation.py (Symbols)
  Mamba in_proj/conv split  megatron/core/ssm/mamba_mixer.py (sharded_state_dict), megatron/core/ssm/utils.py
  conv1d_weight spelling    megatron/core/ssm/mamba_mixer.py (conv_checkpoint_key_map)
  SwiGLU fc1 [gate; up]     megatron/core/transformer/mlp.py (apply_swiglu_sharded_factory)
  experts (leading E axis)  megatron/core/transformer/moe/experts.py (sharded_state_dict)
  linear_qkv per KV group   Megatron-Bridge src/megatron/bridge/models/conversion/param_mapping.py (QKVMapping)
  TP split dims (legacy)    tools/checkpoint/hybrid_conversion.py (get_split_dim)
  MLA / DSA names           megatron/core/transformer/multi_latent_attention.py,
                            megatron/core/transformer/experimental_attention_variant/dsa.py,
                            Megatron-Bridge src/megatron/bridge/models/glm_moe_dsa/glm5_bridge.py
  nemotron_h names          Megatron-Bridge src/megatron/bridge/models/nemotronh/nemotron_h_bridge.py
  DSA switches              megatron/core/transformer/transformer_config.py (dsa_indexer_*)
"""

import math
import re

from common import Refusal, log

LAYER_SYMBOLS = "M*-ED+"
# symbols Megatron (or its open PRs) defines that krait has no layer for
UNSUPPORTED_SYMBOLS = {
    "G": "GatedDeltaNet layer",
    "W": "DeepSeek-V4 layer (Megatron-Bridge#5860)",
    "C": "DeepSeek-V4 layer (Megatron-Bridge#5860)",
    "H": "DeepSeek-V4 layer (Megatron-Bridge#5860)",
}


def parse_pattern(s, where="hybrid_layer_pattern"):
    """Returns (layers, stage lengths, mtp patterns). '|' separates pipeline stages (not a layer), '/'
    separates multi-token-prediction patterns from the main one."""
    main, *mtp = s.split("/")
    for i, c in enumerate(main):
        if c == "|" or c in LAYER_SYMBOLS:
            continue
        what = UNSUPPORTED_SYMBOLS.get(c, "unknown layer symbol")
        raise Refusal("%s %r: symbol '%s' at %d (%s) is not supported; krait takes M * - E D +"
                      % (where, s, c, i, what))
    layers = main.replace("|", "")
    if not layers:
        raise Refusal("%s %r has no layers" % (where, s))
    if "*" in layers and ("D" in layers or "+" in layers):
        raise Refusal("%s %r mixes '*' with MLA/DSA layers, which Megatron and krait both refuse" % (where, s))
    return layers, [len(x) for x in main.split("|")], mtp


class Args:
    """Megatron's saved argparse.Namespace; absent and None fields read as the default."""

    def __init__(self, ns):
        self.ns = ns

    def __call__(self, name, default=None):
        v = getattr(self.ns, name, None)
        return default if v is None else v


def yarn_mscale(s, a):
    return 1.0 if s <= 1 else 0.1 * a * math.log(s) + 1.0


# ---- model description from args ----------------------------------------------------------

def model_info(ns, pattern=None):
    """Everything the mapping needs, from Megatron's args, with the refusals for what krait cannot
    run. `pattern` overrides the args' pattern."""
    a = Args(ns)
    pat = pattern or a("hybrid_layer_pattern") or a("hybrid_override_pattern")
    if not pat:
        raise Refusal("the checkpoint's args have no hybrid_layer_pattern (nor hybrid_override_pattern): not a "
                      "HybridModel checkpoint, or one built from ratios; pass --pattern")
    layers, stages, mtp = parse_pattern(pat)
    if a("mtp_num_layers", 0) and not mtp:
        mtp = ["?"] * a("mtp_num_layers")
    if a("mtp_hybrid_override_pattern") and not mtp:
        mtp = [a("mtp_hybrid_override_pattern")] * max(1, a("mtp_num_layers", 1))
    hidden = a("hidden_size")
    if not hidden:
        raise Refusal("the checkpoint's args have no hidden_size")
    i = {"pattern": layers, "stages": stages, "mtp": mtp, "hidden": hidden,
         "tp": a("tensor_model_parallel_size", 1), "pp": a("pipeline_model_parallel_size", 1),
         "ep": a("expert_model_parallel_size", 1)}
    i["etp"] = a("expert_tensor_parallel_size", i["tp"])
    i["eps"] = float(a("layernorm_epsilon", 1e-5))
    i["tie"] = not a("untie_embeddings_and_output_weights", False)
    i["padded_vocab"] = a("padded_vocab_size")
    i["max_pos"] = a("max_position_embeddings") or a("seq_length") or 4096

    if a("normalization", "LayerNorm") != "RMSNorm":
        raise Refusal("normalization=%s: krait's layers use RMSNorm (--normalization RMSNorm)" % a("normalization"))
    for flag, why in (("apply_layernorm_1p", "a (1 + w) norm weight"),
                      ("layernorm_zero_centered_gamma", "a (1 + w) norm weight"),
                      ("add_bias_linear", "linear biases"), ("add_qkv_bias", "QKV biases"),
                      ("openai_gelu", "the tanh GeLU"), ("quick_geglu", "quick GeGLU"),
                      ("moe_shared_expert_gate", "a gated shared expert")):
        if a(flag, False):
            raise Refusal("--%s (%s) is not supported by krait" % (flag.replace("_", "-"), why))
    if a("activation_func_clamp_value") or a("glu_linear_offset", 0.0):
        raise Refusal("--activation-func-clamp-value / --glu-linear-offset are not supported by krait")
    i["gated"] = bool(a("swiglu", False))
    i["act"] = "silu" if i["gated"] else "relu2" if a("squared_relu", False) else "gelu"

    if "M" in layers:
        hd = a("mamba_head_dim", 64)
        d_inner = a("mamba_num_heads") * hd if a("mamba_num_heads") else 2 * hidden
        i.update(m_heads=d_inner // hd, m_head_dim=hd, m_groups=a("mamba_num_groups", 8),
                 m_state=a("mamba_state_dim", 128), m_chunk=a("mamba_chunk_size", 128), m_d_inner=d_inner)
        if i["eps"] != 1e-5:
            log("note: Megatron's Mamba gated norm uses eps 1e-5 (mamba_mixer.py) and krait uses "
                "layer_norm_epsilon=%g for it: logits differ slightly" % i["eps"])
    if "*" in layers:
        heads = a("num_attention_heads")
        groups = a("num_query_groups") if a("group_query_attention", False) else heads
        i.update(heads=heads, kv_heads=groups or heads, head_dim=a("kv_channels") or hidden // heads)
        if a("position_embedding_type", "none") not in ("none",):
            raise Refusal("position_embedding_type=%s: krait's '*' layers have no position embedding "
                          "(Nemotron-H style, --position-embedding-type none)" % a("position_embedding_type"))
        if a("qk_layernorm", False):
            raise Refusal("--qk-layernorm on '*' layers is not supported by krait")
    if "-" in layers:
        i["ffn"] = a("ffn_hidden_size") or 4 * hidden
    if "E" in layers:
        score = a("moe_router_score_function", "softmax")
        topk = a("moe_router_topk", 2)
        groups, gtopk = a("moe_router_num_groups", 1), a("moe_router_group_topk", 1)
        if score not in ("sigmoid", "softmax"):
            raise Refusal("moe_router_score_function=%s: krait routes with sigmoid or softmax" % score)
        if groups > 1 and topk // gtopk != 2:
            raise Refusal("moe_router_topk=%d with moe_router_group_topk=%d scores a group by its top %d experts; "
                          "krait scores groups by their top 2 (DeepSeek-V3)" % (topk, gtopk, topk // gtopk))
        if a("moe_router_pre_softmax", False) and score == "sigmoid":
            raise Refusal("--moe-router-pre-softmax with sigmoid scores is not supported")
        i.update(experts=a("num_experts"), topk=topk, moe_ffn=a("moe_ffn_hidden_size") or a("ffn_hidden_size"),
                 shared_ffn=a("moe_shared_expert_intermediate_size", 0), n_group=groups, topk_group=gtopk,
                 route_scale=float(a("moe_router_topk_scaling_factor", 1.0)), score=score,
                 # sigmoid: normalized when topk > 1 (router.py); softmax over the top-k logits = renormalized
                 norm_topk=(topk > 1) if score == "sigmoid" else not a("moe_router_pre_softmax", False),
                 latent=a("moe_latent_size", 0))
        if not i["experts"]:
            raise Refusal("the pattern has 'E' layers but args.num_experts is not set")
    if "D" in layers or "+" in layers:
        i.update(mla_heads=a("num_attention_heads"), q_lora=a("q_lora_rank", 0), kv_lora=a("kv_lora_rank", 512),
                 qk_nope=a("qk_head_dim", 128), qk_rope=a("qk_pos_emb_head_dim", 64), v_head=a("v_head_dim", 128))
        rope = a("rope_type", "yarn" if a("multi_latent_attention", False) else "rope")
        factor = float(a("rotary_scaling_factor", 1.0))
        if a("rotary_percent", 1.0) != 1.0:
            raise Refusal("rotary_percent=%g: krait rotates all qk_pos_emb_head_dim dims" % a("rotary_percent"))
        if a("use_rope_scaling", False):
            raise Refusal("--use-rope-scaling (Llama-3 rope scaling) is not supported for MLA")
        i["rope_theta"] = float(a("rotary_base", 10000))
        if rope == "yarn":
            mscale, mscale_all = float(a("mscale", 1.0)), float(a("mscale_all_dim", 0.0))
            rs = {"type": "yarn", "factor": factor,
                  "original_max_position_embeddings": a("original_max_position_embeddings", 4096),
                  "beta_fast": a("beta_fast", 32), "beta_slow": a("beta_slow", 1),
                  "mscale": mscale, "mscale_all_dim": mscale_all}
            # Megatron's cos/sin factor is m(s, mscale) / m(s, mscale_all_dim) (yarn_rotary_pos_embedding.py);
            # krait's default agrees except when only mscale_all_dim is 0: say it explicitly then
            if mscale_all == 0 and mscale != 1.0:
                rs["attention_factor"] = yarn_mscale(factor, mscale) / yarn_mscale(factor, mscale_all)
            i["rope_scaling"] = rs
        elif rope == "rope":
            if yarn_mscale(factor, float(a("mscale_all_dim", 0.0))) != 1.0:
                raise Refusal("rope_type rope with rotary_scaling_factor=%g and mscale_all_dim=%g scales the MLA "
                              "softmax, which krait applies only with YaRN" % (factor, a("mscale_all_dim")))
            i["rope_scaling"] = None
        else:
            raise Refusal("rope_type=%s is not supported for MLA (rope or yarn)" % rope)
    if "D" in layers:
        i.update(idx_heads=a("dsa_indexer_n_heads"), idx_head_dim=a("dsa_indexer_head_dim"),
                 idx_topk=a("dsa_indexer_topk"), idx_eps=float(a("dsa_indexer_k_norm_epsilon", i["eps"])))
        if not (i["idx_heads"] and i["idx_head_dim"] and i["idx_topk"]):
            raise Refusal("the pattern has 'D' layers but dsa_indexer_n_heads/head_dim/topk are not all set")
        # Megatron-LM#5246's switches (dsa.py): shared top-k selections and the ReLU-less score become
        # krait's index_topk_freq / index_skip_topk_offset / index_scoring_relu; the Hadamard rotation of
        # the indexer's q and k is orthonormal (the scores are the same in exact arithmetic: krait's bf16 and
        # fp32 indexers do not rotate, its FP8 one always does), and krait computes the key norm in fp32
        # whatever dsa_indexer_k_norm_fp32 says, so those two need no key
        freq, off = a("dsa_indexer_topk_freq", 1) or 1, a("dsa_indexer_skip_topk_offset", 0) or 0
        if freq < 1 or off < 0:
            raise Refusal("dsa_indexer_topk_freq=%d / dsa_indexer_skip_topk_offset=%d: out of range" % (freq, off))
        i.update(idx_topk_freq=freq, idx_skip_offset=off, idx_relu=bool(a("dsa_indexer_scoring_relu", True)))
        if a("dsa_indexer_rope_interleaved", False):
            raise Refusal("dsa_indexer_rope_interleaved=true: krait's indexer RoPE is half-split "
                          "(--dsa-indexer-rope-interleaved)")
    return i


# ---- TP shard kinds -----------------------------------------------------------------------------

def tp_kind(key, info):
    """How tensor-parallel ranks hold `key` (a canonical or legacy per-rank name): ('dup',) every rank
    a copy, ('cat', d) split along d, ('in_proj',), ('conv',), ('glu',) SwiGLU fc1 [gate_r; up_r] per
    rank, ('auto',) duplicated or split on rows depending on the module class (MLA down projections:
    TELinear duplicated or ColumnParallel). None: unknown."""
    expert = ".mlp.experts." in key
    if expert and info.get("etp", info.get("tp", 1)) == 1:
        return ("dup",)
    rules = [
        (r"^mtp\.", ("dup",)),  # dropped by the converter: any rank's copy will do
        (r"\.layer_norm_(weight|bias)$", ("dup",)),
        (r"(input_layernorm|pre_mlp_layernorm|final_norm|final_layernorm|q_layernorm|kv_layernorm|k_layernorm)"
         r"\.(weight|bias)$", ("dup",)),
        (r"^decoder\.layers\.\d+\.norm\.weight$", ("dup",)),
        (r"\.mixer\.in_proj\.weight$", ("in_proj",)),
        (r"\.mixer\.conv1d(\.|_)(weight|bias)$", ("conv",)),
        (r"\.mixer\.(A_log|D|dt_bias)$", ("cat", 0)),
        (r"\.mixer\.norm\.weight$", ("cat", 0)),
        (r"\.mixer\.out_proj\.weight$", ("cat", 1)),
        (r"\.self_attention\.linear_qkv\.weight$", ("cat", 0)),
        (r"\.self_attention\.linear_proj\.weight$", ("cat", 1)),
        (r"\.linear_(q|kv)_down_proj\.weight$", ("auto",)),
        (r"\.linear_(q_up|kv_up|q|k_up|v_up)_proj\.weight$", ("cat", 0)),
        (r"\.indexer\.", ("dup",)),
        (r"\.mlp\.router\.(weight|expert_bias)$", ("dup",)),
        (r"\.(fc1|fc2)_latent_proj\.weight$", ("auto",)),
        (r"linear_fc1\.weight\d*$", ("glu",) if info.get("gated") else ("cat", 0)),
        (r"linear_fc2\.weight\d*$", ("cat", 1)),
        (r"^embedding\.word_embeddings\.weight$", ("cat", 0)),
        (r"^output_layer\.weight$", ("cat", 0)),
    ]
    for rx, kind in rules:
        if re.search(rx, key):
            return kind
    return None


def _mamba_sections(info, tp, conv):
    d, g, h = info["m_d_inner"] // tp, info["m_groups"] * info["m_state"] // tp, info["m_heads"] // tp
    return [d, g, g] if conv else [d, d, g, g, h]


def tp_merge(key, shards, info):
    """One tensor from its TP shards (rank order)."""
    torch = __import__("torch")
    tp = len(shards)
    if tp == 1:
        return shards[0]
    kind = tp_kind(key, info)
    if kind is None:
        raise Refusal("tensor %s: unknown how tensor-parallel ranks split it (TP=%d); not a HybridModel tensor "
                      "this converter knows" % (key, tp))
    if kind[0] == "dup":
        return shards[0]
    if kind[0] == "auto":
        if all(s.shape == shards[0].shape and torch.equal(s, shards[0]) for s in shards[1:]):
            return shards[0]
        return torch.cat(shards, 0)
    if kind[0] == "cat":
        return torch.cat(shards, kind[1])
    if kind[0] in ("in_proj", "conv"):
        secs = _mamba_sections(info, tp, kind[0] == "conv")
        for s in shards:
            if s.shape[0] != sum(secs):
                raise Refusal("tensor %s: a TP shard has %d rows, expected %d (mamba_num_heads %d, mamba_num_groups %d,"
                              " mamba_state_dim %d over TP=%d)" % (key, s.shape[0], sum(secs), info["m_heads"],
                                                                   info["m_groups"], info["m_state"], tp))
        parts = [torch.split(s, secs, 0) for s in shards]
        return torch.cat([torch.cat([p[c] for p in parts], 0) for c in range(len(secs))], 0)
    if kind[0] == "glu":
        halves = [torch.chunk(s, 2, 0) for s in shards]
        return torch.cat([torch.cat([h[0] for h in halves], 0), torch.cat([h[1] for h in halves], 0)], 0)
    raise AssertionError(kind)


def tp_split(key, t, tp, info):
    """The inverse of tp_merge: TP shards of a canonical tensor (duplicated kinds: copies)."""
    torch = __import__("torch")
    if tp == 1:
        return [t]
    kind = tp_kind(key, info)
    if kind is None:
        raise Refusal("tensor %s: no TP split rule" % key)
    if kind[0] in ("dup", "auto"):
        return [t] * tp
    if kind[0] == "cat":
        if t.shape[kind[1]] % tp:
            raise Refusal("tensor %s %s: dim %d does not divide by TP=%d" % (key, tuple(t.shape), kind[1], tp))
        return list(torch.chunk(t, tp, kind[1]))
    if kind[0] in ("in_proj", "conv"):
        secs = _mamba_sections(info, 1, kind[0] == "conv")
        comps = [torch.chunk(c, tp, 0) for c in torch.split(t, secs, 0)]
        return [torch.cat([c[r] for c in comps], 0) for r in range(tp)]
    if kind[0] == "glu":
        g, u = torch.chunk(t, 2, 0)
        gs, us = torch.chunk(g, tp, 0), torch.chunk(u, tp, 0)
        return [torch.cat([gs[r], us[r]], 0) for r in range(tp)]
    raise AssertionError(kind)


# ---- canonical <-> krait ---------------------------------------------------------------------

def qkv_split(w, info):
    """linear_qkv rows are per KV group [q heads of the group | k | v] (QKVMapping)."""
    nq, nkv, hd = info["heads"], info["kv_heads"], info["head_dim"]
    qpg = nq // nkv
    v = w.reshape(nkv, (qpg + 2) * hd, -1)
    q = v[:, :qpg * hd].reshape(nq * hd, -1)
    k = v[:, qpg * hd:(qpg + 1) * hd].reshape(nkv * hd, -1)
    vv = v[:, (qpg + 1) * hd:].reshape(nkv * hd, -1)
    return q.contiguous(), k.contiguous(), vv.contiguous()


def qkv_join(q, k, v, info):
    torch = __import__("torch")
    nq, nkv, hd = info["heads"], info["kv_heads"], info["head_dim"]
    qpg = nq // nkv
    cols = q.shape[-1]
    return torch.cat([q.reshape(nkv, qpg * hd, cols), k.reshape(nkv, hd, cols), v.reshape(nkv, hd, cols)],
                     1).reshape(-1, cols).contiguous()


def topk_source(info, i):
    """The 0-based layer whose DSA top-k layer i attends with (Megatron's source_dsa_compute_layer, dsa.py)."""
    freq, off, ln = info.get("idx_topk_freq", 1), max(info.get("idx_skip_offset", 0), 1), i + 1
    if freq <= 1 or ln <= off:
        return i
    return ln - (ln - off) % freq - 1


MLA_NAMES = [  # (Megatron name under self_attention., krait name under mixer.)
    ("linear_q_down_proj.weight", "q_a_proj.weight"),
    ("linear_q_up_proj.weight", "q_b_proj.weight"),
    ("linear_q_proj.weight", "q_proj.weight"),
    ("linear_kv_down_proj.weight", "kv_a_proj_with_mqa.weight"),
    ("linear_kv_up_proj.weight", "kv_b_proj.weight"),
    ("linear_proj.weight", "o_proj.weight"),
    ("core_attention.indexer.linear_wq_b.weight", "indexer.wq_b.weight"),
    ("core_attention.indexer.linear_wk.weight", "indexer.wk.weight"),
    ("core_attention.indexer.k_norm.weight", "indexer.k_norm.weight"),
    ("core_attention.indexer.k_norm.bias", "indexer.k_norm.bias"),
    ("core_attention.indexer.linear_weights_proj.weight", "indexer.weights_proj.weight"),
]
# latent norms: standalone (DSA with qk_layernorm, mla_qk_norm_config.py) or fused into the up projection
Q_NORMS = ["q_layernorm.weight", "linear_q_up_proj.layer_norm_weight"]
KV_NORMS = ["kv_layernorm.weight", "linear_kv_up_proj.layer_norm_weight"]


def to_krait(sd, info, vocab):
    """Canonical Megatron tensors -> krait names. Consumes sd; anything left that is not MTP is an
    error (never dropped silently)."""
    torch = __import__("torch")
    out = {}

    def take(*names, optional=False):
        for n in names:
            if n in sd:
                return sd.pop(n)
        if optional:
            return None
        raise Refusal("missing tensor %s%s" % (names[0], " (or %s)" % ", ".join(names[1:]) if names[1:] else ""))

    emb = take("embedding.word_embeddings.weight")
    out["backbone.embeddings.weight"] = emb[:vocab].contiguous()
    out["backbone.norm_f.weight"] = take("decoder.final_norm.weight", "decoder.final_layernorm.weight")
    if info["tie"]:
        take("output_layer.weight", optional=True)  # the last PP stage's copy of the embedding
    else:
        out["lm_head.weight"] = take("output_layer.weight")[:vocab].contiguous()

    for i, sym in enumerate(info["pattern"]):
        p, o = "decoder.layers.%d." % i, "backbone.layers.%d." % i
        if sym == "M":
            out[o + "norm.weight"] = take(p + "mixer.in_proj.layer_norm_weight", p + "norm.weight")
            for n in ("in_proj.weight", "A_log", "D", "dt_bias", "norm.weight", "out_proj.weight"):
                out[o + "mixer." + n] = take(p + "mixer." + n)
            out[o + "mixer.conv1d.weight"] = take(p + "mixer.conv1d.weight", p + "mixer.conv1d_weight")
            b = take(p + "mixer.conv1d.bias", p + "mixer.conv1d_bias", optional=True)
            if b is not None:
                out[o + "mixer.conv1d.bias"] = b
            if out[o + "mixer.D"].dim() != 1 or out[o + "mixer.D"].shape[0] != info["m_heads"]:
                raise Refusal("layer %d: mixer.D has shape %s: D per channel (D_has_hdim) is not supported"
                              % (i, tuple(out[o + "mixer.D"].shape)))
        elif sym == "*":
            out[o + "norm.weight"] = take(p + "self_attention.linear_qkv.layer_norm_weight", p + "input_layernorm.weight")
            q, k, v = qkv_split(take(p + "self_attention.linear_qkv.weight"), info)
            out[o + "mixer.q_proj.weight"], out[o + "mixer.k_proj.weight"], out[o + "mixer.v_proj.weight"] = q, k, v
            out[o + "mixer.o_proj.weight"] = take(p + "self_attention.linear_proj.weight")
        elif sym == "-":
            out[o + "norm.weight"] = take(p + "mlp.linear_fc1.layer_norm_weight", p + "pre_mlp_layernorm.weight")
            _mlp_to_krait(out, o + "mixer.", take(p + "mlp.linear_fc1.weight"), take(p + "mlp.linear_fc2.weight"),
                          info["gated"])
        elif sym == "E":
            out[o + "norm.weight"] = take(p + "pre_mlp_layernorm.weight")
            out[o + "mixer.gate.weight"] = take(p + "mlp.router.weight")
            eb = take(p + "mlp.router.expert_bias", optional=True)
            if eb is not None:
                out[o + "mixer.gate.e_score_correction_bias"] = eb
            fc1, fc2 = take(p + "mlp.experts.linear_fc1.weight"), take(p + "mlp.experts.linear_fc2.weight")
            if fc1.shape[0] != info["experts"]:
                raise Refusal("layer %d: %d routed experts found, args.num_experts is %d" % (i, fc1.shape[0], info["experts"]))
            for e in range(fc1.shape[0]):
                _mlp_to_krait(out, o + "mixer.experts.%d." % e, fc1[e], fc2[e], info["gated"])
            s1 = take(p + "mlp.shared_experts.linear_fc1.weight", optional=True)
            if s1 is not None:
                _mlp_to_krait(out, o + "mixer.shared_experts.", s1, take(p + "mlp.shared_experts.linear_fc2.weight"),
                              info["gated"])
            for n in ("fc1_latent_proj.weight", "fc2_latent_proj.weight"):
                t = take(p + "mlp." + n, optional=True)
                if t is not None:
                    out[o + "mixer." + n] = t
        else:  # D, +
            out[o + "norm.weight"] = take(p + "input_layernorm.weight")
            a = p + "self_attention."
            if a + "linear_kv_up_proj.weight" not in sd and a + "linear_k_up_proj.weight" in sd:
                # split up projections (older checkpoints; absorbed_mla.py recombines them the same way)
                H, Dn, Dv = info["mla_heads"], info["qk_nope"], info["v_head"]
                k, v = sd.pop(a + "linear_k_up_proj.weight"), sd.pop(a + "linear_v_up_proj.weight")
                R = k.shape[-1]
                sd[a + "linear_kv_up_proj.weight"] = torch.cat([k.reshape(H, Dn, R), v.reshape(H, Dv, R)],
                                                               1).reshape(-1, R).contiguous()
            # a D layer that reuses an earlier layer's top-k builds no indexer (dsa.py is_dsa_skip_topk_layer;
            # layer numbers 1-based over the stack): Megatron saved none, krait loads none
            indexed = sym == "D" and topk_source(info, i) == i
            if sym == "D" and not indexed and any(k.startswith(a + "core_attention.indexer.") for k in sd):
                raise Refusal("layer %d holds indexer tensors, but dsa_indexer_topk_freq=%d and "
                              "dsa_indexer_skip_topk_offset=%d make it reuse the top-k of layer %d (Megatron builds "
                              "no indexer there): the args do not match the weights"
                              % (i, info["idx_topk_freq"], info["idx_skip_offset"], topk_source(info, i)))
            for mg, kr in MLA_NAMES:
                if kr.startswith("indexer.") and not indexed:
                    continue
                t = take(a + mg, optional=mg in ("linear_q_down_proj.weight", "linear_q_up_proj.weight",
                                                  "linear_q_proj.weight"))
                if t is not None:
                    out[o + "mixer." + kr] = t
            qn = take(*[a + n for n in Q_NORMS], optional=True)
            if qn is not None:
                out[o + "mixer.q_a_layernorm.weight"] = qn
            kvn = take(*[a + n for n in KV_NORMS], optional=True)
            if kvn is not None:
                out[o + "mixer.kv_a_layernorm.weight"] = kvn
            if (o + "mixer.q_proj.weight" in out) == (o + "mixer.q_a_proj.weight" in out):
                raise Refusal("layer %d: expected either linear_q_down_proj + linear_q_up_proj or linear_q_proj" % i)
    mtp = sorted(k for k in sd if k.startswith("mtp."))
    for k in mtp:
        sd.pop(k)
    left = sorted(sd)
    if left:
        raise Refusal("unexpected tensor %s (%d left over) for pattern %s" % (left[0], len(left), info["pattern"]))
    return out, len(mtp)


def _mlp_to_krait(out, o, fc1, fc2, gated):
    if gated:
        g, u = fc1.chunk(2, 0)
        out[o + "gate_proj.weight"], out[o + "up_proj.weight"] = g.contiguous(), u.contiguous()
    else:
        out[o + "up_proj.weight"] = fc1.contiguous()
    out[o + "down_proj.weight"] = fc2.contiguous()


# ---- HF / krait checkpoints (export side and tests) -----------------------------------------

HF_LIST_NAMES = {"mamba": "M", "linear_attention": "M", "attention": "*", "full_attention": "*", "mlp": "-",
                 "moe": "E", "dsa": "D", "deepseek_sparse_attention": "D", "indexed_attention": "D", "mla": "+"}


def hf_pattern(cfg):
    """krait's layer string for an HF config (model/config.c: parse_layers, parse_ds_layers)."""
    if cfg["model_type"] == "deepseek_v32":
        n, k, f = cfg["num_hidden_layers"], cfg.get("first_k_dense_replace", 0), cfg.get("moe_layer_freq", 1)
        types = cfg.get("mlp_layer_types")
        s = ""
        for i in range(n):
            moe = (types[i] == "sparse") if types else (i >= k and i % f == 0)
            s += "D" + ("E" if moe else "-")
        return s
    if cfg.get("layers_block_type") or cfg.get("layer_types"):
        return "".join(HF_LIST_NAMES[x] for x in (cfg.get("layers_block_type") or cfg.get("layer_types")))
    return cfg["hybrid_override_pattern"].replace("|", "").replace("S", "D")


def krait_name(name, cfg):
    """An HF tensor name as the hybrid nemotron_h layout spells it (deepseek_v32 layer i -> 2i, 2i+1);
    None for multi-token-prediction tensors, which krait skips."""
    if cfg["model_type"] == "deepseek_v32":
        if name == "model.embed_tokens.weight":
            return "backbone.embeddings.weight"
        if name == "model.norm.weight":
            return "backbone.norm_f.weight"
        m = re.match(r"model\.layers\.(\d+)\.(.*)$", name)
        if m:
            i, rest = int(m.group(1)), m.group(2)
            if i >= cfg["num_hidden_layers"]:
                return None
            if rest == "input_layernorm.weight":
                return "backbone.layers.%d.norm.weight" % (2 * i)
            if rest == "post_attention_layernorm.weight":
                return "backbone.layers.%d.norm.weight" % (2 * i + 1)
            if rest.startswith("self_attn."):
                return "backbone.layers.%d.mixer.%s" % (2 * i, rest[len("self_attn."):])
            if rest.startswith("mlp."):
                return "backbone.layers.%d.mixer.%s" % (2 * i + 1, rest[len("mlp."):])
        return name
    if name.startswith("mtp.") or ".mtp." in name:
        return None
    if name.startswith("model."):
        name = "backbone." + name[len("model."):]
    if name == "backbone.embedding.weight":
        name = "backbone.embeddings.weight"
    return name


def hf_to_krait_tensors(tensors, cfg):
    """{krait name: tensor}; fused 3-D experts (transformers 5) split per expert."""
    out = {}
    for n, t in tensors.items():
        k = krait_name(n, cfg)
        if k is None:
            continue
        m = re.match(r"(.*\.mixer\.experts\.)(gate_up_proj|up_proj|down_proj)$", k)
        if m and t.dim() == 3:
            for e in range(t.shape[0]):
                if m.group(2) == "gate_up_proj":
                    g, u = t[e].chunk(2, 0)
                    out["%s%d.gate_proj.weight" % (m.group(1), e)] = g.contiguous()
                    out["%s%d.up_proj.weight" % (m.group(1), e)] = u.contiguous()
                else:
                    out["%s%d.%s.weight" % (m.group(1), e, m.group(2))] = t[e].contiguous()
            continue
        out[k] = t
    return out


def from_krait(kt, info):
    """krait-named tensors -> canonical Megatron tensors (the inverse of to_krait). The latent norms
    of D layers are written standalone (q_layernorm / kv_layernorm), those of + layers fused into the
    up projections, so that both spellings are exercised."""
    torch = __import__("torch")
    kt = dict(kt)
    sd = {}

    def take(n, optional=False):
        if n in kt:
            return kt.pop(n)
        if optional:
            return None
        raise Refusal("missing tensor %s" % n)

    sd["embedding.word_embeddings.weight"] = take("backbone.embeddings.weight")
    sd["decoder.final_norm.weight"] = take("backbone.norm_f.weight")
    lm = take("lm_head.weight", optional=True)
    if not info["tie"]:
        if lm is None:
            raise Refusal("missing lm_head.weight")
        sd["output_layer.weight"] = lm
    for i, sym in enumerate(info["pattern"]):
        p, o = "decoder.layers.%d." % i, "backbone.layers.%d." % i
        norm = take(o + "norm.weight")
        x = o + "mixer."
        if sym == "M":
            sd[p + "mixer.in_proj.layer_norm_weight"] = norm
            for n in ("in_proj.weight", "conv1d.weight", "A_log", "D", "dt_bias", "norm.weight", "out_proj.weight"):
                sd[p + "mixer." + n] = take(x + n)
            b = take(x + "conv1d.bias", optional=True)
            if b is not None:
                sd[p + "mixer.conv1d.bias"] = b
        elif sym == "*":
            sd[p + "self_attention.linear_qkv.layer_norm_weight"] = norm
            sd[p + "self_attention.linear_qkv.weight"] = qkv_join(take(x + "q_proj.weight"), take(x + "k_proj.weight"),
                                                                  take(x + "v_proj.weight"), info)
            sd[p + "self_attention.linear_proj.weight"] = take(x + "o_proj.weight")
        elif sym == "-":
            sd[p + "mlp.linear_fc1.layer_norm_weight"] = norm
            sd[p + "mlp.linear_fc1.weight"], sd[p + "mlp.linear_fc2.weight"] = _mlp_from_krait(take, x, info["gated"])
        elif sym == "E":
            sd[p + "pre_mlp_layernorm.weight"] = norm
            sd[p + "mlp.router.weight"] = take(x + "gate.weight")
            eb = take(x + "gate.e_score_correction_bias", optional=True)
            if eb is not None:
                sd[p + "mlp.router.expert_bias"] = eb
            f1, f2 = zip(*[_mlp_from_krait(take, x + "experts.%d." % e, info["gated"]) for e in range(info["experts"])])
            sd[p + "mlp.experts.linear_fc1.weight"] = torch.stack(f1)
            sd[p + "mlp.experts.linear_fc2.weight"] = torch.stack(f2)
            if x + "shared_experts.up_proj.weight" in kt:
                sd[p + "mlp.shared_experts.linear_fc1.weight"], sd[p + "mlp.shared_experts.linear_fc2.weight"] = \
                    _mlp_from_krait(take, x + "shared_experts.", info["gated"])
            for n in ("fc1_latent_proj.weight", "fc2_latent_proj.weight"):
                t = take(x + n, optional=True)
                if t is not None:
                    sd[p + "mlp." + n] = t
        else:
            sd[p + "input_layernorm.weight"] = norm
            a = p + "self_attention."
            for mg, kr in MLA_NAMES:
                t = take(x + kr, optional=True)
                if t is not None:
                    sd[a + mg] = t
            qn, kvn = take(x + "q_a_layernorm.weight", optional=True), take(x + "kv_a_layernorm.weight", optional=True)
            if qn is not None:
                sd[a + (Q_NORMS[0] if sym == "D" else Q_NORMS[1])] = qn
            if kvn is not None:
                sd[a + (KV_NORMS[0] if sym == "D" else KV_NORMS[1])] = kvn
    if kt:
        raise Refusal("tensor %s has no Megatron counterpart in this exporter" % sorted(kt)[0])
    return sd


def _mlp_from_krait(take, x, gated):
    torch = __import__("torch")
    g = take(x + "gate_proj.weight", optional=True)
    if (g is not None) != gated:
        raise Refusal("%s: gate_proj %s but the model is %sgated (Megatron's --swiglu covers MLPs and experts alike)"
                      % (x, "present" if g is not None else "absent", "" if gated else "not "))
    up = take(x + "up_proj.weight")
    fc1 = torch.cat([g, up], 0) if gated else up
    return fc1, take(x + "down_proj.weight")
