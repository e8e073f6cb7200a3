#!/usr/bin/env python3
"""Load client for krait's OpenAI-compatible API (standard library only: asyncio and raw sockets).

As a CLI it runs the load shapes of `vllm bench serve` against /v1/completions and prints a table
of serving figures (optionally JSON with --json FILE):

  closed loop, fixed concurrency:   load.py --port 8000 --concurrency 16 --num-prompts 64
  Poisson arrivals at a rate:       load.py --port 8000 --request-rate 4 [--max-concurrency 32]
  random prompts:                   --input-len 1024 --output-len 256 [--range-ratio 0.1]
  shared prefix:                    --prefix-len 512 (a common prefix of 512 tokens, random suffix)

Prompts are random token ids sent as `"prompt": [ids]` with `max_tokens` = the output length and
`ignore_eos: true`; requests stream by default (--no-stream for whole responses). Figures: TTFT,
TPOT, ITL and end-to-end latency (mean, p50, p99), output and total tokens/s, requests/s, and the
completed / failed / clean-error / client-cut counts.

Server counters: /metrics is read before and after the measured requests, and what the server
counted meanwhile is reported beside the client's figures: engine steps and generated tokens per
step, and with speculative decoding on (`krait serve --speculative-config`) vLLM's figures from the
krait:spec_decode_* counters: drafts (steps in which a sequence verified drafted tokens), drafted
and accepted tokens, the draft acceptance rate (accepted / drafted), the mean acceptance length
(1 + accepted / drafts: the tokens a sequence gains from one step that verifies drafts) and the
acceptance rate per draft position (accepted at that position / drafts).

Stress extras: --cut-prob P (a request closes its socket after a random time up to --cut-max-s or
after a random number of bytes up to --cut-max-bytes, or right after sending), --n, --mixed
(random sampling parameters, logprobs, stop strings, max_tokens per request), --stop S. Every
response that its client did not cut goes through a checker: it must be complete (a stream: data
events then `data: [DONE]`, a finish_reason on every choice, valid chunked framing; a whole
response: JSON with choices and usage) or a clean error (4xx/5xx with {"error": {"message": ...}},
or in a stream a `data: {"error": ...}` event followed by `data: [DONE]`). Anything else (a bare
close, a truncated chunk, invalid JSON, events after [DONE]) is a failure, recorded with details.
The exit status is 1 when any request failed that way.

As a library (tests/stress/stress.py uses it): build `Req` objects, run them with `run_one`,
`run_closed` or `run_poisson`, read the `Res` objects (outcome "ok" | "error" | "cut" | "fail") and
summarise them with `summarize`.
"""

import argparse
import asyncio
import json
import math
import os
import random
import re
import resource
import socket
import struct
import sys
import time

# ---------------------------------------------------------------------------------------------------
# requests and results
# ---------------------------------------------------------------------------------------------------

CUT_KINDS = ("none", "after_send", "mid_body", "time", "bytes", "event", "no_read")


class Cut:
    """How a client abandons its request: none; after_send (closes right after sending); mid_body
    (closes halfway through the request body); time (after `t` seconds from the start); bytes (once
    `nbytes` bytes of the response arrived); event (once the request's `release` event is set);
    no_read (sends, then reads nothing until `release` is set, with a small receive buffer; the
    response is read and checked after that). `rst` closes
    with a reset (SO_LINGER 0) instead of a FIN."""

    __slots__ = ("kind", "t", "nbytes", "rst")

    def __init__(self, kind="none", t=0.0, nbytes=0, rst=False):
        assert kind in CUT_KINDS, kind
        self.kind, self.t, self.nbytes, self.rst = kind, t, nbytes, rst

    def __repr__(self):
        if self.kind == "time":
            return f"cut(time {self.t * 1000:.0f} ms{' rst' if self.rst else ''})"
        if self.kind == "bytes":
            return f"cut(after {self.nbytes} B{' rst' if self.rst else ''})"
        return f"cut({self.kind}{' rst' if self.rst else ''})"


class Req:
    """One HTTP request. `body` is a dict (sent as JSON) or bytes (sent as is: malformed bodies).
    expect: "ok" (a complete 200 response), "error" (a clean error; `expect_status` pins the
    status), "any" (either). `allow_abort` accepts finish_reason "abort" as complete."""

    def __init__(self, path, body, *, method="POST", tag="", cut=None, expect="ok", expect_status=None,
                 timeout=300.0, allow_abort=False, release=None, api_key=None):
        self.path, self.body, self.method, self.tag = path, body, method, tag
        self.cut = cut or Cut()
        self.expect, self.expect_status, self.timeout = expect, expect_status, timeout
        self.allow_abort = allow_abort
        self.release = release  # asyncio.Event for Cut("no_read")
        self.api_key = api_key

    @property
    def stream(self):
        return isinstance(self.body, dict) and bool(self.body.get("stream"))

    @property
    def chat(self):
        return self.path.endswith("/chat/completions")

    def n_choices(self):
        """Choices a complete response carries (n per prompt; a list of prompts of ids counts each)."""
        if not isinstance(self.body, dict):
            return None
        n = self.body.get("n", 1)
        p = self.body.get("prompt")
        if isinstance(p, list) and p and isinstance(p[0], (list, str)):
            n *= len(p)
        return n

    def prompt_len(self):
        if not isinstance(self.body, dict):
            return 0
        p = self.body.get("prompt")
        if isinstance(p, list):
            if p and isinstance(p[0], list):
                return sum(len(x) for x in p)
            if all(isinstance(x, int) for x in p):
                return len(p)
        return 0

    def describe(self):
        if not isinstance(self.body, dict):
            return f"{self.method} {self.path} raw body {self.body[:80]!r} {self.cut}"
        b = dict(self.body)
        for k in ("prompt", "messages"):
            if k in b:
                v = b[k]
                if isinstance(v, list) and v and isinstance(v[0], int):
                    b[k] = f"<{len(v)} token ids>"
                elif isinstance(v, list) and v and isinstance(v[0], list):
                    b[k] = f"<{len(v)} prompts of {[len(x) for x in v]} ids>"
                else:
                    s = json.dumps(v)
                    b[k] = s if len(s) < 60 else s[:57] + "..."
        return f"{self.method} {self.path} {json.dumps(b)} {self.cut}"


