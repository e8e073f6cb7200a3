#!/usr/bin/env python3
"""Round trip of tools/megatron: every test fixture family is written as a Megatron checkpoint
(export.py: torch_dist and legacy, several TP/PP/EP splits, a padded vocabulary) and converted
back (convert.py). Each result must hold the fixture's tensors bit for bit (names as krait's
loader reads them) and give krait's exact log-probabilities; the negative cases must be refused
with their message.

  python3 tests/megatron/roundtrip.py --krait build-test/krait [--keep DIR] [-k SUBSTRING]

Prints one line per case and `N passed, M failed`; exits nonzero on a failure."""

import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
TOOLS = os.path.join(ROOT, "tools", "megatron")
sys.path.insert(0, TOOLS)
sys.dont_write_bytecode = True  # no __pycache__ next to the sources

import layout  # noqa: E402
from common import st_read_dir_raw  # noqa: E402

FIXTURES = ["nemotron_h/nh_mamba_attn_mlp", "nemotron_h/nh_long_chunks", "nemotron_h/nh_moe", "nemotron_h/nh_gated",
            "deepseek_v32/ds_short", "hybrid/hy_mdme", "hybrid/hy_plus", "hybrid/hy_share", "hybrid/hy_norelu"]
# 70 tokens: longer than every fixture's index_topk except ds_short's 64, so DSA selection is exercised
PROMPT = [(i * 37 + 11) % 250 + 3 for i in range(70)]


def torch_version():
    try:
        import torch
        return torch.__version__
    except ImportError:
        return None


def has_torch_dcp():
    try:
        import torch.distributed.checkpoint  # noqa: F401
        return True
    except Exception:
        return False


def tp_ok(cfg, tp):
    """Whether Megatron could split this model over tp ranks (heads, groups and widths divide)."""
    keys = ["mamba_num_heads", "n_groups", "mamba_n_groups", "num_attention_heads", "intermediate_size",
            "moe_intermediate_size", "moe_shared_expert_intermediate_size"]
    pat = layout.hf_pattern(cfg)
    if "*" in pat:
        keys.append("num_key_value_heads")
    for k in keys:
        v = cfg.get(k)
        if isinstance(v, int) and v % tp:
            return False
    return True


