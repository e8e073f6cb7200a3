#!/usr/bin/env python3
"""Nemotron-H models made the way a user makes a small one with HF (HF's own initialisation, saved in
float32), at sizes beyond the fixtures, written as fixtures for the GPU precision test.

Usage:
    python3 tools/reference/hf_bf16_probe.py ROOT [--device cuda]

Writes ROOT/nemotron_h/<slot>/ (config.json, model.safetensors, reference.json/.bin, hf_bf16.json)
for the models below, under the names of the Nemotron-H fixtures (slots), so that a copy of
tests/fixtures with these in place runs `test_cuda --filter 'cuda_backend/prompt_logprobs_match_hf*'`
on them (KR_FIXTURES=ROOT):

  nh_mamba_attn_mlp  tiny (hidden 128, vocab 1000), HF's initialisation, float32 files
  nh_moe             the same model; reference and bf16 run with HF's dt clamp (see below)
  nh_tied_f32        wide (hidden 512, vocab 4096, 10 layers), HF's initialisation, float32 files
  nh_gated           the same wide model; reference and bf16 run with HF's dt clamp
  nh_long_chunks     wide, the fixtures' initialisation (realistic weight scales), bf16 files

The reference (reference.bin) is HF in float32; hf_bf16.json is the same model cast to bfloat16, as
tools/reference/hf_bf16_deviation.py writes it for the fixtures.

HF's pure-PyTorch Mamba-2 path clamps dt from below at time_step_min (0.001 by default), which the
CUDA kernels of mamba_ssm, Megatron and HF's own CUDA path do not (time_step_limit (0, inf)); krait
follows the latter (MODEL_SPEC's dt limits). The "with HF's dt clamp" slots hold what a user running
HF without those kernels gets as a reference: the CUDA backend is then compared with a model it does
not implement, and the gap between the two slots is what the clamp alone contributes. The script
prints that gap (float32 with against without the clamp) per prompt.

Needs torch, transformers (tested for 5.17), safetensors, numpy. No network.
"""

import argparse
import copy
import json
import os
import sys

import torch

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
import hf_bf16_deviation as dev  # noqa: E402

mod = dev.load_module("make_nemotron_h_fixtures")

BASE = dict(
    seed=9001,
    desc="",
    pattern="M*M-M-",
    vocab=1000,
    hidden=128,
    mamba=dict(heads=8, head_dim=32, groups=2, state=32, conv=4, chunk=32, conv_bias=True),
    attn=dict(heads=4, kv=2, head_dim=32),
    intermediate=384,
    mlp_act="relu2",
    moe=None,
    gated=False,
    tied=False,
    prefix="backbone.",
    fused_experts=False,
    storage="f32",
    shards=1,
    config_style="e",
    prompts=[5, 17, 100, 300],
)

WIDE = dict(BASE, seed=9002, pattern="M*M-M-M*M-", vocab=4096, hidden=512,
            mamba=dict(heads=16, head_dim=64, groups=2, state=64, conv=4, chunk=64, conv_bias=True),
            attn=dict(heads=8, kv=2, head_dim=64), intermediate=1536)

# (slot, model, initialisation, reference with HF's dt clamp)
PROBES = [
    ("nh_mamba_attn_mlp", "tiny", "hf", False),
    ("nh_moe", "tiny", "hf", True),
    ("nh_tied_f32", "wide", "hf", False),
    ("nh_gated", "wide", "hf", True),
    ("nh_long_chunks", "wide", "fixture", False),
]


def set_clamp(model, on):
    """HF's dt clamp at time_step_min as its torch path applies it (on), or none (off)."""
    for m in model.modules():
        if isinstance(m, mod.mnh.NemotronHMamba2Mixer):
            lo = m.config.time_step_min if on else 0.0
            m.time_step_limit = (lo, float("inf"))
            if hasattr(m, "time_step_min"):
                m.time_step_min = lo


