#!/usr/bin/env python3
"""Serving stress suite for `krait serve` (Python 3 standard library; the client is bench/serve/load.py).

    tests/stress/stress.py --krait build/krait --model models/tiny-hybrid            # CPU profile
    tests/stress/stress.py --krait build-gpu/krait --model /tmp/nh8b --profile gpu \\
        --max-model-len 131072 --out /tmp/stress-nh8b

It starts `krait serve MODEL --port 0 --port-file F` itself (flags from the profile, plus any
--serve-arg), then runs these phases on that one process:

  warm-up     the peak shapes of the later phases once (the host RSS baseline is taken after it)
  long        prompts from 1 token to max_model_len - max_tokens (max_model_len from GET /v1/models),
              alone, then several at once, with n > 1, under chunked prefill (a small
              --max-num-batched-tokens); one token over the limit must be a clean 400
  storm-base  the disconnect storm's requests with no disconnects (for the engine step rate)
  storm       streamed requests at concurrency --max-num-seqs whose clients close the socket at
              random: right after sending, halfway through the request body, before the first
              byte, mid-stream (after a time or a number of bytes), with a FIN or a reset; n 1 or 2
  mixed       mixed sampling parameters (temperature, top_p, top_k, seed, penalties, logprobs),
              stop strings, n, streaming and not, chat and completions, several prompts at once, and
              requests that must be refused with a clean error object
  bench       (only when named in --phases) serving figures at each --bench-concurrency, random
              prompts of --bench-input-len tokens, --bench-output-len out (tests/stress/gpu.sh)
  sigterm     SIGTERM while streams are open (some clients never read): /health must answer 503
              (not refuse the connection) and new requests 503 while draining; the process must
              exit with status 0 within --shutdown-timeout + 5 s; requests cut by the timeout
              must end with an error event + data: [DONE] (streams) or a 503 error body

Every response a client did not cut goes through load.py's checker (complete or a clean error;
anything else fails with what was received). After every phase but sigterm:
  - within --idle-timeout seconds (default 1.0; /metrics polled every 50 ms) the gauges are idle:
    krait:num_requests_running, krait:num_requests_waiting, krait:state_slots{state="used"} and
    krait:cache_blocks{state="used"} all 0 (when not, the suite keeps polling up to --settle-s more
    to report whether and when they got there, then goes on);
  - the server's host RSS (/proc/PID/status VmRSS) has grown by at most max(--rss-tol-mib (64),
    --rss-tol-pct (10) % of the baseline) since the warm-up;
  - its device memory (nvidia-smi --query-compute-apps) has grown by at most --gpu-tol-mib (64),
    when a GPU is present;
  - GET /health answers 200.
Engine steps/s (krait:engine_steps_total deltas) of the storm and of the same load without
disconnects are reported. At the end the server log is searched for sanitizer reports.

With --deadline, a phase that would start too late is skipped and a running one is cut, time being
kept for the sigterm phase; the summary says which.

The exit status is 1 when any assertion failed (each printed as FAIL [phase] ...: which request,
what was received), 2 on a usage or start-up problem. A summary table comes last; --out DIR keeps
the server log and a JSON report. The server gets ASAN_OPTIONS with detect_leaks=1, so under
AddressSanitizer a leak at exit makes the exit status non-zero and fails the sigterm phase.
"""

import argparse
import asyncio
import json
import os
import random
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import time

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(os.path.dirname(HERE))
sys.path.insert(0, os.path.join(ROOT, "bench", "serve"))
import load as L  # noqa: E402

# Sizes of each profile; every one can be overridden by the option of the same name.
PROFILES = {
    # models/tiny-hybrid on 1 CPU thread, within ~2-3 minutes also under ASan+UBSan on slow cores
    "cpu": dict(threads=1, max_num_seqs=8, max_num_batched_tokens=256, shutdown_timeout=3.0, block_size=16,
                warmup_long=1, long_max_tokens=4, long_extra=2, long_near_limit=1, long_concurrent=4,
                storm_requests=48, storm_max_tokens=40, storm_prompt_max=256, storm_cut_max_s=0.6,
                mixed_requests=48, mixed_max_tokens=24, mixed_prompt_max=200,
                sigterm_streams=3, sigterm_noread=2, sigterm_nonstream=1, sigterm_prompt=64,
                request_timeout=180.0, load_timeout=180.0),
    # an 8B checkpoint on one H200 with --max-model-len 131072 (256 sequences: the bench phase's top
    # level), about two minutes: a 128K prompt prefills in 8-11 s alone
    "gpu": dict(threads=0, max_num_seqs=256, max_num_batched_tokens=8192, shutdown_timeout=5.0, block_size=16,
                warmup_long=0, long_max_tokens=16, long_extra=0, long_near_limit=0, long_concurrent=4,
                storm_requests=256, storm_max_tokens=128, storm_prompt_max=1024, storm_cut_max_s=2.0,
                mixed_requests=256, mixed_max_tokens=128, mixed_prompt_max=1024,
                sigterm_streams=24, sigterm_noread=8, sigterm_nonstream=4, sigterm_prompt=512,
                request_timeout=300.0, load_timeout=300.0),
}

GAUGES = (("krait:num_requests_running", {}), ("krait:num_requests_waiting", {}),
          ("krait:state_slots", {"state": "used"}), ("krait:cache_blocks", {"state": "used"}))


class Abort(Exception):
    pass


def parse_metrics(text):
    out = {}
    for line in text.splitlines():
        if not line or line[0] == "#":
            continue
        head, _, val = line.rpartition(" ")
        name, _, lab = head.partition("{")
        labels = dict(re.findall(r'(\w+)="((?:[^"\\]|\\.)*)"', lab))
        try:
            out.setdefault(name, []).append((labels, float(val)))
        except ValueError:
            pass
    return out


def mget(m, name, **want):
    if name not in m:
        return None
    return sum(v for lab, v in m[name] if all(lab.get(k) == w for k, w in want.items()))


def is_asan(path):
    try:
        with open(path, "rb") as fp:
            return b"__asan_init" in fp.read()
    except OSError:
        return False


def mib(kb):
    return kb / 1024.0


