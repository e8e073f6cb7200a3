#!/usr/bin/python3
"""Writes tests/fixtures/tokenizer/corpus.json: the texts krait's tokenizer tests encode.

Deterministic (fixed seed). The corpus mixes prose, code, many scripts, emoji sequences, digit runs,
whitespace runs, punctuation runs, special-token spellings inside text, very long words and edge
cases (empty input, lone whitespace, NFC/NFD pairs, Unicode whitespace oddities).

usage: tools/reference/tokenizer/make_corpus.py [OUT]   (default: tests/fixtures/tokenizer/corpus.json)
"""
import json
import os
import random
import sys

rng = random.Random(20240611)
C = []

def add(s):
    C.append(s)

# ---- edge cases
for s in ["", " ", "  ", "\n", "\t", "\r\n", "a", "A", ".", "0", "'s", "'S", " 's", "hello", " hello", "hello ",
          "Hello, world!", "  leading", "trailing  ", "\n\nnewlines first", "ends with newline\n"]:
    add(s)

# ---- prose
add("The quick brown fox jumps over the lazy dog. It wasn't me; I'd say they're right, we'll see, you've won, I'm done.")
add("Tokenizers split text into pieces. BPE merges frequent pairs of symbols: first bytes, then larger and larger units.\n"
    "Large language models read those ids, one after the other, and predict the next one.")
add("DON'T SHOUT. I'LL WHISPER. THEY'RE HERE. WE'VE LEFT. I'M OK. HE'D KNOW. IT'S 'QUOTED'.")
add("Mixed-case CamelCaseIdentifiers and snake_case_names and SCREAMING_CASE and kebab-case-words.")
add("ſ long s: 'ſ 'ſt; Kelvin K and Å angstrom; ﬁ ligature ﬂow; ℌilbert space.")

# ---- code
add('def fib(n: int) -> int:\n    """Return the n-th Fibonacci number."""\n    a, b = 0, 1\n    for _ in range(n):\n'
    '        a, b = b, a + b\n    return a\n\n\nprint([fib(i) for i in range(20)])\n')
add('#include <stdio.h>\n\nint main(int argc, char **argv)\n{\n\tfor (int i = 0; i < argc; i++) {\n'
    '\t\tprintf("%d: %s\\n", i, argv[i]);\n\t}\n\treturn 0;\n}\n')
add('{"model": "krait", "messages": [{"role": "user", "content": "hi"}], "temperature": 0.7, "max_tokens": 256}')
add('<html>\n  <body class="main">\n    <p>&lt;escaped&gt; &amp; <b>bold</b></p>\n  </body>\n</html>')
add("SELECT id, name FROM users WHERE age >= 18 AND name LIKE '%smith%' ORDER BY id DESC LIMIT 10;")
add("fn main() { let v: Vec<u32> = (0..10).map(|x| x * x).collect(); println!(\"{:?}\", v); }")
add("x=1;y=2;z=x+y*3-4/5%6**7//8<<9>>10&11|12^~13;a->b;c::d;e?.f;g??h;i!==j;k===l;m!=n;o<=p;q>=r")

# ---- scripts
add("自然语言处理是人工智能的一个重要分支。我们今天去北京大学参观了图书馆，然后吃了烤鸭。")
add("日本語のテキスト：ひらがな、カタカナ、漢字が混ざっています。東京タワーへ行きましょう！")
add("ｶﾀｶﾅ（半角）とカタカナ（全角）、ゐゑ、ヴァイオリン、ー長音、々踊り字。")
add("한국어 문장입니다. 안녕하세요, 만나서 반갑습니다!")
add("Русский текст: Съешь же ещё этих мягких французских булок, да выпей чаю.")
add("Ελληνικά: Ξεσκεπάζω την ψυχοφθόρα βδελυγμία. Αυτό είναι ένα τεστ.")
add("العربية: مرحبا بالعالم! هذه جملة للاختبار.")
add("हिन्दी: नमस्ते दुनिया, यह एक परीक्षण वाक्य है। क्षत्रिय ज्ञान")
add("ไทย: สวัสดีชาวโลก นี่คือประโยคทดสอบ")
add("עברית: שלום עולם! ‏סימן RTL‏ ו‎LTR‎.")
add("Tiếng Việt: Xin chào thế giới, đây là câu thử nghiệm.")
add("Emoji-free mathematical alphanumerics: 𝕳𝖊𝖑𝖑𝖔 𝓦𝓸𝓻𝓵𝓭 𝟙𝟚𝟛 and ∀x∈ℝ: x²≥0, ∑ᵢ aᵢ ≤ ∞.")

