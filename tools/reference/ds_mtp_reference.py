#!/usr/bin/env python3
"""Reference outputs of a deepseek_v32 checkpoint's multi-token-prediction (MTP) layer, for krait's C tests.

    python3 tools/reference/ds_mtp_reference.py tests/fixtures/deepseek_v32/ds_fp8

(any python3 with torch: no transformers or safetensors package; torch 1.13 suffices.)

FIXTURE_DIR is a fixture of make_dsa_fixtures.py with an MTP layer (its FIXTURES entry of the same name has
mtp=True): config.json, model.safetensors (model.layers.{num_hidden_layers}.* holds the MTP layer),
reference.json (the prompts) and reference.bin (HF's float32 log-probabilities of the main model). The script
writes FIXTURE_DIR/mtp.json in the format of tools/default-model/mtp_reference.py.

The reference is float64 from the stored values (FP8 blocks dequantized with their weight_scale_inv), built
from the float64 spec mixers of make_dsa_fixtures.py (checked there against HF transformers per mixer):
  * main model: make_dsa_fixtures.spec_hidden, the model up to its final norm (hf [T, H]); its
    log-probabilities are compared with reference.bin (HF float32);
  * the MTP layer, DeepSeek-V3's form (the V3 report's MTP module; the layer's tensors as the released
    checkpoints store them), for rows i = 0 .. T-2 of a prompt of T >= 2 tokens, teacher-forced, p =
    model.layers.{L}.:
        e_i = rms(E[t[i+1]], p.enorm)                      (E = p.embed_tokens)
        g_i = p.eh_proj([e_i ; rms(hf_i, p.hnorm)])        (W [H, 2H]: e takes the first H columns)
        g   = g + MLA(rms(g, p.input_layernorm))           (with its lightning indexer, index_topk keys per
                                                            row; the MTP rows are their own causal stream at
                                                            RoPE positions 0 .. T-2)
        g   = g + MoE(rms(g, p.post_attention_layernorm))  (or the dense MLP where a main layer L would be)
        logits_i = rms(g_i, p.shared_head.norm) @ p.shared_head.head^T     (predicts t[i+2])
    rms(x, w) = w * x / sqrt(mean(x^2) + eps), eps = rms_norm_eps (1e-6).
The fixture's p.embed_tokens and p.shared_head.head are random tables of their own (released checkpoints store
copies of the main ones), so a loader that used the main tables instead fails the comparison.
"""
import argparse
import json
import os
import sys

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
sys.path.insert(0, os.path.join(HERE, "..", "default-model"))

import torch  # noqa: E402

import make_dsa_fixtures as S  # noqa: E402
from mtp_reference import dump, g6, prompt_entry  # noqa: E402


def e4m3(raw, shape):
    """float64 values of F8_E4M3 (e4m3fn) bytes: sign, 4 exponent bits (bias 7, 0 = subnormal), 3 mantissa bits;
    S.1111.111 is NaN (there is no infinity). Decoded here, since torch before 2.1 has no float8 type."""
    vals = []
    for b in range(256):
        sign = -1.0 if b & 0x80 else 1.0
        e, m = (b >> 3) & 0xF, b & 7
        vals.append(float("nan") if (e, m) == (15, 7) else
                    sign * (m / 8.0) * 2.0 ** -6 if e == 0 else sign * (1 + m / 8.0) * 2.0 ** (e - 7))
    idx = torch.frombuffer(bytearray(raw), dtype=torch.uint8).long()
    return torch.tensor(vals, dtype=torch.float64)[idx].reshape(shape)


def read_weights(d):
    """{name: float64 tensor} of a checkpoint directory, FP8 blocks times their weight_scale_inv."""
    raw = S.st_common().st_read_dir_raw(d)
    plain = {"BF16": torch.bfloat16, "F32": torch.float32, "F16": torch.float16}
    W = {}
    for k, (dt, shape, b) in raw.items():
        if dt == "F8_E4M3":
            W[k] = e4m3(b, shape)
        elif dt == "BF16":
            W[k] = torch.frombuffer(bytearray(b), dtype=torch.int16).view(torch.bfloat16).reshape(shape).double()
        else:
            S.check(dt in plain, f"{k}: dtype {dt}")
            W[k] = torch.frombuffer(bytearray(b), dtype=plain[dt]).reshape(shape).double()
    for k in [k for k, v in raw.items() if v[0] == "F8_E4M3"]:
        W[k] = W[k] * S.expand_scale(W.pop(k[:-len("weight")] + "weight_scale_inv"), W[k].shape)
    S.check(not any(k.endswith("weight_scale_inv") for k in W), "a weight_scale_inv without its FP8 weight")
    return W