class Runner:
    def __init__(self, krait, work):
        self.krait, self.work = krait, work
        self.passed = self.failed = 0
        self.ref_cache = {}

    def py(self, script, *args):
        p = subprocess.run([sys.executable, os.path.join(TOOLS, script)] + list(args), capture_output=True, text=True)
        return p.returncode, p.stdout + p.stderr

    def logprobs(self, model):
        if not self.krait:
            return None
        vocab = json.load(open(os.path.join(model, "config.json")))["vocab_size"]
        ids = ",".join(str(t % vocab) for t in PROMPT)
        p = subprocess.run([self.krait, "logprobs", "--model", model, "--prompt-ids", ids, "--top", "4",
                            "--threads", "2", "--log-level", "warn"], capture_output=True, text=True)
        if p.returncode:
            raise AssertionError("krait logprobs on %s failed: %s" % (model, (p.stderr or p.stdout).strip()[-300:]))
        j = json.loads(p.stdout)
        return j["prompt_logprobs"], j["top_logprobs"]

    def reference(self, fx):
        """krait's log-probabilities of the fixture as Megatron sees it: Megatron has one eps for every
        norm, so a fixture whose q/kv latent norms use another eps is compared with that eps set."""
        if fx in self.ref_cache:
            return self.ref_cache[fx]
        src = os.path.join(ROOT, "tests", "fixtures", fx)
        cfg = json.load(open(os.path.join(src, "config.json")))
        pat = layout.hf_pattern(cfg)
        model = src
        if cfg["model_type"] == "nemotron_h" and ("D" in pat or "+" in pat) and \
                cfg.get("rms_norm_eps", 1e-6) != cfg.get("layer_norm_epsilon", 1e-5):
            model = os.path.join(self.work, "ref_" + fx.replace("/", "_"))
            os.makedirs(model, exist_ok=True)
            for n in os.listdir(src):
                if n.endswith(".safetensors") or n.endswith(".index.json"):
                    dst = os.path.join(model, n)
                    if not os.path.exists(dst):
                        os.symlink(os.path.join(src, n), dst)
            cfg["rms_norm_eps"] = cfg.get("layer_norm_epsilon", 1e-5)
            json.dump(cfg, open(os.path.join(model, "config.json"), "w"))
        self.ref_cache[fx] = self.logprobs(model)
        return self.ref_cache[fx]

    def report(self, name, err):
        if err:
            self.failed += 1
            print("FAIL %s: %s" % (name, err), flush=True)
        else:
            self.passed += 1
            print("ok   %s" % name, flush=True)

    def case(self, name, fx, export_args, convert_args=(), expect=None, check=None):
        """Export + convert; `expect` is a substring the converter's refusal must contain."""
        d = os.path.join(self.work, name.replace(" ", "_").replace("/", "_"))
        ck, out = d + "_mg", d + "_out"
        try:
            rc, log = self.py("export.py", os.path.join(ROOT, "tests", "fixtures", fx), ck, *export_args)
            if rc:
                raise AssertionError("export failed: " + log.strip()[-400:])
            rc, log = self.py("convert.py", ck, out, *convert_args)
            if expect is not None:
                lines = [x for x in log.strip().splitlines() if "error" in x]
                if rc == 0:
                    raise AssertionError("converted; expected a refusal containing %r" % expect)
                if "Traceback" in log or len(lines) != 1 or expect not in lines[0]:
                    raise AssertionError("expected one error line containing %r, got: %s" % (expect, log.strip()[-400:]))
            else:
                if rc:
                    raise AssertionError("convert failed: " + log.strip()[-400:])
                (check or self.same)(fx, out, log)
            self.report(name, None)
        except AssertionError as e:
            self.report(name, str(e))
        finally:
            if not KEEP:
                shutil.rmtree(ck, ignore_errors=True)
                shutil.rmtree(out, ignore_errors=True)

    def same(self, fx, out, log):
        """Bitwise tensors, key config values, exact krait log-probabilities."""
        src = os.path.join(ROOT, "tests", "fixtures", fx)
        cfg = json.load(open(os.path.join(src, "config.json")))
        want = {}
        for n, v in st_read_dir_raw(src).items():
            k = layout.krait_name(n, cfg)
            if k is not None:
                want[k] = v
        got = st_read_dir_raw(out)
        if set(want) != set(got):
            raise AssertionError("tensor names differ: missing %s, extra %s" % (sorted(set(want) - set(got))[:3],
                                                                                sorted(set(got) - set(want))[:3]))
        for k in sorted(want):
            if want[k] != got[k]:
                w, g = want[k], got[k]
                raise AssertionError("tensor %s differs (%s %s vs %s %s%s)" % (k, w[0], w[1], g[0], g[1],
                                                                            ", bytes" if w[:2] == g[:2] else ""))
        oc = json.load(open(os.path.join(out, "config.json")))
        for key, val in (("hybrid_override_pattern", layout.hf_pattern(cfg)), ("vocab_size", cfg["vocab_size"]),
                         ("hidden_size", cfg["hidden_size"]), ("index_topk", cfg.get("index_topk")),
                         ("max_position_embeddings", cfg.get("max_position_embeddings", 4096))):
            if oc.get(key) != val:
                raise AssertionError("config %s is %r, expected %r" % (key, oc.get(key), val))
        if self.logprobs(out) != self.reference(fx):
            raise AssertionError("krait log-probabilities differ from the fixture's")


KEEP = None


