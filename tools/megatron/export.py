#!/usr/bin/env python3
"""Writes a krait/HF checkpoint directory (nemotron_h, deepseek_v32 or the hybrid layout) as a
Megatron-LM HybridModel checkpoint root, the mapping of convert.py read the other way. It exists
for the round-trip tests (tests/megatron/roundtrip.py); it does not make a checkpoint Megatron can
resume training from (no optimizer or RNG state).

  python3 tools/megatron/export.py MODEL_DIR OUT_ROOT --format torch_dist|legacy [--tp N] [--pp N] [--ep N]
          [--make-vocab-size-divisible-by N] [--set ARG=VALUE ...]

torch_dist: <root>/iter_%07d/{.metadata, __<rank>_0.distcp, common.pt, metadata.json} with every
tensor under its global shape and Megatron's split keys; at TP > 1 each tensor is stored as the
chunks TP ranks save. legacy: <root>/iter_%07d/mp_rank_TT[_PPP][_EEE]/model_optim_rng.pt with
per-rank shards and per-stage layer numbers."""

import argparse
import ast
import collections
import io
import json
import os
import re
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
sys.dont_write_bytecode = True  # no __pycache__ next to the sources

import dcp  # noqa: E402
import layout  # noqa: E402
from common import Refusal, log, need_torch, run_main, st_read_dir_torch  # noqa: E402


