#!/usr/bin/env python3
"""Hostile clients against `krait serve` (docs/RELIABILITY.md, "Under attack"): starts the server with
an API key, measures an authenticated 1-token completion's latency when idle, then under each attack
at full strength (one at a time, then all at once), and reports each probe's median / p90 / max
latency against the idle median, the server's resident memory (VmRSS) at the end of each attack and
its peak (VmHWM), and whether /health stayed 200.

Attacks (python's standard library only; every socket of an attack in one thread with selectors):

  tokenize    4 clients in a loop: 30 MB prompts to /tokenize (with the key)
  slowloris   --slow-conns connections that send a header byte every 5 s and never end their
              headers; those the server closed are opened again every 5 s (as slowloris does)
  connflood   the same connections, each one closed by the server opened again at once
  slowbody    256 connections that send whole headers with Content-Length 1 MB and then a body byte
              every 5 s; reopened when closed
  bodies      8 clients in a loop: 32 MB bodies of token ids ([1,1,...]) to /v1/completions
  disconnect  --storm-clients (64), each 10 times a second: a streamed completion, closed after its
              first bytes
  all         every one of the above at once

Each attack runs in processes of its own (python threads share one core); --server-cpus and
--attack-cpus pin the server and the attackers to separate cores, so that what is measured is
the server's work and not the attackers' competition for the same cores.

  python3 bench/serve/attack.py --krait build/krait --model models/tiny-hybrid --out DIR
"""
import argparse
import http.client
import json
import multiprocessing as mp
import os
import selectors
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import threading
import time

KEY = "attack-bench-key"


class Server:
    def __init__(self, a):
        self.dir = tempfile.mkdtemp(prefix="krait-attack-")
        pf = os.path.join(self.dir, "port")
        self.log = open(os.path.join(a.out, "server.log"), "w")
        cmd = [a.krait, "serve", a.model, "--port", "0", "--port-file", pf, "--api-key", KEY,
               "--served-model-name", "m"] + a.serve_arg
        if a.server_cpus:
            cmd = ["taskset", "-c", a.server_cpus] + cmd
        self.p = subprocess.Popen(cmd, stdout=self.log, stderr=subprocess.STDOUT)
        t0 = time.time()
        self.port = None
        while time.time() - t0 < 120:
            if self.p.poll() is not None:
                raise SystemExit(f"krait serve exited with {self.p.returncode}; see {a.out}/server.log")
            try:
                self.port = int(open(pf).read())
                c = http.client.HTTPConnection("127.0.0.1", self.port, timeout=5)
                c.request("GET", "/health")
                if c.getresponse().status == 200:
                    break
            except (OSError, ValueError, http.client.HTTPException):
                pass
            time.sleep(0.2)

    def mem(self):
        out = {}
        for line in open(f"/proc/{self.p.pid}/status"):
            k, _, v = line.partition(":")
            if k in ("VmRSS", "VmHWM"):
                out[k] = int(v.split()[0]) // 1024
        return out

    def stop(self):
        self.p.send_signal(signal.SIGTERM)
        try:
            return self.p.wait(60)
        except subprocess.TimeoutExpired:
            self.p.kill()
            return -9


def threads_cpu(pid):
    """CPU seconds of the server's threads, summed by name (the main thread, which runs the event
    loop, as "loop"; libuv's workers keep the process's name)."""
    out = {}
    tck = os.sysconf("SC_CLK_TCK")
    for tid in os.listdir(f"/proc/{pid}/task"):
        try:
            st = open(f"/proc/{pid}/task/{tid}/stat").read()
        except OSError:
            continue
        name = "loop" if int(tid) == pid else st[st.index("(") + 1:st.rindex(")")]
        f = st[st.rindex(")") + 2:].split()
        out[name] = out.get(name, 0.0) + (int(f[11]) + int(f[12])) / tck
    return out


def metrics(port):
    """The server's counters that say how much work it did (engine steps, tokens, requests)."""
    want = ("krait:engine_steps_total", "krait:prompt_tokens_total", "krait:generation_tokens_total",
            "krait:http_requests_total")
    out = {}
    try:
        c = http.client.HTTPConnection("127.0.0.1", port, timeout=10)
        c.request("GET", "/metrics", headers={"Authorization": "Bearer " + KEY})
        for line in c.getresponse().read().decode().splitlines():
            name = line.split("{")[0].split(" ")[0]
            if name in want:
                out[name] = out.get(name, 0.0) + float(line.rsplit(" ", 1)[1])
    except (OSError, ValueError, http.client.HTTPException):
        pass
    return out