class Res:
    __slots__ = ("req", "rid", "status", "headers", "outcome", "failure", "cut_done", "cut_stage", "conn_error",
                 "t_start", "t_sent", "t_first_byte", "t_first_token", "t_end", "itl", "out_tokens",
                 "prompt_tokens", "finish", "texts", "ntok", "error", "events", "done_seen", "nbytes", "head",
                 "tail", "raw", "json", "usage", "lp_problem", "token_ids", "stop_reason")

    def __init__(self, req, rid):
        self.req, self.rid = req, rid
        self.status = None
        self.headers = {}
        self.outcome = None
        self.failure = None
        self.cut_done = False
        self.cut_stage = None  # before_response | headers | mid_body (of the response) when cut
        self.conn_error = None
        self.t_start = self.t_sent = self.t_first_byte = self.t_first_token = self.t_end = None
        self.itl = []
        self.out_tokens = 0
        self.prompt_tokens = None
        self.finish = {}
        self.texts = {}
        self.ntok = {}
        self.token_ids = {}
        self.stop_reason = {}
        self.error = None
        self.events = 0
        self.done_seen = False
        self.nbytes = 0
        self.head = bytearray()  # first bytes received (for reports)
        self.tail = bytearray()  # last bytes received
        self.raw = b""  # the body of a response that is not an event stream
        self.json = None  # that body parsed (200 answers of the API)
        self.usage = None
        self.lp_problem = None

    @property
    def e2e(self):
        return None if self.t_end is None or self.t_start is None else self.t_end - self.t_start

    @property
    def ttft(self):
        return None if self.t_first_token is None else self.t_first_token - self.t_start

    def tpot(self):
        n = self.ntok.get(0, self.out_tokens)
        if self.t_first_token is None or n < 2:
            return None
        return (self.t_end - self.t_first_token) / (n - 1)

    def received(self, limit=400):
        h = bytes(self.head)
        if self.nbytes <= len(h):
            return repr(h[:limit])
        t = bytes(self.tail)
        return f"{h[:limit // 2]!r} ... ({self.nbytes} B in all) ... {t[-limit // 2:]!r}"

    def describe(self):
        st = self.status if self.status is not None else "none"
        what = self.failure or self.outcome
        return (f"request #{self.rid} [{self.req.tag}] {self.req.describe()}\n"
                f"    -> {self.outcome}: {what}; status {st}, {self.nbytes} B, {self.events} events, "
                f"[DONE] {'seen' if self.done_seen else 'not seen'}"
                + (f", connection: {self.conn_error}" if self.conn_error else "")
                + f"\n    received: {self.received()}")


# ---------------------------------------------------------------------------------------------------
# HTTP/1.1 response parsing (incremental, chunked transfer decoding, SSE)
# ---------------------------------------------------------------------------------------------------


class Parser:
    """Feeds on response bytes. Decodes the status line, headers and the body (Content-Length,
    chunked, or until EOF) and hands SSE events to `on_event(payload, t)` for streams."""

    def __init__(self, res, on_event):
        self.res = res
        self.on_event = on_event
        self.buf = bytearray()
        self.state = "head"
        self.framing = None
        self.left = 0
        self.body = bytearray()
        self.sse = bytearray()
        self.sse_data = []
        self.done = False
        self.problem = None
        self.is_sse = False

    def feed(self, data, t):
        self.buf += data
        try:
            self._run(t)
        except ValueError as e:
            if not self.problem:
                self.problem = str(e)
            self.done = True

    def _run(self, t):
        while not self.done:
            if self.state == "head":
                i = self.buf.find(b"\r\n\r\n")
                if i < 0:
                    if len(self.buf) > 65536:
                        raise ValueError("response headers over 64 KiB")
                    return
                head = bytes(self.buf[:i]).decode("latin-1")
                del self.buf[:i + 4]
                lines = head.split("\r\n")
                parts = lines[0].split(" ", 2)
                if len(parts) < 2 or not parts[0].startswith("HTTP/1.") or not parts[1].isdigit():
                    raise ValueError(f"bad status line {lines[0]!r}")
                self.res.status = int(parts[1])
                for ln in lines[1:]:
                    k, sep, v = ln.partition(":")
                    if not sep:
                        raise ValueError(f"bad header line {ln!r}")
                    self.res.headers[k.strip().lower()] = v.strip()
                hd = self.res.headers
                self.is_sse = hd.get("content-type", "").startswith("text/event-stream")
                if "chunked" in hd.get("transfer-encoding", "").lower():
                    self.framing, self.state = "chunked", "size"
                elif "content-length" in hd:
                    self.framing, self.state = "length", "data"
                    self.left = int(hd["content-length"])
                    if self.left == 0:
                        self.done = True
                else:
                    self.framing, self.state = "eof", "data"
            elif self.framing == "length":
                n = min(self.left, len(self.buf))
                self._body(bytes(self.buf[:n]), t)
                del self.buf[:n]
                self.left -= n
                if self.left == 0:
                    self.done = True
                    if self.buf:
                        raise ValueError(f"{len(self.buf)} bytes after the Content-Length body")
                return
            elif self.framing == "eof":
                self._body(bytes(self.buf), t)
                self.buf.clear()
                return
            elif self.state == "size":
                i = self.buf.find(b"\r\n")
                if i < 0:
                    if len(self.buf) > 1024:
                        raise ValueError("chunk size line over 1 KiB")
                    return
                line = bytes(self.buf[:i]).split(b";")[0].strip()
                del self.buf[:i + 2]
                try:
                    self.left = int(line, 16)
                except ValueError:
                    raise ValueError(f"bad chunk size line {line!r}") from None
                self.state = "trailer" if self.left == 0 else "chunk"
            elif self.state == "chunk":
                n = min(self.left, len(self.buf))
                if n == 0:
                    return
                self._body(bytes(self.buf[:n]), t)
                del self.buf[:n]
                self.left -= n
                if self.left == 0:
                    self.state = "crlf"
            elif self.state == "crlf":
                if len(self.buf) < 2:
                    return
                if self.buf[:2] != b"\r\n":
                    raise ValueError(f"chunk not followed by CRLF: {bytes(self.buf[:16])!r}")
                del self.buf[:2]
                self.state = "size"
            elif self.state == "trailer":
                i = self.buf.find(b"\r\n")
                if i < 0:
                    return
                line = self.buf[:i]
                del self.buf[:i + 2]
                if not line:
                    self.done = True
                    if self.buf:
                        raise ValueError(f"{len(self.buf)} bytes after the last chunk")

    def _body(self, b, t):
        if not b:
            return
        if not self.is_sse:
            self.body += b
            return
        self.sse += b
        while True:
            i = self.sse.find(b"\n")
            if i < 0:
                return
            line = bytes(self.sse[:i])
            del self.sse[:i + 1]
            if line.endswith(b"\r"):
                line = line[:-1]
            if not line:
                if self.sse_data:
                    payload = b"\n".join(self.sse_data)
                    self.sse_data = []
                    self.on_event(payload, t)
            elif line.startswith(b"data:"):
                d = line[5:]
                self.sse_data.append(d[1:] if d.startswith(b" ") else d)
            # comments (":...") and other fields are ignored

    def eof_problem(self):
        """What is wrong when the connection ends now (None when the framing is complete)."""
        if self.done:
            return self.problem
        if self.state == "head":
            return "connection closed before a complete status line and headers" if self.buf or self.res.nbytes \
                else "connection closed without any response"
        if self.framing == "eof":
            self.done = True
            if self.sse_data or self.sse.strip():
                return "connection closed in the middle of an SSE event"
            return None
        if self.framing == "length":
            return f"connection closed with {self.left} bytes of the Content-Length body missing"
        if self.state == "chunk":
            return f"truncated chunk: connection closed with {self.left} bytes of the chunk missing"
        if self.state in ("size", "crlf"):
            return "connection closed in the middle of the chunked body (no terminating 0-size chunk)"
        return "connection closed in the chunked trailer"


