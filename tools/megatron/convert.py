#!/usr/bin/env python3
"""Converts a Megatron-LM HybridModel checkpoint (torch_dist or legacy torch format, any TP/PP/EP
split) into a directory krait serves: config.json (HF nemotron_h layout, D/+ layers with
deepseek_v32 attention names) and model.safetensors.

  python3 tools/megatron/convert.py CKPT_DIR OUT_DIR [--iteration N] [--tokenizer DIR] [--vocab-size N]

See docs/MEGATRON.md for what is supported and the name table."""

import argparse
import json
import os
import re
import shutil
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
sys.dont_write_bytecode = True  # no __pycache__ next to the sources

import dcp  # noqa: E402
import layout  # noqa: E402
from common import Refusal, load_pt, log, need_torch, run_main, st_write_dir  # noqa: E402

# non-model entries of a torch_dist checkpoint (dist_checkpoint_io.py _NON_MODEL_TOP_LEVEL_PREFIXES)
NON_MODEL = ("optimizer.", "rng_state", "rerun_state_machine_state", "opt_param_scheduler")
MODEL_PREFIXES = ("model.module.module.", "model.module.", "model.", "")  # dist_checkpoint_io.py


# ---- locating the checkpoint -------------------------------------------------------------------

def resolve(root, iteration):
    """The iteration directory: iter_%07d (Megatron's get_checkpoint_name) from --iteration or
    latest_checkpointed_iteration.txt ("release" names the release/ directory), or root itself."""
    if not os.path.isdir(root):
        raise Refusal("%s is not a directory" % root)
    if iteration is not None:
        d = os.path.join(root, "iter_%07d" % iteration)
        if not os.path.isdir(d):
            raise Refusal("%s: no iter_%07d directory" % (root, iteration))
        return d
    base = os.path.basename(os.path.normpath(root))
    if base.startswith("iter_") or base == "release" or os.path.exists(os.path.join(root, ".metadata")) or \
            any(n.startswith("mp_rank_") for n in os.listdir(root)):
        return root
    tracker = os.path.join(root, "latest_checkpointed_iteration.txt")
    if os.path.exists(tracker):
        s = open(tracker).read().strip()
        d = os.path.join(root, "release" if s == "release" else "iter_%07d" % int(s))
        if not os.path.isdir(d):
            raise Refusal("%s names iteration %s but %s is missing" % (tracker, s, d))
        return d
    its = sorted(n for n in os.listdir(root) if re.match(r"iter_\d{7}$", n))
    if its:
        raise Refusal("%s: no latest_checkpointed_iteration.txt; pass --iteration (found %s)" % (root, ", ".join(its)))
    raise Refusal("%s is not a Megatron checkpoint (no latest_checkpointed_iteration.txt, iter_* or mp_rank_*)" % root)


# ---- torch_dist ---------------------------------------------------------------------------------

def read_torch_dist(d, impl):
    mdj = os.path.join(d, "metadata.json")
    if os.path.exists(mdj):
        backend = json.load(open(mdj)).get("sharded_backend")
        if backend not in ("torch_dist", None):
            raise Refusal("%s: sharded_backend %s is not supported (torch_dist or legacy torch)" % (d, backend))
    common = os.path.join(d, "common.pt")
    if not os.path.exists(common):
        raise Refusal("%s: no common.pt, so no saved args to take the model config from" % d)
    cs = load_pt(common)
    args = cs.get("args") if isinstance(cs, dict) else None
    if args is None:
        raise Refusal("%s: common.pt has no 'args'" % common)
    impl = dcp.pick_impl(impl)
    keys = dcp.tensor_keys(d, impl)
    prefix = next((p for p in MODEL_PREFIXES for k in keys
                   if k.startswith(p + "embedding.word_embeddings") or k.startswith(p + "decoder.layers.")), None)
    if prefix is None:
        raise Refusal("%s: no HybridModel tensors (embedding.word_embeddings, decoder.layers.*) in the checkpoint" % d)

    def want(k):
        if not k.startswith(prefix):
            return False
        b = k[len(prefix):]
        return not b.startswith(NON_MODEL) and "_extra_state" not in b

    raw = dcp.load(d, want, impl)
    log("read %d tensors of %s (torch_dist, %s reader)" % (len(raw), d, impl))
    return {k[len(prefix):]: v for k, v in raw.items()}, args, cs.get("iteration")


