#!/usr/bin/env python3
"""Decode step time with constrained rows: `krait serve` at a batch of B streamed requests of which
none, half or all carry a JSON Schema (guided_json), on the same prompts and seeds.

Each request streams `--tokens` tokens (ignore_eos: the constrained ones are held by a schema that
cannot complete that early: an array of at least 32 objects). The step time is read from the
streams: per request, (time of token hi - time of token lo) / (hi - lo) over the steady window
where every request decodes (after the prefills, before the first one ends); the figure is the
median over the requests. Beside it, from the server's /metrics: the host time spent making masks
per step (krait:structured_output_mask_seconds over krait:engine_steps_total) and per mask. A warm-up run of the constrained workload comes first, so that the
grammar's mask cache holds its positions (the cold masks of a new schema are a one-time cost:
docs/STRUCTURED_OUTPUTS.md); `--cold` measures without it.

  python3 bench/serve/structured.py --krait build-rel/krait --model models/tiny-hybrid
  python3 bench/serve/structured.py --port 8000            # a server already running

Standard library only.
"""

import argparse
import http.client
import json
import os
import random
import statistics
import subprocess
import sys
import tempfile
import threading
import time

SCHEMA = {
    "type": "array",
    "minItems": 32,
    "items": {
        "type": "object",
        "properties": {
            "id": {"type": "integer", "minimum": 0, "maximum": 99999},
            "name": {"type": "string", "maxLength": 24},
            "tags": {"type": "array", "items": {"enum": ["red", "green", "blue"]}, "maxItems": 3},
            "score": {"type": "number", "minimum": -100, "maximum": 100},
            "ok": {"type": "boolean"},
        },
        "required": ["id", "name", "tags", "score", "ok"],
        "additionalProperties": False,
    },
}


def stream_one(host, port, body, out):
    """Runs one streamed completion; appends (t, n_tokens) per event to out."""
    c = http.client.HTTPConnection(host, port, timeout=600)
    c.request("POST", "/v1/completions", json.dumps(body), {"Content-Type": "application/json"})
    r = c.getresponse()
    if r.status != 200:
        raise RuntimeError(f"status {r.status}: {r.read()[:300]!r}")
    while True:
        line = r.readline()
        if not line:
            break
        line = line.strip()
        if not line.startswith(b"data: "):
            continue
        data = line[6:]
        if data == b"[DONE]":
            break
        ev = json.loads(data)
        n = sum(len(ch.get("token_ids") or []) for ch in ev.get("choices", []))
        if n:
            out.append((time.perf_counter(), n))
    c.close()


def metrics(host, port):
    """The server's counters this bench reads: steps, and the masks with their host time."""
    c = http.client.HTTPConnection(host, port, timeout=30)
    c.request("GET", "/metrics")
    text = c.getresponse().read().decode()
    c.close()
    out = {}
    for line in text.splitlines():
        for name in ("krait:engine_steps_total", "krait:structured_output_mask_seconds_sum",
                     "krait:structured_output_mask_seconds_count"):
            if line.startswith(name + "{") or line.startswith(name + " "):
                out[name] = float(line.rsplit(" ", 1)[1])
    return out


def step_times(series, lo, hi):
    """Per stream: seconds per token between its token lo and token hi."""
    per = []
    for ev in series:
        times = []
        for t, n in ev:
            times.extend([t] * n)
        if len(times) > hi:
            per.append((times[hi] - times[lo]) / (hi - lo))
    return per


