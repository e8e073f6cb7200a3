#!/usr/bin/env python3
"""How far HF transformers in bfloat16 is from its own float32 reference, on every HF fixture.

Usage:
    python3 tools/reference/hf_bf16_deviation.py FIXTURES_DIR [--device cuda] [--only NAME ...]

For each fixture of tools/reference/make_nemotron_h_fixtures.py (FIXTURES_DIR/nemotron_h/<name>) and
tools/reference/make_dsa_fixtures.py (FIXTURES_DIR/deepseek_v32/<name>, FIXTURES_DIR/hybrid/<name>):

  1. rebuild the HF model exactly as the fixture script does (same seeds, same weights), in float32,
     and check that it reproduces the stored reference (reference.bin) within 1e-4: the model below
     is the fixture's model;
  2. cast the whole model to bfloat16 (what `from_pretrained(..., torch_dtype=torch.bfloat16)`
     gives: weights, norms, the Mamba parameters, activations and caches in bf16) and evaluate the
     stored prompts again (one forward pass each, no cache);
  3. write FIXTURES_DIR/<family>/<name>/hf_bf16.json: per prompt, |logprob(bf16) - reference| as
     the largest over every position and vocabulary entry, the mean, and the largest per position.

The GPU tests (tests/gpu/test_backend.c, prompt_logprobs_match_hf) bound the CUDA backend's deviation
from the reference relative to these figures: HF's own bf16 run is what bf16 arithmetic costs on
the same weights.

Needs torch, transformers (tested for 5.17), safetensors, numpy. No network.
"""

import argparse
import importlib.util
import json
import os
import sys

import torch

HERE = os.path.dirname(os.path.abspath(__file__))


def load_module(name):
    if name in sys.modules:
        return sys.modules[name]
    spec = importlib.util.spec_from_file_location(name, os.path.join(HERE, name + ".py"))
    mod = importlib.util.module_from_spec(spec)
    sys.modules[name] = mod
    spec.loader.exec_module(mod)
    return mod


def read_prompts(d):
    """[(ids, float32 reference rows as float64)] of fixture directory d, read by the fixture scripts'
    own reader (both families write reference.json / reference.bin alike)."""
    _, refs = load_module("make_nemotron_h_fixtures").read_reference(d)
    return [(p["ids"], lp.double()) for p, lp in refs]


def logprobs(model, ids, device):
    with torch.no_grad():
        out = model(input_ids=torch.tensor([ids], dtype=torch.long, device=device), use_cache=False)
    return torch.log_softmax(out.logits[0].double(), dim=-1).cpu()


def evaluate(name, d, model, device, gen_note):
    prompts = read_prompts(d)
    worst32 = 0.0
    for ids, lp_ref in prompts:
        worst32 = max(worst32, (logprobs(model, ids, device) - lp_ref).abs().max().item())
    if worst32 > 1e-4:
        raise AssertionError(f"{name}: the rebuilt float32 model is {worst32:.3g} from reference.bin: not the "
                             f"fixture's model")
    model.to(torch.bfloat16)
    rows = []
    for ids, lp_ref in prompts:
        dev = (logprobs(model, ids, device) - lp_ref).abs()
        if not torch.isfinite(dev).all():
            raise AssertionError(f"{name}: non-finite bf16 log-probabilities")
        per_pos = dev.max(dim=1).values
        rows.append({"n": len(ids), "max": per_pos.max().item(), "mean": dev.mean().item(),
                     "per_position_max": [round(v, 6) for v in per_pos.tolist()]})
        print(f"  {name:20s} len {len(ids):3d}: bf16 HF max |lp - ref| {rows[-1]['max']:.4f} mean "
              f"{rows[-1]['mean']:.5f}", flush=True)
    doc = {
        "generator": f"tools/reference/hf_bf16_deviation.py (torch {torch.__version__}, transformers "
                     f"{__import__('transformers').__version__}, device {device}; {gen_note})",
        "fixture": name,
        "notes": "HF transformers with the whole model cast to bfloat16, the stored prompts in one forward pass "
                 "each, no cache; |logprob - reference.bin| over every position and vocabulary entry. The float32 "
                 f"rebuild reproduced reference.bin within {worst32:.2g}.",
        "prompts": rows,
    }
    with open(os.path.join(d, "hf_bf16.json"), "w") as f:
        json.dump(doc, f, indent=1)
        f.write("\n")


FAILED = []


def guarded(name, fn):
    try:
        fn()
    except Exception as e:  # report and go on with the next fixture
        import traceback
        traceback.print_exc()
        FAILED.append(f"{name}: {e}")


def nemotron_h_one(mod, fx, d, device):
    model, _ = mod.build_model(fx)
    gen = torch.Generator().manual_seed(fx["seed"])
    mod.randomize_and_round(model, fx, gen)
    model.to(device)
    mod.disable_dt_clamp(model)
    model.eval()
    evaluate(fx["name"], d, model, device, "model rebuilt by make_nemotron_h_fixtures.py")


def dsa_one(mod, fx, d, device):
    _, W = mod.generate_weights(fx)
    model, _ = mod.build_model(fx, W, device)
    model.eval()
    evaluate(fx["name"], d, model, device, "model rebuilt by make_dsa_fixtures.py")


def run_nemotron_h(mod, root, only, device):
    for fx in mod.FIXTURES:
        d = os.path.join(root, "nemotron_h", fx["name"])
        if (only and fx["name"] not in only) or not os.path.exists(os.path.join(d, "reference.json")):
            continue
        guarded(fx["name"], lambda: nemotron_h_one(mod, fx, d, device))


def run_dsa(mod, root, only, device):
    mod.import_hf()["transformers"].logging.set_verbosity_error()
    for fx in mod.FIXTURES:
        d = mod.fx_dir(root, fx)
        if (only and fx["name"] not in only) or fx.get("spec_ref") or \
                not os.path.exists(os.path.join(d, "reference.json")):
            continue
        guarded(fx["name"], lambda: dsa_one(mod, fx, d, device))


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("root")
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--only", nargs="*", default=[])
    a = ap.parse_args()
    for modname, run in (("make_nemotron_h_fixtures", run_nemotron_h), ("make_dsa_fixtures", run_dsa)):
        def family():
            mod = load_module(modname)
            mod.disable_tf32()
            run(mod, a.root, set(a.only), a.device)
        guarded(modname, family)
    if FAILED:
        print("FAILED: " + "; ".join(FAILED), file=sys.stderr)
        sys.exit(1)


if __name__ == "__main__":
    main()
