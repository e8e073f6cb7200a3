#!/usr/bin/env python3
"""Reference outputs of the trained default model's multi-token-prediction (MTP) head, for krait's C tests.

    python3 tools/default-model/mtp_reference.py models/small-hybrid tests/fixtures/default/small-hybrid

(any python3 with torch and numpy: no transformers, tokenizers or jinja2; torch 1.13 suffices.)

MODEL_DIR holds config.json and model.safetensors (bf16); OUT_DIR holds reference.json, written by
tools/default-model/reference.py, whose "prompts" give the token ids. The script writes OUT_DIR/mtp.json.

The reference is float64 from the stored bf16 values, built from the float64 spec mixers of
tools/reference/make_dsa_fixtures.py (imported as a module: its transformers imports are lazy, inside
import_hf(), and nothing here calls them, so nothing is stubbed):
  * main model: embeddings, the blocks of hybrid_override_pattern (h = h + mixer(rms(h, norm)); Mamba-2 as a
    recurrence, D = MLA with the lightning indexer choosing index_topk keys per row, MoE) and
    hf = rms(h, norm_f), for every position; its log-probabilities are checked to equal
    make_dsa_fixtures.spec_forward's, and compared with reference.bin (HF float32);
  * MTP head (what tools/default-model/train.py's Model.forward computes), for rows i = 0 .. T-2 of a prompt
    of T >= 2 tokens, teacher-forced:
        e_i = rms(emb(t[i+1]), enorm)
        g_i = eh_proj([e_i ; rms(hf_i, hnorm)])              (x @ W^T, W [dim, 2 dim]: e takes the first dim columns)
        g   = g + mixer(rms(g, norm)) for the blocks of mtp_hybrid_override_pattern ("DE"), over the MTP rows
              as their own causal stream at RoPE positions 0 .. T-2 (the D layer's indexer selects among MTP
              rows when T-1 > index_topk)
        logits_i = rms(g_i, final_layernorm) @ emb^T        (tied head; predicts t[i+2])
    rms(x, w) = w * x / sqrt(mean(x^2) + eps), eps = layer_norm_epsilon (1e-5); the MLA's q_a/kv_a norms and the
    indexer's k LayerNorm use 1e-6 as in the spec.

Cross-check: train.py's Model (float32, CPU, sparse=True) loaded with the same file (train.load_exported) is
run on ids t[0..T-2] with nxt t[1..T-1]; the max |float64 - float32| over all MTP logits of all prompts is
checks.vs_train_py_max_abs (small unless a top-k selection sits at a near tie).

mtp.json: {"generator", "description", "eps", "index_topk", "prompts": [{"ids", "rows" (T-1), "argmax" (per
row), "margin" (per row top1 - top2 logit), "top_logit", "lse" (per-row logsumexp), "last_logits" (the 4096
logits of row T-2, 6 significant digits), "router_margin_min" (smallest top-k boundary gap of the MTP MoE
router scores, sigmoid + correction bias), and where T-1 > index_topk "index_margin_min" (smallest gap between
the 64th and 65th indexer score of the MTP D layer over rows that select, relative to the row's largest
|score|) with "index_margin_min_row"}], "checks": {...}}.
"""
import argparse
import json
import math
import os
import sys

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.join(HERE, "..", "reference"))
sys.path.insert(0, HERE)

import torch  # noqa: E402

import make_dsa_fixtures as S  # noqa: E402
import train as TR  # noqa: E402
from reference import fx_from_config  # noqa: E402  (the fixture description reference.py uses)

F64 = torch.float64
MTP = "mtp.layers.0."


KINDS = {"M": "mamba", "D": "mla_idx", "-": "mlp_relu2", "E": "moe_relu2"}


def run_blocks(W, fx, h, blocks, eps):
    """Pre-norm residual blocks [(kind letter, prefix)] over h [T, dim] -> (h, index infos, min router margin)."""
    infos, rmin = [], math.inf
    for c, pre in blocks:
        y, info, mg = S.spec_apply(W, fx, KINDS[c], pre + "mixer.", S.rms(h, W[pre + "norm.weight"], eps))
        if info is not None:
            infos.append(info)
        if mg is not None:
            rmin = min(rmin, mg.min().item())
        h = h + y
    return h, infos, rmin


