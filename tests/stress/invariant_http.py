#!/usr/bin/env python3
"""`krait serve --batch-invariant` over HTTP: a completion's tokens and log-probabilities are the same
bits whether the request is served alone or among many concurrent ones.

Starts `krait serve MODEL --batch-invariant --port 0 --port-file F` (plus --serve-arg flags), then:
  1. alone: each probe request (token-id prompts of 1 token to a few 256-token chunks; greedy for
     even probes, seeded sampling at temperature 0.9 for odd ones; logprobs with 2 alternatives)
     is sent by itself and its answer kept;
  2. together: the same probes again, each in the middle of a crowd of concurrent requests (long
     prompts that arrive at once, so that the server cuts prompts into chunks and mixes prefills
     with decodes), with some crowd requests cut by their clients mid-stream;
  3. every probe's choice (token ids, each log-probability and its alternatives) must be equal to
     the alone one exactly: the JSON numbers are the server's float printed in full, so an equal
     string is the same bits.
Standard library only. Exit status 0 when every probe matched; the first mismatch is printed.
"""
import argparse
import http.client
import json
import os
import random
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time


def post(port, body, timeout=600):
    c = http.client.HTTPConnection("127.0.0.1", port, timeout=timeout)
    c.request("POST", "/v1/completions", json.dumps(body), {"Content-Type": "application/json"})
    r = c.getresponse()
    data = r.read()
    c.close()
    if r.status != 200:
        raise RuntimeError("HTTP %d: %s" % (r.status, data[:300]))
    return json.loads(data)


def cut_stream(port, body, after_bytes):
    """A streamed request whose client leaves after reading some bytes."""
    try:
        s = socket.create_connection(("127.0.0.1", port), timeout=60)
        payload = json.dumps(dict(body, stream=True)).encode()
        s.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                  b"Content-Length: %d\r\n\r\n" % len(payload) + payload)
        got = 0
        while got < after_bytes:
            chunk = s.recv(4096)
            if not chunk:
                break
            got += len(chunk)
        s.close()
    except OSError:
        pass


def preemptions(port):
    """krait:num_preemptions_total from the server's /metrics (0 when absent)."""
    c = http.client.HTTPConnection("127.0.0.1", port, timeout=30)
    c.request("GET", "/metrics")
    text = c.getresponse().read().decode()
    c.close()
    n = 0
    for line in text.splitlines():
        if line.startswith("krait:num_preemptions_total"):
            n += int(float(line.split()[-1]))
    return n


def choice_key(resp):
    ch = resp["choices"][0]
    lp = ch.get("logprobs") or {}
    return json.dumps({"text": ch.get("text"), "tokens": lp.get("tokens"), "lp": lp.get("token_logprobs"),
                       "top": lp.get("top_logprobs"), "finish": ch.get("finish_reason")}, sort_keys=True)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--krait", required=True)
    ap.add_argument("--model", required=True)
    ap.add_argument("--serve-arg", action="append", default=[])
    ap.add_argument("--probes", type=int, default=10)
    ap.add_argument("--crowd", type=int, default=24)
    ap.add_argument("--max-tokens", type=int, default=16)
    ap.add_argument("--max-prompt", type=int, default=900)
    ap.add_argument("--token-lo", type=int, default=3)
    ap.add_argument("--token-hi", type=int, default=4000)
    ap.add_argument("--log", default=None)
    ap.add_argument("--min-preemptions", type=int, default=0,
                    help="fail unless the server preempted at least this many sequences (its /metrics)")
    a = ap.parse_args()

    rng = random.Random(12345)
    port_file = tempfile.mktemp(prefix="krait-port-")
    log = open(a.log or os.devnull, "w")
    cmd = [a.krait, "serve", a.model, "--batch-invariant", "--host", "127.0.0.1", "--port", "0",
           "--port-file", port_file, "--skip-tokenizer-init"]
    for s in a.serve_arg:
        cmd += s.split(" ", 1) if s.startswith("--") and " " in s else [s]
    srv = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT)
    try:
        port = None
        t0 = time.time()
        while time.time() - t0 < 600 and srv.poll() is None:
            if os.path.exists(port_file) and os.path.getsize(port_file) > 0:
                port = int(open(port_file).read().strip())
                try:
                    c = http.client.HTTPConnection("127.0.0.1", port, timeout=5)
                    c.request("GET", "/health")
                    if c.getresponse().status == 200:
                        break
                except OSError:
                    pass
            time.sleep(0.2)
        else:
            print("invariant_http: the server did not come up (exit %s)" % srv.poll())
            return 1
        lens = [1, 7, 40, 255, 256, 257, 300, 513, 700, a.max_prompt]
        probes = []
        for i in range(a.probes):
            n = min(lens[i % len(lens)], a.max_prompt)
            body = {"model": a.model, "prompt": [rng.randrange(a.token_lo, a.token_hi) for _ in range(n)],
                    "max_tokens": a.max_tokens, "logprobs": 2, "ignore_eos": True,
                    "temperature": 0.9 if i % 2 else 0.0, "seed": 100 + i}
            probes.append(body)
        alone = [choice_key(post(port, b)) for b in probes]

        together = [None] * len(probes)
        errors = []

        def probe(i):
            try:
                together[i] = choice_key(post(port, probes[i]))
            except Exception as e:  # noqa: BLE001
                errors.append("probe %d: %s" % (i, e))

        def crowd(j):
            n = rng.randrange(1, a.max_prompt + 1)
            body = {"model": a.model, "prompt": [rng.randrange(a.token_lo, a.token_hi) for _ in range(n)],
                    "max_tokens": rng.randrange(1, 3 * a.max_tokens), "ignore_eos": True, "temperature": 1.0}
            if j % 4 == 0:
                cut_stream(port, body, 200)
            else:
                try:
                    post(port, body)
                except Exception as e:  # noqa: BLE001
                    errors.append("crowd %d: %s" % (j, e))

        threads = [threading.Thread(target=crowd, args=(j,)) for j in range(a.crowd)]
        threads += [threading.Thread(target=probe, args=(i,)) for i in range(len(probes))]
        rng.shuffle(threads)
        for t in threads:
            t.start()
            time.sleep(0.01)
        for t in threads:
            t.join()
        bad = 0
        for i in range(len(probes)):
            if together[i] != alone[i]:
                bad += 1
                if bad == 1:
                    print("invariant_http: probe %d (%d prompt tokens, temperature %g) differs:\n  alone    %s\n"
                          "  together %s" % (i, len(probes[i]["prompt"]), probes[i]["temperature"],
                                             alone[i][:400], (together[i] or "none")[:400]))
        for e in errors[:5]:
            print("invariant_http: " + e)
        preempted = preemptions(port)
        print("invariant_http: %d of %d probes equal alone and in a crowd of %d (%d errors, %d preemptions)"
              % (len(probes) - bad, len(probes), a.crowd, len(errors), preempted))
        if preempted < a.min_preemptions:
            print("invariant_http: %d preemptions, fewer than the %d asked for" % (preempted, a.min_preemptions))
            return 1
        return 0 if bad == 0 and not errors else 1
    finally:
        srv.send_signal(signal.SIGTERM)
        try:
            srv.wait(60)
        except subprocess.TimeoutExpired:
            srv.kill()
        if os.path.exists(port_file):
            os.unlink(port_file)


if __name__ == "__main__":
    sys.exit(main())