# ---- emoji
add("Emoji: 😀😃😄 👍🏽 👩‍💻 👨‍👩‍👧‍👦 🏳️‍🌈 🇫🇷🇯🇵 1️⃣ #️⃣ ❤️ 🫶 🧑🏿‍🚀 🐈‍⬛")
add("Newer emoji: 🫨 🩷 🪿 🫎 and variation selectors ︎︎☺︎ ☺️")
add("👨‍👩‍👧‍👦👨‍👩‍👧‍👦👨‍👩‍👧‍👦")

# ---- digits
for n in range(1, 26):
    add("".join(str((i * 7 + n) % 10) for i in range(n)))
add("3.14159 2,718,281 1e-10 -42 +7 0x1F 0b1010 1_000_000 12:34:56 2024-06-11 $1,234.56 50% 1/2 ½ ⅔ ² ³ ①②③ ٣٤٥ ४५६ 一二三")
add(" 1 22 333 4444 55555 666666 7777777")

# ---- whitespace
for n in [1, 2, 3, 4, 7, 8, 16, 31]:
    add("a" + " " * n + "b")
    add("x" + " " * n)
add("tabs\there\t\tand\t\t\tthere\t")
add("mixed\r\nnewlines\rand\nmore\n\n\n\r\n\r\nend")
add("  \n  \n\t\n   indented\n      deeper\n")
add("space before newline   \nand after\n   ")
add("unicode spaces:\u00a0nbsp\u2003em\u3000ideographic\u2009thin\u180emvs\u200bzwsp\u0085nel\u2028ls\u2029ps\u000bvt\u000cff\u001cfs")

# ---- punctuation
add("!!!??? ... --- ___ *** ### @@@ $$$ %%% ^^^ &&& ((( ))) [[[ ]]] {{{ }}} <<< >>> ||| \\\\\\ /// ~~~ ``` '''' \"\"\"")
add("Wait... what?! Really?!?! No way!!! (Yes.) [OK] {fine} <done>")
add("«guillemets» „Anführungszeichen“ “curly” ‘single’ — em-dash – en-dash … ellipsis ¡hola! ¿qué?")
add(".,;:!?'\"()[]{}<>-_=+*&^%$#@~`|\\/")

# ---- special-token spellings inside text (each tokenizer knows some of them)
add("<｜begin▁of▁sentence｜>You are helpful.<｜User｜>Hi<｜Assistant｜>Hello!<｜end▁of▁sentence｜>")
add("text <｜User｜> with spaces <｜Assistant｜>  around <｜end▁of▁sentence｜>\n")
add("<|begin_of_text|><|start_header_id|>user<|end_header_id|>\n\nHi<|eot_id|>")
add("<s>[INST] question [/INST] answer</s><s>again</s>")
add("broken specials: <|begin_of_text <｜User| <s <|eot_id|x> </ s>")
add("<think>\nreasoning here\n</think>\n\nanswer")

# ---- long words
add("a" * 3000)
add("supercalifragilisticexpialidocious" * 60)
add("".join(rng.choice("ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz0123456789+/") for _ in range(4000)))
add("https://example.com/" + "/".join("segment%d" % i for i in range(300)) + "?q=" + "x" * 500)
add("中" * 2000)
add("🙂" * 500)
add("!" * 1500)
add("1" * 2000)
add(" " * 2000)
add("\n" * 500)

# ---- normalization pairs
add("caf\u00e9 vs cafe\u0301; \u00c5 vs A\u030a vs \u212b; \uac00 vs \u1100\u1161")
add("ＦＵＬＬＷＩＤＴＨ ｌｅｔｔｅｒｓ １２３ and ①②③ and ㍿ and ﬃ and ｶﾞ")
add("Z\u0351\u0308\u0307a\u0316\u0317l\u0353g\u0362o t\u0334e\u0335x\u0336t")
add("private use \ue000\uf8ff and noncharacters \ufdd0\uffff and BOM \ufeff and replacement \ufffd")
add("İstanbul ı I ß ẞ ﬀ Σίσυφος ΣΑΣ")

# ---- one mixed document
parts = []
for i in range(40):
    parts.append(C[rng.randrange(len(C))][:200])
add("\n".join(parts))

out = sys.argv[1] if len(sys.argv) > 1 else os.path.join(os.path.dirname(__file__), "../../../tests/fixtures/tokenizer/corpus.json")
with open(out, "w", encoding="utf-8") as f:
    json.dump({"generator": "tools/reference/tokenizer/make_corpus.py", "texts": C}, f, ensure_ascii=False, indent=0)
    f.write("\n")
print("wrote %d texts to %s" % (len(C), out))