def run_mix(a, n_con, prompts):
    bodies = []
    for i in range(a.batch):
        b = {"prompt": prompts[i], "max_tokens": a.tokens, "ignore_eos": True, "temperature": a.temperature,
             "seed": 1000 + i, "stream": True, "return_token_ids": True}
        if i < n_con:
            b["guided_json"] = SCHEMA
        bodies.append(b)
    series = [[] for _ in bodies]
    errors = []

    def work(i):
        try:
            stream_one(a.host, a.port, bodies[i], series[i])
        except Exception as e:  # reported below
            errors.append(e)

    th = [threading.Thread(target=work, args=(i,)) for i in range(a.batch)]
    m0 = metrics(a.host, a.port)
    t0 = time.perf_counter()
    for t in th:
        t.start()
    for t in th:
        t.join()
    wall = time.perf_counter() - t0
    m1 = metrics(a.host, a.port)
    if errors:
        raise RuntimeError(errors[0])
    lo, hi = a.window
    per = step_times(series, lo, hi)
    d = {k: m1.get(k, 0.0) - m0.get(k, 0.0) for k in m1}
    steps = d.get("krait:engine_steps_total", 0.0) or 1.0
    n_masks = d.get("krait:structured_output_mask_seconds_count", 0.0)
    mask_s = d.get("krait:structured_output_mask_seconds_sum", 0.0)
    return (statistics.median(per) * 1e3, min(per) * 1e3, max(per) * 1e3, wall, mask_s * 1e3 / steps,
            mask_s * 1e6 / n_masks if n_masks else 0.0)


def start_server(a):
    d = tempfile.mkdtemp(prefix="krait-structured-")
    port_file = os.path.join(d, "port")
    args = [a.krait, "serve", a.model, "--host", "127.0.0.1", "--port", "0", "--port-file", port_file,
            "--log-level", "warn", "--max-num-seqs", str(max(16, a.batch))]
    if a.threads:
        args += ["--threads", str(a.threads)]
    p = subprocess.Popen(args)
    for _ in range(600):
        if os.path.exists(port_file) and open(port_file).read().strip():
            a.port = int(open(port_file).read())
            break
        time.sleep(0.1)
    for _ in range(600):
        try:
            c = http.client.HTTPConnection(a.host, a.port, timeout=2)
            c.request("GET", "/health")
            if c.getresponse().status == 200:
                return p
        except OSError:
            pass
        time.sleep(0.1)
    p.terminate()
    sys.exit("the server did not become healthy")


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--krait", help="start this krait binary (else --port names a running server)")
    ap.add_argument("--model", default="models/tiny-hybrid")
    ap.add_argument("--threads", type=int, default=0, help="the server's --threads (0: its default)")
    ap.add_argument("--host", default="127.0.0.1")
    ap.add_argument("--port", type=int, default=8000)
    ap.add_argument("--batch", type=int, default=16)
    ap.add_argument("--tokens", type=int, default=96, help="tokens per request")
    ap.add_argument("--window", type=int, nargs=2, default=(16, 80), metavar=("LO", "HI"),
                    help="the steady tokens the step time is read over")
    ap.add_argument("--temperature", type=float, default=0.0)
    ap.add_argument("--rounds", type=int, default=2, help="runs of each mix (the quietest is kept)")
    ap.add_argument("--cold", action="store_true", help="no warm-up of the schema's masks")
    a = ap.parse_args()
    proc = start_server(a) if a.krait else None
    try:
        rng = random.Random(7)
        prompts = [[rng.randrange(1000, 100000) for _ in range(8)] for _ in range(a.batch)]
        if not a.cold:
            run_mix(a, a.batch, prompts)
        mixes = [("none", 0), ("half", a.batch // 2), ("all", a.batch)]
        print(f"batch {a.batch}, {a.tokens} tokens per request, temperature {a.temperature}, "
              f"step time over tokens {a.window[0]}..{a.window[1]} (ms)")
        print("| constrained rows | step ms (median) | min | max | mask ms per step | µs per mask | wall s |")
        print("|---|---|---|---|---|---|---|")
        for name, n in mixes:
            best = None
            for _ in range(a.rounds):
                r = run_mix(a, n, prompts)
                best = r if best is None or r[0] < best[0] else best
            print(f"| {name} ({n} of {a.batch}) | {best[0]:.2f} | {best[1]:.2f} | {best[2]:.2f} | {best[4]:.2f} | "
                  f"{best[5]:.0f} | {best[3]:.1f} |")
    finally:
        if proc:
            proc.terminate()
            proc.wait()


if __name__ == "__main__":
    main()
