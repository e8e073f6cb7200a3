#!/usr/bin/python3
"""Seeds tests/fuzz/corpus/{chat_template,tokenizer}/ from the fixtures (the input layouts are
described at the top of fuzz_chat_template.c and fuzz_tokenizer.c). The checked-in corpora are
these seeds after fuzzing, merged down with -merge=1.

usage: tests/fuzz/seed_chat_template_tokenizer.py OUT_DIR   (writes OUT_DIR/chat_template, OUT_DIR/tokenizer)
"""
import hashlib
import json
import os
import sys

ROOT = os.path.join(os.path.dirname(os.path.abspath(__file__)), "../..")
FIX = os.path.join(ROOT, "tests/fixtures/tokenizer")
SEP = b"\n#JSON#\n"
STD = ("messages", "tools", "documents", "add_generation_prompt", "bos_token", "eos_token")
# fuzz_chat_template.c's fixtures, in its order, after dropping repeated templates
FIXTURES = {"deepseek_v3": 1, "qwen3": 2, "llama3": 3}
N_SEL = 1 + len(FIXTURES)
# fuzz_tokenizer.c's TOKENIZERS, in its order
TOKENIZERS = ["llama2", "llama3", "deepseek_v3", "../../../models/tiny-hybrid", "synth/bert_pretok",
              "synth/bytelevel_prefix", "synth/metaspace_first", "synth/metaspace_never", "synth/split_empty",
              "synth/split_invert", "synth/split_merged", "synth/subword", "synth/whitespace"]


def write(d, data):
    os.makedirs(d, exist_ok=True)
    with open(os.path.join(d, hashlib.sha1(data).hexdigest()), "wb") as f:
        f.write(data)


def chat_template(out):
    d = os.path.join(out, "chat_template")
    cases = json.load(open(os.path.join(FIX, "templates/cases.json"), encoding="utf-8"))["cases"]
    for c in cases:
        v = c["variables"]
        doc = {"messages": v.get("messages"), "tools": v.get("tools"),
               "kwargs": {k: x for k, x in v.items() if k not in STD}}
        agp = 0x80 if v.get("add_generation_prompt") else 0
        body = json.dumps(doc, ensure_ascii=False).encode()
        model = c["name"].split("/")[0]
        if model in FIXTURES:  # a realistic request for a model's own template
            write(d, bytes([FIXTURES[model] | agp]) + body)
        else:  # a template of the feature set with its variables
            write(d, bytes([0 | agp]) + c["template"].encode() + SEP + body)
    # hostile shapes: wide and deep values, long strings, many keys
    wide = {"k%d" % i: i for i in range(300)}
    deep = []
    for _ in range(60):
        deep = [deep]
    hostile = [
        {"messages": [{"role": "user", "content": "x", "meta": wide}], "kwargs": {"kw": wide}},
        {"messages": [{"role": "user", "content": deep}]},
        {"messages": [{"role": "user", "content": "é" * 200 + "\u0000\ud7ff"}]},
        {"messages": [{"role": "user", "content": [{"type": "text", "text": "a"}, {"type": "image_url"}]}]},
        {"messages": [{"role": "assistant", "content": None, "tool_calls": [
            {"id": "c", "type": "function", "function": {"name": "f", "arguments": {"a": [1, 2.5e300, -0.0]}}}]},
            {"role": "tool", "tool_call_id": "c", "content": "{}"}], "tools": [{"type": "function"}]},
    ]
    for h in hostile:
        body = json.dumps(h, ensure_ascii=False).encode()
        for sel in range(1, N_SEL):
            write(d, bytes([sel | 0x80]) + body)
        write(d, bytes([0]) + b"{{ messages }}{{ kw|tojson }}{% for m in messages %}{{ m|dictsort }}{% endfor %}" + SEP + body)


def tokenizer(out):
    d = os.path.join(out, "tokenizer")
    texts = json.load(open(os.path.join(FIX, "corpus.json"), encoding="utf-8"))["texts"]
    for ti, name in enumerate(TOKENIZERS):
        for k in range(10):  # each tokenizer a different slice of the corpus, all modes
            t = texts[(ti * 10 + k) % len(texts)].encode("utf-8", "surrogatepass")[:1000]
            write(d, bytes([ti, (k % 4) * 2 | (4 if k % 3 == 0 else 0)]) + t)
        exp = os.path.join(FIX, name, "expected.json")
        if not os.path.exists(exp):
            continue
        e = json.load(open(exp, encoding="utf-8"))
        span = e["vocab_size"] + 8
        for k, c in enumerate(e["cases"][1:60:12]):
            raw = b""
            for i in c["ids_special"][:200]:
                r = min(65535, -(-(i + 4) * 65536 // span))
                raw += bytes([r & 255, r >> 8])
            write(d, bytes([ti, 1 | (4 if k % 2 else 0)]) + raw)


if __name__ == "__main__":
    chat_template(sys.argv[1])
    tokenizer(sys.argv[1])