def canonical_from_dcp(sd):
    """Joins what Megatron's sharded_state_dict split: in_proj .z/.x/.B/.C/.dt and conv1d .x/.B/.C
    (ssm/utils.py _split_tensor_factory), fc1 `_w`/`_v` (singleton_local_shards), experts under
    `.experts.experts.` [E, ...] or per expert `.experts.<e>.`."""
    torch = need_torch()
    out, parts = {}, {}
    for k, v in sd.items():
        m = re.match(r"(.*\.mixer\.in_proj\.(?:weight|bias))\.(z|x|B|C|dt)$", k) or \
            re.match(r"(.*\.mixer\.conv1d\.(?:weight|bias))\.(x|B|C)$", k) or \
            re.match(r"(.*\.linear_fc1\.weight)_(w|v)$", k)
        if m:
            parts.setdefault(m.group(1), {})[m.group(2)] = v
            continue
        out[k] = v
    orders = {"in_proj": "z x B C dt", "conv1d": "x B C", "linear_fc1": "w v"}
    for k, p in parts.items():
        order = next(o for n, o in orders.items() if n in k).split()
        if set(p) != set(order):
            raise Refusal("%s: split parts %s, expected %s" % (k, sorted(p), order))
        out[k] = torch.cat([p[n] for n in order], 0)
    experts = {}
    for k in list(out):
        m = re.match(r"(decoder\.layers\.\d+\.mlp\.experts\.)experts\.(linear_fc[12]\.weight)$", k)
        if m:
            out[m.group(1) + m.group(2)] = out.pop(k)
            continue
        m = re.match(r"(decoder\.layers\.\d+\.mlp\.experts\.)(\d+)\.(linear_fc[12]\.weight)$", k)
        if m:
            experts.setdefault(m.group(1) + m.group(3), {})[int(m.group(2))] = out.pop(k)
    for k, per in experts.items():
        out[k] = torch.stack([per[e] for e in range(len(per))])
    return out


# ---- legacy torch ------------------------------------------------------------------------------