# ---------------------------------------------------------------------------------------------------
# the response checker
# ---------------------------------------------------------------------------------------------------

FINISH_OK = ("stop", "length")


class StreamState:
    """Follows a stream's events as they arrive (timestamps, tokens per choice) and notes the first
    protocol problem."""

    def __init__(self, res):
        self.res = res
        self.problem = None
        self.after_error = False
        self.last_t = {}
        self.finish_event = {}
        self.payload = b""

    def on_event(self, payload, t):
        res = self.res
        res.events += 1
        if res.done_seen:
            self._bad(f"event #{res.events} after data: [DONE]: {payload[:120]!r}")
            return
        if payload == b"[DONE]":
            res.done_seen = True
            return
        if self.after_error:
            self._bad(f"event #{res.events} after the error event (expected data: [DONE]): {payload[:120]!r}")
            return
        try:
            obj = json.loads(payload)
        except ValueError as e:
            self._bad(f"event #{res.events} is not JSON ({e}): {payload[:200]!r}")
            return
        if not isinstance(obj, dict):
            self._bad(f"event #{res.events} is not a JSON object: {payload[:200]!r}")
            return
        if "error" in obj:
            res.error = obj["error"]
            self.after_error = True
            if not isinstance(res.error, dict) or not isinstance(res.error.get("message"), str):
                self._bad(f"error event without error.message: {payload[:200]!r}")
            return
        if obj.get("usage") is not None:
            res.usage = obj["usage"]
        choices = obj.get("choices")
        if not isinstance(choices, list):
            self._bad(f"event #{res.events} has no choices list: {payload[:200]!r}")
            return
        want_obj = "chat.completion.chunk" if res.req.chat else "text_completion"
        if obj.get("object") != want_obj:
            self._bad(f"event #{res.events} has object {obj.get('object')!r}, expected {want_obj!r}")
        self.payload = payload
        for c in choices:
            self._choice(c, t)

    def _choice(self, c, t):
        res = self.res
        if not isinstance(c, dict) or not isinstance(c.get("index"), int):
            self._bad(f"a choice without an integer index: {str(c)[:200]}")
            return
        i = c["index"]
        nc = res.req.n_choices()
        if nc is not None and not 0 <= i < nc:
            self._bad(f"choice index {i} out of range (the request asked for {nc} choices)")
            return
        if res.req.chat:
            d = c.get("delta")
            if not isinstance(d, dict):
                self._bad(f"chat chunk choice {i} without a delta object")
                return
            text = d.get("content") or ""
        else:
            text = c.get("text")
            if not isinstance(text, str):
                self._bad(f"choice {i} text is not a string: {str(c)[:200]}")
                return
        ids = c.get("token_ids")
        n = len(ids) if isinstance(ids, list) else (1 if text else 0)
        if i in res.finish and (n or text):
            self._bad(f"choice {i} got content after its finish_reason")
        lp = c.get("logprobs")
        want_lp = res.req.body.get("logprobs") if isinstance(res.req.body, dict) else None
        if want_lp is not None and want_lp is not False and (n or text) and res.lp_problem is None:
            if res.req.chat:
                if not isinstance(lp, dict) or not isinstance(lp.get("content"), list):
                    res.lp_problem = f"choice {i}: logprobs requested but the chunk has {str(lp)[:120]}"
            elif not isinstance(lp, dict) or not isinstance(lp.get("tokens"), list) or \
                    len(lp.get("token_logprobs", [])) != len(lp["tokens"]) or \
                    (isinstance(ids, list) and len(lp["tokens"]) != len(ids)):
                res.lp_problem = f"choice {i}: malformed logprobs {str(lp)[:160]}"
            elif isinstance(want_lp, int) and want_lp > 0:
                for top in lp.get("top_logprobs") or []:
                    if not isinstance(top, dict) or len(top) > want_lp:
                        res.lp_problem = f"choice {i}: top_logprobs {str(top)[:120]} for logprobs={want_lp}"
                        break
        if n or text:
            res.texts[i] = res.texts.get(i, "") + text
            res.ntok[i] = res.ntok.get(i, 0) + n
            if isinstance(ids, list):
                res.token_ids.setdefault(i, []).extend(ids)
            if res.t_first_token is None:
                res.t_first_token = t
            if i in self.last_t:
                res.itl.append(t - self.last_t[i])
            self.last_t[i] = t
        fr = c.get("finish_reason")
        if fr is not None:
            res.stop_reason[i] = c.get("stop_reason")
            if i in res.finish:
                self._bad(f"choice {i} got a second finish_reason ({res.finish[i]!r} in event "
                          f"{self.finish_event[i][0]}: {self.finish_event[i][1]!r}; then {fr!r} in event "
                          f"{res.events}: {self.payload[:300]!r})")
            res.finish[i] = fr
            self.finish_event.setdefault(i, (res.events, self.payload[:300]))

    def _bad(self, msg):
        if self.problem is None:
            self.problem = msg