def megatron_args(cfg, pattern, o, dtype):
    """argparse.Namespace with Megatron's field names (megatron/training/arguments.py and
    TransformerConfig) for an HF config; refuses what Megatron cannot express."""
    ds = cfg["model_type"] == "deepseek_v32"
    eps = cfg.get("rms_norm_eps", 1e-6) if ds else cfg.get("layer_norm_epsilon", cfg.get("rms_norm_eps", 1e-5))
    gated = (cfg.get("mlp_hidden_act") or cfg.get("hidden_act") or "relu2") in ("silu", "swish")
    act = cfg.get("mlp_hidden_act") or cfg.get("hidden_act") or "relu2"
    a = dict(
        hybrid_layer_pattern=pattern, num_layers=len(pattern.replace("|", "")), hidden_size=cfg["hidden_size"],
        normalization="RMSNorm", layernorm_epsilon=eps, swiglu=gated, squared_relu=act == "relu2",
        untie_embeddings_and_output_weights=not cfg.get("tie_word_embeddings", False),
        position_embedding_type="none", max_position_embeddings=cfg.get("max_position_embeddings", 4096),
        seq_length=cfg.get("max_position_embeddings", 4096), add_bias_linear=False, add_qkv_bias=False,
        tensor_model_parallel_size=o.tp, pipeline_model_parallel_size=o.pp, expert_model_parallel_size=o.ep,
        expert_tensor_parallel_size=o.tp, make_vocab_size_divisible_by=o.make_vocab_size_divisible_by,
        bf16=dtype == "torch.bfloat16", fp16=dtype == "torch.float16", ckpt_format=o.format,
        mtp_num_layers=None, vocab_size=None)
    if not gated and act not in ("relu2", "gelu"):
        raise Refusal("activation %s has no Megatron switch" % act)
    if "M" in pattern:
        a.update(mamba_num_heads=cfg["mamba_num_heads"], mamba_head_dim=cfg["mamba_head_dim"],
                 mamba_state_dim=cfg.get("ssm_state_size", 128),
                 mamba_num_groups=cfg.get("n_groups", cfg.get("mamba_n_groups", 8)),
                 mamba_chunk_size=cfg.get("chunk_size", cfg.get("mamba_chunk_size", 128)))
    if "*" in pattern:
        h = cfg["num_attention_heads"]
        kv = cfg.get("num_key_value_heads", h)
        a.update(num_attention_heads=h, num_query_groups=kv, group_query_attention=kv != h,
                 kv_channels=cfg.get("head_dim") or cfg.get("attention_head_dim"))
    if "-" in pattern:
        a["ffn_hidden_size"] = cfg["intermediate_size"]
    if "E" in pattern:
        if not cfg.get("norm_topk_prob", True) and cfg["num_experts_per_tok"] > 1:
            raise Refusal("norm_topk_prob false: Megatron normalizes sigmoid top-k weights (router.py)")
        n_shared = cfg.get("n_shared_experts", 1)
        a.update(num_experts=cfg["n_routed_experts"], moe_router_topk=cfg["num_experts_per_tok"],
                 moe_ffn_hidden_size=cfg["moe_intermediate_size"],
                 moe_shared_expert_intermediate_size=(cfg.get("moe_shared_expert_intermediate_size")
                                                      or n_shared * cfg["moe_intermediate_size"]) if n_shared else None,
                 moe_router_score_function=cfg.get("scoring_func", "sigmoid"), moe_router_enable_expert_bias=True,
                 moe_router_num_groups=cfg.get("n_group", 1), moe_router_group_topk=cfg.get("topk_group", 1),
                 moe_router_topk_scaling_factor=cfg.get("routed_scaling_factor", 1.0), moe_router_pre_softmax=False,
                 moe_latent_size=cfg.get("moe_latent_size"))
    if "D" in pattern or "+" in pattern:
        rs = cfg.get("rope_scaling") or cfg.get("rope_parameters") or {}
        yarn = (rs.get("rope_type") or rs.get("type")) == "yarn"
        a.update(multi_latent_attention=True, num_attention_heads=cfg["num_attention_heads"],
                 q_lora_rank=cfg.get("q_lora_rank"), kv_lora_rank=cfg["kv_lora_rank"],
                 qk_head_dim=cfg["qk_nope_head_dim"], qk_pos_emb_head_dim=cfg["qk_rope_head_dim"],
                 v_head_dim=cfg["v_head_dim"], rotary_base=cfg.get("rope_theta", 10000.0), rotary_percent=1.0,
                 rope_type="yarn" if yarn else "rope", rotary_scaling_factor=rs.get("factor", 1.0) if yarn else 1.0,
                 original_max_position_embeddings=rs.get("original_max_position_embeddings"),
                 beta_fast=rs.get("beta_fast", 32), beta_slow=rs.get("beta_slow", 1),
                 mscale=rs.get("mscale", 1.0), mscale_all_dim=rs.get("mscale_all_dim", 0.0), qk_layernorm=True)
        latent_eps = cfg.get("rms_norm_eps", 1e-6)
        if latent_eps != eps:
            log("note: the q/kv latent norms use eps %g in %s, Megatron uses layernorm_epsilon=%g for every norm"
                % (latent_eps, o.model, eps))
    if "D" in pattern:
        a.update(experimental_attention_variant="dsa", dsa_indexer_n_heads=cfg["index_n_heads"],
                 dsa_indexer_head_dim=cfg["index_head_dim"], dsa_indexer_topk=cfg["index_topk"],
                 dsa_indexer_topk_freq=cfg.get("index_topk_freq", 1),
                 dsa_indexer_skip_topk_offset=cfg.get("index_skip_topk_offset", 0), dsa_indexer_rope_interleaved=False,
                 dsa_indexer_rotate_activation=True, dsa_indexer_scoring_relu=cfg.get("index_scoring_relu", True),
                 dsa_indexer_k_norm_epsilon=cfg.get("index_k_norm_eps", 1e-6), dsa_indexer_k_norm_fp32=False)
    return a


