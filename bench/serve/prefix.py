#!/usr/bin/env python3
"""Prefix-cache figures of `krait serve` (docs/PERF.md): starts the server twice on one checkpoint,
with the prefix cache (default flags) and with --no-enable-prefix-caching, and runs on each:

  shared:  a warm-up request of an 8,192-token prefix + 64 tokens, then ten requests of the same
           prefix + 64 new tokens each, one at a time: time to first token (TTFT) of each;
  conv:    a 10-turn conversation (each turn adds 512 new prompt tokens; the answer's 128 tokens
           go back into the next prompt): TTFT per turn;
  load:    --load-prompts requests at concurrency --load-concurrency sharing a --load-prefix-token
           prefix (then 512 own tokens, 128 out): output tok/s and the prefix cache's hit rate.

Greedy token ids of both servers are compared (shared and conv): bf16 rounding differs with the
prefill chunking, so a later token may legitimately diverge after a near tie; the match counts are
reported, not asserted. Prompts are token ids (the server runs with --skip-tokenizer-init).

  python3 bench/serve/prefix.py --krait build/krait --model DIR --out DIR [--serve-arg ...]
"""
import argparse
import asyncio
import json
import os
import random
import statistics
import subprocess
import sys
import tempfile
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import load as L  # noqa: E402


async def metric(host, port, name):
    st, body = await L.http_get(host, port, "/metrics")
    for line in body.decode(errors="replace").splitlines():
        if line.startswith(name + "{") or line.startswith(name + " "):
            return float(line.rsplit(" ", 1)[1])
    return float("nan")


def body(ids, max_tokens):
    return {"prompt": ids, "max_tokens": max_tokens, "temperature": 0, "ignore_eos": True, "stream": True,
            "stream_options": {"include_usage": True}, "return_token_ids": True}


async def one(host, port, ids, max_tokens):
    res = await L.run_one(L.Req("/v1/completions", body(ids, max_tokens), timeout=600), host, port)
    if res.outcome != "ok":
        raise RuntimeError(f"request failed: {res.describe()}")
    return res


async def long_prompts(host, port, a):
    """Cold prompts of --long lengths, one at a time, 1 token out: TTFT and the snapshots taken."""
    rng = random.Random(a.seed + 1)
    rows = []
    for n in a.long:
        s0 = await metric(host, port, "krait:prefix_cache_snapshots_total")
        r = await one(host, port, L.random_ids(rng, n, a.token_lo, a.token_hi), 1)
        rows.append({"tokens": n, "ttft_s": r.ttft,
                     "snapshots": (await metric(host, port, "krait:prefix_cache_snapshots_total")) - s0})
    return {"long": rows}


async def scenarios(host, port, a):
    if a.long:
        return await long_prompts(host, port, a)
    rng = random.Random(a.seed)
    out = {}
    # shared prefix
    prefix = L.random_ids(rng, a.shared_prefix, a.token_lo, a.token_hi)
    await one(host, port, prefix + L.random_ids(rng, 64, a.token_lo, a.token_hi), 1)
    h0 = await metric(host, port, "krait:prefix_cache_hits_total")
    ttft, toks = [], []
    for _ in range(10):
        r = await one(host, port, prefix + L.random_ids(rng, 64, a.token_lo, a.token_hi), 16)
        ttft.append(r.ttft)
        toks.append(r.token_ids.get(0, []))
    out["shared"] = {"ttft_s": ttft, "tokens": toks,
                     "hit_tokens": (await metric(host, port, "krait:prefix_cache_hits_total")) - h0}
    # conversation
    conv = L.random_ids(rng, a.turn, a.token_lo, a.token_hi)
    ttft, toks, lens = [], [], []
    for _ in range(a.turns):
        r = await one(host, port, conv, a.answer)
        ttft.append(r.ttft)
        ans = r.token_ids.get(0, [])
        toks.append(ans)
        lens.append(len(conv))
        conv = conv + ans + L.random_ids(rng, a.turn, a.token_lo, a.token_hi)
    out["conv"] = {"ttft_s": ttft, "tokens": toks, "prompt_len": lens}
    # prefix-sharing load
    q0 = await metric(host, port, "krait:prefix_cache_queries_total")
    h0 = await metric(host, port, "krait:prefix_cache_hits_total")
    sp = L.random_ids(rng, a.load_prefix, a.token_lo, a.token_hi)
    reqs = [L.Req("/v1/completions", body(sp + L.random_ids(rng, a.turn, a.token_lo, a.token_hi), a.answer),
                  timeout=900)
            for _ in range(a.load_prompts)]
    t0 = time.perf_counter()
    res = await L.run_closed(reqs, host, port, a.load_concurrency)
    dur = time.perf_counter() - t0
    s = L.summarize(res, dur)
    q1 = await metric(host, port, "krait:prefix_cache_queries_total")
    h1 = await metric(host, port, "krait:prefix_cache_hits_total")
    out["load"] = {"output_throughput": s.get("output_throughput"), "completed": s.get("completed"),
                   "failed": s.get("failed"), "duration_s": dur,
                   "median_ttft_ms": (s.get("ttft_ms") or {}).get("p50"), "hit_rate": (h1 - h0) / (q1 - q0) if q1 > q0 else 0.0}
    return out


