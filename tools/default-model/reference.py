#!/usr/bin/env python3
"""Reference outputs of the trained default model from HF transformers, in the format of every other
family's fixtures (tools/reference/README.md): HF NemotronHForCausalLM with its D mixers replaced by
HF DeepseekV32Attention modules (tools/reference/make_dsa_fixtures.py builds it), float32, no cache,
from the stored bf16 values; each mixer checked against the float64 specification model, and the
whole model against it end to end.

    python3 tools/default-model/reference.py MODEL_DIR DATA_DIR OUT_DIR [--device cuda|cpu]

Prompts are real text: the start of held-out documents and rendered held-out chat prompts (DATA_DIR
is data.py's output), of lengths near 1, 8, 40 and 150 tokens, chosen in a fixed order as the first
whose indexer selections (prompt and prompt + greedy continuation) have relative margins above 1e-3
and whose greedy margins are at least 0.05; where none qualifies the best is kept and reported.
Writes OUT_DIR/reference.json and reference.bin. Needs torch, transformers 5.17, tokenizers, jinja2.
"""
import argparse
import json
import os
import sys

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.join(HERE, "..", "reference"))
sys.path.insert(0, HERE)

import torch  # noqa: E402

import make_dsa_fixtures as S  # noqa: E402
import train as TR  # noqa: E402

LENGTHS = [1, 8, 40, 150]
MAX_TRIES = 60


def fx_from_config(c):
    return dict(
        name="default", kind="hybrid", pattern=c["hybrid_override_pattern"], hidden=c["hidden_size"],
        vocab=c["vocab_size"], intermediate=c["intermediate_size"], max_pos=c["max_position_embeddings"],
        mla=dict(heads=c["num_attention_heads"], q_lora=c["q_lora_rank"], kv_lora=c["kv_lora_rank"],
                 nope=c["qk_nope_head_dim"], rope=c["qk_rope_head_dim"], v=c["v_head_dim"],
                 idx_heads=c["index_n_heads"], idx_dim=c["index_head_dim"], topk=c["index_topk"],
                 rope_theta=c["rope_theta"]),
        rope_scaling=None,
        mamba=dict(heads=c["mamba_num_heads"], head_dim=c["mamba_head_dim"], groups=c["n_groups"],
                   state=c["ssm_state_size"], conv=c["conv_kernel"], chunk=c["chunk_size"],
                   conv_bias=c["use_conv_bias"]),
        moe=dict(E=c["n_routed_experts"], top_k=c["num_experts_per_tok"], n_group=c["n_group"],
                 topk_group=c["topk_group"], scale=c["routed_scaling_factor"], norm=c["norm_topk_prob"],
                 ffn=c["moe_intermediate_size"], shared=c["moe_shared_expert_intermediate_size"], n_shared=1),
        time_step_limit=None, prompts=LENGTHS)