def main():
    global KEEP
    ap = argparse.ArgumentParser()
    ap.add_argument("--krait", required=True, help="krait binary (runs `krait logprobs`); 'none': compare tensors "
                                                   "and config only")
    ap.add_argument("--keep", help="work directory to keep (default: a temporary one, removed)")
    ap.add_argument("-k", help="run only cases whose name contains this")
    o = ap.parse_args()
    if not torch_version():
        print("0 passed, 1 failed (PyTorch is not importable by %s)" % sys.executable)
        sys.exit(1)
    KEEP = o.keep
    work = o.keep or tempfile.mkdtemp(prefix="krait-megatron-")
    os.makedirs(work, exist_ok=True)
    r = Runner(None if o.krait == "none" else os.path.abspath(o.krait), work)
    dcp_note = "torch.distributed.checkpoint" if has_torch_dcp() else "builtin DCP reader/writer"
    print("torch %s, %s, %s" % (torch_version(), dcp_note, sys.executable), flush=True)

    def want(name):
        return not o.k or o.k in name

    for fx in FIXTURES:
        cfg = json.load(open(os.path.join(ROOT, "tests", "fixtures", fx, "config.json")))
        pat = layout.hf_pattern(cfg)
        tag = fx.split("/")[1]
        variants = [
            ("torch_dist TP1", ["--format", "torch_dist"], []),
            ("legacy TP1", ["--format", "legacy", "--final-norm", "final_layernorm"], []),
        ]
        if tp_ok(cfg, 2):
            variants += [
                ("torch_dist TP2", ["--format", "torch_dist", "--tp", "2"], []),
                ("legacy TP2", ["--format", "legacy", "--tp", "2", "--conv-spelling", "param"], []),
                ("legacy TP2 PP2", ["--format", "legacy", "--tp", "2", "--pp", "2"], []),
                ("padded vocab torch_dist TP2", ["--format", "torch_dist", "--tp", "2",
                                                 "--make-vocab-size-divisible-by", "96"],
                 ["--vocab-size", str(cfg["vocab_size"])]),
            ]
        else:
            variants += [("legacy PP2", ["--format", "legacy", "--pp", "2"], [])]
        if tp_ok(cfg, 4):
            variants.append(("legacy TP4", ["--format", "legacy", "--tp", "4"], []))
        variants.append(("padded vocab legacy", ["--format", "legacy", "--make-vocab-size-divisible-by", "100"],
                         ["--vocab-size", str(cfg["vocab_size"])]))
        if "E" in pat:
            variants.append(("legacy EP2", ["--format", "legacy", "--ep", "2", "--expert-layout", "sequential"], []))
            if tp_ok(cfg, 2):
                variants.append(("legacy TP2 PP2 EP2", ["--format", "legacy", "--tp", "2", "--pp", "2", "--ep", "2"], []))
        if has_torch_dcp():  # the builtin reader against files torch itself wrote, and the reverse
            variants.append(("torch_dist TP1 builtin reader", ["--format", "torch_dist", "--dcp", "torch"],
                             ["--dcp", "builtin"]))
            variants.append(("torch_dist TP1 builtin writer", ["--format", "torch_dist", "--dcp", "builtin"],
                             ["--dcp", "torch"]))
        for vname, ea, ca in variants:
            name = "%s %s" % (tag, vname)
            if want(name):
                r.case(name, fx, ea, ca)

    # structural cases
    def padded_kept(fx, out, log):
        oc = json.load(open(os.path.join(out, "config.json")))
        if oc["vocab_size"] != 288 or "keeping all 288 embedding rows" not in log:
            raise AssertionError("vocab_size %s, log: %s" % (oc["vocab_size"], log.strip()[-300:]))
        r.logprobs(out)  # loads and runs

    def mtp_dropped(fx, out, log):
        if "dropping 1 multi-token-prediction layer" not in log or "dropped 2 mtp.* tensors" not in log:
            raise AssertionError("no MTP log line: " + log.strip()[-300:])
        r.same(fx, out, log)

    def tied(fx, out, log):
        oc = json.load(open(os.path.join(out, "config.json")))
        names = st_read_dir_raw(out)
        if not oc["tie_word_embeddings"] or "lm_head.weight" in names:
            raise AssertionError("expected tie_word_embeddings and no lm_head.weight")
        r.logprobs(out)

    extra = [
        ("padded vocab kept (no --vocab-size)", "hybrid/hy_mdme",
         ["--format", "torch_dist", "--make-vocab-size-divisible-by", "96"], [], None, padded_kept),
        ("mtp layers dropped", "hybrid/hy_mdme", ["--format", "torch_dist", "--set", "mtp_num_layers=1"], [], None,
         mtp_dropped),
        ("tied embeddings", "nemotron_h/nh_mamba_attn_mlp",
         ["--format", "legacy", "--set", "untie_embeddings_and_output_weights=False"], [], None, tied),
        ("refuse unknown symbol G", "hybrid/hy_mdme", ["--format", "torch_dist", "--set", "hybrid_layer_pattern=MG-ME-D"],
         [], "symbol 'G' at 1 (GatedDeltaNet layer) is not supported", None),
        ("refuse unknown symbol W (legacy)", "hybrid/hy_mdme",
         ["--format", "legacy", "--tp", "2", "--set", "hybrid_layer_pattern=MD-MW-D"], [], "symbol 'W' at 4", None),
        # args that make a layer with indexer tensors a skip layer: the weights and args disagree
        ("refuse indexer tensors on a layer that reuses a top-k", "hybrid/hy_mdme",
         ["--format", "torch_dist", "--set", "dsa_indexer_topk_freq=2"], [],
         "layer 1 holds indexer tensors, but dsa_indexer_topk_freq=2", None),
        # orthonormal rotation and an fp32 key norm: the same model for krait (the same logprobs)
        ("dsa_indexer_rotate_activation=false", "hybrid/hy_mdme",
         ["--format", "torch_dist", "--set", "dsa_indexer_rotate_activation=False"], [], None, r.same),
        ("dsa_indexer_k_norm_fp32=true", "hybrid/hy_mdme",
         ["--format", "legacy", "--set", "dsa_indexer_k_norm_fp32=True"], [], None, r.same),
        ("refuse LayerNorm", "nemotron_h/nh_moe", ["--format", "torch_dist", "--set", "normalization=LayerNorm"], [],
         "normalization=LayerNorm", None),
        ("refuse vocab larger than the rows", "nemotron_h/nh_moe", ["--format", "torch_dist"], ["--vocab-size", "300"],
         "vocabulary size 300 exceeds the 256 embedding rows", None),
    ]
    for name, fx, ea, ca, expect, check in extra:
        if want(name):
            r.case(name, fx, ea, ca, expect, check)

    if not o.keep:
        shutil.rmtree(work, ignore_errors=True)
    print("%d passed, %d failed" % (r.passed, r.failed))
    sys.exit(1 if r.failed or not r.passed else 0)


if __name__ == "__main__":
    main()