def staged_pattern(pattern, pp):
    """'|' between pipeline stages, as --hybrid-layer-pattern spells a PP split (earlier stages take
    the remainder)."""
    n = len(pattern)
    sizes = [n // pp + (s < n % pp) for s in range(pp)]
    out, i = [], 0
    for s in sizes:
        out.append(pattern[i:i + s])
        i += s
    return "|".join(out), sizes


def pad_vocab(t, rows, gen):
    """Megatron's padding rows (vocab_utils.py): present and trained in a real checkpoint, random here
    so that keeping them would show."""
    torch = need_torch()
    if t.shape[0] == rows:
        return t
    pad = (torch.randn(rows - t.shape[0], t.shape[1], generator=gen) * 0.02).to(t.dtype)
    return torch.cat([t, pad], 0)


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("model", help="krait/HF checkpoint directory (config.json + *.safetensors)")
    ap.add_argument("out", help="checkpoint root to create")
    ap.add_argument("--format", choices=["torch_dist", "legacy"], required=True)
    ap.add_argument("--tp", type=int, default=1)
    ap.add_argument("--pp", type=int, default=1, help="pipeline stages (legacy only)")
    ap.add_argument("--ep", type=int, default=1, help="expert-parallel ranks (legacy only)")
    ap.add_argument("--make-vocab-size-divisible-by", type=int, default=1,
                    help="pad the vocabulary to a multiple of this times TP, as Megatron does (default 1: none)")
    ap.add_argument("--iteration", type=int, default=100)
    ap.add_argument("--conv-spelling", choices=["module", "param"], default="module",
                    help="legacy: mixer.conv1d.weight (before Megatron-LM#4899) or mixer.conv1d_weight (after)")
    ap.add_argument("--final-norm", choices=["final_norm", "final_layernorm"], default="final_norm")
    ap.add_argument("--expert-layout", choices=["grouped", "sequential"], default="grouped",
                    help="legacy expert names: TEGroupedMLP weight<i> or SequentialMLP local_experts.<i>")
    ap.add_argument("--dcp", choices=["auto", "torch", "builtin"], default="auto",
                    help="torch_dist writer at TP=1 (TP>1 always uses the builtin chunk writer)")
    ap.add_argument("--set", action="append", default=[], metavar="ARG=VALUE",
                    help="override a saved Megatron arg (a Python literal or a string)")
    ap.add_argument("--seed", type=int, default=0)
    o = ap.parse_args()
    torch = need_torch()
    if o.format == "torch_dist" and (o.pp > 1 or o.ep > 1):
        raise Refusal("torch_dist output stores global tensors: --pp/--ep only apply to legacy")

    cfg = json.load(open(os.path.join(o.model, "config.json")))
    if cfg.get("quantization_config"):
        raise Refusal("%s is quantized; export takes bf16/f16/f32 checkpoints" % o.model)
    pattern = layout.hf_pattern(cfg)
    kt = layout.hf_to_krait_tensors(st_read_dir_torch(o.model), cfg)
    dtype = str(kt["backbone.embeddings.weight"].dtype)
    staged, sizes = staged_pattern(pattern, o.pp) if o.pp > 1 else (pattern, [len(pattern)])
    a = megatron_args(cfg, staged, o, dtype)
    vocab = kt["backbone.embeddings.weight"].shape[0]
    mult = o.make_vocab_size_divisible_by * o.tp
    a["padded_vocab_size"] = -(-vocab // mult) * mult
    for s in o.set:
        k, _, v = s.partition("=")
        try:
            a[k] = ast.literal_eval(v)
        except (ValueError, SyntaxError):
            a[k] = v
    ns = argparse.Namespace(**a)
    # the mapping needs the dims only; the refusals of model_info are the converter's business
    info = {"pattern": pattern, "tie": not a["untie_embeddings_and_output_weights"], "gated": a["swiglu"],
            "experts": a.get("num_experts"), "tp": o.tp, "etp": o.tp}
    if "*" in pattern:
        info.update(heads=a["num_attention_heads"], kv_heads=a["num_query_groups"], head_dim=a["kv_channels"] or
                    cfg["hidden_size"] // a["num_attention_heads"])
    if "M" in pattern:
        info.update(m_d_inner=a["mamba_num_heads"] * a["mamba_head_dim"], m_heads=a["mamba_num_heads"],
                    m_groups=a["mamba_num_groups"], m_state=a["mamba_state_dim"])
    sd = layout.from_krait(kt, info)
    gen = torch.Generator().manual_seed(o.seed)
    sd["embedding.word_embeddings.weight"] = pad_vocab(sd["embedding.word_embeddings.weight"], a["padded_vocab_size"], gen)
    if "output_layer.weight" in sd:
        sd["output_layer.weight"] = pad_vocab(sd["output_layer.weight"], a["padded_vocab_size"], gen)
    if a.get("mtp_num_layers"):  # stand-ins for MTP tensors (the converter drops them)
        h = cfg["hidden_size"]
        for dpt in range(a["mtp_num_layers"]):
            sd["mtp.layers.%d.enorm.weight" % dpt] = torch.ones(h, dtype=sd["decoder.final_norm.weight"].dtype)
            sd["mtp.layers.%d.eh_proj.weight" % dpt] = torch.zeros(h, 2 * h, dtype=sd["decoder.final_norm.weight"].dtype)
    if o.final_norm != "final_norm":
        sd["decoder.%s.weight" % o.final_norm] = sd.pop("decoder.final_norm.weight")

    it_dir = os.path.join(o.out, "iter_%07d" % o.iteration)
    if os.path.exists(it_dir):
        raise Refusal("%s exists" % it_dir)
    os.makedirs(it_dir)
    common = {"args": ns, "checkpoint_version": 3.0, "iteration": o.iteration}
    if o.format == "torch_dist":
        write_torch_dist(it_dir, sd, info, o, common)
    else:
        write_legacy(it_dir, sd, info, o, common, sizes)
    with open(os.path.join(o.out, "latest_checkpointed_iteration.txt"), "w") as f:
        f.write(str(o.iteration))
    log("wrote %s (%s, TP=%d PP=%d EP=%d, pattern %s, padded vocab %d)"
        % (o.out, o.format, o.tp, o.pp, o.ep, staged, a["padded_vocab_size"]))


def write_torch_dist(d, sd, info, o, common):
    torch = need_torch()
    flat = {}
    for k, v in sd.items():
        m = re.match(r"(.*\.mixer\.in_proj\.weight)$", k)
        if m:
            secs = [info["m_d_inner"], info["m_d_inner"], info["m_groups"] * info["m_state"],
                    info["m_groups"] * info["m_state"], info["m_heads"]]
            for n, part in zip("z x B C dt".split(), torch.split(v, secs, 0)):
                flat[k + "." + n] = (k, part)
            continue
        m = re.match(r"(.*\.mixer\.conv1d\.(?:weight|bias))$", k)
        if m:
            secs = [info["m_d_inner"], info["m_groups"] * info["m_state"], info["m_groups"] * info["m_state"]]
            for n, part in zip("x B C".split(), torch.split(v, secs, 0)):
                flat[k + "." + n] = (k, part)
            continue
        m = re.match(r"(decoder\.layers\.\d+\.mlp\.experts\.)(linear_fc[12]\.weight)$", k)
        flat[(m.group(1) + "experts." + m.group(2)) if m else k] = (k, v)
    flat["optimizer.state.fake.exp_avg"] = ("optimizer", torch.zeros(4))  # non-model entries are skipped
    impl = dcp.pick_impl(o.dcp)
    if o.tp == 1 and impl == "torch":
        sdict = {k: v for k, (_, v) in flat.items()}
        sdict["decoder.layers.0._extra_state_fake"] = io.BytesIO(b"te-fp8-meta")  # a bytes entry, as TE saves
        dcp.save_torch(d, sdict)
    else:
        chunks = {}
        for key, (canon, t) in flat.items():
            chunks[key] = (tuple(t.shape), dcp_chunks(key, canon, t, o.tp, info))
        dcp.save_chunks(d, chunks)
    torch.save(common, os.path.join(d, "common.pt"))
    with open(os.path.join(d, "metadata.json"), "w") as f:
        json.dump({"sharded_backend": "torch_dist", "sharded_backend_version": 1}, f)


def dcp_chunks(key, canon, t, tp, info):
    """[(rank, offsets, chunk)]: how TP ranks of a torch_dist save hold `key` (split parts and
    experts' leading axis included; duplicated tensors are written by rank 0 only)."""
    zero = (0,) * t.dim()
    if tp == 1 or canon == "optimizer":
        return [(0, zero, t)]
    if re.search(r"\.(in_proj\.weight|conv1d\.(weight|bias))\.(z|x|B|C|dt)$", key):
        kind = ("cat", 0)
    else:
        kind = layout.tp_kind(canon, info)
    expert = ".experts.experts." in key
    lead = 1 if expert else 0  # experts: [E, out, in], TP splits out (fc1) or in (fc2)
    if kind[0] in ("dup", "auto"):
        return [(0, zero, t)]
    if kind[0] == "cat":
        dim = kind[1] + lead
        n = t.shape[dim] // tp
        return [(r, tuple(r * n if i == dim else 0 for i in range(t.dim())), t.narrow(dim, r * n, n))
                for r in range(tp)]
    if kind[0] == "glu":  # global [gate; up]; rank r holds gate_r and up_r (mlp.py apply_swiglu_sharded_factory)
        dim = lead
        half = t.shape[dim] // 2
        n = half // tp
        out = []
        for r in range(tp):
            for h in range(2):
                o0 = h * half + r * n
                out.append((r, tuple(o0 if i == dim else 0 for i in range(t.dim())), t.narrow(dim, o0, n)))
        return out
    raise Refusal("%s: no torch_dist chunk rule" % key)


def write_legacy(d, sd, info, o, common, sizes):
    torch = need_torch()
    tp, pp, ep = o.tp, o.pp, o.ep
    starts = [sum(sizes[:s]) for s in range(pp)]
    last = pp - 1
    n_exp = info["experts"] or 0
    if n_exp % ep:
        raise Refusal("%d experts do not divide by EP=%d" % (n_exp, ep))
    ranks = {(t, s, e): collections.OrderedDict() for t in range(tp) for s in range(pp) for e in range(ep)}

    def put(s, key, t, only_ep=None):
        for e in range(ep):
            if only_ep is not None and e != only_ep:
                continue
            for r, shard in enumerate(layout.tp_split(key, t, tp, info)):
                ranks[(r, s, e)][key] = shard.clone()

    for k, v in sd.items():
        m = re.match(r"decoder\.layers\.(\d+)\.(.*)$", k)
        if not m:
            stage = 0 if k.startswith("embedding.") else last
            put(stage, k, v)
            continue
        g = int(m.group(1))
        s = max(i for i in range(pp) if starts[i] <= g)
        local = "decoder.layers.%d.%s" % (g - starts[s], m.group(2))
        if o.conv_spelling == "param":
            local = re.sub(r"\.mixer\.conv1d\.(weight|bias)$", r".mixer.conv1d_\1", local)
        me = re.match(r"(.*\.mlp\.experts\.)(linear_fc[12])\.weight$", local)
        if me:
            per = n_exp // ep
            for e in range(n_exp):
                li = e % per
                name = ("%slocal_experts.%d.%s.weight" % (me.group(1), li, me.group(2)) if o.expert_layout == "sequential"
                        else "%s%s.weight%d" % (me.group(1), me.group(2), li))
                put(s, name, v[e], only_ep=e // per)
            continue
        put(s, local, v)
        if local.endswith("mixer.in_proj.weight"):  # TE FP8 metadata blobs: ignored by the converter
            for e in range(ep):
                for r in range(tp):
                    ranks[(r, s, e)][local.replace(".weight", "._extra_state")] = io.BytesIO(b"")
    for (t, s, e), model in ranks.items():
        name = "mp_rank_%02d" % t + ("_%03d" % s if pp > 1 else "") + ("_%03d" % e if ep > 1 else "")
        os.makedirs(os.path.join(d, name))
        torch.save(dict(common, model=model), os.path.join(d, name, "model_optim_rng.pt"))


if __name__ == "__main__":
    run_main("export.py", main)