def candidates(tok, data, render, L):
    """Prompt candidates of about L tokens, in a fixed order."""
    docs = TR.read_docs(os.path.join(data, "heldout.txt"))
    convs = TR.read_convs(os.path.join(data, "chat-heldout.jsonl"))
    out = []
    if L == 1:
        return [[0]]
    if 20 <= L <= 80:
        for c in convs:
            ids = tok.encode(render(c["messages"][:1], None, True), add_special_tokens=False).ids
            if abs(len(ids) - L) <= L // 4:
                out.append(ids)
    for d in docs:
        ids = [0] + tok.encode(d, add_special_tokens=False).ids
        if len(ids) >= L:
            out.append(ids[:L])
    return out


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("model")
    ap.add_argument("data")
    ap.add_argument("out")
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    a = ap.parse_args()
    S.disable_tf32()
    from tokenizers import Tokenizer
    tok = Tokenizer.from_file(os.path.join(a.model, "tokenizer.json"))
    _, render = TR.render_template()
    with open(os.path.join(a.model, "config.json")) as f:
        cfg = json.load(f)
    fx = fx_from_config(cfg)
    st = TR.read_safetensors(os.path.join(a.model, "model.safetensors"))
    W = {k: v.double() for k, v in st.items() if not k.startswith("mtp.")}
    W["lm_head.weight"] = W["backbone.embeddings.weight"]
    model, _ = S.build_model(fx, W, a.device)

    def lp_fn(ids):
        return S.hf_logprobs(model, ids, a.device).cpu()

    thr = S.IDX_REL_MARGIN
    prompts, notes = [], []
    stats = dict(mixer_max_rel_err=0.0, router_near_ties_skipped=0, clamp_sensitivity=0.0, e2e_max_err=0.0,
                 e2e_skipped=0, mask_checked=0, sparse_vs_dense=0.0)
    for L in LENGTHS:
        best, best_key = None, None
        for ids in candidates(tok, a.data, render, L)[:MAX_TRIES]:
            lp_s, infos, _ = S.spec_forward(W, fx, ids)
            okp, relp = S.index_ok(infos, thr)
            lp = lp_fn(ids)
            toks, margins = S.greedy(lp_fn, ids, lp[-1])
            _, infos_f, _ = S.spec_forward(W, fx, ids + toks[:-1])
            okf, relf = S.index_ok(infos_f, thr)
            gm_ok = min(margins) >= S.MIN_MARGIN
            key = (okp, okf, gm_ok, min(margins), min(relp, relf))
            if best_key is None or key > best_key:
                best, best_key = dict(ids=ids, lp=lp, greedy=toks, margins=margins, infos=infos), key
            if okp and okf and gm_ok:
                break
        if not (best_key[0] and best_key[1] and best_key[2]):
            notes.append(f"length {len(best['ids'])}: no candidate met every margin; kept {best_key}")
        prompts.append(best)
        print(f"len {len(best['ids'])}: key {best_key} greedy {tok.decode(best['greedy'])!r}", flush=True)
    for p in prompts:
        lp_h, cap, sets, _ = S.hooked_forward(model, fx, p["ids"], a.device)
        S.check((lp_h.cpu() - p["lp"]).abs().max().item() <= 1e-6, "HF forward not reproducible")
        S.check_against_spec(model, fx, W, p["ids"], cap, sets, stats)
        p["sets"] = sets
        lp_ref, _, rmin = S.spec_forward(W, fx, p["ids"])
        err = (p["lp"].double() - lp_ref).abs().max().item()
        if rmin < S.NEAR_TIE:
            stats["e2e_skipped"] += 1
        else:
            stats["e2e_max_err"] = max(stats["e2e_max_err"], err)
            S.check(err < S.E2E_TOL, f"end-to-end float64 spec differs from HF by {err:.3e}")
    os.makedirs(a.out, exist_ok=True)
    blob, entries = bytearray(), []
    for p in prompts:
        entries.append({"ids": p["ids"], "logprobs_offset": len(blob), "n_rows": len(p["ids"]),
                        "greedy": p["greedy"], "greedy_margin": p["margins"]})
        blob += p["lp"].numpy().astype("<f4").tobytes()
    import transformers
    ref = {
        "generator": f"tools/default-model/reference.py (torch {torch.__version__}, transformers "
                     f"{transformers.__version__}, device {a.device}, float32, no cache)",
        "fixture": os.path.basename(os.path.normpath(a.model)),
        "description": "the trained default model; prompts are held-out text and chat prompts",
        "pattern": cfg["hybrid_override_pattern"],
        "vocab_size": cfg["vocab_size"],
        "notes": "format as tools/reference/README.md; " + "; ".join(notes),
        "index_topk": fx["mla"]["topk"],
        "index_layers": S.index_layers(fx),
        "index_layers_native": S.index_layers(fx),
        "index_margin_rel_threshold": thr,
        "prompts": entries,
        "index_sets": [p["sets"] for p in prompts],
        "index_margins": [[[None if g is None else float(f"{g:.6g}") for g in inf["marg"]] for inf in p["infos"]]
                          for p in prompts],
        "checks": stats,
    }
    with open(os.path.join(a.out, "reference.bin"), "wb") as f:
        f.write(bytes(blob))
    S.write_json(os.path.join(a.out, "reference.json"), ref)
    print(json.dumps({"prompts": [len(p["ids"]) for p in prompts], "notes": notes, "checks": stats}), flush=True)


if __name__ == "__main__":
    main()