def read_legacy(d, pattern):
    """Loads every mp_rank_* file, merges TP shards per component, renumbers PP stages to global
    layer indices and gathers EP experts (tools/checkpoint/hybrid_conversion.py does the TP part for
    Mamba; checkpointing.py get_checkpoint_name names the directories)."""
    torch = need_torch()
    names = sorted(n for n in os.listdir(d) if n.startswith("mp_rank_"))
    first = load_pt(os.path.join(d, names[0], "model_optim_rng.pt"))
    args = first.get("args")
    if args is None:
        raise Refusal("%s: the state dict has no 'args'" % names[0])
    info = layout.model_info(args, pattern)
    tp, pp, ep = info["tp"], info["pp"], info["ep"]
    files = {}
    for n in names:
        m = re.match(r"mp_rank_(\d{2})(?:_(\d{3}))?(?:_(\d{3}))?$", n)
        if not m:
            raise Refusal("%s: unexpected directory %s" % (d, n))
        nums = [int(x) for x in m.groups() if x is not None]
        t = nums[0]
        s = nums[1] if pp > 1 else 0
        e = nums[-1] if ep > 1 else 0
        if len(nums) != 1 + (pp > 1) + (ep > 1):
            raise Refusal("%s: %s does not match TP=%d PP=%d EP=%d from the args" % (d, n, tp, pp, ep))
        files[(t, s, e)] = os.path.join(d, n, "model_optim_rng.pt")
    want = {(t, s, e) for t in range(tp) for s in range(pp) for e in range(ep)}
    if set(files) != want:
        missing = sorted(want - set(files))
        raise Refusal("%s: %d rank files for TP=%d PP=%d EP=%d (missing %s)" % (d, len(files), tp, pp, ep,
                                                                                  missing[:3] or "none"))
    n_local_exp = info["experts"] // ep if "experts" in info else 0
    stage_sds, counts = [], []
    for s in range(pp):
        merged = {}
        for e in range(ep):
            shards = {}
            for t in range(tp):
                st = first if (t, s, e) == (0, 0, 0) else load_pt(files[(t, s, e)])
                if "model" not in st:
                    raise Refusal("%s: no 'model' in the state dict (virtual pipeline stages model0.. are not "
                                  "supported)" % files[(t, s, e)])
                for k, v in st["model"].items():
                    if "_extra_state" in k or not hasattr(v, "shape"):
                        continue
                    shards.setdefault(k, []).append(v)
            for k, lst in shards.items():
                if len(lst) != tp:
                    raise Refusal("tensor %s is on %d of %d TP ranks" % (k, len(lst), tp))
                expert = ".mlp.experts." in k and ".shared_experts." not in k
                if e > 0 and not expert:
                    continue  # non-expert tensors repeat on every EP rank
                k2 = k
                if expert:  # local expert index -> global
                    m = re.match(r"(.*\.mlp\.experts\.)(?:local_experts\.(\d+)\.(linear_fc[12]\.weight)|"
                                 r"(linear_fc[12]\.weight)(\d+))$", k)
                    if not m:
                        raise Refusal("unexpected expert tensor %s" % k)
                    li = int(m.group(2) if m.group(2) is not None else m.group(5))
                    k2 = "%s%d.%s" % (m.group(1), e * n_local_exp + li, m.group(3) or m.group(4))
                merged[k2] = layout.tp_merge(k, lst, info)
        idx = [int(m.group(1)) for k in merged for m in [re.match(r"decoder\.layers\.(\d+)\.", k)] if m]
        counts.append(max(idx) + 1 if idx else 0)
        stage_sds.append(merged)
    # stage lengths: the pattern's '|' segments when they match PP, else what each stage holds
    if len(info["stages"]) == pp:
        if any(c > n for c, n in zip(counts, info["stages"])):
            raise Refusal("pipeline stages hold %s layers, the pattern's | segments say %s" % (counts, info["stages"]))
        counts = info["stages"]
    if sum(counts) != len(info["pattern"]):
        raise Refusal("the %d pipeline stages hold %s layers, %d in all; the pattern has %d"
                      % (pp, counts, sum(counts), len(info["pattern"])))
    sd, off = {}, 0
    for s, merged in enumerate(stage_sds):
        for k, v in merged.items():
            m = re.match(r"decoder\.layers\.(\d+)\.(.*)$", k)
            if m:
                k = "decoder.layers.%d.%s" % (int(m.group(1)) + off, m.group(2))
            elif k in sd and k.startswith(("output_layer", "embedding")):
                continue  # the first stage's embedding wins over the last stage's tied copy
            sd[k] = v
        off += counts[s]
    experts = {}
    for k in list(sd):
        m = re.match(r"(decoder\.layers\.\d+\.mlp\.experts\.)(\d+)\.(linear_fc[12]\.weight)$", k)
        if m:
            experts.setdefault(m.group(1) + m.group(3), {})[int(m.group(2))] = sd.pop(k)
    for k, per in experts.items():
        if sorted(per) != list(range(len(per))):
            raise Refusal("%s: experts %s found, not 0..%d" % (k, sorted(per)[:8], len(per) - 1))
        sd[k] = torch.stack([per[e] for e in range(len(per))])
    log("read %d rank files of %s (legacy torch, TP=%d PP=%d EP=%d)" % (len(files), d, tp, pp, ep))
    return sd, args, first.get("iteration"), info


# ---- output ------------------------------------------------------------------------------------

def tokenizer_vocab(tok_dir):
    """Number of ids a tokenizer.json uses (vocab + added tokens), or None."""
    p = os.path.join(tok_dir, "tokenizer.json")
    if not os.path.exists(p):
        return None
    j = json.load(open(p))
    ids = list(((j.get("model") or {}).get("vocab") or {}).values()) if isinstance((j.get("model") or {}).get("vocab"), dict) \
        else list(range(len((j.get("model") or {}).get("vocab") or [])))
    ids += [t["id"] for t in j.get("added_tokens") or []]
    return max(ids) + 1 if ids else None