async def serve_and_run(a, flags, log_path):
    fd, pf = tempfile.mkstemp(prefix="krait-prefix-port-")
    os.close(fd)
    os.unlink(pf)
    cmd = [a.krait, "serve", a.model, "--host", "127.0.0.1", "--port", "0", "--port-file", pf, "--skip-tokenizer-init",
           "--max-model-len", str(a.max_model_len), "--log-level", "info"] + flags
    for s in a.serve_arg:
        cmd += s.split()
    log = open(log_path, "ab")
    log.write(("$ " + " ".join(cmd) + "\n").encode())
    log.flush()
    proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL)
    try:
        port = None
        t0 = time.monotonic()
        while time.monotonic() - t0 < a.start_timeout:
            if proc.poll() is not None:
                raise RuntimeError(f"krait serve exited with {proc.returncode} (log {log_path})")
            if port is None and os.path.exists(pf):
                try:
                    port = int(open(pf).read().strip() or 0) or None
                except ValueError:
                    pass
            if port:
                try:
                    st, _ = await L.http_get("127.0.0.1", port, "/health", timeout=5)
                    if st == 200:
                        break
                except (OSError, ConnectionError):
                    pass
            await asyncio.sleep(0.2)
        else:
            raise RuntimeError("krait serve did not become healthy")
        return await scenarios("127.0.0.1", port, a)
    finally:
        proc.terminate()
        try:
            proc.wait(timeout=60)
        except subprocess.TimeoutExpired:
            proc.kill()
        log.close()


def med(xs):
    xs = [x for x in xs if x is not None]
    return statistics.median(xs) if xs else float("nan")


def matching(ta, tb):
    """Requests whose tokens are equal; and for the others the first position that differs."""
    same, first = 0, []
    for x, y in zip(ta, tb):
        if x == y:
            same += 1
        else:
            first.append(next((i for i, (p, q) in enumerate(zip(x, y)) if p != q), min(len(x), len(y))))
    return same, first