def _check_error_body(res, body):
    try:
        obj = json.loads(body)
    except ValueError:
        return f"status {res.status} with a body that is not JSON: {body[:200]!r}"
    e = obj.get("error") if isinstance(obj, dict) else None
    if not isinstance(e, dict) or not isinstance(e.get("message"), str) or not e["message"]:
        return f"status {res.status} without an error object with a message: {body[:200]!r}"
    res.error = e
    return None


def _check_choices(res, nc, finish, get_text):
    req = res.req
    body = req.body
    for i in range(nc or 0):
        if i not in finish or finish[i] is None:
            return f"choice {i} has no finish_reason"
        if finish[i] not in FINISH_OK and not (req.allow_abort and finish[i] == "abort"):
            return f"choice {i} finished with {finish[i]!r} (the client did not cut it)"
    stops = body.get("stop")
    if isinstance(stops, str):
        stops = [stops]
    # Whatever ended a choice, its text holds none of the request's stop strings: the earliest
    # occurrence of any of them ends it there.
    for i in range(nc or 0):
        text = get_text(i)
        if text is None:
            continue
        for s in stops or []:
            if s and s in text:
                return (f"choice {i} (finish_reason {finish.get(i)!r}, stop_reason {res.stop_reason.get(i)!r}) "
                        f"holds the stop string {s!r}: {text[:120]!r}")
    mt = body.get("max_tokens")
    if isinstance(mt, int):
        for i, n in res.ntok.items():
            if n > mt:
                return f"choice {i} has {n} tokens, max_tokens is {mt}"
            if body.get("ignore_eos") and not stops and not body.get("stop_token_ids") and n != mt \
                    and finish.get(i) == "length":
                return f"choice {i} finished with 'length' after {n} tokens, max_tokens is {mt}"
    return None


def check(res, parser_problem, stream_state):
    """Classifies a finished request: outcome "ok" | "error" | "cut" | "fail" and `failure`."""
    req = res.req
    if res.cut_done:
        res.outcome = "cut"
        return
    problem = None
    if res.conn_error and res.status is None:
        problem = f"no response: {res.conn_error}"
    elif parser_problem:
        problem = parser_problem
    elif res.status is None:
        problem = "no response"
    outcome = None
    if problem is None and res.status != 200:
        if not 400 <= res.status <= 599:
            problem = f"unexpected status {res.status}"
        else:
            problem = _check_error_body(res, res.raw)
            outcome = "error"
    elif problem is None and req.stream and stream_state is not None:
        if not res.headers.get("content-type", "").startswith("text/event-stream"):
            problem = f"a stream answered with Content-Type {res.headers.get('content-type')!r}"
        elif stream_state.problem:
            problem = stream_state.problem
        elif not res.done_seen:
            problem = "the stream ended without data: [DONE]" + (
                " (after an error event)" if res.error is not None else "")
        elif res.error is not None:
            outcome = "error"
        else:
            problem = _check_choices(res, req.n_choices(), res.finish, lambda i: res.texts.get(i, ""))
            if problem is None and res.lp_problem:
                problem = res.lp_problem
            if problem is None and isinstance(res.usage, dict):
                u = res.usage
                if sum(res.ntok.values()) and u.get("completion_tokens") != sum(res.ntok.values()):
                    problem = f"usage.completion_tokens {u.get('completion_tokens')} but {sum(res.ntok.values())} " \
                              f"tokens streamed"
            if problem is None and isinstance(req.body, dict) and \
                    (req.body.get("stream_options") or {}).get("include_usage") and res.usage is None:
                problem = "stream_options.include_usage was set but no usage chunk came"
            outcome = "ok"
    elif problem is None and (req.method == "GET" and not req.path.startswith("/v1/")):
        outcome = "ok"  # /health, /metrics, /version: the caller reads res.raw
    elif problem is None:
        body = res.raw
        try:
            obj = json.loads(body)
        except ValueError as e:
            obj = None
            problem = f"a 200 response that is not JSON ({e}): {body[:200]!r}"
        if obj is not None:
            res.json = obj
            if isinstance(req.body, dict) and req.path.startswith("/v1/") and req.path != "/v1/models":
                ch = obj.get("choices") if isinstance(obj, dict) else None
                u = obj.get("usage") if isinstance(obj, dict) else None
                nc = req.n_choices()
                if not isinstance(ch, list) or (nc is not None and len(ch) != nc):
                    problem = f"expected {nc} choices, got {str(ch)[:200]}"
                elif not isinstance(u, dict) or not all(isinstance(u.get(k), int) for k in
                                                        ("prompt_tokens", "completion_tokens", "total_tokens")):
                    problem = f"no valid usage object: {str(u)[:200]}"
                elif u["total_tokens"] != u["prompt_tokens"] + u["completion_tokens"]:
                    problem = f"usage does not add up: {u}"
                else:
                    res.usage = u
                    fin, texts = {}, {}
                    for c in ch:
                        i = c.get("index")
                        fin[i] = c.get("finish_reason")
                        res.stop_reason[i] = c.get("stop_reason")
                        if req.chat:
                            texts[i] = (c.get("message") or {}).get("content")
                        else:
                            texts[i] = c.get("text")
                        if isinstance(c.get("token_ids"), list):
                            res.ntok[i] = len(c["token_ids"])
                            res.token_ids[i] = c["token_ids"]
                        lp = c.get("logprobs")
                        if isinstance(lp, dict) and isinstance(lp.get("tokens"), list) and not req.chat:
                            res.ntok.setdefault(i, len(lp["tokens"]))
                    res.finish, res.texts = fin, {k: v for k, v in texts.items() if v is not None}
                    problem = _check_choices(res, nc, fin, lambda i: texts.get(i))
                    if problem is None and len(ch) == 1 and not res.ntok:
                        res.ntok[0] = u["completion_tokens"]
        outcome = "ok"
    if problem is None and req.expect == "ok" and outcome != "ok":
        e = res.error or {}
        problem = f"expected a complete response, got status {res.status} error {e.get('message')!r}"
    if problem is None and req.expect == "error":
        if outcome != "error":
            problem = f"expected an error{f' {req.expect_status}' if req.expect_status else ''}, got a complete response"
        elif req.expect_status and res.status != req.expect_status:
            problem = f"expected status {req.expect_status}, got {res.status}: {(res.error or {}).get('message')!r}"
    if problem is None and req.expect_status and outcome == "ok" and req.expect != "error" \
            and res.status != req.expect_status:
        problem = f"expected status {req.expect_status}, got {res.status}"
    if problem:
        res.outcome, res.failure = "fail", problem
    else:
        res.outcome = outcome
    if res.usage and isinstance(res.usage.get("completion_tokens"), int):
        res.out_tokens = res.usage["completion_tokens"]
        res.prompt_tokens = res.usage.get("prompt_tokens")
    else:
        res.out_tokens = sum(res.ntok.values())


