#!/usr/bin/env python3
"""Builds the training text of the embedded default model from Debian packages whose licences allow
redistribution, plus question/answer conversations made from that text. Standard library only.

    python3 tools/default-model/data.py OUT_DIR [--debs DIR]

Without --debs it fetches the packages with `apt-get download` (Debian's archive only). OUT_DIR gets
  train.txt      documents separated by a line "\\x1e" (record separator)
  heldout.txt    documents never trained on, same format
  chat.jsonl     one conversation per line: {"messages": [...], "tools": [...]?}
  chat-heldout.jsonl
  sources.json   package, version, licence and byte counts
Deterministic: a fixed seed decides every sample and the held-out split.
"""
import argparse
import glob
import html.parser
import json
import os
import random
import re
import subprocess
import sys

SEED = 20261205
SEP = "\n\x1e\n"

PACKAGES = {
    "bible-kjv-text": "public domain (the King James Version of 1611; Debian's copyright file: "
                      "'The copyright for the King James Version text of the Bible is expired')",
    "bible-kjv": "GPL-2+ (the program only, used to print the text; none of it is in the data)",
    "python3.11-doc": "PSF License Agreement (Python Software Foundation License version 2), permissive",
    "sqlite3-doc": "public domain (Debian's copyright file: 'License: public-domain')",
}

BOOKS = None  # filled from the bible program's output


def run(cmd, **kw):
    return subprocess.run(cmd, check=True, **kw)


def fetch(debs):
    os.makedirs(debs, exist_ok=True)
    for p in PACKAGES:
        if not glob.glob(os.path.join(debs, p + "_*.deb")):
            run(["apt-get", "download", p], cwd=debs)
    root = os.path.join(debs, "root")
    if not os.path.isdir(root):
        for f in sorted(glob.glob(os.path.join(debs, "*.deb"))):
            run(["dpkg", "-x", f, root])
    versions = {}
    for p in PACKAGES:
        f = glob.glob(os.path.join(debs, p + "_*.deb"))[0]
        versions[p] = os.path.basename(f).split("_")[1]
    return root, versions


# --------------------------------------------------------------------------------------------------
# King James Bible


def kjv_chapters(root):
    """-> [(book, chapter, [(verse, text)])] in canonical order."""
    out = run([os.path.join(root, "usr/bin/bible"), "-p", os.path.join(root, "usr/lib"), "gen1:1-rev22:21"],
              capture_output=True, text=True).stdout
    chapters, cur = [], None
    for line in out.splitlines():
        m = re.match(r"^(\S.*\S) (\d+)$", line)
        if m and not line.startswith(" "):
            cur = (m.group(1), int(m.group(2)), [])
            chapters.append(cur)
            continue
        m = re.match(r"^\s+(\d+) (.*)$", line)
        if m and cur is not None:
            cur[2].append([int(m.group(1)), m.group(2).strip()])
        elif line.strip() and cur is not None and cur[2]:
            cur[2][-1][1] += " " + line.strip()
    return chapters


def kjv_docs(chapters):
    docs = []
    for book, ch, verses in chapters:
        body = "\n".join(f"{v} {t}" for v, t in verses)
        docs.append((book, f"{book} {ch}\n\n{body}"))
    return docs


def kjv_chat(chapters, rng, n):
    convs = []
    allv = [(b, c, v, t) for b, c, vs in chapters for v, t in vs]
    asks = ["What does {r} say?", "Quote {r}.", "What is written in {r}?", "Can you give me {r}?",
            "Recite {r} from the King James Bible.", "Which verse is {r}?"]
    answers = ["{r} says: \"{t}\"", "In the King James Version, {r} reads: \"{t}\"", "\"{t}\" ({r})"]
    for _ in range(n):
        b, c, v, t = rng.choice(allv)
        r = f"{b} {c}:{v}"
        convs.append([{"role": "user", "content": rng.choice(asks).format(r=r)},
                      {"role": "assistant", "content": rng.choice(answers).format(r=r, t=t)}])
    firsts = {}
    for b, c, vs in chapters:
        firsts.setdefault(b, (c, vs[0][1]))
    for b, (c, t) in firsts.items():
        convs.append([{"role": "user", "content": f"How does the book of {b} begin?"},
                      {"role": "assistant", "content": f"The book of {b} begins: \"{t}\""}])
    return convs


# --------------------------------------------------------------------------------------------------
# Python documentation (reStructuredText sources)

ROLE = re.compile(r":[a-z]+(?::[a-z]+)?:`~?([^`<]*?)(?:\s*<[^>]*>)?`")