def make_model(fx, init, device):
    model, _ = mod.build_model(fx)  # HF's own initialisation (torch.manual_seed(0) first)
    if init == "fixture":  # (HF's initialisation is kept as it is: its files are float32)
        mod.randomize_and_round(model, fx, torch.Generator().manual_seed(fx["seed"]))
    return model.to(device).eval()


def write_fixture(d, fx, model, prompts, lps, bf16_rows, note):
    os.makedirs(d, exist_ok=True)
    for f in os.listdir(d):
        os.remove(os.path.join(d, f))
    mod.write_checkpoint(d, fx, mod.hf_to_hub(model, fx))
    mod.write_json(os.path.join(d, "config.json"), mod.config_json(fx), allow_nan=True)
    blob, entries = bytearray(), []
    for ids, lp, (toks, margins) in zip(prompts, lps, [p[1] for p in bf16_rows]):
        entries.append({"ids": ids, "logprobs_offset": len(blob), "n_rows": len(ids), "greedy": toks,
                        "greedy_margin": margins})
        blob += lp.numpy().astype("<f4").tobytes()
    with open(os.path.join(d, "reference.bin"), "wb") as f:
        f.write(bytes(blob))
    mod.write_json(os.path.join(d, "reference.json"), {
        "generator": f"tools/reference/hf_bf16_probe.py (torch {torch.__version__}, float32, no cache)",
        "fixture": os.path.basename(d), "description": note, "vocab_size": fx["vocab"], "prompts": entries,
    }, allow_nan=False)
    with open(os.path.join(d, "hf_bf16.json"), "w") as f:
        json.dump({"generator": "tools/reference/hf_bf16_probe.py", "fixture": os.path.basename(d), "notes": note,
                   "prompts": [p[0] for p in bf16_rows]}, f, indent=1)
        f.write("\n")


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("root")
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    a = ap.parse_args()
    mod.disable_tf32()
    mod.transformers.logging.set_verbosity_error()
    for slot, size, init, clamp in PROBES:
        fx = copy.deepcopy(WIDE if size == "wide" else BASE)
        fx["name"] = slot
        if init == "fixture":
            fx["storage"] = "bf16"
        model = make_model(fx, init, a.device)
        gen = torch.Generator().manual_seed(fx["seed"] + 777)
        prompts = [torch.randint(0, fx["vocab"], (n,), generator=gen).tolist() for n in fx["prompts"]]
        set_clamp(model, False)
        lp_free = [mod.hf_logprobs(model, ids, a.device).cpu() for ids in prompts]
        set_clamp(model, clamp)
        lps = [mod.hf_logprobs(model, ids, a.device).cpu() for ids in prompts]
        greedy = [mod.greedy(model, ids, lp[-1].to(a.device), a.device) for ids, lp in zip(prompts, lps)]
        b16 = copy.deepcopy(model).to(torch.bfloat16)
        set_clamp(b16, clamp)
        rows = []
        for ids, lp, lpf, g in zip(prompts, lps, lp_free, greedy):
            d16 = (dev.logprobs(b16, ids, a.device) - lp.double()).abs()
            per_pos = d16.max(dim=1).values
            rows.append(({"n": len(ids), "max": per_pos.max().item(), "mean": d16.mean().item(),
                          "per_position_max": [round(v, 6) for v in per_pos.tolist()]}, g))
            print(f"{slot:18s} {size} init={init} clamp={int(clamp)} len {len(ids):3d}: bf16 HF max "
                  f"{rows[-1][0]['max']:.4f} mean {rows[-1][0]['mean']:.5f}; clamp vs none (fp32) max "
                  f"{(lp - lpf).abs().max().item():.4f} mean {(lp - lpf).abs().mean().item():.5f}", flush=True)
        note = (f"{size} model (hidden {fx['hidden']}, vocab {fx['vocab']}, pattern {fx['pattern']}), {init} "
                f"initialisation, {fx['storage']} files; reference {'with' if clamp else 'without'} HF's dt clamp")
        write_fixture(os.path.join(a.root, "nemotron_h", slot), fx, model.cpu(), prompts, lps, rows, note)


if __name__ == "__main__":
    main()