def special_ids(tok_dir):
    """bos/eos ids from tokenizer_config.json's token strings, looked up in tokenizer.json."""
    try:
        tc = json.load(open(os.path.join(tok_dir, "tokenizer_config.json")))
        tj = json.load(open(os.path.join(tok_dir, "tokenizer.json")))
    except (OSError, ValueError):
        return {}
    vocab = dict((tj.get("model") or {}).get("vocab") or {}) if isinstance((tj.get("model") or {}).get("vocab"), dict) else {}
    vocab.update({t["content"]: t["id"] for t in tj.get("added_tokens") or []})
    out = {}
    for key in ("bos_token", "eos_token", "pad_token"):
        v = tc.get(key)
        v = v.get("content") if isinstance(v, dict) else v
        if isinstance(v, str) and v in vocab:
            out[key + "_id"] = vocab[v]
    return out


def hf_config(info, vocab, dtype):
    c = {"architectures": ["NemotronHForCausalLM"], "model_type": "nemotron_h", "vocab_size": vocab,
         "hidden_size": info["hidden"], "num_hidden_layers": len(info["pattern"]),
         "hybrid_override_pattern": info["pattern"],
         "layer_norm_epsilon": info["eps"], "rms_norm_eps": info["eps"],  # Megatron has one eps for every norm
         "tie_word_embeddings": info["tie"], "max_position_embeddings": info["max_pos"],
         "mlp_hidden_act": info["act"], "mlp_bias": False, "use_bias": False, "attention_bias": False,
         "torch_dtype": dtype}
    p = info["pattern"]
    if "M" in p:
        c.update(mamba_num_heads=info["m_heads"], mamba_head_dim=info["m_head_dim"], ssm_state_size=info["m_state"],
                 n_groups=info["m_groups"], conv_kernel=info["m_conv"], chunk_size=info["m_chunk"],
                 use_conv_bias=info["m_conv_bias"], mamba_hidden_act="silu")
    if "*" in p:
        c.update(num_attention_heads=info["heads"], num_key_value_heads=info["kv_heads"], head_dim=info["head_dim"])
    if "-" in p:
        c["intermediate_size"] = info["ffn"]
    if "E" in p:
        c.update(n_routed_experts=info["experts"], num_experts_per_tok=info["topk"],
                 moe_intermediate_size=info["moe_ffn"], n_shared_experts=1 if info["shared_ffn"] else 0,
                 moe_shared_expert_intermediate_size=info["shared_ffn"], n_group=info["n_group"],
                 topk_group=info["topk_group"], routed_scaling_factor=info["route_scale"],
                 norm_topk_prob=info["norm_topk"], scoring_func=info["score"])
        if info["latent"]:
            c["moe_latent_size"] = info["latent"]
    if "D" in p or "+" in p:
        c.update(num_attention_heads=info["mla_heads"], num_key_value_heads=info["mla_heads"],
                 q_lora_rank=info["q_lora"] or None, kv_lora_rank=info["kv_lora"], qk_nope_head_dim=info["qk_nope"],
                 qk_rope_head_dim=info["qk_rope"], v_head_dim=info["v_head"], rope_theta=info["rope_theta"])
        if info["rope_scaling"]:
            c["rope_scaling"] = info["rope_scaling"]
    if "D" in p:
        c.update(index_n_heads=info["idx_heads"], index_head_dim=info["idx_head_dim"], index_topk=info["idx_topk"],
                 index_k_norm_eps=info["idx_eps"])
        if info["idx_topk_freq"] > 1:
            c.update(index_topk_freq=info["idx_topk_freq"], index_skip_topk_offset=info["idx_skip_offset"])
        if not info["idx_relu"]:
            c["index_scoring_relu"] = False
    return c


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("ckpt", help="checkpoint root (with latest_checkpointed_iteration.txt) or an iter_* directory")
    ap.add_argument("out", help="output directory (created; must be empty or absent)")
    ap.add_argument("--iteration", type=int, help="iteration to convert (default: the latest)")
    ap.add_argument("--tokenizer", help="HF tokenizer directory: its files are copied and its vocabulary size "
                                        "trims the padded embedding rows")
    ap.add_argument("--vocab-size", type=int, help="real vocabulary size (overrides the tokenizer's)")
    ap.add_argument("--pattern", help="hybrid layer pattern when the args lack one")
    ap.add_argument("--dcp", choices=["auto", "torch", "builtin"], default="auto",
                    help="torch_dist reader: torch.distributed.checkpoint (torch >= 2) or the builtin one")
    ap.add_argument("--max-shard-gb", type=float, default=5.0, help="split model.safetensors above this size")
    o = ap.parse_args()
    need_torch()

    if os.path.exists(o.out) and os.listdir(o.out):
        raise Refusal("%s exists and is not empty" % o.out)
    d = resolve(o.ckpt, o.iteration)
    if os.path.exists(os.path.join(d, ".metadata")):
        sd, args, it = read_torch_dist(d, o.dcp)
        info = layout.model_info(args, o.pattern)
        sd = canonical_from_dcp(sd)
    elif any(n.startswith("mp_rank_") for n in os.listdir(d)):
        sd, args, it, info = read_legacy(d, o.pattern)
    else:
        raise Refusal("%s: neither torch_dist (.metadata) nor legacy (mp_rank_*) files" % d)
    if info["mtp"]:
        log("dropping %d multi-token-prediction layer(s) (pattern after '/', mtp.* tensors): krait does not "
            "use them" % len(info["mtp"]))

    emb = sd.get("embedding.word_embeddings.weight")
    if emb is None:
        raise Refusal("missing tensor embedding.word_embeddings.weight")
    rows = emb.shape[0]
    vocab = o.vocab_size or (tokenizer_vocab(o.tokenizer) if o.tokenizer else None)
    if o.tokenizer and not o.vocab_size and vocab is None:
        log("%s has no tokenizer.json to take the vocabulary size from" % o.tokenizer)
    if vocab is None:
        vocab = rows
        if info["padded_vocab"] and rows == info["padded_vocab"]:
            log("vocabulary: keeping all %d embedding rows (padded_vocab_size; the tokenizer's real size is not "
                "in the args): pass --vocab-size or --tokenizer to drop the padding rows" % rows)
    elif vocab > rows:
        raise Refusal("vocabulary size %d exceeds the %d embedding rows" % (vocab, rows))
    elif vocab < rows:
        log("vocabulary: %d of %d embedding rows kept (the rest is Megatron's padding)" % (vocab, rows))

    if "M" in info["pattern"]:
        first_m = info["pattern"].index("M")
        cw = sd.get("decoder.layers.%d.mixer.conv1d.weight" % first_m)
        if cw is None:
            cw = sd.get("decoder.layers.%d.mixer.conv1d_weight" % first_m)
        if cw is None:
            raise Refusal("missing tensor decoder.layers.%d.mixer.conv1d.weight" % first_m)
        info["m_conv"] = cw.shape[-1]
        info["m_conv_bias"] = any(k.endswith(("mixer.conv1d.bias", "mixer.conv1d_bias")) for k in sd)

    tensors, n_mtp = layout.to_krait(sd, info, vocab)
    if n_mtp:
        log("dropped %d mtp.* tensors" % n_mtp)
    dtype = {"torch.bfloat16": "bfloat16", "torch.float16": "float16"}.get(str(emb.dtype), "float32")
    cfg = hf_config(info, vocab, dtype)
    if o.tokenizer:
        cfg.update(special_ids(o.tokenizer))
    os.makedirs(o.out, exist_ok=True)
    files = st_write_dir(o.out, tensors, int(o.max_shard_gb * (1 << 30)))
    with open(os.path.join(o.out, "config.json"), "w") as f:
        json.dump(cfg, f, indent=2)
        f.write("\n")
    if o.tokenizer:
        copied = []
        for n in ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "tokenizer.model",
                  "vocab.json", "merges.txt", "generation_config.json", "chat_template.jinja"):
            if os.path.exists(os.path.join(o.tokenizer, n)):
                shutil.copy(os.path.join(o.tokenizer, n), os.path.join(o.out, n))
                copied.append(n)
        log("tokenizer files copied: %s" % (", ".join(copied) or "none found"))
    log("wrote %s: pattern %s, %d tensors in %s%s" % (o.out, info["pattern"], len(tensors), ", ".join(files),
                                                     "" if it is None else " (iteration %s)" % it))


if __name__ == "__main__":
    run_main("convert.py", main)