def connect(port, timeout=None):
    """A client socket to the server, from SRC_ADDR when it is set (an attacker's own address)."""
    return socket.create_connection(("127.0.0.1", port), timeout=timeout,
                                    source_address=(SRC_ADDR, 0) if SRC_ADDR else None)


SRC_ADDR = ""
STORM_TEMPERATURE = None


def probe(port):
    """An authenticated 1-token completion on a new connection; its latency in seconds."""
    body = json.dumps({"model": "m", "prompt": "Hello", "max_tokens": 1, "temperature": 0})
    t0 = time.perf_counter()
    c = http.client.HTTPConnection("127.0.0.1", port, timeout=120)
    c.request("POST", "/v1/completions", body, {"Content-Type": "application/json",
                                                "Authorization": "Bearer " + KEY})
    r = c.getresponse()
    r.read()
    c.close()
    dt = time.perf_counter() - t0
    if r.status != 200:
        raise RuntimeError(f"probe answered {r.status}")
    return dt


def health(port):
    try:
        c = http.client.HTTPConnection("127.0.0.1", port, timeout=10)
        c.request("GET", "/health")
        return c.getresponse().status
    except OSError as e:
        return str(e)


def post_loop(port, path, payload, stop, stats):
    """A client that posts `payload` again and again (a new connection each time)."""
    while not stop.is_set():
        try:
            c = http.client.HTTPConnection("127.0.0.1", port, timeout=120,
                                           source_address=(SRC_ADDR, 0) if SRC_ADDR else None)
            c.request("POST", path, payload, {"Content-Type": "application/json",
                                              "Authorization": "Bearer " + KEY})
            r = c.getresponse()
            r.read()
            stats[r.status] = stats.get(r.status, 0) + 1
            c.close()
        except (OSError, http.client.HTTPException) as e:
            stats[type(e).__name__] = stats.get(type(e).__name__, 0) + 1


def disconnect_loop(port, stop, stats, pause=0.1):
    req_body = {"model": "m", "prompt": "Once upon a time", "max_tokens": 200, "stream": True, "ignore_eos": True}
    if STORM_TEMPERATURE is not None:
        req_body["temperature"] = STORM_TEMPERATURE
    body = json.dumps(req_body)
    req = (f"POST /v1/completions HTTP/1.1\r\nHost: x\r\nAuthorization: Bearer {KEY}\r\n"
           f"Content-Type: application/json\r\nContent-Length: {len(body)}\r\n\r\n{body}").encode()
    while not stop.is_set():
        try:
            s = connect(port, 60)
            s.sendall(req)
            s.recv(256)
            s.close()
            stats["left"] = stats.get("left", 0) + 1
            time.sleep(pause)
        except OSError as e:
            stats[type(e).__name__] = stats.get(type(e).__name__, 0) + 1


def trickle_loop(port, n, head, stop, stats, at_once=False):
    """n connections that send `head` whole and then one byte every 5 s (a header byte when `head` is
    a partial header, a body byte when it ends the headers); those the server closed are opened again
    every 5 s, as slowloris does, or at once with `at_once` (a connection flood)."""
    sel = selectors.DefaultSelector()
    socks = {}

    def opened():
        try:
            s = socket.socket()
            if SRC_ADDR:
                s.bind((SRC_ADDR, 0))
            s.setblocking(False)
            s.connect_ex(("127.0.0.1", port))
            socks[s] = False
            sel.register(s, selectors.EVENT_WRITE | selectors.EVENT_READ)
        except OSError as e:
            stats[type(e).__name__] = stats.get(type(e).__name__, 0) + 1
            time.sleep(0.01)

    def closed(s):
        sel.unregister(s)
        socks.pop(s, None)
        s.close()
        stats["closed by server"] = stats.get("closed by server", 0) + 1

    for _ in range(n):
        opened()
    last = time.time()
    while not stop.is_set():
        for key, ev in sel.select(timeout=0.5):
            s = key.fileobj
            if ev & selectors.EVENT_READ:
                try:
                    if not s.recv(4096):
                        closed(s)
                        continue
                except OSError:
                    closed(s)
                    continue
            if ev & selectors.EVENT_WRITE and not socks.get(s, True):
                try:
                    s.send(head)
                    socks[s] = True
                    sel.modify(s, selectors.EVENT_READ)
                except OSError:
                    closed(s)
        refill = at_once
        if time.time() - last >= 5:
            last = time.time()
            refill = True
            for s in list(socks):
                if socks.get(s):
                    try:
                        s.send(b"a")
                    except OSError:
                        closed(s)
        while refill and len(socks) < n and not stop.is_set():
            opened()
    stats["open at end"] = len(socks)
    for s in list(socks):
        s.close()