def report(on, off):
    lines = ["| scenario | prefix cache on | off |", "| --- | --- | --- |"]
    lines.append(f"| shared prefix + 64: TTFT median (ms) | {med(on['shared']['ttft_s']) * 1e3:.1f} | "
                 f"{med(off['shared']['ttft_s']) * 1e3:.1f} |")
    lines.append(f"| shared: TTFT each (ms) | {', '.join(f'{x * 1e3:.0f}' for x in on['shared']['ttft_s'])} | "
                 f"{', '.join(f'{x * 1e3:.0f}' for x in off['shared']['ttft_s'])} |")
    lines.append(f"| shared: tokens restored | {on['shared']['hit_tokens']:.0f} | {off['shared']['hit_tokens']:.0f} |")
    lines.append(f"| conversation: prompt tokens per turn | {', '.join(str(x) for x in on['conv']['prompt_len'])} | |")
    lines.append(f"| conversation: TTFT per turn (ms) | {', '.join(f'{x * 1e3:.0f}' for x in on['conv']['ttft_s'])} | "
                 f"{', '.join(f'{x * 1e3:.0f}' for x in off['conv']['ttft_s'])} |")
    for k in ("output_throughput", "median_ttft_ms", "hit_rate", "completed", "failed", "duration_s"):
        x, y = on["load"].get(k), off["load"].get(k)
        f = (lambda v: f"{v:.3f}" if isinstance(v, float) else str(v))
        lines.append(f"| load: {k} | {f(x)} | {f(y)} |")
    s1, d1 = matching(on["shared"]["tokens"], off["shared"]["tokens"])
    s2, d2 = matching(on["conv"]["tokens"], off["conv"]["tokens"])
    n1, n2 = len(on["shared"]["tokens"]), len(on["conv"]["tokens"])
    lines.append(f"| greedy tokens equal (shared) | {s1}/{n1} (first differences at {d1}) | |")
    lines.append(f"| greedy tokens equal (conversation) | {s2}/{n2} (first differences at {d2}) | |")
    return "\n".join(lines)


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--krait", required=True)
    ap.add_argument("--model", required=True)
    ap.add_argument("--out", required=True)
    ap.add_argument("--serve-arg", action="append", default=[])
    ap.add_argument("--max-model-len", type=int, default=16384)
    ap.add_argument("--load-prompts", type=int, default=256)
    ap.add_argument("--load-concurrency", type=int, default=64)
    ap.add_argument("--load-prefix", type=int, default=4096)
    ap.add_argument("--shared-prefix", type=int, default=8192)
    ap.add_argument("--turn", type=int, default=512)
    ap.add_argument("--answer", type=int, default=128)
    ap.add_argument("--turns", type=int, default=10)
    ap.add_argument("--token-lo", type=int, default=1000)
    ap.add_argument("--token-hi", type=int, default=30000)
    ap.add_argument("--seed", type=int, default=7)
    ap.add_argument("--start-timeout", type=float, default=300)
    ap.add_argument("--only", choices=["on", "off"], default=None)
    ap.add_argument("--long", type=lambda s: [int(x) for x in s.split(",")], default=None,
                    help="comma-separated prompt lengths: only cold prompts of these lengths, TTFT on and off")
    a = ap.parse_args()
    os.makedirs(a.out, exist_ok=True)
    res = {}
    for name, flags in (("on", []), ("off", ["--no-enable-prefix-caching"])):
        if a.only and a.only != name:
            continue
        t0 = time.monotonic()
        res[name] = asyncio.run(serve_and_run(a, flags, os.path.join(a.out, f"server-{name}.log")))
        res[name]["wall_s"] = time.monotonic() - t0
        with open(os.path.join(a.out, f"prefix-{name}.json"), "w") as fp:
            json.dump(res[name], fp)
        print(f"{name}: done in {res[name]['wall_s']:.0f} s", flush=True)
    if "on" in res and "off" in res and a.long:
        text = "| prompt tokens | TTFT on (ms) | snapshots taken | TTFT off (ms) |\n|---|---|---|---|\n" + "\n".join(
            f"| {x['tokens']} | {x['ttft_s'] * 1e3:.0f} | {x['snapshots']:.0f} | {y['ttft_s'] * 1e3:.0f} |"
            for x, y in zip(res["on"]["long"], res["off"]["long"]))
        print(text)
        with open(os.path.join(a.out, "prefix-long.md"), "w") as fp:
            fp.write(text + "\n")
    elif "on" in res and "off" in res:
        text = report(res["on"], res["off"])
        print(text)
        with open(os.path.join(a.out, "prefix.md"), "w") as fp:
            fp.write(text + "\n")


if __name__ == "__main__":
    main()