# ---------------------------------------------------------------------------------------------------
# running one request
# ---------------------------------------------------------------------------------------------------

_RID = [0]


def _encode(req, host, port):
    body = req.body if isinstance(req.body, (bytes, bytearray)) else json.dumps(req.body).encode()
    h = [f"{req.method} {req.path} HTTP/1.1", f"Host: {host}:{port}", "User-Agent: krait-load/1"]
    if req.method == "POST":
        h += ["Content-Type: application/json", f"Content-Length: {len(body)}"]
    if req.stream:
        h.append("Accept: text/event-stream")
    if req.api_key:
        h.append(f"Authorization: Bearer {req.api_key}")
    head = ("\r\n".join(h) + "\r\n\r\n").encode()
    return head, (bytes(body) if req.method == "POST" else b"")


def _close(sock, rst):
    try:
        if rst:
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
        sock.close()
    except OSError:
        pass


async def _connect(host, port, rcvbuf=None):
    loop = asyncio.get_running_loop()
    infos = await loop.getaddrinfo(host, port, type=socket.SOCK_STREAM)
    fam, typ, proto, _, addr = infos[0]
    sock = socket.socket(fam, typ, proto)
    sock.setblocking(False)
    if rcvbuf:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, rcvbuf)
    try:
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        await loop.sock_connect(sock, addr)
    except BaseException:
        sock.close()
        raise
    return sock