class Server:
    def __init__(self, a, log_path):
        self.a = a
        self.log_path = log_path
        self.proc = None
        self.port = None
        self.gpu_source = None
        self.host = "127.0.0.1"
        fd, self.port_file = tempfile.mkstemp(prefix="krait-stress-port-")
        os.close(fd)
        os.unlink(self.port_file)
        self.exit_status = None

    def cmd(self):
        a = self.a
        c = [a.krait, "serve", a.model, "--host", self.host, "--port", "0", "--port-file", self.port_file,
             "--max-num-seqs", str(a.max_num_seqs), "--max-num-batched-tokens", str(a.max_num_batched_tokens),
             "--shutdown-timeout", f"{a.shutdown_timeout:g}", "--block-size", str(a.block_size),
             "--log-level", "info"]
        if a.threads:
            c += ["--threads", str(a.threads)]
        if a.max_model_len:
            c += ["--max-model-len", str(a.max_model_len)]
        for s in a.serve_arg:
            c += s.split()
        return c

    def start(self):
        env = dict(os.environ)
        asan = env.get("ASAN_OPTIONS", "")
        if "detect_leaks" not in asan:
            asan = (asan + ":" if asan else "") + "detect_leaks=1"
        if self.a.asan_quarantine_mb > 0 and "quarantine_size_mb" not in asan and is_asan(self.a.krait):
            # ASan keeps freed memory in a quarantine of 256 MiB by default, which reads as RSS growth:
            # a small one keeps the RSS bound meaningful under the sanitizer
            asan += f":quarantine_size_mb={self.a.asan_quarantine_mb}"
        env["ASAN_OPTIONS"] = asan
        env.setdefault("OMP_WAIT_POLICY", "passive")
        self.log = open(self.log_path, "ab")
        self.log.write(("$ " + " ".join(self.cmd()) + "\n").encode())
        self.log.flush()
        self.proc = subprocess.Popen(self.cmd(), stdout=self.log, stderr=subprocess.STDOUT, env=env,
                                     stdin=subprocess.DEVNULL)
        self.pid = self.proc.pid
        with open(os.path.join(os.path.dirname(self.log_path), "server.pid"), "w") as fp:
            fp.write(f"{self.pid}\n")

    async def wait_ready(self, timeout):
        t0 = time.monotonic()
        while time.monotonic() - t0 < timeout:
            if self.proc.poll() is not None:
                raise Abort(f"krait serve exited with status {self.proc.returncode} while starting "
                            f"(log: {self.log_path})\n{self.log_tail()}")
            if self.port is None:
                try:
                    with open(self.port_file) as fp:
                        self.port = int(fp.read().strip() or 0) or None
                except (OSError, ValueError):
                    pass
            if self.port:
                try:
                    st, _ = await L.http_get(self.host, self.port, "/health", timeout=5)
                    if st == 200:
                        return time.monotonic() - t0
                    if st != 503:
                        raise Abort(f"/health answered {st} while loading")
                except (OSError, ConnectionError):
                    pass
            await asyncio.sleep(0.1)
        raise Abort(f"krait serve not healthy after {timeout:.0f} s (log: {self.log_path})\n{self.log_tail()}")

    def alive(self):
        return self.proc is not None and self.proc.poll() is None

    def rss_kb(self):
        try:
            with open(f"/proc/{self.pid}/status") as fp:
                for line in fp:
                    if line.startswith("VmRSS:"):
                        return int(line.split()[1])
        except OSError:
            return None
        return None

    def gpu_mib(self):
        if not shutil.which("nvidia-smi"):
            return None
        try:
            out = subprocess.run(["nvidia-smi", "--query-compute-apps=pid,used_memory", "--format=csv,noheader,nounits"],
                                 capture_output=True, text=True, timeout=20).stdout
        except (OSError, subprocess.SubprocessError):
            return None
        for line in out.splitlines():
            parts = [p.strip() for p in line.split(",")]
            if len(parts) == 2 and parts[0] == str(self.pid):
                try:
                    self.gpu_source = "the server's process (nvidia-smi --query-compute-apps)"
                    return float(parts[1])
                except ValueError:
                    return None
        # some containers hide other processes from nvidia-smi: the device's memory in use then (the
        # server is its only user here)
        try:
            out = subprocess.run(["nvidia-smi", "--query-gpu=memory.used", "--format=csv,noheader,nounits", "-i", "0"],
                                 capture_output=True, text=True, timeout=20).stdout.strip()
            self.gpu_source = "device 0 in all (nvidia-smi --query-gpu=memory.used; no per-process entry)"
            return float(out.splitlines()[0])
        except (OSError, subprocess.SubprocessError, ValueError, IndexError):
            return None

    def log_tail(self, n=30):
        try:
            with open(self.log_path, "rb") as fp:
                lines = fp.read().decode("utf-8", "replace").splitlines()
            return "\n".join("    | " + ln for ln in lines[-n:])
        except OSError:
            return ""

    def kill(self):
        if self.alive():
            self.proc.kill()
            self.proc.wait()


