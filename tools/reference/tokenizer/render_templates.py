#!/usr/bin/python3
"""Expected chat-template renderings for krait's tests, from Python jinja2 (Debian's python3-jinja2)
configured exactly as HF transformers' _compile_jinja_template configures it.

usage: tools/reference/tokenizer/render_templates.py   (writes tests/fixtures/tokenizer/templates/cases.json)
"""
import json
import os
from datetime import datetime

import jinja2
from jinja2.ext import Extension, loopcontrols
from jinja2.sandbox import ImmutableSandboxedEnvironment

HERE = os.path.dirname(os.path.abspath(__file__))
FIX = os.path.join(HERE, "../../../tests/fixtures/tokenizer")


class AssistantTracker(Extension):  # transformers' {% generation %} tag, rendering its body
    tags = {"generation"}

    def parse(self, parser):
        lineno = next(parser.stream).lineno
        body = parser.parse_statements(["name:endgeneration"], drop_needle=True)
        return jinja2.nodes.CallBlock(self.call_method("_generation_support"), [], [], body).set_lineno(lineno)

    def _generation_support(self, caller):
        return caller()


def raise_exception(message):
    raise jinja2.exceptions.TemplateError(message)


def tojson(x, ensure_ascii=False, indent=None, separators=None, sort_keys=False):
    return json.dumps(x, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)


def strftime_now(fmt):
    return datetime.now().strftime(fmt)


env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True, extensions=[AssistantTracker, loopcontrols])
env.filters["tojson"] = tojson
env.globals["raise_exception"] = raise_exception
env.globals["strftime_now"] = strftime_now


def cfg_template(name):
    with open(os.path.join(FIX, name, "tokenizer_config.json"), encoding="utf-8") as f:
        return json.load(f)["chat_template"]


TOOLS = [{"type": "function", "function": {"name": "get_weather", "description": "Weather in a city, \"now\".",
          "parameters": {"type": "object", "properties": {"city": {"type": "string", "description": "Nom de la ville é"},
                         "days": {"type": "integer", "minimum": 1, "maximum": 7.5}}, "required": ["city"]}}},
         {"type": "function", "function": {"name": "search", "description": "Web search",
          "parameters": {"type": "object", "properties": {"q": {"type": "string"}}, "required": ["q"]}}}]
CALL1 = {"id": "call_1", "type": "function", "function": {"name": "get_weather", "arguments": "{\"city\": \"Paris\", \"days\": 2}"}}
CALL2 = {"id": "call_2", "type": "function", "function": {"name": "search", "arguments": "{\"q\": \"météo 東京\"}"}}
CONVS = {
    "user_only": [{"role": "user", "content": "Hello!"}],
    "system_user": [{"role": "system", "content": "You are a helpful assistant."}, {"role": "user", "content": "What is 2+2?"}],
    "two_systems": [{"role": "system", "content": "Rule one."}, {"role": "system", "content": "Rule two."},
                    {"role": "user", "content": "  spaced  \n"}],
    "multi_turn": [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi"},
                   {"role": "assistant", "content": "Hello! How can I help?"}, {"role": "user", "content": "Tell me a joke 😀\nwith\ttabs"}],
    "tool_calls": [{"role": "system", "content": "Use tools."}, {"role": "user", "content": "Weather in Paris and news?"},
                   {"role": "assistant", "content": None, "tool_calls": [CALL1, CALL2]},
                   {"role": "tool", "tool_call_id": "call_1", "content": "{\"temp\": 21}"},
                   {"role": "tool", "tool_call_id": "call_2", "content": "No news."},
                   {"role": "assistant", "content": "It is 21 degrees."}, {"role": "user", "content": "Thanks"}],
    "tool_pending": [{"role": "user", "content": "Weather?"},
                     {"role": "assistant", "content": None, "tool_calls": [CALL1]},
                     {"role": "tool", "tool_call_id": "call_1", "content": "sunny"}],
    "think": [{"role": "user", "content": "Q1"}, {"role": "assistant", "content": "<think>\nhmm\n</think>\n\nA1"},
              {"role": "user", "content": "Q2"}],
}

cases = []
def add(name, template, variables):
    case = {"name": name, "template": template, "variables": variables}
    try:
        case["expected"] = env.from_string(template).render(**variables)
    except jinja2.exceptions.TemplateSyntaxError as e:
        case["error"] = "syntax: " + str(e)
    except Exception as e:  # a template that raises, or a runtime error
        case["error"] = "render: %s: %s" % (type(e).__name__, e)
    cases.append(case)