def spec_mtp(W, fx, cfg, ids):
    """float64 main model + MTP head on ids (T tokens) -> dict of main log-probs [T,V], MTP logits [T-1,V], ..."""
    eps = cfg["layer_norm_epsilon"]
    emb = W["backbone.embeddings.weight"]
    t = torch.tensor(ids)
    S.check(all(S.topk_source(fx, i) == i for i in range(len(fx["pattern"]))), "shared top-k selections")
    main = [(c, f"backbone.layers.{i}.") for i, c in enumerate(cfg["hybrid_override_pattern"])]
    h, main_infos, main_rmin = run_blocks(W, fx, emb[t], main, eps)
    hf = S.rms(h, W["backbone.norm_f.weight"], eps)
    main_lp = torch.log_softmax(hf @ emb.T, -1)
    e = S.rms(emb[t[1:]], W[MTP + "enorm.weight"], eps)
    g = torch.cat([e, S.rms(hf[:-1], W[MTP + "hnorm.weight"], eps)], -1) @ W[MTP + "eh_proj.weight"].T
    blocks = [(c, f"{MTP}layers.{j}.") for j, c in enumerate(cfg["mtp_hybrid_override_pattern"])]
    g, mtp_infos, mtp_rmin = run_blocks(W, fx, g, blocks, eps)
    logits = S.rms(g, W[MTP + "final_layernorm.weight"], eps) @ emb.T
    return dict(main_lp=main_lp, logits=logits, main_infos=main_infos, main_rmin=main_rmin, mtp_infos=mtp_infos,
                mtp_rmin=mtp_rmin)


def prompt_entry(ids, L, rmin, infos, K):
    """mtp.json's entry of a prompt of T tokens from the head's logits L [T-1, V], the smallest router margin
    of its MoE block (None or inf without one) and the index infos of its indexer (top-k K; none: [])."""
    T = len(ids)
    top2 = L.topk(2, -1)
    entry = {
        "ids": ids, "rows": T - 1,
        "argmax": top2.indices[:, 0].tolist(),
        "margin": [g9(v) for v in (top2.values[:, 0] - top2.values[:, 1]).tolist()],
        "top_logit": [g9(v) for v in top2.values[:, 0].tolist()],
        "lse": [g9(v) for v in torch.logsumexp(L, -1).tolist()],
        "router_margin_min": g6(rmin) if rmin is not None and math.isfinite(rmin) else None,  # None: no MoE block
    }
    S.check(len(infos) <= 1, "at most one MTP indexer expected")
    rels = [(v, i) for i, v in enumerate(infos[0]["rel"]) if v is not None] if infos else []
    if rels:
        S.check(T - 1 > K, "selection below index_topk")
        v, i = min(rels)
        entry["index_margin_min"] = g6(v)
        entry["index_margin_min_row"] = i
    entry["last_logits"] = [g6(v) for v in L[-1].tolist()]
    return entry


def g6(x):
    return float(f"{x:.6g}")


def g9(x):
    return float(f"{x:.9g}")