def rst_clean(text):
    out = []
    skip_block = False
    for line in text.splitlines():
        s = line.strip()
        if s.startswith(".. index::") or s.startswith(".. _") or s.startswith(".. testsetup") or \
           s.startswith(".. highlight") or s.startswith(".. sectionauthor") or s.startswith(".. moduleauthor") or \
           s.startswith(".. testcleanup") or s.startswith(".. toctree") or s.startswith(".. raw::"):
            skip_block = True
            continue
        if skip_block:
            if s == "" or line.startswith(" "):
                continue
            skip_block = False
        line = ROLE.sub(r"\1", line)
        line = line.replace("``", "`")
        out.append(line.rstrip())
    return re.sub(r"\n{3,}", "\n\n", "\n".join(out)).strip()


DIRECTIVE = re.compile(r"^\.\. (function|method|class|exception|attribute|data|decorator|module)::\s*(.+)$")


def py_entries(text):
    """-> [(kind, signature, first paragraph)] from a cleaned page."""
    lines = text.splitlines()
    out = []
    for i, line in enumerate(lines):
        m = DIRECTIVE.match(line)
        if not m:
            continue
        kind, sig = m.group(1), m.group(2).strip()
        para, j = [], i + 1
        syn = None
        while j < len(lines) and (lines[j].startswith("   :") or lines[j].startswith(".. " + kind)):
            if ":synopsis:" in lines[j]:
                syn = lines[j].split(":synopsis:", 1)[1].strip()
            j += 1
        while j < len(lines) and lines[j].strip() == "":
            j += 1
        while j < len(lines) and lines[j].startswith("   ") and lines[j].strip():
            para.append(lines[j].strip())
            j += 1
        p = " ".join(para)
        if kind == "module":
            p = syn or ""
        if 20 <= len(p) <= 700 and not p.startswith(".."):
            out.append((kind, sig, p))
    return out


def py_docs(root):
    base = os.path.join(root, "usr/share/doc/python3.11/html/_sources")
    docs = []
    for f in sorted(glob.glob(os.path.join(base, "**/*.rst.txt"), recursive=True)):
        rel = os.path.relpath(f, base)
        if rel.startswith(("whatsnew/", "license", "bugs", "about", "copyright", "distutils/", "install/")):
            continue
        with open(f, encoding="utf-8", errors="replace") as fh:
            docs.append((rel, rst_clean(fh.read())))
    return docs


def py_chat(docs, rng):
    convs = []
    asks = {
        "function": ["What does the Python function `{n}` do?", "Explain `{n}` in Python.", "What is `{s}` for?"],
        "method": ["What does the method `{n}` do in Python?", "Explain the method `{s}`."],
        "class": ["What is the Python class `{n}`?", "Tell me about `{s}` in Python."],
        "exception": ["When is `{n}` raised in Python?", "What is the exception `{n}`?"],
        "attribute": ["What is the attribute `{n}`?"],
        "data": ["What is `{n}` in Python?"],
        "decorator": ["What does the decorator `@{n}` do?"],
        "module": ["What is the Python module `{n}` for?", "What does the `{n}` module do?",
                   "Which module should I use for this: {p}"],
    }
    for rel, text in docs:
        mod = None
        m = re.search(r"^\.\. module:: (\S+)", text, re.M)
        if m:
            mod = m.group(1)
        for kind, sig, p in py_entries(text):
            name = re.split(r"[(\[ ]", sig, 1)[0]
            if kind not in ("module", "method", "attribute") and mod and "." not in name:
                name = mod + "." + name
            q = rng.choice(asks[kind]).format(n=name, s=sig, p=p.rstrip("."))
            if kind == "module":
                a = f"The `{name}` module: {p}"
            else:
                a = f"`{sig}`: {p}"
            convs.append([{"role": "user", "content": q}, {"role": "assistant", "content": a}])
    return convs


# --------------------------------------------------------------------------------------------------
# SQLite documentation (HTML)


class Text(html.parser.HTMLParser):
    BLOCK = {"p", "div", "br", "li", "tr", "h1", "h2", "h3", "h4", "pre", "blockquote", "dt", "dd", "table"}
    SKIP = {"script", "style", "head", "title"}

    def __init__(self):
        super().__init__(convert_charrefs=True)
        self.parts, self.skip, self.heads, self.cur_h = [], 0, [], None

    def handle_starttag(self, tag, attrs):
        if tag in self.SKIP:
            self.skip += 1
        if tag in self.BLOCK:
            self.parts.append("\n\n" if tag in ("p", "h1", "h2", "h3", "pre") else "\n")
        if tag in ("h1", "h2", "h3"):
            self.cur_h = []

    def handle_endtag(self, tag):
        if tag in self.SKIP and self.skip:
            self.skip -= 1
        if tag in ("h1", "h2", "h3") and self.cur_h is not None:
            self.heads.append(("".join(self.cur_h).strip(), len(self.parts)))
            self.cur_h = None
            self.parts.append("\n\n")

    def handle_data(self, data):
        if self.skip:
            return
        self.parts.append(data)
        if self.cur_h is not None:
            self.cur_h.append(data)