def spec_mtp(W, fx, ids):
    """-> dict of main log-probs [T,V], MTP logits [T-1,V], MTP index infos, MTP router margin."""
    L = fx["layers"]
    p = f"model.layers.{L}."
    eps = S.block_eps(fx)
    t = torch.tensor(ids)
    hf, _, _ = S.spec_hidden(W, fx, ids)
    main_lp = torch.log_softmax(hf @ W["lm_head.weight"].T, -1)
    e = S.rms(W[p + "embed_tokens.weight"][t[1:]], W[p + "enorm.weight"], eps)
    g = torch.cat([e, S.rms(hf[:-1], W[p + "hnorm.weight"], eps)], -1) @ W[p + "eh_proj.weight"].T
    y, info, _ = S.spec_apply(W, fx, "mla_idx", p + "self_attn.", S.rms(g, W[p + "input_layernorm.weight"], eps))
    g = g + y
    kind = "moe_gated" if S.ds_layer_is_moe(fx, L) else "mlp_gated"
    y, _, mg = S.spec_apply(W, fx, kind, p + "mlp.", S.rms(g, W[p + "post_attention_layernorm.weight"], eps))
    g = g + y
    logits = S.rms(g, W[p + "shared_head.norm.weight"], eps) @ W[p + "shared_head.head.weight"].T
    return dict(main_lp=main_lp, logits=logits, infos=[info], rmin=mg.min().item() if mg is not None else None)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("fixture")
    a = ap.parse_args()
    torch.set_num_threads(max(1, min(8, os.cpu_count() or 1)))
    name = os.path.basename(os.path.normpath(a.fixture))
    fx = next((f for f in S.FIXTURES if f["name"] == name), None)
    S.check(fx is not None and fx["kind"] == "ds" and fx["mtp"], f"{name}: not a deepseek_v32 fixture with an MTP layer")
    with open(os.path.join(a.fixture, "config.json")) as f:
        cfg = json.load(f)
    S.check(cfg["num_nextn_predict_layers"] == 1 and cfg["num_hidden_layers"] == fx["layers"], "config.json")
    W = read_weights(a.fixture)
    p = f"model.layers.{fx['layers']}."
    for k in ("embed_tokens.weight", "shared_head.head.weight"):
        main_k = "model.embed_tokens.weight" if k.startswith("embed") else "lm_head.weight"
        S.check(not torch.equal(W[p + k], W[main_k]), f"{p}{k} equals {main_k}: the test would not tell them apart")
    K = cfg["index_topk"]
    _, refs = S.read_reference(a.fixture)
    out, worst_main = [], 0.0
    for pr, hf_lp in refs:
        ids = pr["ids"]
        if len(ids) < 2:
            continue
        r = spec_mtp(W, fx, ids)
        worst_main = max(worst_main, (r["main_lp"] - hf_lp.double()).abs().max().item())
        entry = prompt_entry(ids, r["logits"], r["rmin"], r["infos"], K)
        out.append(entry)
        print(f"T {len(ids)}: min logit margin {min(entry['margin']):.4g}, index margin "
              f"{entry.get('index_margin_min')}, router margin {entry['router_margin_min']}", flush=True)
    res = {
        "generator": f"tools/reference/ds_mtp_reference.py (torch {torch.__version__}, float64 spec mixers of "
                     f"tools/reference/make_dsa_fixtures.py, CPU)",
        "fixture": name,
        "description": "MTP layer logits of a deepseek_v32 checkpoint (model.layers.N.*, DeepSeek-V3's form), "
                       "teacher-forced: row i (i = 0 .. T-2) takes the main model's final-normed hidden state at "
                       "position i and token ids[i+1] and predicts ids[i+2]; the layer's attention (with its indexer) "
                       "runs over rows 0..i causally at RoPE positions 0..i. Float64 from the stored weights (FP8 "
                       "dequantized). Fields as tools/default-model/mtp_reference.py's.",
        "eps": cfg["rms_norm_eps"],
        "index_topk": K,
        "mtp_pattern": "D" + ("E" if S.ds_layer_is_moe(fx, fx["layers"]) else "-"),
        "vocab_size": cfg["vocab_size"],
        "prompts": out,
        "checks": {"main_vs_reference_bin_max_abs": g6(worst_main)},
    }
    S.check(worst_main < 1e-3, f"main model differs from reference.bin by {worst_main}")
    path = os.path.join(a.fixture, "mtp.json")
    with open(path, "w") as f:
        f.write(dump(res) + "\n")
    print(json.dumps(res["checks"]), f"-> {path} ({os.path.getsize(path)} bytes)", flush=True)


if __name__ == "__main__":
    main()