class Suite:
    def __init__(self, a):
        self.a = a
        self.failures = []
        self.rows = []
        self.notes = []
        self.report = {"phases": {}, "failures": self.failures, "notes": self.notes}
        self.rng = random.Random(a.seed)
        self.rss_base = None
        self.gpu_base = None
        self.srv = None
        self.t_start = time.monotonic()

    # ---- reporting -------------------------------------------------------------------------------

    def fail(self, phase, msg):
        self.failures.append({"phase": phase, "message": msg})
        print(f"FAIL [{phase}] {msg}", flush=True)

    def note(self, phase, msg):
        self.notes.append({"phase": phase, "message": msg})
        print(f"  [{phase}] {msg}", flush=True)

    def left(self):
        return self.a.deadline - (time.monotonic() - self.t_start) if self.a.deadline else 1e9

    # ---- helpers ---------------------------------------------------------------------------------

    async def metrics(self):
        st, body = await L.http_get(self.srv.host, self.srv.port, "/metrics", timeout=10)
        if st != 200:
            raise ConnectionError(f"/metrics answered {st}")
        return parse_metrics(body.decode("utf-8", "replace"))

    async def gauges(self):
        m = await self.metrics()
        return {f"{n}{'{' + ','.join(f'{k}={v}' for k, v in lab.items()) + '}' if lab else ''}": mget(m, n, **lab)
                for n, lab in GAUGES}, m

    async def steps(self):
        try:
            return mget(await self.metrics(), "krait:engine_steps_total")
        except (OSError, ConnectionError):
            return None

    async def spec_counts(self):
        """The server's draft counters (drafts, drafted tokens, kept tokens); None without them."""
        try:
            m = await self.metrics()
        except (OSError, ConnectionError):
            return None
        names = ("krait:spec_decode_num_drafts_total", "krait:spec_decode_num_draft_tokens_total",
                 "krait:spec_decode_num_accepted_tokens_total")
        if any(n not in m for n in names):
            return None
        return tuple(mget(m, n) for n in names)

    def body(self, prompt, **kw):
        b = {"model": self.model, "prompt": prompt}
        b.update(kw)
        return b

    def ids(self, n):
        return self.rand_ids(self.rng, n)

    def rand_ids(self, rng, n):
        """n random prompt ids; with --prompt-period P, a random block of P ids repeated (so that
        n-gram drafting finds its matches in every prompt longer than P)."""
        a = self.a
        if a.prompt_period > 0 and n > a.prompt_period:
            block = L.random_ids(rng, a.prompt_period, a.token_lo, a.token_hi)
            return (block * (n // a.prompt_period + 1))[:n]
        return L.random_ids(rng, n, a.token_lo, a.token_hi)

    def check_results(self, phase, results, what=None):
        counts = {}
        for r in results:
            counts[r.outcome] = counts.get(r.outcome, 0) + 1
        bad = [r for r in results if r.outcome == "fail"]
        for r in bad[:self.a.max_fail_details]:
            self.fail(phase, (what + ": " if what else "") + r.describe())
        if len(bad) > self.a.max_fail_details:
            self.fail(phase, f"... and {len(bad) - self.a.max_fail_details} more requests failed the checker "
                             f"(all in the JSON report)")
        self.report["phases"].setdefault(phase, {})["failed_requests"] = [r.describe() for r in bad]
        return counts

    async def after_phase(self, phase, row):
        """The checks that follow every phase: idle gauges, RSS, device memory, /health."""
        a = self.a
        if not self.srv.alive():
            self.fail(phase, f"krait serve exited (status {self.srv.proc.returncode}) during the phase\n"
                             f"{self.srv.log_tail()}")
            raise Abort("the server is gone")
        t0 = time.monotonic()
        idle_at, last = None, None
        while True:
            try:
                g, _ = await self.gauges()
            except (OSError, ConnectionError) as e:
                g = {"/metrics": f"unreachable: {e}"}
            last = g
            if all(v == 0 for v in g.values()):
                idle_at = time.monotonic() - t0
                break
            if time.monotonic() - t0 > a.idle_timeout + a.settle_s:
                break
            await asyncio.sleep(0.05)
        row["idle_s"] = idle_at
        if idle_at is None and "/metrics" in last:
            # the server does not answer: when its process is on its way out (a process holding a GPU
            # can take many seconds to end), wait for it and say how it ended, with its log's end
            t1 = time.monotonic()
            while self.srv.alive() and time.monotonic() - t1 < 60:
                await asyncio.sleep(0.2)
            if not self.srv.alive():
                rc = self.srv.proc.returncode
                how = f"signal {signal.Signals(-rc).name}" if rc is not None and rc < 0 else f"exit status {rc}"
                self.fail(phase, f"krait serve died during the phase ({how}; /metrics: {last['/metrics']})\n"
                                 f"{self.srv.log_tail(60)}")
                raise Abort("the server is gone")
        if idle_at is None or idle_at > a.idle_timeout:
            vals = ", ".join(f"{k} = {v:g}" if isinstance(v, float) else f"{k}: {v}" for k, v in last.items())
            later = (f"; they got there after {idle_at:.2f} s" if idle_at is not None else
                     f"; still not idle {a.idle_timeout + a.settle_s:.1f} s after the phase")
            self.fail(phase, f"gauges not idle within {a.idle_timeout:g} s after the phase's last response: "
                             f"{vals}{later}")
            if idle_at is None and a.recover_s > 0:
                t1 = time.monotonic()
                while time.monotonic() - t1 < a.recover_s:
                    try:
                        g, _ = await self.gauges()
                        if all(v == 0 for v in g.values()):
                            break
                    except (OSError, ConnectionError):
                        pass
                    await asyncio.sleep(0.1)
                idle = all(v == 0 for v in g.values())
                self.note(phase, f"waited for idle before going on: " + (
                    f"idle {time.monotonic() - t0:.1f} s after the phase" if idle else
                    f"still busy after {time.monotonic() - t0:.1f} s; the next phase starts on a busy server"))
        rss = self.srv.rss_kb()
        row["rss_mib"] = None if rss is None else mib(rss)
        if phase == "warm-up":
            self.rss_base = rss
        elif rss is not None and self.rss_base is not None:
            grow = mib(rss - self.rss_base)
            tol = max(a.rss_tol_mib, a.rss_tol_pct / 100.0 * mib(self.rss_base))
            row["rss_growth_mib"] = grow
            if grow > tol:
                self.fail(phase, f"host RSS grew {grow:.1f} MiB since the warm-up ({mib(self.rss_base):.1f} -> "
                                 f"{mib(rss):.1f} MiB); the bound is {tol:.1f} MiB = max({a.rss_tol_mib:g} MiB, "
                                 f"{a.rss_tol_pct:g} %)")
        gm = self.srv.gpu_mib()
        row["gpu_mib"] = gm
        if gm is not None:
            if phase == "warm-up" or self.gpu_base is None:
                self.gpu_base = gm
                self.note(phase, f"device memory {gm:.0f} MiB: {self.srv.gpu_source}")
            elif gm - self.gpu_base > a.gpu_tol_mib:
                self.fail(phase, f"device memory of the server grew {gm - self.gpu_base:.0f} MiB since the warm-up "
                                 f"({self.gpu_base:.0f} -> {gm:.0f} MiB; bound {a.gpu_tol_mib:g} MiB)")
        try:
            st, body = await L.http_get(self.srv.host, self.srv.port, "/health", timeout=10)
            row["health"] = st
            if st != 200:
                self.fail(phase, f"/health answered {st} after the phase: {body[:200]!r}")
        except (OSError, ConnectionError) as e:
            row["health"] = f"error: {e}"
            self.fail(phase, f"/health did not answer after the phase: {e}")

    def reserve(self):
        """Seconds of the deadline kept for the sigterm phase (and the checks after a phase)."""
        return (self.a.shutdown_timeout + 15.0 if "sigterm" in self.a.phases else 0.0) + 8.0

    async def run_phase(self, name, fn):
        budget = self.left() - self.reserve()
        if budget < 10:
            self.note(name, f"skipped: {self.left():.0f} s left of the --deadline, {self.reserve():.0f} s of them kept")
            self.rows.append({"phase": name, "skipped": True})
            return
        print(f"== {name}", flush=True)
        row = {"phase": name}
        s0 = await self.steps()
        d0 = await self.spec_counts()
        t0 = time.perf_counter()
        try:
            results = await asyncio.wait_for(fn(row), timeout=budget if self.a.deadline else None)
        except asyncio.TimeoutError:
            # its clients are gone (the sockets closed), so the checks after it still apply
            self.note(name, f"cut by the --deadline after {time.perf_counter() - t0:.0f} s: its requests are not "
                            f"checked, the checks after it are")
            row["cut_by_deadline"] = True
            results = []
        dt = time.perf_counter() - t0
        s1 = await self.steps()
        d1 = await self.spec_counts()
        if d0 is not None and d1 is not None and d1[0] > d0[0]:
            drafts, drafted, kept = (b - a for a, b in zip(d0, d1))
            row["spec_decode"] = {"drafts": drafts, "draft_tokens": drafted, "accepted_tokens": kept}
            self.note(name, f"speculative decoding: {drafts:g} drafts of {drafted:g} tokens, {kept:g} kept "
                            f"(mean acceptance length {1 + kept / drafts:.2f})")
        row["seconds"] = dt
        if s0 is not None and s1 is not None:
            row["steps"] = s1 - s0
            row["steps_per_s"] = (s1 - s0) / dt if dt > 0 else None
        counts = self.check_results(name, results) if results is not None else {}
        row.update(counts=counts, requests=len(results or []))
        s = L.summarize(results or [], dt)
        row["out_tok_s"] = s["output_throughput"]
        row["ttft_p50_ms"] = s["ttft_ms"]["p50"]
        row["itl_p50_ms"] = s["itl_ms"]["p50"]
        await self.after_phase(name, row)
        self.rows.append(row)
        self.report["phases"].setdefault(name, {}).update({k: v for k, v in row.items() if k != "phase"})
        print(f"   {name}: {len(results or [])} requests {counts} in {dt:.1f} s; idle after "
              f"{'-' if row.get('idle_s') is None else '%.2f s' % row['idle_s']}; RSS "
              f"{'-' if row.get('rss_mib') is None else '%.1f MiB' % row['rss_mib']}", flush=True)

    # ---- phases ----------------------------------------------------------------------------------

    def long_lengths(self):
        a, lim = self.a, self.mml - self.a.long_max_tokens
        bs, mbt = a.block_size, a.max_num_batched_tokens
        want = {1, 2, bs - 1, bs, bs + 1, mbt - 1, mbt, mbt + 1, 2 * mbt + 3, lim // 2, lim}
        if a.long_near_limit:
            want.add(lim - 1)
        for _ in range(a.long_extra):
            want.add(self.rng.randint(1, lim))
        return sorted(x for x in want if 1 <= x <= lim)

    def long_group(self, prompts):
        """Several long prompts at once: the longest, half of it with n = 2, a chunk + 1, 1 token with
        n = 2, and random lengths; streams and whole responses."""
        a, lim = self.a, self.mml - self.a.long_max_tokens
        lens = [lim, lim // 2 + 1, min(a.max_num_batched_tokens + 1, lim), 1]
        while len(lens) < a.long_concurrent:
            lens.append(self.rng.randint(1, lim))
        reqs = []
        for i, n in enumerate(lens[:max(a.long_concurrent, 1)]):
            p = prompts.get(n) or self.ids(n)
            kw = dict(max_tokens=a.long_max_tokens, ignore_eos=True, temperature=0.0, stream=i % 2 == 0)
            if i in (1, 3):
                kw["n"] = 2
            reqs.append(L.Req("/v1/completions", self.body(p, **kw), tag=f"long together, {n} tokens",
                              timeout=a.request_timeout))
        return reqs

    async def phase_warmup(self, row):
        a = self.a
        # the long group reaches the later phases' peak of host memory on the CPU; on a GPU (its
        # caches allocated at start) it would cost a minute of prefill next to the streams
        reqs = self.long_group({}) if a.warmup_long else [
            L.Req("/v1/completions", self.body(self.ids(min(a.max_num_batched_tokens + 1, self.mml - 4)), max_tokens=4,
                                                 ignore_eos=True),
                  tag="warm-up chunked prefill", timeout=a.request_timeout)]
        for i in range(a.max_num_seqs):
            reqs.append(L.Req("/v1/completions", self.body(self.ids(self.rng.randint(1, a.storm_prompt_max)),
                                                           max_tokens=8, ignore_eos=True, stream=True, n=1 + i % 2),
                              tag="warm-up stream", timeout=a.request_timeout))
        return await L.run_poisson(reqs, self.srv.host, self.srv.port, float("inf"))

    async def phase_long(self, row):
        a, lim = self.a, self.mml - self.a.long_max_tokens
        host, port = self.srv.host, self.srv.port
        lens = self.long_lengths()
        row["lengths"] = lens
        self.note("long", f"max_model_len {self.mml}, max_tokens {a.long_max_tokens}: prompt lengths {lens} alone, "
                          f"then {a.long_concurrent} at once (--max-num-batched-tokens {a.max_num_batched_tokens})")
        prompts, results, alone = {}, [], {}
        for i, n in enumerate(lens):
            prompts[n] = self.ids(n)
            r = await L.run_one(L.Req("/v1/completions",
                                      self.body(prompts[n], max_tokens=a.long_max_tokens, ignore_eos=True,
                                                temperature=0.0, stream=i % 2 == 1),
                                      tag=f"long alone, {n} tokens", timeout=a.request_timeout), host, port)
            results.append(r)
            alone[n] = r.token_ids.get(0)
            if r.outcome == "ok" and r.prompt_tokens is not None and r.prompt_tokens != n:
                self.fail("long", f"usage.prompt_tokens {r.prompt_tokens} for a prompt of {n} tokens")
        # over the limit by one: refused with a clean 400, as are prompts longer than the context
        for n, mt in ((lim + 1, a.long_max_tokens), (self.mml + 1, 1)):
            results.append(await L.run_one(L.Req("/v1/completions", self.body(self.ids(n), max_tokens=mt,
                                                                               stream=n % 2 == 0),
                                                 tag=f"over the limit, {n} + {mt} tokens", expect="error",
                                                 expect_status=400, timeout=a.request_timeout), host, port))
        grp = self.long_group(prompts)
        gres = await L.run_poisson(grp, host, port, float("inf"))
        results += gres
        same = tot = 0
        for r in gres:
            n = r.req.prompt_len()
            if r.outcome == "ok" and alone.get(n) is not None and r.token_ids.get(0) is not None:
                tot += 1
                same += r.token_ids[0] == alone[n]
        if tot:
            self.note("long", f"greedy tokens of a prompt alone vs among others: {same} of {tot} identical (reported, "
                              f"not asserted)")
        return results

    def storm_requests(self, cuts=True, count=None):
        a = self.a
        rng = random.Random(self.a.seed + 7)
        reqs = []
        kinds = [("none", 20), ("after_send", 12), ("mid_body", 8), ("early", 15), ("time", 20), ("bytes", 25)]
        total = sum(w for _, w in kinds)
        for i in range(count or a.storm_requests):
            x, kind = rng.uniform(0, total), "none"
            for k, w in kinds:
                if x < w:
                    kind = k
                    break
                x -= w
            rst = rng.random() < 0.5
            if not cuts or kind == "none":
                cut = L.Cut()
            elif kind == "early":
                cut = L.Cut("time", t=rng.uniform(0, 0.02), rst=rst)
            elif kind == "time":
                cut = L.Cut("time", t=rng.uniform(0.02, a.storm_cut_max_s), rst=rst)
            elif kind == "bytes":
                cut = L.Cut("bytes", nbytes=rng.randint(1, 8000), rst=rst)
            else:
                cut = L.Cut(kind, rst=rst)
            n = 1 + (rng.random() < 0.35)
            plen = rng.randint(1, a.storm_prompt_max)
            body = self.body(self.rand_ids(rng, plen), max_tokens=a.storm_max_tokens,
                             ignore_eos=True, stream=True, temperature=rng.choice([0.0, 1.0]), n=n)
            if rng.random() < 0.3:
                body["stream_options"] = {"include_usage": True}
            reqs.append(L.Req("/v1/completions", body, tag=f"storm #{i}", cut=cut, timeout=a.request_timeout))
        return reqs

    async def phase_storm_base(self, row):
        a = self.a
        reqs = self.storm_requests(cuts=False, count=min(a.storm_requests, 2 * a.max_num_seqs))
        res = await L.run_closed(reqs, self.srv.host, self.srv.port, a.max_num_seqs)
        return res

    async def phase_storm(self, row):
        a = self.a
        s0, t0 = await self.steps(), time.perf_counter()
        res = await L.run_closed(self.storm_requests(), self.srv.host, self.srv.port, a.max_num_seqs)
        s1, dt = await self.steps(), time.perf_counter() - t0
        if s0 is not None and s1 is not None:
            row["loop_steps"], row["loop_steps_per_s"] = s1 - s0, (s1 - s0) / dt
        res += await self.final_wave(row)
        stages = {}
        for r in res:
            if r.outcome == "cut":
                stages[r.cut_stage] = stages.get(r.cut_stage, 0) + 1
        row["cut_stages"] = stages
        self.note("storm", "client cuts by stage: " + ", ".join(f"{k} {v}" for k, v in sorted(stages.items())))
        return res

    async def final_wave(self, row):
        """The storm ends with every slot taken by a running stream and more requests waiting behind
        them; then all their clients go at once (FIN or reset), so that the idle check that follows
        times the release of running, waiting and just-sent requests alike."""
        a = self.a
        host, port = self.srv.host, self.srv.port
        ev = asyncio.Event()
        k = a.max_num_seqs
        plen = 16
        # long enough to outlast the idle check by far, short enough that a server which does not
        # release them gets them out of the way a few seconds after it (at the storm's ITL)
        itl = self.itl_s or 0.05
        big = int(max(32, min(self.mml - plen - 1, (a.idle_timeout + a.settle_s + 2.0) / max(itl, 1e-4))))
        # the waiting ones never start while the running ones hold every slot: a few tokens each
        mk = lambda tag, cut, stream, mt=big: L.Req(  # noqa: E731
            "/v1/completions", self.body(self.ids(plen), max_tokens=mt, ignore_eos=True, stream=stream),
            tag=tag, cut=cut, release=ev, timeout=a.request_timeout)
        tasks = [asyncio.ensure_future(L.run_one(mk(f"final wave, running #{i}", L.Cut("event", rst=i % 2 == 1), True),
                                                 host, port)) for i in range(k)]
        running = await self.wait_running(k, 60)
        q = max(2, k // 2)
        tasks += [asyncio.ensure_future(L.run_one(mk(f"final wave, waiting #{i}", L.Cut("event", rst=i % 2 == 0),
                                                     i % 2 == 0, 8), host, port)) for i in range(q)]
        tasks += [asyncio.ensure_future(L.run_one(mk(f"final wave, waiting, closed after sending #{i}",
                                                     L.Cut("after_send", rst=i % 2 == 1), True, 8), host, port))
                  for i in range(max(1, q // 2))]
        t0 = time.monotonic()
        g = {}
        while time.monotonic() - t0 < 10:
            try:
                g, _ = await self.gauges()
                if (g["krait:num_requests_waiting"] or 0) >= q:
                    break
            except (OSError, ConnectionError):
                pass
            await asyncio.sleep(0.05)
        await asyncio.sleep(0.2)
        self.note("storm", f"final wave: {running:g} running, {g.get('krait:num_requests_waiting')} waiting "
                           f"(max_tokens {big}); now all {len(tasks)} clients go")
        ev.set()
        return list(await asyncio.gather(*tasks))

    def mixed_requests(self):
        a = self.a
        rng = random.Random(a.seed + 11)
        reqs = []
        for i in range(a.mixed_requests):
            x = rng.random()
            if x < 0.1:
                reqs.append(self.invalid_request(rng, i))
                continue
            p = L.mixed_params(rng, max_tokens_hi=a.mixed_max_tokens, allow_stop=self.has_tok)
            stream = rng.random() < 0.5
            body = {"model": self.model, "stream": stream}
            body.update(p)
            if rng.random() < 0.3:
                body["n"] = rng.randint(2, 3)
            if stream and rng.random() < 0.5:
                body["stream_options"] = {"include_usage": True}
            path = "/v1/completions"
            if self.has_chat and x < 0.3:
                path = "/v1/chat/completions"
                body["messages"] = [{"role": "user", "content": rng.choice(["Hello", "Write a poem", "Count to 9",
                                                                             "x" * rng.randint(1, 200)])}]
                if "logprobs" in body:
                    lp = body.pop("logprobs")
                    body["logprobs"] = True
                    body["top_logprobs"] = lp
            elif self.has_tok and x < 0.4:
                body["prompt"] = "The quick brown fox " * rng.randint(1, 20)
            elif x < 0.5:
                body["prompt"] = [self.rand_ids(rng, rng.randint(1, a.mixed_prompt_max // 4))
                                  for _ in range(rng.randint(2, 3))]
            else:
                body["prompt"] = self.rand_ids(rng, rng.randint(1, a.mixed_prompt_max))
            reqs.append(L.Req(path, body, tag=f"mixed #{i}", timeout=a.request_timeout))
        return reqs

    def invalid_request(self, rng, i):
        p = L.random_ids(rng, 8, self.a.token_lo, self.a.token_hi)
        stream = rng.random() < 0.5
        cases = [
            (dict(prompt=p, max_tokens=4, top_p=0), 400),
            (dict(prompt=p, max_tokens=4, n=0), 400),
            (dict(prompt=p, max_tokens=4, temperature=-1), 400),
            (dict(prompt=p, max_tokens=self.mml), 400),
            (dict(prompt=p, max_tokens=4, logprobs=100), 400),
            (dict(prompt=[], max_tokens=4), 400),
            (dict(prompt=p, max_tokens=4, model="no-such-model"), 404),
            (dict(prompt=p, max_tokens=4, response_format={"type": "structural_tag"}), 400),
            (dict(prompt=p, max_tokens=4, guided_json={"type": "object", "multipleOf": 2}), 400),
            (b'{"prompt": [1, 2', 400),
        ]
        body, status = rng.choice(cases)
        if isinstance(body, dict):
            body = {"model": self.model, "stream": stream, **body}
        return L.Req("/v1/completions", body, tag=f"mixed #{i} (invalid)", expect="error", expect_status=status,
                     timeout=self.a.request_timeout)

    async def phase_mixed(self, row):
        return await L.run_closed(self.mixed_requests(), self.srv.host, self.srv.port, self.a.max_num_seqs)

    async def phase_bench(self, row):
        """Serving figures (vllm bench serve's random dataset, closed loop) at each --bench-concurrency:
        random prompts of exactly --bench-input-len tokens, --bench-output-len tokens with ignore_eos,
        greedy, streamed with usage. Every response is checked like any other."""
        a = self.a
        rng = random.Random(a.seed + 13)
        results = []
        self.bench = []
        for c in a.bench_concurrency:
            n = max(a.bench_min_prompts, a.bench_rounds * c)
            if self.left() - self.reserve() < 20:
                self.note("bench", f"concurrency {c}: skipped, {self.left():.0f} s left of the --deadline")
                continue
            reqs = [L.Req("/v1/completions",
                          self.body(self.rand_ids(rng, a.bench_input_len),
                                    max_tokens=a.bench_output_len, ignore_eos=True, temperature=0.0, stream=True,
                                    stream_options={"include_usage": True}),
                          tag=f"bench c={c} #{i}", timeout=a.request_timeout) for i in range(n)]
            t0 = time.perf_counter()
            res = await L.run_closed(reqs, self.srv.host, self.srv.port, c)
            sm = L.summarize(res, time.perf_counter() - t0)
            sm["concurrency"], sm["num_prompts"] = c, n
            sm["input_len"], sm["output_len"] = a.bench_input_len, a.bench_output_len
            sm.pop("failures", None)
            self.bench.append(sm)
            print(L.format_table(sm, f"concurrency {c}, {n} prompts, {a.bench_input_len} in / "
                                     f"{a.bench_output_len} out"), flush=True)
            results += res
        self.report["bench"] = self.bench
        return results

    async def phase_sigterm(self):
        """SIGTERM under load; returns nothing (its checks are its own)."""
        a, srv = self.a, self.srv
        host, port = srv.host, srv.port
        phase = "sigterm"
        print("== sigterm", flush=True)
        row = {"phase": phase}
        plen = a.sigterm_prompt
        big = max(1, self.mml - plen - 1)
        release = asyncio.Event()
        long_reqs = []
        for i in range(a.sigterm_streams):
            long_reqs.append(L.Req("/v1/completions",
                                   self.body(self.ids(plen), max_tokens=big, ignore_eos=True, stream=True,
                                             temperature=1.0, n=2 if i == 0 else 1),
                                   tag=f"sigterm stream #{i}", expect="any", timeout=a.request_timeout))
        for i in range(a.sigterm_nonstream):
            long_reqs.append(L.Req("/v1/completions", self.body(self.ids(plen), max_tokens=big, ignore_eos=True),
                                   tag=f"sigterm whole response #{i}", expect="any", timeout=a.request_timeout))
        noread = [L.Req("/v1/completions", self.body(self.ids(plen), max_tokens=big, ignore_eos=True, stream=True),
                        tag=f"sigterm never-reading client #{i}", cut=L.Cut("no_read"), release=release,
                        expect="any", timeout=a.request_timeout + 60)
                  for i in range(a.sigterm_noread)]
        tasks = [asyncio.ensure_future(L.run_one(r, host, port)) for r in long_reqs + noread]
        # wait until all of them run (n = 2 of the first stream runs as two sequences)
        want = a.sigterm_streams + (a.sigterm_streams > 0) + a.sigterm_nonstream + a.sigterm_noread
        running = await self.wait_running(want, 60)
        self.note(phase, f"{running:g} sequences running before SIGTERM ({a.sigterm_streams} streams, one with n = 2, "
                         f"{a.sigterm_nonstream} whole responses, {a.sigterm_noread} clients that never read)")
        # a request that should finish within the drain: its tokens at the ITL measured under the storm's
        # load take about a quarter of the shutdown timeout. SIGTERM goes once it runs.
        itl = self.itl_s or 0.02
        medium_tokens = max(2, min(256, int(a.shutdown_timeout / 4 / max(itl, 1e-4))))
        medium = L.Req("/v1/completions", self.body(self.ids(8), max_tokens=medium_tokens, ignore_eos=True,
                                                    stream=True),
                       tag=f"sigterm in-flight request of {medium_tokens} tokens", timeout=a.request_timeout)
        mt = asyncio.ensure_future(L.run_one(medium, host, port))
        got = await self.wait_running(want + 1, 30)
        if got < want + 1:
            self.note(phase, f"only {got:g} sequences run (want {want + 1}): SIGTERM anyway")
        t_sig = time.perf_counter()
        os.kill(srv.pid, signal.SIGTERM)
        probes_h, probes_r = [], []
        exited = asyncio.Event()

        async def probe_health():
            while not exited.is_set():
                ts = time.perf_counter()
                try:
                    r = await L.run_one(L.Req("/health", None, method="GET", expect="any", timeout=5), host, port)
                    probes_h.append((ts - t_sig, time.perf_counter() - t_sig, r))
                except Exception as e:  # noqa: BLE001
                    probes_h.append((ts - t_sig, time.perf_counter() - t_sig, str(e)))
                await asyncio.sleep(0.1)

        probe_tasks = []

        async def one_request_probe(i):
            ts = time.perf_counter()
            r = await L.run_one(L.Req("/v1/completions", self.body(self.ids(4), max_tokens=2, stream=i % 2 == 0),
                                      tag=f"new request during the drain #{i}", expect="error", expect_status=503,
                                      timeout=a.shutdown_timeout + 15), host, port)
            probes_r.append((ts - t_sig, time.perf_counter() - t_sig, r))

        async def probe_requests():
            i = 0
            while not exited.is_set():
                i += 1
                probe_tasks.append(asyncio.ensure_future(one_request_probe(i)))
                await asyncio.sleep(0.25)

        ph, pr = asyncio.ensure_future(probe_health()), asyncio.ensure_future(probe_requests())
        bound = a.shutdown_timeout + 5.0
        t_exit = None
        while time.perf_counter() - t_sig < bound + 10:
            if srv.proc.poll() is not None:
                t_exit = time.perf_counter() - t_sig
                break
            await asyncio.sleep(0.02)
        exited.set()
        if t_exit is None:
            self.fail(phase, f"krait serve still running {bound + 10:.0f} s after SIGTERM (bound {bound:g} s): killed")
            srv.kill()
        status = srv.proc.returncode
        srv.exit_status = status
        row["sigterm_to_exit_s"] = t_exit
        row["exit_status"] = status
        release.set()
        await asyncio.gather(ph, pr)
        await asyncio.gather(*probe_tasks)
        results = await asyncio.gather(*tasks)
        mres = await mt
        if t_exit is not None and t_exit > bound:
            self.fail(phase, f"exit {t_exit:.2f} s after SIGTERM, over the bound of --shutdown-timeout + 5 = {bound:g} s")
        if status != 0:
            why = f"signal {-status}" if status is not None and status < 0 else f"status {status}"
            self.fail(phase, f"krait serve ended with {why} after SIGTERM (expected exit status 0)\n{srv.log_tail(40)}")
        # the drain window: from SIGTERM until the first long request ended (the timeout cut) or the exit
        long_res = results[:len(long_reqs)]
        ends = [r.t_end - t_sig for r in long_res if r.t_end is not None]
        window = min(ends + ([t_exit] if t_exit is not None else []) or [bound])
        row["drain_window_s"] = window
        # A probe answered 200 before the server acted on the signal is fine; from the first probe that
        # shows the drain (a 503, or a refused connection) on, every probe must be a 503.
        probes_h.sort(key=lambda p: p[0])
        first = next((p[0] for p in probes_h if isinstance(p[2], str) or p[2].status != 200), None)
        in_window = [p for p in probes_h if p[1] <= window - 0.02 and first is not None and p[0] >= first]
        early = [p for p in probes_h if first is None or p[0] < first]
        bad_h = []
        for ts, te, r in in_window:
            if isinstance(r, str):
                bad_h.append(f"GET /health at +{ts:.2f} s: {r}")
            elif r.status != 503:
                bad_h.append(f"GET /health at +{ts:.2f} s: " + (f"status {r.status}" if r.status is not None else
                                                                 f"no answer ({r.conn_error or r.failure})"))
        row["health_probes"] = len(in_window)
        if first is None:
            self.fail(phase, f"/health never showed the drain: {len(probes_h)} probes from SIGTERM to the exit all "
                             f"answered 200")
        elif not in_window:
            self.fail(phase, f"no /health probe answered within the drain window of {window:.2f} s")
        if bad_h:
            self.fail(phase, f"/health while draining must answer 503: {len(bad_h)} of {len(in_window)} probes from "
                             f"+{first:.2f} s (the first sign of the drain) to +{window:.2f} s (the first in-flight "
                             f"request's end) did not: " + "; ".join(bad_h[:4]))
        rw = [p for p in probes_r if first is not None and p[0] >= first and p[1] <= window - 0.02]
        bad_r = [p for p in rw if p[2].outcome == "fail"]
        row["request_probes"] = len(rw)
        if bad_r:
            self.fail(phase, f"new requests while draining must get a clean 503: {len(bad_r)} of {len(rw)} did not; "
                             f"first (at +{bad_r[0][0]:.2f} s): {bad_r[0][2].describe()}")
        late = [p for p in probes_r if first is None or p[0] < first]
        if late:
            self.note(phase, f"{len(early)} /health probes and {len(late)} new requests came before the server showed "
                             f"the drain (not asserted)")
        # the requests in flight at SIGTERM
        n_ok = n_err = 0
        bad = []
        for r in long_res:
            if r.outcome == "ok":
                n_ok += 1
            elif r.outcome == "error":
                n_err += 1
                if not r.req.stream and r.status != 503:
                    bad.append((r, f"cut by the shutdown: expected a 503 error body, got status {r.status}"))
            else:
                what = ("a stream cut by the shutdown timeout must end with an error event + data: [DONE]"
                        if r.req.stream else "a whole response cut by the shutdown timeout must be a 503 error body")
                bad.append((r, what))
        for r, what in bad[:self.a.max_fail_details]:
            self.fail(phase, f"{what}: {r.describe()}")
        if len(bad) > self.a.max_fail_details:
            self.fail(phase, f"... and {len(bad) - self.a.max_fail_details} more in-flight requests")
        if mres.outcome != "ok":
            self.fail(phase, f"a request in flight at SIGTERM that needs ~{a.shutdown_timeout / 4:.1f} s must complete "
                             f"within the drain: {mres.describe()}")
        nr = {}
        for r in results[len(long_reqs):]:
            nr[r.outcome] = nr.get(r.outcome, 0) + 1
        self.note(phase, f"SIGTERM to exit {'-' if t_exit is None else '%.2f s' % t_exit} (exit status {status}); "
                         f"drain window {window:.2f} s; {len(in_window)} /health probes, {len(rw)} new requests in it; "
                         f"in-flight: {n_ok} complete, {n_err} clean errors, {len(bad)} bad; in-flight request of "
                         f"{medium_tokens} tokens: {mres.outcome}; clients that never read (not asserted: the server "
                         f"cannot write into a full window): {nr}")
        row.update(counts={"ok": n_ok + (mres.outcome == "ok"), "error": n_err, "fail": len(bad)},
                   requests=len(results) + 1, seconds=t_exit)
        self.rows.append(row)
        self.report["phases"][phase] = {k: v for k, v in row.items() if k != "phase"}

    async def wait_running(self, want, timeout):
        t0 = time.monotonic()
        running = 0
        while time.monotonic() - t0 < timeout:
            try:
                g, _ = await self.gauges()
                running = g["krait:num_requests_running"] or 0
            except (OSError, ConnectionError):
                pass
            if running >= want:
                break
            await asyncio.sleep(0.02)
        return running

    def scan_log(self):
        try:
            with open(self.srv.log_path, "rb") as fp:
                text = fp.read().decode("utf-8", "replace")
        except OSError:
            return
        for pat in ("ERROR: AddressSanitizer", "ERROR: LeakSanitizer", "runtime error:", "WARNING: ThreadSanitizer"):
            i = text.find(pat)
            if i >= 0:
                self.fail("log", f"the server log has a sanitizer report ({pat}):\n" +
                          "\n".join("    | " + ln for ln in text[max(0, i - 200):i + 2500].splitlines()))
                break

    # ---- the run ---------------------------------------------------------------------------------

    async def run(self):
        a = self.a
        self.srv = Server(a, a.log)
        print(f"starting: {' '.join(self.srv.cmd())}", flush=True)
        self.srv.start()
        try:
            t = await self.srv.wait_ready(a.load_timeout)
        except Abort as e:
            self.fail("start", str(e))
            self.srv.kill()
            return
        print(f"   ready after {t:.1f} s on port {self.srv.port} (pid {self.srv.pid})", flush=True)
        try:
            st, j = await L.http_json(self.srv.host, self.srv.port, "GET", "/v1/models")
            self.model = j["data"][0]["id"]
            self.mml = int(j["data"][0]["max_model_len"])
            st, j = await L.http_json(self.srv.host, self.srv.port, "POST", "/tokenize", {"prompt": "hello"})
            self.has_tok = st == 200
            st, j = await L.http_json(self.srv.host, self.srv.port, "POST", "/tokenize",
                                      {"messages": [{"role": "user", "content": "hi"}]})
            self.has_chat = st == 200
            self.note("start", f"model {self.model!r}, max_model_len {self.mml}, tokenizer "
                               f"{'yes' if self.has_tok else 'no'}, chat template {'yes' if self.has_chat else 'no'}")
            self.itl_s = None
            phases = ["warm-up"]
            for p in a.phases:
                phases += ["storm-base", "storm"] if p == "storm" else [p] if p != "sigterm" else []
            fns = {"warm-up": self.phase_warmup, "long": self.phase_long, "storm-base": self.phase_storm_base,
                   "storm": self.phase_storm, "mixed": self.phase_mixed, "bench": self.phase_bench}
            for p in phases:
                await self.run_phase(p, fns[p])
                if p in ("warm-up", "storm-base") and self.rows[-1].get("itl_p50_ms"):
                    self.itl_s = self.rows[-1]["itl_p50_ms"] / 1000.0  # the load's ITL, for later sizes
            base = next((r for r in self.rows if r["phase"] == "storm-base" and r.get("steps_per_s")), None)
            storm = next((r for r in self.rows if r["phase"] == "storm" and r.get("loop_steps_per_s")), None)
            if base and storm:
                self.note("storm", f"engine steps/s: {storm['loop_steps_per_s']:.1f} in the storm vs "
                                   f"{base['steps_per_s']:.1f} for the same load without disconnects "
                                   f"({storm['loop_steps_per_s'] / base['steps_per_s']:.2f}x; {storm['loop_steps']:g} "
                                   f"steps for {a.storm_requests} requests vs {base['steps']:g} for "
                                   f"{base['requests']}; the final wave not counted)")
                self.report["steps_per_s"] = {"storm": storm["loop_steps_per_s"], "no_disconnects": base["steps_per_s"]}
            if "sigterm" in a.phases:
                if self.left() < a.shutdown_timeout + 10:
                    self.note("sigterm", f"skipped: {self.left():.0f} s left of the --deadline")
                    self.rows.append({"phase": "sigterm", "skipped": True})
                else:
                    if self.itl_s is None:
                        self.itl_s = 0.02
                    await self.phase_sigterm()
        except Abort:
            pass
        finally:
            if self.srv.alive():
                self.srv.proc.send_signal(signal.SIGTERM)
                try:
                    self.srv.proc.wait(a.shutdown_timeout + 10)
                except subprocess.TimeoutExpired:
                    self.srv.kill()
            self.scan_log()

    def summary(self):
        lines = ["", "| phase | requests | ok | clean errors | cut | failed | seconds | steps/s | out tok/s | "
                     "TTFT p50 ms | ITL p50 ms | idle after s | RSS MiB | GPU MiB | /health |",
                 "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|"]

        def f(x, fmt="{:.2f}"):
            return "-" if x is None else (fmt.format(x) if isinstance(x, (int, float)) else str(x))

        for r in self.rows:
            if r.get("skipped"):
                lines.append(f"| {r['phase']} | skipped (deadline) |" + " |" * 13)
                continue
            if r.get("cut_by_deadline"):
                r = dict(r, phase=r["phase"] + " (cut by the deadline)")
            c = r.get("counts", {})
            extra = ""
            if r["phase"] == "sigterm":
                extra = f" exit {r.get('exit_status')} after {f(r.get('sigterm_to_exit_s'))} s"
            lines.append(
                f"| {r['phase']}{extra} | {r.get('requests', 0)} | {c.get('ok', 0)} | {c.get('error', 0)} | "
                f"{c.get('cut', 0)} | {c.get('fail', 0)} | {f(r.get('seconds'), '{:.1f}')} | "
                f"{f(r.get('steps_per_s'), '{:.0f}')} | {f(r.get('out_tok_s'), '{:.0f}')} | "
                f"{f(r.get('ttft_p50_ms'), '{:.1f}')} | {f(r.get('itl_p50_ms'), '{:.1f}')} | {f(r.get('idle_s'))} | "
                f"{f(r.get('rss_mib'), '{:.1f}')} | {f(r.get('gpu_mib'), '{:.0f}')} | {f(r.get('health'), '{}')} |")
        if getattr(self, "bench", None):
            lines += ["", "Serving figures (closed loop; random prompts; streamed):", "",
                      "| concurrency | prompts | in/out tokens | ok | failed | req/s | out tok/s | TTFT mean / p50 / p99 ms | "
                      "TPOT mean / p50 / p99 ms | ITL p50 / p99 ms | E2E p50 / p99 ms |",
                      "|---|---|---|---|---|---|---|---|---|---|---|"]
            for b in self.bench:
                t, p, i, e = b["ttft_ms"], b["tpot_ms"], b["itl_ms"], b["e2el_ms"]
                lines.append(f"| {b['concurrency']} | {b['num_prompts']} | {b['input_len']}/{b['output_len']} | "
                             f"{b['completed']} | {b['failed']} | {f(b['request_throughput'])} | "
                             f"{f(b['output_throughput'], '{:.0f}')} | {f(t['mean'], '{:.1f}')} / {f(t['p50'], '{:.1f}')} / "
                             f"{f(t['p99'], '{:.1f}')} | {f(p['mean'])} / {f(p['p50'])} / {f(p['p99'])} | "
                             f"{f(i['p50'])} / {f(i['p99'])} | {f(e['p50'], '{:.0f}')} / {f(e['p99'], '{:.0f}')} |")
        lines.append("")
        by = {}
        for x in self.failures:
            by[x["phase"]] = by.get(x["phase"], 0) + 1
        total = time.monotonic() - self.t_start
        if self.failures:
            lines.append(f"stress: FAILED: {len(self.failures)} assertion(s) failed (" +
                         ", ".join(f"{k}: {v}" for k, v in by.items()) + f") in {total:.0f} s; server log "
                         f"{self.a.log}")
            for x in self.failures:
                lines.append(f"  - [{x['phase']}] {x['message'].splitlines()[0][:300]}")
        else:
            skipped = [r["phase"] for r in self.rows if r.get("skipped") or r.get("cut_by_deadline")]
            lines.append(f"stress: OK: every assertion held ({len(self.rows) - len(skipped)} phases, {total:.0f} s)" +
                         (f"; skipped or cut by the --deadline: {', '.join(skipped)}" if skipped else ""))
        return "\n".join(lines)


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--krait", required=True, help="the krait binary")
    ap.add_argument("--model", required=True, help="the model directory to serve")
    ap.add_argument("--profile", choices=sorted(PROFILES), default="cpu")
    ap.add_argument("--phases", default="long,storm,mixed,sigterm",
                    help="comma-separated, in order, of long,storm,mixed,bench,sigterm (the warm-up always runs "
                         "first, sigterm always last; bench: serving figures, not in the default list)")
    ap.add_argument("--max-model-len", type=int, default=None, help="passed to krait serve")
    ap.add_argument("--serve-arg", action="append", default=[], help="more krait serve flags (split on spaces)")
    ap.add_argument("--idle-timeout", type=float, default=1.0,
                    help="seconds within which the gauges must be idle after a phase (default 1.0; give more under "
                         "sanitizers)")
    ap.add_argument("--settle-s", type=float, default=5.0,
                    help="after a failed idle check, keep polling this long to report when (if) they got idle")
    ap.add_argument("--recover-s", type=float, default=60.0,
                    help="when the gauges stay busy, wait up to this long for idle before the next phase")
    ap.add_argument("--rss-tol-mib", type=float, default=64.0)
    ap.add_argument("--rss-tol-pct", type=float, default=10.0)
    ap.add_argument("--asan-quarantine-mb", type=int, default=16,
                    help="ASan quarantine of an ASan build (unless ASAN_OPTIONS sets one; 0: ASan's default)")
    ap.add_argument("--gpu-tol-mib", type=float, default=64.0)
    ap.add_argument("--token-lo", type=int, default=1000, help="random prompt ids from [lo, hi)")
    ap.add_argument("--token-hi", type=int, default=30000)
    ap.add_argument("--seed", type=int, default=1)
    ap.add_argument("--prompt-period", type=int, default=0,
                    help="prompts repeat a random block of this many ids (n-gram drafts find matches); 0: none")
    ap.add_argument("--deadline", type=float, default=0, help="seconds for the whole run; phases that would start "
                                                               "too late are skipped, saying so (0: none)")
    ap.add_argument("--bench-concurrency", default="1,16,64,256", help="the bench phase's concurrency levels")
    ap.add_argument("--bench-input-len", type=int, default=1024)
    ap.add_argument("--bench-output-len", type=int, default=256)
    ap.add_argument("--bench-rounds", type=int, default=1, help="prompts per level = max(min, rounds x concurrency)")
    ap.add_argument("--bench-min-prompts", type=int, default=4)
    ap.add_argument("--max-fail-details", type=int, default=5, help="failed requests printed in full per phase")
    ap.add_argument("--out", default=None, help="directory for the server log and report.json")
    ap.add_argument("--json", default=None, help="the JSON report (default OUT/report.json)")
    for k, v in PROFILES["cpu"].items():
        ap.add_argument("--" + k.replace("_", "-"), type=type(v), default=None, help=f"(profile default)")
    a = ap.parse_args(argv)
    for k, v in PROFILES[a.profile].items():
        if getattr(a, k) is None:
            setattr(a, k, v)
    a.phases = [p.strip() for p in a.phases.split(",") if p.strip()]
    a.bench_concurrency = [int(x) for x in a.bench_concurrency.split(",") if x.strip()]
    for p in a.phases:
        if p not in ("long", "storm", "mixed", "bench", "sigterm"):
            ap.error(f"unknown phase {p!r}")
    need = a.sigterm_streams + (a.sigterm_streams > 0) + a.sigterm_nonstream + a.sigterm_noread + 1
    if "sigterm" in a.phases and need > a.max_num_seqs:
        ap.error(f"the sigterm phase runs {need} sequences at once; --max-num-seqs {a.max_num_seqs} is too few")
    if not os.access(a.krait, os.X_OK):
        print(f"stress: {a.krait} is not an executable", file=sys.stderr)
        return 2
    if not os.path.isfile(os.path.join(a.model, "config.json")):
        print(f"stress: {a.model} has no config.json", file=sys.stderr)
        return 2
    out = a.out or tempfile.mkdtemp(prefix="krait-stress-")
    os.makedirs(out, exist_ok=True)
    a.log = os.path.join(out, "server.log")
    if os.path.exists(a.log):
        os.unlink(a.log)
    L.raise_nofile()
    s = Suite(a)

    def on_term(signum, frame):
        raise KeyboardInterrupt  # a timeout around the suite: the server goes with it

    signal.signal(signal.SIGTERM, on_term)
    try:
        asyncio.run(s.run())
    except KeyboardInterrupt:
        if s.srv:
            s.srv.kill()
        print(f"stress: interrupted; server log {a.log}", flush=True)
        return 130
    s.report["summary_rows"] = s.rows
    s.report["config"] = {k: v for k, v in vars(a).items()}
    with open(a.json or os.path.join(out, "report.json"), "w") as fp:
        json.dump(s.report, fp, indent=1, default=str)
    print(s.summary())
    return 1 if s.failures or not s.rows else 0


if __name__ == "__main__":
    sys.exit(main())
