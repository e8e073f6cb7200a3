#!/usr/bin/env python3
"""Writes the seed inputs of the fuzz harnesses (tests/fuzz/fuzz_<name>.c) into
tests/fuzz/corpus/<name>/, each file named by the SHA-1 of its bytes as libFuzzer names its own.
Seeds come from the test fixtures (configs, safetensors headers, tokenizer configs) and from
requests shaped as the OpenAI SDKs and vLLM's clients send them. Run from anywhere; existing files
are kept (the corpus grows by what the fuzzer finds and is minimised with -merge=1)."""
import hashlib
import json
import os
import struct
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
CORPUS = os.path.join(ROOT, "tests", "fuzz", "corpus")
FIX = os.path.join(ROOT, "tests", "fixtures")


def put(name, data):
    if isinstance(data, str):
        data = data.encode()
    d = os.path.join(CORPUS, name)
    os.makedirs(d, exist_ok=True)
    with open(os.path.join(d, hashlib.sha1(data).hexdigest()), "wb") as f:
        f.write(data)


def read(path):
    with open(path, "rb") as f:
        return f.read()


def fixture_dirs():
    out = []
    for fam in sorted(os.listdir(FIX)):
        famdir = os.path.join(FIX, fam)
        for m in sorted(os.listdir(famdir)) if os.path.isdir(famdir) else []:
            if os.path.exists(os.path.join(famdir, m, "config.json")):
                out.append(os.path.join(famdir, m))
    out.append(os.path.join(ROOT, "models", "tiny-hybrid"))
    return out


# ---- config and json ----------------------------------------------------------------------------
for d in fixture_dirs():
    cfg = read(os.path.join(d, "config.json"))
    put("config", cfg)
    put("json", cfg)
    idx = os.path.join(d, "model.safetensors.index.json")
    if os.path.exists(idx):
        put("json", read(idx))
for t in sorted(os.listdir(os.path.join(FIX, "tokenizer"))):
    p = os.path.join(FIX, "tokenizer", t, "tokenizer_config.json")
    if os.path.exists(p) and os.path.getsize(p) < 64 << 10:
        put("json", read(p))
# what Python's json writes and strict parsers refuse, and the number forms config.c reads
for s in ['{"a": NaN, "b": Infinity, "c": -Infinity}', '[1.0, 1e400, -0, 9223372036854775807, 9223372036854775808]',
          '{"x": {"__float__": "Infinity"}, "y": "-inf", "z": "nan"}', '"\\u00e9\\ud83d\\ude00\\u0000"',
          '{"k": 1, "k": 2}', '[[[[[[[[]]]]]]]]', '{"\\"": "\\\\\\/\\b\\f\\n\\r\\t"}', 'true', 'null', '-1.5E-3']:
    put("json", s)

# ---- safetensors ----------------------------------------------------------------------------------
SIZES = {"F32": 4, "F16": 2, "BF16": 2, "F8_E4M3": 1, "I32": 4, "I64": 8}


def st_file(entries, meta=True):
    """A safetensors file of (name, dtype, shape) with each tensor's data after the previous one."""
    hdr, off = {}, 0
    if meta:
        hdr["__metadata__"] = {"format": "pt"}
    for name, dt, shape in entries:
        n = SIZES[dt]
        for s in shape:
            n *= s
        hdr[name] = {"dtype": dt, "shape": shape, "data_offsets": [off, off + n]}
        off += n
    h = json.dumps(hdr, separators=(",", ":")).encode()
    h += b" " * (-len(h) % 8)
    return struct.pack("<Q", len(h)) + h + bytes(i % 251 for i in range(off))


def fixture_tensors(path, limit):
    """The first `limit` tensors of a fixture's header with small shapes (the names and dtypes are
    the real ones)."""
    b = read(path)
    (n,) = struct.unpack("<Q", b[:8])
    hdr = json.loads(b[8:8 + n])
    out = []
    for name in sorted(k for k in hdr if k != "__metadata__")[:limit]:
        shape = [min(s, 3) for s in hdr[name]["shape"]]
        out.append((name, hdr[name]["dtype"], shape))
    return out