def attack_threads(kind, port, a, stop, stats):
    big_text = json.dumps({"prompt": "a" * (30 << 20)})
    ids = json.dumps({"model": "m", "prompt": [1] * ((32 << 20) // 2 - 64), "max_tokens": 1}, separators=(",", ":"))
    slow_head = b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nX-a: "
    body_head = (f"POST /v1/completions HTTP/1.1\r\nHost: x\r\nAuthorization: Bearer {KEY}\r\n"
                 f"Content-Type: application/json\r\nContent-Length: {1 << 20}\r\n\r\n").encode()
    ts = []
    if kind in ("tokenize", "all"):
        ts += [threading.Thread(target=post_loop, args=(port, "/tokenize", big_text, stop, stats.setdefault("tokenize", {})))
               for _ in range(4)]
    if kind in ("slowloris", "all"):
        ts.append(threading.Thread(target=trickle_loop, args=(port, a.slow_conns, slow_head, stop,
                                                              stats.setdefault("slowloris", {}))))
    if kind == "connflood":
        ts.append(threading.Thread(target=trickle_loop, args=(port, a.slow_conns, slow_head, stop,
                                                              stats.setdefault("connflood", {}), True)))
    if kind in ("slowbody", "all"):
        ts.append(threading.Thread(target=trickle_loop, args=(port, 256, body_head, stop, stats.setdefault("slowbody", {}))))
    if kind in ("bodies", "all"):
        ts += [threading.Thread(target=post_loop, args=(port, "/v1/completions", ids, stop, stats.setdefault("bodies", {})))
               for _ in range(8)]
    if kind in ("disconnect", "all"):
        ts += [threading.Thread(target=disconnect_loop, args=(port, stop, stats.setdefault("disconnect", {})))
               for _ in range(a.storm_clients)]
    return ts


def attack_proc(kind, port, a, stop, q):
    """One attack in a process of its own: its threads until `stop`, then its outcome counts on q."""
    global SRC_ADDR, STORM_TEMPERATURE
    SRC_ADDR, STORM_TEMPERATURE = a.attack_addr, a.storm_temperature
    if a.attack_cpus:
        os.sched_setaffinity(0, parse_cpus(a.attack_cpus))
    stats = {}
    ts = attack_threads(kind, port, a, stop, stats)
    for t in ts:
        t.daemon = True
        t.start()
    stop.wait()
    for t in ts:
        t.join(30)
    q.put(stats)


def parse_cpus(spec):
    out = set()
    for part in spec.split(","):
        lo, _, hi = part.partition("-")
        out.update(range(int(lo), int(hi or lo) + 1))
    return out


def summarize(lat, idle):
    lat = sorted(lat)
    return {"n": len(lat), "median_s": statistics.median(lat), "p90_s": lat[int(0.9 * (len(lat) - 1))],
            "max_s": lat[-1], "median_vs_idle": statistics.median(lat) / idle}


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--krait", required=True)
    ap.add_argument("--model", required=True)
    ap.add_argument("--out", required=True)
    ap.add_argument("--attacks", default="tokenize,slowloris,connflood,slowbody,bodies,disconnect,all")
    ap.add_argument("--slow-conns", type=int, default=4500)
    ap.add_argument("--storm-clients", type=int, default=64, help="disconnect storm: clients, each 10 streams a second")
    ap.add_argument("--warmup-s", type=float, default=15, help="attack running before the probes start")
    ap.add_argument("--probes", type=int, default=20)
    ap.add_argument("--storm-temperature", type=float, default=None,
                    help="the disconnect storm's temperature (default: the server's, 1)")
    ap.add_argument("--attack-addr", default="",
                    help="the attackers' source address (e.g. 127.0.0.2): attackers at an address of "
                         "their own, as on a network, while the probe comes from 127.0.0.1")
    ap.add_argument("--serve-arg", action="append", default=[])
    ap.add_argument("--server-cpus", default="", help="taskset list for the server, e.g. 0-1")
    ap.add_argument("--attack-cpus", default="", help="cores for the attackers and probes, e.g. 2-15")
    a = ap.parse_args()
    if a.attack_cpus:
        os.sched_setaffinity(0, parse_cpus(a.attack_cpus))
    os.makedirs(a.out, exist_ok=True)
    srv = Server(a)
    res = {"serve_args": a.serve_arg, "attacks": {}}
    try:
        for _ in range(3):
            probe(srv.port)
        idle = [probe(srv.port) for _ in range(a.probes)]
        res["idle"] = summarize(idle, statistics.median(idle))
        res["idle"]["mem_mb"] = srv.mem()
        idle_med = statistics.median(idle)
        print(f"idle: median {idle_med * 1000:.1f} ms", flush=True)
        for kind in a.attacks.split(","):
            stop = mp.Event()
            q = mp.Queue()
            kinds = ["tokenize", "slowloris", "slowbody", "bodies", "disconnect"] if kind == "all" else [kind]
            procs = [mp.Process(target=attack_proc, args=(k, srv.port, a, stop, q)) for k in kinds]
            for p in procs:
                p.start()
            time.sleep(a.warmup_s)
            cpu0, met0, t0 = threads_cpu(srv.p.pid), metrics(srv.port), time.time()
            lat, fails, healths = [], [], []
            for _ in range(a.probes):
                try:
                    lat.append(probe(srv.port))
                except (OSError, RuntimeError, http.client.HTTPException) as e:
                    fails.append(str(e))
                healths.append(health(srv.port))
                time.sleep(0.25)
            mem = srv.mem()
            cpu1, met1, dt = threads_cpu(srv.p.pid), metrics(srv.port), time.time() - t0
            cpu = {k: round((v - cpu0.get(k, 0.0)) / dt, 3) for k, v in cpu1.items() if v - cpu0.get(k, 0.0) > 0}
            rates = {k.split(":")[1]: round((v - met0.get(k, 0.0)) / dt, 1) for k, v in met1.items()}
            stop.set()
            stats = {}
            for _ in procs:
                try:
                    stats.update(q.get(timeout=60))
                except Exception:  # noqa: BLE001 - a stuck attacker is reported, not fatal
                    stats["attacker"] = "no report"
            for p in procs:
                p.join(10)
                if p.is_alive():
                    p.kill()
            row = summarize(lat, idle_med) if lat else {"n": 0}
            row.update({"probe_failures": fails, "health": sorted(set(map(str, healths))), "mem_mb": mem,
                        "attack_outcomes": stats, "server_cpu_cores_by_thread": cpu, "server_rates_per_s": rates})
            res["attacks"][kind] = row
            print(f"{kind}: " + (f"median {row['median_s'] * 1000:.1f} ms ({row['median_vs_idle']:.2f}x idle), "
                                 f"p90 {row['p90_s'] * 1000:.1f} ms, max {row['max_s'] * 1000:.1f} ms"
                                 if lat else "no probe answered") +
                  f", failures {len(fails)}, health {row['health']}, RSS {mem.get('VmRSS')} MB "
                  f"(peak {mem.get('VmHWM')} MB), {json.dumps(stats)}\n    server CPU (cores) by thread "
                  f"{json.dumps(cpu)}; per second {json.dumps(rates)}", flush=True)
            time.sleep(2)
    finally:
        res["exit_code"] = srv.stop()
        json.dump(res, open(os.path.join(a.out, "attack.json"), "w"), indent=1)
        print(f"server exit code {res['exit_code']}; {a.out}/attack.json")


if __name__ == "__main__":
    main()