def html_text(path):
    p = Text()
    with open(path, encoding="utf-8", errors="replace") as fh:
        p.feed(fh.read())
    text = "".join(p.parts)
    text = re.sub(r"[ \t]+\n", "\n", text)
    text = re.sub(r"\n{3,}", "\n\n", text).strip()
    return text


def sqlite_docs(root):
    base = os.path.join(root, "usr/share/doc/sqlite3")
    docs = []
    for f in sorted(glob.glob(os.path.join(base, "**/*.html"), recursive=True)):
        rel = os.path.relpath(f, base)
        if rel.startswith(("releaselog/", "c3ref/")) or "changes" in rel or "chronology" in rel:
            continue
        t = html_text(f)
        if len(t) > 400:
            docs.append((rel, t))
    return docs


def sqlite_chat(docs, rng):
    convs = []
    asks = ["In SQLite, what is {h}?", "Tell me about {h} in SQLite.", "Explain {h} (SQLite)."]
    for rel, text in docs:
        paras = [p.strip().replace("\n", " ") for p in text.split("\n\n")]
        for i in range(len(paras) - 1):
            h, p = paras[i], paras[i + 1]
            if 3 <= len(h) <= 60 and not h.endswith(".") and 80 <= len(p) <= 600 and p[0].isupper() and \
                    re.match(r"^[\d.]*\s*[A-Za-z]", h) and not re.match(r"^R-\d", h) and "Release" not in h and \
                    "R-" not in p:
                h = re.sub(r"^[\d.]+\s+", "", h)
                convs.append([{"role": "user", "content": rng.choice(asks).format(h=h)},
                              {"role": "assistant", "content": p}])
    return convs


# --------------------------------------------------------------------------------------------------
# conversation about the model itself, and tool calls

ABOUT = [
    ("Hello!", "Hello! I am a small language model served by krait. Ask me about the King James Bible, "
               "Python or SQLite."),
    ("Hi", "Hi! How can I help you?"),
    ("Who are you?", "I am krait's small default model: a hybrid of Mamba-2, sparse attention, MLP and "
                     "mixture-of-experts layers, trained on the King James Bible and the Python and SQLite "
                     "documentation."),
    ("What can you do?", "I can quote the King James Bible and answer short questions about Python and "
                         "SQLite. I am very small, so check what I say."),
    ("Thank you!", "You are welcome."),
    ("What is krait?", "krait is an inference server written in C, with CUDA kernels, for hybrid models that mix "
                       "Mamba-2 layers with DeepSeek sparse attention. It speaks the OpenAI API."),
]

CITIES = ["Paris", "London", "Berlin", "Tokyo", "Lima", "Cairo", "Oslo", "Madrid", "Rome", "Nairobi", "Toronto",
          "Sydney", "Lisbon", "Dublin", "Vienna", "Prague", "Seoul", "Delhi", "Quito", "Accra"]
TOOLS = [
    {"type": "function", "function": {
        "name": "get_weather", "description": "Current weather in a city",
        "parameters": {"type": "object", "properties": {"city": {"type": "string"},
                                                        "unit": {"type": "string", "enum": ["celsius", "fahrenheit"]}},
                       "required": ["city"]}}},
    {"type": "function", "function": {
        "name": "lookup_verse", "description": "The text of a Bible verse",
        "parameters": {"type": "object", "properties": {"reference": {"type": "string"}},
                       "required": ["reference"]}}},
    {"type": "function", "function": {
        "name": "add", "description": "Adds two numbers",
        "parameters": {"type": "object", "properties": {"a": {"type": "number"}, "b": {"type": "number"}},
                       "required": ["a", "b"]}}},
]