def dump(obj, ind=0):
    """JSON with dicts indented and lists of numbers on one line."""
    pad = "  " * (ind + 1)
    if isinstance(obj, dict):
        items = [f"{pad}{json.dumps(k)}: {dump(v, ind + 1)}" for k, v in obj.items()]
        return "{\n" + ",\n".join(items) + "\n" + "  " * ind + "}"
    if isinstance(obj, list) and any(isinstance(v, (dict, list)) for v in obj):
        return "[\n" + ",\n".join(pad + dump(v, ind + 1) for v in obj) + "\n" + "  " * ind + "]"
    return json.dumps(obj, allow_nan=False, separators=(",", ":") if isinstance(obj, list) else None)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("model")
    ap.add_argument("out")
    a = ap.parse_args()
    torch.set_num_threads(max(1, min(8, os.cpu_count() or 1)))
    with open(os.path.join(a.model, "config.json")) as f:
        cfg = json.load(f)
    S.check(cfg["num_nextn_predict_layers"] == 1, "one MTP layer expected")
    fx = fx_from_config(cfg)
    K = cfg["index_topk"]
    st = TR.read_safetensors(os.path.join(a.model, "model.safetensors"))
    W = {k: v.to(F64) for k, v in st.items()}
    W["lm_head.weight"] = W["backbone.embeddings.weight"]
    ref, hf_refs = S.read_reference(a.out)

    torch.manual_seed(0)
    tm = TR.Model(cfg)
    TR.load_exported(tm, os.path.join(a.model, "model.safetensors"))
    tm.eval()

    out_prompts, checks = [], dict(vs_train_py_max_abs=0.0, vs_train_py_per_prompt=[], vs_train_py_main_max_abs=0.0,
                                   main_vs_spec_forward_max_abs=0.0, main_vs_reference_bin_max_abs=0.0,
                                   main_index_margin_min=[], argmax_agrees_with_train_py=True)
    for p, hf_lp in hf_refs:
        ids = p["ids"]
        T = len(ids)
        if T < 2:
            continue
        r = spec_mtp(W, fx, cfg, ids)
        lp_s, _, _ = S.spec_forward(W, fx, ids)
        checks["main_vs_spec_forward_max_abs"] = max(checks["main_vs_spec_forward_max_abs"],
                                                     (r["main_lp"] - lp_s).abs().max().item())
        checks["main_vs_reference_bin_max_abs"] = max(checks["main_vs_reference_bin_max_abs"],
                                                      (r["main_lp"] - hf_lp.double()).abs().max().item())
        rel = [x for inf in r["main_infos"] for x in inf["rel"] if x is not None]
        checks["main_index_margin_min"].append(g6(min(rel)) if rel else None)

        with torch.no_grad():
            x = torch.tensor([ids[:-1]])
            nxt = torch.tensor([ids[1:]])
            lg_t, mtp_t, _ = tm(x, nxt, True)
        mtp_t = mtp_t[0].double()
        d = (r["logits"] - mtp_t).abs().max().item()
        dm = (r["main_lp"][:-1] - torch.log_softmax(lg_t[0].double(), -1)).abs().max().item()
        checks["vs_train_py_max_abs"] = max(checks["vs_train_py_max_abs"], d)
        checks["vs_train_py_main_max_abs"] = max(checks["vs_train_py_main_max_abs"], dm)
        checks["vs_train_py_per_prompt"].append(g6(d))

        if not torch.equal(r["logits"].argmax(-1), mtp_t.argmax(-1)):
            checks["argmax_agrees_with_train_py"] = False
        entry = prompt_entry(ids, r["logits"], r["mtp_rmin"], r["mtp_infos"], K)
        out_prompts.append(entry)
        print(f"T {T}: rows {T - 1}, min logit margin {min(entry['margin']):.4g}, mtp index margin "
              f"{entry.get('index_margin_min')}, router margin {entry['router_margin_min']:.4g}, vs train.py {d:.3e} "
              f"(main {dm:.3e})", flush=True)

    for k in ("vs_train_py_max_abs", "vs_train_py_main_max_abs", "main_vs_spec_forward_max_abs",
              "main_vs_reference_bin_max_abs"):
        checks[k] = g6(checks[k])
    S.check(checks["main_vs_spec_forward_max_abs"] == 0.0, "main model differs from make_dsa_fixtures.spec_forward")
    res = {
        "generator": f"tools/default-model/mtp_reference.py (torch {torch.__version__}, float64 spec mixers of "
                     f"tools/reference/make_dsa_fixtures.py, CPU)",
        "fixture": os.path.basename(os.path.normpath(a.model)),
        "description": "MTP head logits of the trained default model, teacher-forced: row i (i = 0 .. T-2) takes the "
                       "main model's final-normed hidden state at position i and token ids[i+1] and predicts "
                       "ids[i+2]; the MTP D/E blocks run over rows 0..i causally at RoPE positions 0..i. Float64 "
                       "from the stored bf16 weights. Prompts are reference.json's with at least 2 tokens. margin = "
                       "top1 - top2 logit per row; lse = logsumexp of the row's logits; last_logits = row T-2 "
                       "(6 significant digits); index_margin_min = smallest (64th - 65th indexer score) / max |score| "
                       "of the MTP D layer over rows that select (T-1 > index_topk); router_margin_min = smallest "
                       "gap at the MTP MoE router's top-k boundary (sigmoid + correction bias).",
        "eps": cfg["layer_norm_epsilon"],
        "index_topk": K,
        "mtp_pattern": cfg["mtp_hybrid_override_pattern"],
        "vocab_size": cfg["vocab_size"],
        "prompts": out_prompts,
        "checks": checks,
    }
    path = os.path.join(a.out, "mtp.json")
    with open(path, "w") as f:
        f.write(dump(res) + "\n")
    print(json.dumps(checks), f"-> {path} ({os.path.getsize(path)} bytes)", flush=True)


if __name__ == "__main__":
    main()