real = {"deepseek_v3": ("<｜begin▁of▁sentence｜>", "<｜end▁of▁sentence｜>"), "qwen3": (None, "<|im_end|>"),
        "llama3": ("<|begin_of_text|>", "<|end_of_text|>")}
for model, (bos, eos) in real.items():
    tpl = cfg_template(model)
    for conv_name, conv in CONVS.items():
        for agp in (False, True):
            for tools in ((None, TOOLS) if model == "qwen3" else (None,)):
                v = {"messages": conv, "tools": tools, "documents": None, "add_generation_prompt": agp}
                if bos is not None:
                    v["bos_token"] = bos
                v["eos_token"] = eos
                add("%s/%s/agp=%d/tools=%d" % (model, conv_name, agp, tools is not None), tpl, v)
    if model == "qwen3":
        add("qwen3/enable_thinking_false", tpl, {"messages": CONVS["user_only"], "tools": None, "documents": None,
                                               "add_generation_prompt": True, "enable_thinking": False})

# the embedded model's template (models/tiny-hybrid: DeepSeek-V3's format with tools rendered)
with open(os.path.join(HERE, "../../../models/tiny-hybrid/tokenizer_config.json"), encoding="utf-8") as f:
    tiny = json.load(f)["chat_template"]
CALL_OBJ = {"id": "call_3", "type": "function", "function": {"name": "get_weather", "arguments": {"city": "Lyon"}}}
tiny_convs = dict(CONVS)
tiny_convs["tool_rounds"] = [{"role": "user", "content": "Two rounds"},
                             {"role": "assistant", "content": "Let me look.", "tool_calls": [CALL1]},
                             {"role": "tool", "tool_call_id": "call_1", "content": "sunny"},
                             {"role": "assistant", "content": None, "tool_calls": [CALL2, CALL_OBJ]},
                             {"role": "tool", "tool_call_id": "call_2", "content": "news"},
                             {"role": "tool", "tool_call_id": "call_3", "content": "rain"},
                             {"role": "assistant", "content": "Done."}, {"role": "user", "content": "Thanks"}]
for conv_name, conv in tiny_convs.items():
    for agp in (False, True):
        for tools in (None, TOOLS):
            add("tiny_hybrid/%s/agp=%d/tools=%d" % (conv_name, agp, tools is not None), tiny,
                {"messages": conv, "tools": tools, "documents": None, "add_generation_prompt": agp,
                 "bos_token": real["deepseek_v3"][0], "eos_token": real["deepseek_v3"][1]})

# the trained default model's template (tools/default-model/chat_template.jinja, in its
# tokenizer_config.json): tools listed in the system turn, calls in the hermes format
with open(os.path.join(HERE, "../../default-model/chat_template.jinja"), encoding="utf-8") as f:
    small = f.read()
for conv_name, conv in tiny_convs.items():
    for agp in (False, True):
        for tools in (None, TOOLS):
            add("small_hybrid/%s/agp=%d/tools=%d" % (conv_name, agp, tools is not None), small,
                {"messages": conv, "tools": tools, "documents": None, "add_generation_prompt": agp,
                 "bos_token": "<|bos|>", "eos_token": "<|end|>"})

