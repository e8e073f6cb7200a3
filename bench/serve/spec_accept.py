#!/usr/bin/env python3
"""Acceptance of speculative drafts on real text: held-out prompts of the default model's data
(tools/default-model/data.py OUT_DIR: heldout.txt and chat-heldout.jsonl, never trained on) sent to
a running `krait serve` one at a time (batch 1) or N at a time, and what the server counted
meanwhile (/metrics before and after, bench/serve/load.py's counter_figures): drafts, drafted and
accepted tokens, the mean acceptance length (1 + accepted / drafts) and the rate per draft position,
with the client's output tokens per second. Standard library only.

    python3 bench/serve/spec_accept.py --port 8000 --data DIR [--prompts 32] [--max-tokens 128]
                                       [--temperature 0] [--concurrency 1] [--json FILE]

Text prompts are the first --text-chars characters of held-out documents (cut at a word); chat
prompts are held-out conversations up to their last user turn (with their tools, if any), sent to
/v1/chat/completions. Half of the prompts of each kind, in the file's order.
"""
import argparse
import asyncio
import json
import os
import sys
import threading
import time
import urllib.request

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import load  # noqa: E402


def prompts_from(data, n, chars):
    docs = open(os.path.join(data, "heldout.txt"), encoding="utf-8").read().split("\n\x1e\n")
    text = []
    for d in docs:
        d = d.strip()
        if len(d) < chars:
            continue
        cut = d[:chars]
        text.append(cut[:cut.rfind(" ")] if " " in cut else cut)
        if len(text) >= (n + 1) // 2:
            break
    chats = []
    for line in open(os.path.join(data, "chat-heldout.jsonl"), encoding="utf-8"):
        c = json.loads(line)
        msgs = c["messages"]
        last = max(i for i, m in enumerate(msgs) if m["role"] == "user")
        body = {"messages": msgs[:last + 1]}
        if c.get("tools"):
            body["tools"] = c["tools"]
        chats.append(body)
        if len(chats) >= n // 2:
            break
    return [("/v1/completions", {"prompt": p}) for p in text] + [("/v1/chat/completions", b) for b in chats]


def post(port, path, body):
    req = urllib.request.Request(f"http://127.0.0.1:{port}{path}", data=json.dumps(body).encode(),
                                 headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=600) as r:
        return json.loads(r.read())


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--port", type=int, default=8000)
    ap.add_argument("--data", required=True, help="tools/default-model/data.py's output directory")
    ap.add_argument("--prompts", type=int, default=32)
    ap.add_argument("--text-chars", type=int, default=400)
    ap.add_argument("--max-tokens", type=int, default=128)
    ap.add_argument("--temperature", type=float, default=0.0)
    ap.add_argument("--concurrency", type=int, default=1)
    ap.add_argument("--json", help="write the figures here")
    a = ap.parse_args()
    work = prompts_from(a.data, a.prompts, a.text_chars)
    m0 = asyncio.run(load.scrape_counters("127.0.0.1", a.port))
    out_tokens = [0]
    lock = threading.Lock()
    queue = list(enumerate(work))

    def worker():
        while True:
            with lock:
                if not queue:
                    return
                i, (path, body) = queue.pop(0)
            b = dict(body, max_tokens=a.max_tokens, temperature=a.temperature, seed=1000 + i)
            r = post(a.port, path, b)
            with lock:
                out_tokens[0] += r["usage"]["completion_tokens"]

    t0 = time.time()
    th = [threading.Thread(target=worker) for _ in range(a.concurrency)]
    for t in th:
        t.start()
    for t in th:
        t.join()
    wall = time.time() - t0
    m1 = asyncio.run(load.scrape_counters("127.0.0.1", a.port))
    fig = load.counter_figures(m0, m1)
    res = {"prompts": len(work), "concurrency": a.concurrency, "temperature": a.temperature,
           "max_tokens": a.max_tokens, "output_tokens": out_tokens[0], "wall_s": wall,
           "output_tokens_per_s": out_tokens[0] / wall if wall > 0 else None, "server": fig}
    sd = fig.get("spec_decode")
    print(f"prompts {len(work)} (concurrency {a.concurrency}, temperature {a.temperature}): "
          f"{out_tokens[0]} tokens in {wall:.2f} s = {res['output_tokens_per_s']:.1f} tok/s; "
          f"{fig['tokens_per_step'] or 0:.3f} tokens per engine step")
    if sd:
        pp = ", ".join(f"{x:.3f}" for x in sd["per_position_acceptance_rate"] if x is not None)
        print(f"drafts {sd['drafts']:.0f}, drafted {sd['draft_tokens']:.0f}, accepted {sd['accepted_tokens']:.0f}: "
              f"acceptance rate {sd['acceptance_rate'] or 0:.3f}, mean acceptance length "
              f"{sd['mean_acceptance_length'] or 0:.3f}, per position [{pp}]")
    if a.json:
        with open(a.json, "w") as f:
            json.dump(res, f, indent=1)


if __name__ == "__main__":
    main()