put("safetensors", b"\x00" + st_file([("w", "F32", [2, 3]), ("b", "BF16", [3]), ("s", "I64", [])]))
put("safetensors", b"\x00" + st_file([("e", "F8_E4M3", [0, 4]), ("x", "I32", [1, 1, 1, 1, 1, 1, 1, 2])], meta=False))
put("safetensors", b"\x00" + st_file([]))
for d in fixture_dirs():
    p = os.path.join(d, "model.safetensors")
    if os.path.exists(p):
        put("safetensors", b"\x00" + st_file(fixture_tensors(p, 6)))
# sharded: an index and two shards (the harness names them s1.safetensors, s2.safetensors)
SEP = b"\n#shard\n"
a = [("model.embed_tokens.weight", "BF16", [4, 2]), ("model.norm.weight", "F32", [2])]
b = [("lm_head.weight", "BF16", [4, 2])]
index = {"metadata": {"total_size": 40}, "weight_map": {n: "s1.safetensors" for n, _, _ in a}}
index["weight_map"].update({n: "s2.safetensors" for n, _, _ in b})
put("safetensors", b"\x01" + json.dumps(index).encode() + SEP + st_file(a) + SEP + st_file(b))
index1 = {"weight_map": {"t": "s1.safetensors"}}
put("safetensors", b"\x01" + json.dumps(index1).encode() + SEP + st_file([("t", "F16", [5])]))

# ---- requests ---------------------------------------------------------------------------------------
MODEL = "tiny-hybrid"
msgs = [{"role": "system", "content": "You are terse."}, {"role": "user", "content": "Hello"}]
schema = {"type": "object", "properties": {"name": {"type": "string"}, "age": {"type": "integer", "minimum": 0}},
          "required": ["name"], "additionalProperties": False}
tool = {"type": "function", "function": {"name": "get_weather", "description": "Weather of a city",
                                         "parameters": {"type": "object", "properties": {"city": {"type": "string"}},
                                                        "required": ["city"]}}}
requests = [
    # openai-python / openai-node chat.completions.create
    {"model": MODEL, "messages": msgs},
    {"model": MODEL, "messages": msgs, "max_tokens": 16, "temperature": 0.7, "top_p": 0.9, "n": 2, "seed": 42,
     "stop": ["\n", "END"], "frequency_penalty": 0.5, "presence_penalty": -0.5, "user": "u-1"},
    {"model": MODEL, "messages": msgs, "stream": True, "stream_options": {"include_usage": True,
                                                                         "continuous_usage_stats": False}},
    {"model": MODEL, "messages": msgs, "logprobs": True, "top_logprobs": 5, "max_completion_tokens": 8},
    {"model": MODEL, "messages": [{"role": "user", "content": [{"type": "text", "text": "Describe"},
                                                               {"type": "text", "text": "this"}]}]},
    {"model": MODEL, "messages": [{"role": "developer", "content": "Be brief"}, {"role": "user", "content": "Hi"},
                                  {"role": "assistant", "content": None, "tool_calls": [
                                      {"id": "call_1", "type": "function",
                                       "function": {"name": "get_weather", "arguments": "{\"city\":\"Paris\"}"}}]},
                                  {"role": "tool", "tool_call_id": "call_1", "content": "sunny"}],
     "tools": [tool], "tool_choice": "auto", "parallel_tool_calls": False},
    {"model": MODEL, "messages": msgs, "response_format": {"type": "json_object"}},
    {"model": MODEL, "messages": msgs, "response_format": {"type": "json_schema", "json_schema": {
        "name": "person", "strict": True, "schema": schema}}},
    {"model": MODEL, "messages": msgs, "logit_bias": {"15": -100, "16": 5}, "metadata": {"k": "v"}, "store": False},
    {"model": MODEL, "messages": [{"role": "user", "content": "Write"}, {"role": "assistant", "content": "Once"}],
     "add_generation_prompt": False, "continue_final_message": True, "chat_template_kwargs": {"thinking": True}},
    # vLLM sampling and structured-output extras
    {"model": MODEL, "messages": msgs, "top_k": 20, "min_p": 0.05, "repetition_penalty": 1.1, "min_tokens": 2,
     "ignore_eos": True, "stop_token_ids": [1, 2], "skip_special_tokens": False, "return_token_ids": True,
     "cache_salt": "tenant-a", "prompt_logprobs": 2},
    {"model": MODEL, "messages": msgs, "guided_json": schema},
    {"model": MODEL, "messages": msgs, "guided_regex": "[a-z]{1,8}@[a-z]+\\.com"},
    {"model": MODEL, "messages": msgs, "guided_choice": ["yes", "no", "maybe"]},
    {"model": MODEL, "messages": msgs, "guided_grammar": "root ::= \"a\" [0-9]+ (\"b\" | \"c\")*"},
    {"model": MODEL, "messages": msgs, "structured_outputs": {"json": schema, "disable_any_whitespace": True}},
    {"model": MODEL, "messages": msgs, "structured_outputs": {"regex": "\\d+"}},
    # completions.create
    {"model": MODEL, "prompt": "Once upon a time", "max_tokens": 16},
    {"model": MODEL, "prompt": ["a", "b"], "n": 2, "echo": True, "logprobs": 3, "stream": True},
    {"model": MODEL, "prompt": [1, 2, 3], "max_tokens": 4, "suffix": ""},
    {"model": MODEL, "prompt": [[1, 2], [3, 4]], "best_of": 2, "n": 2},
    {"model": MODEL, "prompt": "x", "guided_choice": ["a", "b"], "temperature": 0},
    {"prompt": "no model", "stop": "\n\n"},
    # responses.create (the Responses API)
    {"model": MODEL, "input": "Hello", "instructions": "Be brief", "max_output_tokens": 16},
    {"model": MODEL, "input": [{"role": "user", "content": [{"type": "input_text", "text": "Hi"}]}], "stream": True,
     "tools": [{"type": "function", "name": "f", "parameters": {"type": "object"}}],
     "text": {"format": {"type": "json_schema", "name": "p", "schema": schema}}},
    # /tokenize and /detokenize
    {"prompt": "Hello world", "add_special_tokens": True, "return_token_strs": True},
    {"messages": msgs, "add_generation_prompt": True},
    {"tokens": [0, 1, 2, 100, 1000]},
]
for r in requests:
    put("request", json.dumps(r))