# feature templates: each exercises part of the Jinja subset
M = CONVS["multi_turn"]
base = {"messages": M, "tools": TOOLS, "documents": None, "add_generation_prompt": True, "bos_token": "<s>"}
features = {
    "whitespace_control": "A  {{- ' x ' -}}  B\n  {%- if true %}\n   C {% endif -%}\n D {#- note -#}  E\n{%+ if 1 %}F{% endif +%}\nG  \n",
    "lstrip_trim": "  {% for m in messages %}\n    {{ m.role }}\n  {% endfor %}\n  {# c #}\nend\n\n",
    "raw": "{% raw %}{{ not rendered }}{% endraw %} and {%- raw -%}  x  {%- endraw %}.",
    "loop_vars": "{% for m in messages %}{{ loop.index }}/{{ loop.index0 }}/{{ loop.revindex }}/{{ loop.revindex0 }}/{{ loop.first }}/{{ loop.last }}/{{ loop.length }}/{{ loop.cycle('a','b') }}{% if not loop.last %},{% endif %}{% endfor %}",
    "loop_prev_next": "{% for x in [1,2,3] %}[{{ loop.previtem }}|{{ loop.nextitem }}]{% endfor %}",
    "loop_filter_else": "{% for m in messages if m.role == 'user' %}{{ loop.index }}:{{ m.content|length }} {% else %}none{% endfor %}{% for x in [] %}x{% else %}empty{% endfor %}",
    "loop_break_continue": "{% for i in range(10) %}{% if i == 2 %}{% continue %}{% endif %}{% if i > 5 %}{% break %}{% endif %}{{ i }}{% endfor %}",
    "scoping": "{% set x = 1 %}{% for i in [1,2] %}{{ x }}{% set x = x + 10 %}{{ x }};{% endfor %}{{ x }}{% if true %}{% set y = 5 %}{% endif %}{{ y }}",
    "namespace": "{% set ns = namespace(n=0, s='') %}{% for m in messages %}{% set ns.n = ns.n + 1 %}{% set ns.s = ns.s ~ m.role[0] %}{% endfor %}{{ ns.n }} {{ ns.s }}",
    "tuple_unpack": "{% for k, v in {'a': 1, 'b': [2, 3]}.items() %}{{ k }}={{ v }};{% endfor %}{% set a, b = 1, 'two' %}{{ a }}{{ b }}",
    "filters_text": "{{ '  Hi There  '|trim }}|{{ 'xxhixx'|trim('x') }}|{{ 'abc'|upper }}|{{ 'ABC'|lower }}|{{ 'hello world'|title }}|{{ 'hello World'|capitalize }}|{{ 'a-b-c'|replace('-', '+') }}|{{ 'one two  three'|wordcount }}|{{ '<a&b>'|e }}|{{ 42|string }}|{{ 'x'|safe }}",
    "filters_seq": "{{ [3,1,2]|sort }}{{ [3,1,2]|sort(reverse=true) }}{{ ['b','A','c']|sort }}{{ [1,2,3]|first }}{{ [1,2,3]|last }}{{ [1,2,2,3]|unique|list }}{{ [1,2,3]|reverse|list }}{{ [1,2,3]|sum }}{{ [1,5,3]|max }}{{ [4,2,9]|min }}{{ [1,2]|join('-') }}{{ messages|map(attribute='role')|join(',') }}{{ messages|selectattr('role','equalto','user')|list|length }}{{ messages|rejectattr('role','eq','user')|map(attribute='role')|list }}{{ [0,1,2,3]|select('odd')|list }}{{ [0,1,'',None]|reject|list }}",
    "filters_misc": "{{ undefined_var|default('dflt') }}|{{ ''|default('e', true) }}|{{ -3|abs }}|{{ '12'|int + 1 }}|{{ '1.5'|float }}|{{ 2.567|round(2) }}|{{ 'x\ny'|indent(2) }}|{{ {'b':1,'a':2}|dictsort }}|{{ {'a':1}|items|list }}|{{ messages|length }}|{{ 'héllo'|length }}|{{ messages[0]|attr('role') }}",
    "tojson": "{{ tools|tojson }}\n{{ tools[0]|tojson(indent=2) }}\n{{ {'z': 1, 'a': [1.0, 2.5, 1e20, -0.0001, None, true, 'q\"\\\\\n\t\\u0001é']}|tojson }}\n{{ {'z':1,'a':2}|tojson(sort_keys=true) }}\n{{ [1,2]|tojson(separators=(',', ':')) }}",
    "print_values": "{{ [1, 'a', None, true, 1.5, {'k': 'v'}] }} {{ (1,) }} {{ ('a', 2) }} {{ 1e100 }} {{ 0.1 + 0.2 }} {{ 10 / 4 }} {{ 7 // 2 }} {{ -7 // 2 }} {{ -7 % 3 }} {{ 2 ** 10 }} {{ 'it\\'s' ~ \"q\" }} {{ [\"it's\"] }} {{ none }} {{ undefined_thing }}|",
    "operators": "{{ 1 + 2 * 3 - 4 / 2 }} {{ 'a' ~ 1 ~ none }} {{ 'ab' in 'cabd' }} {{ 3 not in [1,2] }} {{ 'role' in messages[0] }} {{ 1 < 2 < 3 }} {{ 2 > 1 and not false }} {{ none or 'x' }} {{ 0 and 1 }} {{ 'yes' if 1 > 2 else 'no' }} {{ 'a' * 3 }} {{ [1] + [2] }} {{ 1 == 1.0 }} {{ true == 1 }} {{ 'a' < 'b' }}",
    "tests": "{{ x is defined }}{{ messages is defined }}{{ none is none }}{{ 1 is number }}{{ 'a' is string }}{{ {} is mapping }}{{ [] is iterable }}{{ 4 is even }}{{ 3 is odd }}{{ 9 is divisibleby 3 }}{{ 1 is integer }}{{ 1.0 is float }}{{ false is false }}{{ true is true }}{{ 'ab' is lower }}{{ 2 is gt 1 }}{{ 2 is in [1,2] }}{{ x is not defined }}{{ messages[0].content is not none }}",
    "strings_methods": "{{ '  a b  '.strip() }}|{{ 'xxaxx'.lstrip('x') }}|{{ 'xxaxx'.rstrip('x') }}|{{ 'a,b,,c'.split(',') }}|{{ ' a  b '.split() }}|{{ 'a b c'.split(' ', 1) }}|{{ 'a.b.c'.rsplit('.', 1) }}|{{ 'hello'.startswith('he') }}|{{ 'hello'.endswith(('x','lo')) }}|{{ 'Hi'.upper() }}{{ 'Hi'.lower() }}|{{ 'aXbX'.replace('X','-') }}|{{ 'hello'.find('l') }}|{{ 'hello'.rfind('l') }}|{{ 'hello'.count('l') }}|{{ '-'.join(['a','b']) }}|{{ '123'.isdigit() }}|{{ 'ab'.isalpha() }}|{{ '  '.isspace() }}|{{ 'AB'.isupper() }}",
    "indexing_slicing": "{{ messages[-1].role }} {{ messages[0]['content'] }} {{ 'héllo'[1] }} {{ 'héllo'[-1] }} {{ 'abcdef'[1:4] }} {{ 'abcdef'[::-1] }} {{ 'abcdef'[::2] }} {{ [1,2,3,4][1:] }} {{ [1,2,3,4][:-1] }} {{ [1,2,3,4][-2:] }} {{ messages[10] is defined }} {{ messages[0].missing is defined }} {{ {'a': 1}.get('a') }} {{ {'a': 1}.get('b', 'd') }} {{ {'a':1}.keys()|list }} {{ {'a':1}.values()|list }}",
    "macros": "{% macro greet(name, punct='!') %}Hello {{ name }}{{ punct }}{% endmacro %}{{ greet('a') }} {{ greet('b', '?') }} {{ greet(name='c', punct='.') }}",
    "set_block_with_filter": "{% set block %}  Some {{ 'text' }}  {% endset %}[{{ block }}]{% set t | upper %}shout{% endset %}{{ t }}{% filter upper %}up {{ 'here' }}{% endfilter %}{% with a = 1, b = 2 %}{{ a + b }}{% endwith %}",
    "generation_tag": "{% for m in messages %}{% if m.role == 'assistant' %}{% generation %}{{ m.content }}{% endgeneration %}{% else %}{{ m.content }}{% endif %}|{% endfor %}",
    "string_escapes": "{{ 'tab\\there' }}|{{ \"nl\\nx\" }}|{{ 'uni\\u00e9\\x41' }}|{{ 'a' 'b' \"c\" }}|{{ 'back\\\\slash' }}|{{ 'unknown\\q' }}",
    "crlf_source": "line1\r\n{% if true %}\r\nline2\r\n{% endif %}\rline3\r\n",
    "range_dict": "{{ range(3)|list }}{{ range(1, 10, 3)|list }}{{ dict(a=1, b='x') }}{% for i in range(3, 0, -1) %}{{ i }}{% endfor %}",
    "raise": "{% if messages|length > 1 %}{{ raise_exception('Only one message is supported!') }}{% endif %}ok",
    "error_undefined_attr": "{{ messages[0].nothere.deeper }}",
    "error_type": "{{ 'a' + 1 }}",
    "error_syntax_unclosed": "{% if true %}never closed",
    "error_syntax_bad_expr": "{{ 1 + }}",
    "error_unknown_filter": "{{ x|frobnicate }}",
    "error_unsafe": "{% set l = [1] %}{{ l.append(2) }}",
    "error_div_zero": "{{ 1 // 0 }}",
    # the builtins' semantics where their algorithms changed (hash index, merge sort, memmem, slices)
    "filters_unique_sort": "{{ ['a','A','b','B','a']|unique|list }}{{ ['a','A']|unique(case_sensitive=true)|list }}{{ [1, 1.0, true, 2]|unique|list }}{{ messages|unique(attribute='role')|map(attribute='role')|list }}{{ ['b','A','a','B']|sort }}{{ ['b','A','a','B']|sort(case_sensitive=true) }}{{ [3,1,2,1,3]|sort(reverse=true) }}{{ messages|sort(attribute='role')|map(attribute='content')|list }}{{ messages|sort(attribute='role', reverse=true)|map(attribute='role')|list }}{{ {'b':1,'A':2,'a':3}|dictsort }}{{ {'b':1,'A':2,'a':3}|dictsort(by='value') }}{{ {'b':1,'A':2,'a':3}|dictsort(reverse=true) }}{{ ['b','A','c']|max }}{{ ['b','A','c']|min }}{{ [2.5, 1, 3]|max }}",
    "dict_keys": "{% set d = {'k0':0,'k1':1,'k2':2,'k3':3,'k4':4,'k5':5,'k6':6,'k7':7,'k8':8,'k9':9,'k10':10,'k11':11,'k3':33} %}{{ d }} {{ d|length }} {{ 'k11' in d }} {{ 'k12' in d }} {{ d.k7 }} {{ d['k3'] }} {{ {1:'a',2:'b',3:'c',4:'d',5:'e',6:'f',7:'g',8:'h',9:'i',10:'j',1.0:'A',true:'B',10.0:'J',0:'z',false:'Z'} }} {{ {(1, 2): 'x', (1, 2): 'y'} }} {{ dict(d, k0='new')|length }} {% set ns = namespace(a=1) %}{% set ns.b = 2 %}{% set ns.a = 3 %}{{ ns.a }}{{ ns.b }}",
    "numbers_rounding": "{{ 5|round }} {{ 2.5|round }} {{ 3.5|round }} {{ -2.5|round }} {{ 2.567|round(2, 'floor') }} {{ 2.561|round(2, 'ceil') }} {{ 1234.5|round(-2) }} {{ (-1) ** 1000000000000000001 }} {{ 2 ** 62 }} {{ 0 ** 0 }} {{ 7 is divisibleby(-1) }} {{ -7 % -3 }} {{ 7 % -3 }} {{ -7 // 2 }} {{ '3.0'|float|int }} {{ -3.9|int }} {{ '0x1A'|int }} {{ 'abc'|int(7) }} {{ range(-5, 5, 3)|list }} {{ range(5, -5, -3)|list }}",
    "slices_and_search": "{{ 'héllo wörld'[::3] }} {{ 'héllo wörld'[::-2] }} {{ 'héllo'[10:] }} {{ 'héllo'[-100:2] }} {{ 'héllo'[1:-1] }} {{ [1,2,3,4,5][::-2] }} {{ [1,2,3][5:1:-1] }} {{ 'abc'[1:1] }} {{ [1,2,3][::100] }} {{ 'aaaa'.count('aa') }} {{ 'abcabc'.rfind('bc') }} {{ 'abcabcabcabcabc'.rfind('abcabcabca') }} {{ 'x'.find('') }} {{ 'ab'.rfind('') }} {{ 'aXbXc'.split('X') }} {{ 'a.b.c.d'.rsplit('.', 2) }} {{ 'ab' in 'xaby' }} {{ 'abcabc'.replace('bc', '-', 1) }} {{ 'abc'.replace('', '.') }} {{ 'x' * 3 ~ 'y' }} {{ [1, [2, [3]]] == [1, [2, [3]]] }} {{ [1, 2] < [1, 3] }} {{ 'é'|length }}",
    "error_split_undefined": "{{ 'a b'.split(nothing) }}",
    "error_round_string": "{{ 'ab'|round }}",
    "error_sort_mixed": "{{ [1, 'a']|sort }}",
}
for name, tpl in features.items():
    add("feature/" + name, tpl, dict(base))

out = os.path.join(FIX, "templates/cases.json")
os.makedirs(os.path.dirname(out), exist_ok=True)
with open(out, "w", encoding="utf-8") as f:
    json.dump({"generator": "tools/reference/tokenizer/render_templates.py (Debian python3-jinja2 %s, transformers' "
               "environment)" % jinja2.__version__, "cases": cases}, f, ensure_ascii=False, indent=1)
    f.write("\n")
print("%d cases (%d errors) -> %s" % (len(cases), sum("error" in c for c in cases), out))