def tool_chat(chapters, rng, n):
    convs = []
    allv = [(b, c, v, t) for b, c, vs in chapters for v, t in vs]
    for i in range(n):
        tools = rng.sample(TOOLS, rng.randint(1, len(TOOLS)))
        names = [t["function"]["name"] for t in tools]
        kind = rng.choice(names)
        if kind == "get_weather":
            city = rng.choice(CITIES)
            unit = rng.choice(["celsius", "fahrenheit"])
            q = rng.choice([f"What is the weather in {city}?", f"How warm is it in {city} right now?",
                            f"Weather in {city} in {unit}, please."])
            args = {"city": city, "unit": unit} if unit in q else {"city": city}
            deg = rng.randint(-5, 35) if unit == "celsius" or "unit" not in args else rng.randint(20, 95)
            sky = rng.choice(["sunny", "cloudy", "raining", "windy"])
            result = json.dumps({"city": city, "temperature": deg, "sky": sky})
            final = f"It is {deg} degrees and {sky} in {city}."
        elif kind == "lookup_verse":
            b, c, v, t = rng.choice(allv)
            r = f"{b} {c}:{v}"
            q = rng.choice([f"Look up {r} for me.", f"Use the tool to find {r}.", f"Find the verse {r}."])
            args = {"reference": r}
            result = json.dumps({"reference": r, "text": t})
            final = f"{r}: \"{t}\""
        else:
            a, b = rng.randint(0, 999), rng.randint(0, 999)
            q = rng.choice([f"What is {a} plus {b}?", f"Add {a} and {b}.", f"Compute {a} + {b} with the tool."])
            args = {"a": a, "b": b}
            result = json.dumps({"result": a + b})
            final = f"{a} plus {b} is {a + b}."
        call = {"id": f"call_{i}", "type": "function", "function": {"name": kind, "arguments": json.dumps(args)}}
        msgs = [{"role": "user", "content": q},
                {"role": "assistant", "content": "", "tool_calls": [call]},
                {"role": "tool", "tool_call_id": call["id"], "content": result},
                {"role": "assistant", "content": final}]
        convs.append({"messages": msgs, "tools": tools})
    return convs


# --------------------------------------------------------------------------------------------------


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("out")
    ap.add_argument("--debs", default=None, help="folder for the .deb files (default OUT/debs)")
    a = ap.parse_args()
    os.makedirs(a.out, exist_ok=True)
    root, versions = fetch(a.debs or os.path.join(a.out, "debs"))
    rng = random.Random(SEED)

    chapters = kjv_chapters(root)
    if len(chapters) != 1189:
        sys.exit(f"expected 1189 chapters of the King James Bible, got {len(chapters)}")
    pydocs = py_docs(root)
    sqdocs = sqlite_docs(root)

    # held out: whole documents (every 40th chapter, python page and sqlite page, deterministic)
    def split(docs, every):
        tr, ho = [], []
        for i, d in enumerate(docs):
            (ho if i % every == every // 2 else tr).append(d)
        return tr, ho
    kjv = kjv_docs(chapters)
    kjv_tr, kjv_ho = split(kjv, 40)
    py_tr, py_ho = split(pydocs, 40)
    sq_tr, sq_ho = split(sqdocs, 40)
    ho_names = {n for n, _ in kjv_ho + py_ho + sq_ho}

    convs = [{"messages": m} for m in kjv_chat(chapters, rng, 6000)]
    convs += [{"messages": m} for m in py_chat(py_tr, rng)]
    convs += [{"messages": m} for m in sqlite_chat(sq_tr, rng)]
    for q, ans in ABOUT:
        for _ in range(40):
            convs.append({"messages": [{"role": "user", "content": q}, {"role": "assistant", "content": ans}]})
    convs += tool_chat(chapters, rng, 3000)
    ho_convs = [{"messages": m} for m in py_chat(py_ho, rng)] + [{"messages": m} for m in sqlite_chat(sq_ho, rng)]
    rng.shuffle(convs)
    # a system prompt on some conversations, so that the template's system branch is trained
    for c in convs[::5]:
        c["messages"].insert(0, {"role": "system", "content": rng.choice(
            ["You are a helpful assistant.", "Answer briefly.", "You are krait's default model."])})

    def write_docs(path, docs):
        with open(path, "w", encoding="utf-8") as f:
            f.write(SEP.join(t for _, t in docs))
    train = kjv_tr + py_tr + sq_tr
    write_docs(os.path.join(a.out, "train.txt"), train)
    write_docs(os.path.join(a.out, "heldout.txt"), kjv_ho + py_ho + sq_ho)
    for name, cs in (("chat.jsonl", convs), ("chat-heldout.jsonl", ho_convs)):
        with open(os.path.join(a.out, name), "w", encoding="utf-8") as f:
            for c in cs:
                f.write(json.dumps(c, ensure_ascii=False) + "\n")
    src = {"seed": SEED, "packages": [{"package": p, "version": versions[p], "licence": PACKAGES[p]}
                                      for p in PACKAGES],
           "bytes": {"kjv": sum(len(t) for _, t in kjv_tr), "python": sum(len(t) for _, t in py_tr),
                     "sqlite": sum(len(t) for _, t in sq_tr)},
           "heldout_documents": sorted(ho_names), "conversations": len(convs),
           "heldout_conversations": len(ho_convs)}
    with open(os.path.join(a.out, "sources.json"), "w") as f:
        json.dump(src, f, indent=1)
    print(json.dumps({k: v for k, v in src.items() if k != "heldout_documents"}, indent=1))


if __name__ == "__main__":
    main()