async def run_one(req, host, port):
    """Runs one request to its end (or its client's cut) and checks the answer. Never raises for
    network problems: they are recorded in the result."""
    _RID[0] += 1
    res = Res(req, _RID[0])
    loop = asyncio.get_running_loop()
    res.t_start = time.perf_counter()
    stream_state = StreamState(res) if req.stream else None
    parser = Parser(res, stream_state.on_event if stream_state else (lambda p, t: None))
    state = {"sock": None}
    cut = req.cut

    def note(data):
        if len(res.head) < 2048:
            res.head += data[:2048 - len(res.head)]
        res.tail += data
        if len(res.tail) > 4096:
            del res.tail[:len(res.tail) - 2048]

    async def io():
        head, body = _encode(req, host, port)
        sock = await _connect(host, port, rcvbuf=4096 if cut.kind == "no_read" else None)
        state["sock"] = sock
        if cut.kind == "mid_body":
            await loop.sock_sendall(sock, head + body[:max(1, len(body) // 2)])
            res.t_sent = time.perf_counter()
            await asyncio.sleep(0.002)
            res.cut_done, res.cut_stage = True, "request_body"
            return
        await loop.sock_sendall(sock, head + body)
        res.t_sent = time.perf_counter()
        if cut.kind == "after_send":
            res.cut_done, res.cut_stage = True, "after_send"
            return
        if cut.kind == "no_read" and req.release is not None:
            await req.release.wait()
        while True:
            data = await loop.sock_recv(sock, 65536)
            t = time.perf_counter()
            if not data:
                break
            if res.t_first_byte is None:
                res.t_first_byte = t
            res.nbytes += len(data)
            note(data)
            parser.feed(data, t)
            if parser.done:
                break
            if cut.kind == "bytes" and res.nbytes >= cut.nbytes:
                res.cut_done = True
                res.cut_stage = "response_body" if parser.state != "head" else "response_head"
                return

    task = asyncio.ensure_future(io())
    why = None
    ev_task = None
    try:
        waiters = {task}
        if cut.kind == "event" and req.release is not None:
            ev_task = asyncio.ensure_future(req.release.wait())
            waiters.add(ev_task)
        limit = min(cut.t, req.timeout) if cut.kind == "time" else req.timeout
        done, _ = await asyncio.wait(waiters, timeout=limit, return_when=asyncio.FIRST_COMPLETED)
        if ev_task is not None and not ev_task.done():
            ev_task.cancel()
        if task not in done:
            why = "cut" if cut.kind == "time" or (ev_task is not None and ev_task in done) else "timeout"
            task.cancel()
            try:
                await task
            except asyncio.CancelledError:
                pass
            except Exception:  # noqa: BLE001 (the client gave up on it anyway)
                pass
        else:
            try:
                task.result()
            except (OSError, asyncio.IncompleteReadError) as e:
                res.conn_error = f"{type(e).__name__}: {e}"
    except asyncio.CancelledError:
        task.cancel()
        if ev_task is not None:
            ev_task.cancel()
        if state["sock"]:
            _close(state["sock"], True)
        raise
    res.t_end = time.perf_counter()
    if why == "cut":
        if parser.done:
            pass  # the response completed before the cut fired
        else:
            res.cut_done = True
            res.cut_stage = ("before_response" if res.t_first_byte is None else
                             "response_head" if parser.state == "head" else
                             "before_first_token" if res.t_first_token is None else "mid_stream")
    if state["sock"] is not None:
        _close(state["sock"], cut.rst and res.cut_done)
    problem = None
    if why == "timeout":
        problem = f"no complete answer within {req.timeout:.0f} s"
    elif not res.cut_done and res.conn_error is None:
        problem = parser.eof_problem()
    elif not res.cut_done and res.status is not None:
        problem = parser.eof_problem() or parser.problem
    if not parser.is_sse:
        res.raw = bytes(parser.body)
    if parser.is_sse and not req.stream and not res.cut_done and problem is None:
        problem = "an event stream answered a request that did not ask for one"
    check(res, problem, stream_state if parser.is_sse else None)
    if why == "timeout":
        res.outcome, res.failure = "fail", problem
    return res


async def http_get(host, port, path, timeout=10.0):
    """A plain GET: returns (status, body bytes); raises OSError / asyncio.TimeoutError."""
    req = Req(path, None, method="GET", expect="any", timeout=timeout)
    res = await run_one(req, host, port)
    if res.status is None:
        raise ConnectionError(res.conn_error or res.failure or "no response")
    return res.status, res.raw


async def http_json(host, port, method, path, body=None, timeout=30.0):
    req = Req(path, body, method=method, expect="any", timeout=timeout)
    res = await run_one(req, host, port)
    if res.status is None:
        raise ConnectionError(res.conn_error or res.failure or "no response")
    try:
        j = json.loads(res.raw) if res.raw else None
    except ValueError:
        j = None
    return res.status, j


# ---------------------------------------------------------------------------------------------------
# load shapes
# ---------------------------------------------------------------------------------------------------


async def run_closed(reqs, host, port, concurrency, on_result=None):
    """Closed loop: `concurrency` requests in flight, the next starting as one ends."""
    results = [None] * len(reqs)
    it = iter(range(len(reqs)))

    async def worker():
        for i in it:
            results[i] = await run_one(reqs[i], host, port)
            if on_result:
                on_result(results[i])

    await asyncio.gather(*(worker() for _ in range(max(1, min(concurrency, len(reqs))))))
    return results


async def run_poisson(reqs, host, port, rate, max_concurrency=None, burstiness=1.0, seed=0, on_result=None):
    """Arrivals at `rate` requests/s (inf: all at once), gamma-distributed gaps (burstiness 1:
    Poisson), at most `max_concurrency` in flight (the rest wait, as in vllm bench serve)."""
    rng = random.Random(seed)
    sem = asyncio.Semaphore(max_concurrency) if max_concurrency else None
    results = [None] * len(reqs)

    async def one(i):
        if sem:
            async with sem:
                results[i] = await run_one(reqs[i], host, port)
        else:
            results[i] = await run_one(reqs[i], host, port)
        if on_result:
            on_result(results[i])

    tasks = []
    for i in range(len(reqs)):
        tasks.append(asyncio.ensure_future(one(i)))
        if rate != math.inf and i + 1 < len(reqs):
            theta = 1.0 / (rate * burstiness)
            await asyncio.sleep(rng.gammavariate(burstiness, theta))
    await asyncio.gather(*tasks)
    return results


# ---------------------------------------------------------------------------------------------------
# prompts and sampling parameters
# ---------------------------------------------------------------------------------------------------


def random_ids(rng, n, lo=1000, hi=30000):
    return [rng.randrange(lo, hi) for _ in range(n)]


def lengths(rng, mean, ratio):
    lo, hi = max(1, int(mean * (1 - ratio))), max(1, int(mean * (1 + ratio)))
    return rng.randint(lo, hi)


STOP_POOL = ["e", "a", " the", "\n", "。", "in", "s ", "!", "ing", "ation"]


def mixed_params(rng, max_tokens_hi=64, allow_stop=True):
    """Random sampling parameters in the ranges clients send."""
    p = {}
    p["temperature"] = rng.choice([0.0, 0.0, 0.5, 0.8, 1.0, 1.3])
    if rng.random() < 0.5:
        p["top_p"] = rng.choice([1.0, 0.95, 0.8, 0.3])
    if rng.random() < 0.5:
        p["top_k"] = rng.choice([-1, 1, 2, 8, 50])
    if rng.random() < 0.5:
        p["seed"] = rng.randrange(1 << 31)
    if rng.random() < 0.3:
        p["presence_penalty"] = round(rng.uniform(-1.0, 1.5), 2)
    if rng.random() < 0.3:
        p["frequency_penalty"] = round(rng.uniform(-1.0, 1.5), 2)
    if rng.random() < 0.3:
        p["logprobs"] = rng.choice([0, 1, 3, 5])
    if allow_stop and rng.random() < 0.4:
        p["stop"] = rng.sample(STOP_POOL, rng.randint(1, 3))
    p["max_tokens"] = rng.randint(1, max_tokens_hi)
    if rng.random() < 0.5:
        p["ignore_eos"] = True
    return p


def build_requests(a, model, rng):
    """The request list of the CLI's options."""
    prefix = random_ids(rng, a.prefix_len, a.token_lo, a.token_hi) if a.prefix_len else []
    reqs = []
    for i in range(a.num_prompts):
        il = lengths(rng, a.input_len, a.range_ratio)
        ol = lengths(rng, a.output_len, a.range_ratio)
        body = {"model": model, "prompt": prefix + random_ids(rng, il, a.token_lo, a.token_hi), "max_tokens": ol,
                "ignore_eos": True, "temperature": a.temperature, "stream": not a.no_stream}
        if not a.no_stream:
            body["stream_options"] = {"include_usage": True}
        if a.n > 1:
            body["n"] = a.n
        if a.mixed:
            body.update(mixed_params(rng, max_tokens_hi=max(1, ol)))
        if a.stop:
            body["stop"] = a.stop
        cut = Cut()
        if a.cut_prob and rng.random() < a.cut_prob:
            k = rng.choice(["after_send", "time", "time", "bytes", "bytes"])
            cut = Cut(k, t=rng.uniform(0, a.cut_max_s), nbytes=rng.randint(1, a.cut_max_bytes),
                      rst=rng.random() < 0.5)
        reqs.append(Req("/v1/completions", body, tag=f"load #{i}", cut=cut, timeout=a.timeout,
                        api_key=a.api_key))
    return reqs


# ---------------------------------------------------------------------------------------------------
# server counters
# ---------------------------------------------------------------------------------------------------

SPEC = "krait:spec_decode_"


async def scrape_counters(host, port):
    """The krait: samples of /metrics as {name: value} (a per-position sample as name[position]);
    {} when /metrics cannot be read."""
    try:
        st, body = await http_get(host, port, "/metrics")
    except (OSError, ConnectionError, asyncio.TimeoutError):
        return {}
    if st != 200:
        return {}
    out = {}
    for line in body.decode("utf-8", "replace").splitlines():
        if not line.startswith("krait:"):
            continue
        head, _, val = line.rpartition(" ")
        name, _, labels = head.partition("{")
        pos = re.search(r'position="(\d+)"', labels)
        try:
            out[name + (f"[{pos.group(1)}]" if pos else "")] = float(val)
        except ValueError:
            pass
    return out


def counter_figures(m0, m1):
    """What the server counted between two scrapes: engine steps and generated tokens per step, and
    the speculative-decoding figures when its counters are there (None otherwise)."""

    def d(k):
        return m1[k] - m0.get(k, 0.0) if k in m1 else None

    steps, gen = d("krait:engine_steps_total"), d("krait:generation_tokens_total")
    out = {"engine_steps": steps, "generation_tokens": gen,
           "tokens_per_step": gen / steps if steps and gen is not None else None, "spec_decode": None}
    drafts = d(SPEC + "num_drafts_total")
    if drafts is None:
        return out
    drafted, acc = d(SPEC + "num_draft_tokens_total"), d(SPEC + "num_accepted_tokens_total")
    per_pos = []
    while SPEC + f"num_accepted_tokens_per_pos_total[{len(per_pos)}]" in m1:
        x = d(SPEC + f"num_accepted_tokens_per_pos_total[{len(per_pos)}]")
        per_pos.append(x / drafts if drafts else None)
    out["spec_decode"] = {
        "drafts": drafts, "draft_tokens": drafted, "accepted_tokens": acc,
        "acceptance_rate": acc / drafted if drafted else None,
        "mean_acceptance_length": 1 + acc / drafts if drafts else None,
        "per_position_acceptance_rate": per_pos,
    }
    return out


# ---------------------------------------------------------------------------------------------------
# figures
# ---------------------------------------------------------------------------------------------------


def percentile(xs, q):
    if not xs:
        return None
    xs = sorted(xs)
    k = (len(xs) - 1) * q / 100.0
    f = math.floor(k)
    c = min(f + 1, len(xs) - 1)
    return xs[f] + (xs[c] - xs[f]) * (k - f)


def _stats(xs, scale=1000.0):
    if not xs:
        return {"mean": None, "p50": None, "p99": None, "n": 0}
    return {"mean": sum(xs) / len(xs) * scale, "p50": percentile(xs, 50) * scale,
            "p99": percentile(xs, 99) * scale, "n": len(xs)}


def summarize(results, duration):
    ok = [r for r in results if r.outcome == "ok"]
    out_tok = sum(r.out_tokens for r in ok)
    in_tok = sum(r.prompt_tokens if r.prompt_tokens is not None else r.req.prompt_len() for r in ok)
    itl = [x for r in ok for x in r.itl]
    s = {
        "duration_s": duration,
        "requests": len(results),
        "completed": len(ok),
        "failed": sum(r.outcome == "fail" for r in results),
        "errors": sum(r.outcome == "error" for r in results),
        "cut": sum(r.outcome == "cut" for r in results),
        "total_input_tokens": in_tok,
        "total_output_tokens": out_tok,
        "request_throughput": len(ok) / duration if duration > 0 else None,
        "output_throughput": out_tok / duration if duration > 0 else None,
        "total_token_throughput": (in_tok + out_tok) / duration if duration > 0 else None,
        "ttft_ms": _stats([r.ttft for r in ok if r.ttft is not None]),
        "tpot_ms": _stats([r.tpot() for r in ok if r.tpot() is not None]),
        "itl_ms": _stats(itl),
        "e2el_ms": _stats([r.e2e for r in ok if r.e2e is not None]),
        "error_statuses": {},
        "failures": [r.describe() for r in results if r.outcome == "fail"][:50],
    }
    for r in results:
        if r.outcome == "error":
            s["error_statuses"][str(r.status)] = s["error_statuses"].get(str(r.status), 0) + 1
    return s


def _f(x, fmt="{:.2f}"):
    return "-" if x is None else fmt.format(x)


def format_table(s, title="Serving Benchmark Result"):
    w = 50
    lines = [f" {title} ".center(w, "=")]

    def row(k, v):
        lines.append(f"{k:<40}{v:>10}")

    row("Successful requests:", s["completed"])
    row("Failed requests (checker):", s["failed"])
    row("Clean error responses:", s["errors"] if not s["error_statuses"] else
        f"{s['errors']} " + ",".join(f"{k}x{v}" for k, v in sorted(s["error_statuses"].items())))
    row("Cut by their clients:", s["cut"])
    row("Benchmark duration (s):", _f(s["duration_s"]))
    row("Total input tokens:", s["total_input_tokens"])
    row("Total generated tokens:", s["total_output_tokens"])
    row("Request throughput (req/s):", _f(s["request_throughput"]))
    row("Output token throughput (tok/s):", _f(s["output_throughput"]))
    row("Total token throughput (tok/s):", _f(s["total_token_throughput"]))
    for key, name in (("ttft_ms", "Time to First Token"), ("tpot_ms", "Time per Output Token (excl. 1st token)"),
                      ("itl_ms", "Inter-token Latency"), ("e2el_ms", "End-to-end Latency")):
        short = key.split("_")[0].upper()
        lines.append(f" {name} ".center(w, "-"))
        row(f"Mean {short} (ms):", _f(s[key]["mean"]))
        row(f"Median {short} (ms):", _f(s[key]["p50"]))
        row(f"P99 {short} (ms):", _f(s[key]["p99"]))
    sv = s.get("server")
    if sv and sv["engine_steps"] is not None:
        lines.append(" Server counters ".center(w, "-"))
        row("Engine steps:", _f(sv["engine_steps"], "{:.0f}"))
        row("Generated tokens per engine step:", _f(sv["tokens_per_step"]))
    sd = sv and sv["spec_decode"]
    if sd:
        lines.append(" Speculative Decoding ".center(w, "-"))
        row("Drafts (steps verifying drafts):", _f(sd["drafts"], "{:.0f}"))
        row("Draft tokens:", _f(sd["draft_tokens"], "{:.0f}"))
        row("Accepted tokens:", _f(sd["accepted_tokens"], "{:.0f}"))
        row("Draft acceptance rate (%):", _f(None if sd["acceptance_rate"] is None else 100 * sd["acceptance_rate"]))
        row("Mean acceptance length:", _f(sd["mean_acceptance_length"]))
        for i, x in enumerate(sd["per_position_acceptance_rate"]):
            row(f"Acceptance rate at position {i} (%):", _f(None if x is None else 100 * x))
    lines.append("=" * w)
    return "\n".join(lines)


def raise_nofile():
    try:
        soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
        want = hard if hard != resource.RLIM_INFINITY else 65536
        if soft < want:
            resource.setrlimit(resource.RLIMIT_NOFILE, (want, hard))
    except (ValueError, OSError):
        pass


# ---------------------------------------------------------------------------------------------------
# CLI
# ---------------------------------------------------------------------------------------------------


async def cli_main(a):
    raise_nofile()
    model = a.model
    if not model:
        st, j = await http_json(a.host, a.port, "GET", "/v1/models")
        if st != 200 or not j or not j.get("data"):
            print(f"load.py: GET /v1/models answered {st}: {j}", file=sys.stderr)
            return 2
        model = j["data"][0]["id"]
    rng = random.Random(a.seed)
    reqs = build_requests(a, model, rng)
    if a.warmup:
        wu = build_requests(argparse.Namespace(**{**vars(a), "num_prompts": a.warmup, "cut_prob": 0}), model,
                            random.Random(a.seed + 1))
        await run_closed(wu, a.host, a.port, min(a.warmup, a.concurrency or a.warmup))
    m0 = await scrape_counters(a.host, a.port)
    t0 = time.perf_counter()
    if a.request_rate != math.inf or not a.concurrency:
        res = await run_poisson(reqs, a.host, a.port, a.request_rate, a.max_concurrency, a.burstiness, a.seed)
    else:
        res = await run_closed(reqs, a.host, a.port, a.concurrency)
    dur = time.perf_counter() - t0
    s = summarize(res, dur)
    s["server"] = counter_figures(m0, await scrape_counters(a.host, a.port))
    s["config"] = {k: v for k, v in vars(a).items() if k not in ("api_key",)}
    s["config"]["request_rate"] = str(a.request_rate)
    s["config"]["model"] = model
    shape = (f"closed loop, concurrency {a.concurrency}" if a.concurrency and a.request_rate == math.inf else
             f"rate {a.request_rate} req/s" + (f", max concurrency {a.max_concurrency}" if a.max_concurrency else ""))
    print(format_table(s, f"Serving Benchmark Result ({shape})"))
    for d in s["failures"][:10]:
        print("FAIL " + d, file=sys.stderr)
    if a.json:
        with open(a.json, "w") as fp:
            json.dump(s, fp, indent=1)
    return 1 if s["failed"] else 0


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--host", default="127.0.0.1")
    ap.add_argument("--port", type=int, default=8000)
    ap.add_argument("--model", default=None, help="model name (default: the first of GET /v1/models)")
    ap.add_argument("--api-key", default=os.environ.get("KRAIT_API_KEY"))
    ap.add_argument("--num-prompts", type=int, default=100)
    ap.add_argument("--concurrency", type=int, default=None, help="closed loop at this concurrency")
    ap.add_argument("--request-rate", type=float, default=math.inf, help="Poisson arrivals (req/s; default inf)")
    ap.add_argument("--max-concurrency", type=int, default=None, help="with --request-rate: cap on requests in flight")
    ap.add_argument("--burstiness", type=float, default=1.0, help="gamma shape of the arrival gaps (1: Poisson)")
    ap.add_argument("--input-len", type=int, default=1024)
    ap.add_argument("--output-len", type=int, default=128)
    ap.add_argument("--range-ratio", type=float, default=0.0, help="lengths uniform in [L(1-r), L(1+r)]")
    ap.add_argument("--prefix-len", type=int, default=0, help="a shared prefix of this many tokens")
    ap.add_argument("--token-lo", type=int, default=1000, help="random prompt ids from [lo, hi)")
    ap.add_argument("--token-hi", type=int, default=30000)
    ap.add_argument("--temperature", type=float, default=0.0)
    ap.add_argument("--no-stream", action="store_true")
    ap.add_argument("--n", type=int, default=1)
    ap.add_argument("--mixed", action="store_true", help="random sampling parameters, logprobs, stop strings")
    ap.add_argument("--stop", action="append", default=None)
    ap.add_argument("--cut-prob", type=float, default=0.0, help="share of requests their client cuts")
    ap.add_argument("--cut-max-s", type=float, default=1.0)
    ap.add_argument("--cut-max-bytes", type=int, default=4096)
    ap.add_argument("--timeout", type=float, default=600.0, help="per request")
    ap.add_argument("--warmup", type=int, default=0, help="requests run (and not counted) before the measured ones")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--json", default=None, help="write the figures (and failures) here")
    a = ap.parse_args(argv)
    if a.concurrency is None and a.request_rate == math.inf and a.max_concurrency is None:
        a.concurrency = 1
    return asyncio.run(cli_main(a))


if __name__ == "__main__":
    sys.exit(main())