for s in ['{}', '[]', '{"messages": []}', '{"prompt": ""}', '{"model": "tiny-hybrid\\u0000x", "prompt": "a"}',
          '{"messages": [{"role": "user\\u0000x", "content": "a"}]}', 'not json']:
    put("request", s)
# ---- http: url, method, Authorization, Content-Length, SSE events, read sizes (one a line) ----------
chunk = json.dumps({"id": "chatcmpl-1", "object": "chat.completion.chunk", "created": 1, "model": MODEL,
                    "choices": [{"index": 0, "delta": {"content": "Hi"}, "finish_reason": None}]},
                   separators=(",", ":"))
for url, method, auth, clen in [("/v1/chat/completions", "POST", "Bearer sk-test-0123456789", "128"),
                                ("/v1/completions", "GET", "bearer k2", "0"), ("/v1/models", "GET", "", ""),
                                ("/v1/models", "POST", "Basic Zm9vOmJhcg==", "18446744073709551616"),
                                ("/tokenize", "POST", "BEARER Bearer x", "33554432"),
                                ("/detokenize", "PUT", "Bearer ", "-1"), ("/health", "GET", "Bearer k", "+12"),
                                ("/metrics", "HEAD", "Bearer sk-test-012345678", " 7"),
                                ("/v1/chat/completions?x=1", "POST", "Bearer k2 ", "12abc"),
                                ("/v1/responses", "POST", "Bearer k2", "10"), ("/v1/models/tiny-hybrid", "GET", "", ""),
                                ("/v1/models/", "DELETE", "Bearer k2", "")]:
    put("http", "\n".join([url, method, auth, clen]))
put("http", "\n".join(["/v1/chat/completions", "POST", "Bearer k2", "64", chunk, '{"choices":[]}',
                       "data: [DONE]", "\x01\x07\x10\xff"]))
put("http", "\n".join(["/v1/completions", "POST", "", "", '{"error":{"message":"x"}}', "", "\x00\x02"]))
print("seeds written under", CORPUS, file=sys.stderr)
