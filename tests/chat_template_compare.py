#!/usr/bin/env python3
"""Chat templates: strata's renderer against Python's jinja2, as transformers runs it.

Not part of the test suite (it needs jinja2). Two jobs:

  chat_template_compare.py --write-fixtures
      Renders the hand-written cases below with jinja2 and writes
      tests/fixtures/chat_templates/cases.json, which chat_template_test.cpp
      compares strata's rendering with, byte for byte.

  chat_template_compare.py --driver BUILD/tests/drivers/chat_template_render \\
                           [--random 300] [--seed 1]
      Renders the hand-written cases and --random random conversations per
      template with jinja2 and with strata (through the driver) and prints,
      per template, how many renderings agree; the first disagreement of each
      template is shown. Exits 1 on any disagreement.

jinja2 is set up as transformers sets it up: ImmutableSandboxedEnvironment
(trim_blocks, lstrip_blocks, loopcontrols and the {% generation %} tag),
tojson = json.dumps(x, ensure_ascii=False, indent, separators, sort_keys),
raise_exception and strftime_now as globals, and render(messages=...,
tools=... or None, documents=None, add_generation_prompt=..., bos_token=...,
eos_token=...).
"""
import argparse
import json
import os
import random
import subprocess
import sys
import tempfile
from datetime import datetime

HERE = os.path.dirname(os.path.abspath(__file__))
FIXTURES = os.path.join(HERE, "fixtures", "chat_templates")
TEMPLATES = ["chatml", "llama2", "llama3", "llama3.1", "mistral-v0.1", "mistral-v0.3", "qwen2.5",
             "qwen3"]
TOKENS = {
    "chatml": ("", "<|im_end|>"),
    "llama3": ("<|begin_of_text|>", "<|eot_id|>"),
    "llama3.1": ("<|begin_of_text|>", "<|eot_id|>"),
    "llama2": ("<s>", "</s>"),
    "mistral-v0.1": ("<s>", "</s>"),
    "mistral-v0.3": ("<s>", "</s>"),
    "qwen2.5": ("", "<|im_end|>"),
    "qwen3": ("", "<|im_end|>"),
}
TOOL_TEMPLATES = {"llama3.1", "mistral-v0.3", "qwen2.5", "qwen3"}


def make_environment():
    import jinja2
    from jinja2 import nodes
    from jinja2.ext import Extension, loopcontrols
    from jinja2.sandbox import ImmutableSandboxedEnvironment

    class Generation(Extension):
        # transformers' AssistantTracker, less the bookkeeping of positions.
        tags = {"generation"}

        def parse(self, parser):
            lineno = next(parser.stream).lineno
            body = parser.parse_statements(["name:endgeneration"], drop_needle=True)
            return nodes.CallBlock(self.call_method("_render", []), [], [], body).set_lineno(lineno)

        def _render(self, caller):
            return caller()

    def raise_exception(message):
        raise jinja2.exceptions.TemplateError(message)

    def tojson(x, ensure_ascii=False, indent=None, separators=None, sort_keys=False):
        return json.dumps(x, ensure_ascii=ensure_ascii, indent=indent, separators=separators,
                          sort_keys=sort_keys)

    def strftime_now(format):
        return datetime.now().strftime(format)

    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True,
                                        extensions=[Generation, loopcontrols])
    env.filters["tojson"] = tojson
    env.globals["raise_exception"] = raise_exception
    env.globals["strftime_now"] = strftime_now
    return env


def load_template(name):
    with open(os.path.join(FIXTURES, name + ".jinja"), encoding="utf-8", newline="") as f:
        return f.read()


def render_jinja(env, template, case):
    try:
        text = template.render(messages=case["messages"], tools=case.get("tools"), documents=None,
                               add_generation_prompt=case["add_generation_prompt"],
                               bos_token=case["bos_token"], eos_token=case["eos_token"])
        return {"text": text}
    except Exception as error:  # raise_exception, and TypeErrors of malformed conversations
        return {"error": f"{type(error).__name__}: {error}"}


# ---------------------------------------------------------------- the fixed cases

WEATHER_TOOL = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "Current weather in a city, in \"celsius\" or \"fahrenheit\".",
        "parameters": {
            "type": "object",
            "properties": {
                "city": {"type": "string", "description": "City name, e.g. Zürich"},
                "unit": {"type": "string", "enum": ["celsius", "fahrenheit"]},
            },
            "required": ["city"],
        },
    },
}
SEARCH_TOOL = {
    "type": "function",
    "function": {"name": "search", "description": "Web search.",
                 "parameters": {"type": "object", "properties": {"q": {"type": "string"},
                                                                 "top_k": {"type": "integer"}}}},
}


def call(name, arguments, wrapped=True, id_=None):
    inner = {"name": name, "arguments": arguments}
    out = {"type": "function", "function": inner} if wrapped else inner
    if id_:
        out["id"] = id_
    return out


def fixed_cases():
    plain = [
        {"role": "system", "content": "  You are terse.\n"},
        {"role": "user", "content": "What is 2+2?"},
        {"role": "assistant", "content": " 4. "},
        {"role": "user", "content": "And 'three' times \"three\"?\nAnswer in words — ünïcödé ok."},
        {"role": "assistant", "content": "Nine.\n"},
    ]
    no_system = plain[1:]
    cases = []

    def add(name, template, messages, agp=False, tools=None):
        bos, eos = TOKENS[template]
        case = {"name": name, "template": template, "bos_token": bos, "eos_token": eos,
                "add_generation_prompt": agp, "messages": messages}
        if tools is not None:
            case["tools"] = tools
        cases.append(case)

    for template in TEMPLATES:
        add(f"{template}_with_system", template, plain)
        add(f"{template}_without_system", template, no_system)
        add(f"{template}_generation_prompt", template, plain[:4], agp=True)

    for template in ("llama2", "mistral-v0.1", "mistral-v0.3"):
        add(f"{template}_roles_must_alternate", template,
            [{"role": "user", "content": "a"}, {"role": "user", "content": "b"}])
        add(f"{template}_other_roles_refused", template,
            [{"role": "user", "content": "a"}, {"role": "critic", "content": "b"}])
    mistral_tools = [
        {"role": "system", "content": "Answer with tools."},
        {"role": "user", "content": "Weather in Paris?"},
        {"role": "assistant", "tool_calls": [
            call("get_weather", {"city": "Paris", "unit": "celsius"}, id_="abc123XYZ")]},
        {"role": "tool", "tool_call_id": "abc123XYZ", "content": {"temperature": 21, "sky": "it's clear"}},
        {"role": "assistant", "content": "  21 °C, clear.  "},
        {"role": "user", "content": "Search \"paris\" for me"},
        {"role": "assistant", "tool_calls": [
            call("search", {"q": "paris"}, id_="s00000001"), call("search", {"q": "Paris", "top_k": 2}, id_="s00000002")]},
        {"role": "tool", "tool_call_id": "s00000001", "content": "result one"},
        {"role": "tool", "tool_call_id": "s00000002", "content": {"content": ["two", 2.5, None]}},
        {"role": "assistant", "content": "Found two."},
    ]
    add("mistral-v0.3_tools", "mistral-v0.3", mistral_tools, tools=[WEATHER_TOOL, SEARCH_TOOL])
    add("mistral-v0.3_tools_last_user", "mistral-v0.3", mistral_tools[:6], tools=[WEATHER_TOOL])
    add("mistral-v0.3_tool_call_id_refused", "mistral-v0.3",
        [{"role": "user", "content": "a"},
         {"role": "assistant", "tool_calls": [call("search", {"q": "x"}, id_="short")]}])

    llama_tools = [
        {"role": "system", "content": "Use tools when needed."},
        {"role": "user", "content": "  Weather in Paris?  "},
        {"role": "assistant", "tool_calls": [call("get_weather", {"city": "Paris", "unit": "celsius"})]},
        {"role": "tool", "content": "{\"temperature\": 21.5}"},
        {"role": "ipython", "content": {"temperature": 21.5, "sky": "clear", "ok": True, "rain": None}},
        {"role": "assistant", "content": "It is 21.5 °C and clear."},
    ]
    add("llama3.1_tools", "llama3.1", llama_tools, tools=[WEATHER_TOOL, SEARCH_TOOL])
    add("llama3.1_tools_generation_prompt", "llama3.1", llama_tools[:5], agp=True,
        tools=[WEATHER_TOOL])
    add("llama3.1_tool_call_without_tools", "llama3.1", llama_tools)
    add("llama3.1_tools_without_user_message", "llama3.1",
        [{"role": "system", "content": "s"}], tools=[WEATHER_TOOL])
    add("llama3.1_two_tool_calls_refused", "llama3.1",
        [{"role": "user", "content": "u"},
         {"role": "assistant", "tool_calls": [call("a", {}), call("b", {"x": 1})]}])

    qwen_tools = [
        {"role": "system", "content": "You are a weather bot."},
        {"role": "user", "content": "Weather in Paris and Tokyo?"},
        {"role": "assistant", "content": "Checking both.",
         "tool_calls": [call("get_weather", {"city": "Paris"}),
                        call("get_weather", {"city": "Tokyo", "unit": "celsius"}, wrapped=False)]},
        {"role": "tool", "content": "{\"temperature\": 21}"},
        {"role": "tool", "content": "{\"temperature\": 18.25}"},
        {"role": "assistant", "content": "Paris 21, Tokyo 18.25."},
        {"role": "user", "content": "Thanks"},
        {"role": "assistant", "content": None,
         "tool_calls": [call("search", {"q": "thanks in Japanese", "top_k": 3, "lang": ["ja", "en"],
                                        "exact": False, "boost": 1e-05, "weight": 1e20})]},
        {"role": "tool", "content": "ありがとう"},
    ]
    for template in ("qwen2.5", "qwen3"):
        add(f"{template}_tools", template, qwen_tools, tools=[WEATHER_TOOL, SEARCH_TOOL])
        add(f"{template}_tools_generation_prompt", template, qwen_tools, agp=True,
            tools=[WEATHER_TOOL])
        add(f"{template}_tools_without_system", template, qwen_tools[1:], tools=[SEARCH_TOOL])
        add(f"{template}_tool_calls_without_tools", template, qwen_tools)

    thinking = [
        {"role": "user", "content": "Is 91 prime?"},
        {"role": "assistant", "content": "<think>\n91 = 7 * 13.\n</think>\n\nNo, 91 = 7 × 13."},
        {"role": "user", "content": "Is 97?"},
        {"role": "assistant", "reasoning_content": "\nCheck 2,3,5,7.\n", "content": "\nYes."},
    ]
    add("qwen3_thinking", "qwen3", thinking)
    add("qwen3_thinking_history", "qwen3", thinking + [{"role": "user", "content": "Why?"}],
        agp=True)
    add("qwen3_tool_arguments_as_text", "qwen3",
        [{"role": "user", "content": "search"},
         {"role": "assistant", "content": "<think>plan</think>",
          "tool_calls": [{"function": {"name": "search", "arguments": "{\"q\": \"x\"}"}}]},
         {"role": "user", "content": "<tool_response>\nok\n</tool_response>"},
         {"role": "assistant", "content": "done"}])
    return cases


# Small templates, one construct each, rendered with a short conversation.
SNIPPETS = {
    "whitespace_control": "a  {%- if true %} b {% endif -%}  c\n  {% if true %}\n    x\n  {% endif %}\n"
                          "y {{- ' z ' -}} w\n{# note #}\nend\n   {#- gone -#}   !\n",
    "plus_disables_trimming": "  {%+ if true %}k{% endif +%}\nq\n  {{ 'v' }}  \n  {% if true -%}\n  t{% endif %}",
    "comment_alone_on_a_line": "A\n    {# note #}\nB\n{#- x #}C",
    "one_trailing_newline_dropped": "text\n\n",
    "carriage_returns": "a\r\nb{% if true %}\r\nc{% endif %}\rd",
    "loop_variables": "{% for m in messages %}{{ loop.index }}/{{ loop.length }}:{{ loop.first }}"
                      "{{ loop.last }}{{ loop.revindex }}{{ loop.revindex0 }}"
                      "{{ loop.previtem.role if loop.previtem is defined else '-' }}"
                      "{{ loop.nextitem.role if loop.nextitem is defined else '-' }};{% endfor %}",
    "loop_filter_else_break_continue": "{% for m in messages if m.role == 'nobody' %}x{% else %}empty{% endfor %}|"
                                       "{% for i in range(6) %}{% if i == 1 %}{% continue %}{% endif %}"
                                       "{% if i == 4 %}{% break %}{% endif %}{{ i }}{% endfor %}|"
                                       "{% for i in range(2, 9, 3) %}{{ i }}{% endfor %}"
                                       "{% for m in messages if m.role != 'system' %}{{ loop.index }}{{ m.role[0] }}{% endfor %}",
    "namespace": "{% set ns = namespace(n=0, s='') %}{% for m in messages %}{% set ns.n = ns.n + 1 %}"
                 "{% set ns.s = ns.s ~ m.role[0] %}{% endfor %}{{ ns.n }} {{ ns.s }}",
    "scoping": "{% set x = 1 %}{% for i in [1, 2] %}[{{ x }}]{% set x = i * 10 %}({{ x }}){% endfor %}{{ x }}"
               "{% if true %}{% set y = 5 %}{% endif %}{{ y }}",
    "slices_and_indexing": "{{ 'abcdef'[::-1] }} {{ 'abcdef'[1:4] }} {{ [1, 2, 3, 4][-2:] }} {{ 'héllo'[1] }} "
                           "{{ [1, 2, 3][::2] }} [{{ 'abc'[5:] }}] {{ [1, 2, 3][-1] }} [{{ [1][3] }}] "
                           "{{ messages[-1].content }} {{ messages[1:][0]['role'] }} {{ 'abcdef'[-2::-2] }}",
    "string_methods": "{{ '  a b  '.strip() }}|{{ 'xxaxx'.strip('x') }}|{{ ' a '.lstrip() }}|{{ ' a '.rstrip() }}|"
                      "{{ 'a,b,,c'.split(',') }}|{{ ' a  b '.split() }}|{{ 'a b c'.split(' ', 1) }}|"
                      "{{ 'abc'.startswith('ab') }}{{ 'abc'.endswith(('x', 'c')) }}|"
                      "{{ 'Hi'.upper() }}{{ 'Hi'.lower() }}{{ 'hello world'.title() }}{{ 'hELLO'.capitalize() }}|"
                      "{{ 'a-b-c'.replace('-', '+') }}{{ 'a-b-c'.replace('-', '', 1) }}|{{ '\u3000x\u00a0'.strip() }}|",
    "filters": "{{ messages|length }} {{ 'héllo'|length }} [{{ '  x  '|trim }}] {{ 'Ab'|lower }}{{ 'Ab'|upper }} "
               "{{ nothing|default('dflt') }} {{ ''|default('e', true) }} {{ [3, 4]|first }}{{ [3, 4]|last }} "
               "{{ ['a', 'b']|join(', ') }} {{ 'aXbX'|replace('X', '-') }} {{ 42|string ~ '!' }} "
               "{{ {'a': 1, 'b': [true, none]}|items|list }} {{ [1, 2]|reverse|list }} {{ -3|abs }} "
               "{{ '12'|int + 1 }} {{ 'x'|int }} {{ '2.5'|float }} {{ 'ab cd'|title }} {{ 'aB'|capitalize }} "
               "{{ messages|map(attribute='role')|join(',') }} {{ ['a', 'b']|map('upper')|list }} {{ 'ab'|list }} "
               "{{ messages[0]|count }} [{{ nothing|trim }}] {{ nothing|length }} {{ nothing|items|list }} "
               "{{ \"it's-a (test) x2y\"|title }} {{ \"it's-a (test) x2y\".title() }} {{ '2.7'|int }} "
               "{{ ' 7 '|int }} {{ 'n/a'|float(-1.0) }}",
    "select_and_reject": "{{ messages|selectattr('role', 'equalto', 'user')|list|length }} "
                         "{{ messages|rejectattr('role', 'equalto', 'user')|map(attribute='content')|join('+') }} "
                         "{{ [1, 2, 3, 4]|select('odd')|list }} {{ [1, 2, 3]|reject('equalto', 2)|list }} "
                         "{{ [0, 1, '', 'a']|select|list }} {{ messages|selectattr('name')|list }}",
    "tests": "{{ none is none }}{{ 1 is number }}{{ 'a' is string }}{{ {} is mapping }}{{ [] is sequence }}"
             "{{ 'a' is sequence }}{{ x is defined }}{{ x is undefined }}{{ 3 is odd }}{{ 4 is even }}"
             "{{ 4 is divisibleby 2 }}{{ true is sameas true }}{{ 1 is integer }}{{ 1.0 is float }}"
             "{{ 'ab' is lower }}{{ x is iterable }}{{ 1 is boolean }}{{ true is true }}{{ 0 is false }}"
             "{{ 2 is eq 2 }}{{ 2 is ne 2 }}{{ 'a' is in 'cat' }}{{ 3 is gt 2 }}{{ 1 is not none }}"
             "{{ none is mapping }}{{ 'x' is iterable }}{{ 5 is iterable }}",
    "operators": "{{ 7 // 2 }} {{ -7 // 2 }} {{ -7 % 3 }} {{ 7 % -3 }} {{ 7 / 2 }} {{ 2 ** 10 }} {{ 'a' ~ 1 ~ none }} "
                 "{{ [1] + [2] }} {{ 'ab' * 2 }} {{ 1 < 2 < 3 }} {{ 3 > 2 > 2 }} {{ 'a' in 'cat' }} "
                 "{{ 'x' not in ['x'] }} {{ 1 == 1.0 }} {{ true == 1 }} {{ none or 'fallback' }} {{ 0 and 'no' }} "
                 "{{ 'yes' if 1 else 'no' }} [{{ 'y' if 0 }}] {{ not 0 }} {{ -(2 + 3) * 2 }} {{ 1.5 + 1 }} "
                 "{{ 'b' >= 'a' }} {{ [1, 2] < [1, 3] }} {{ {'a': 1} == {'a': 1} }} {{ 'k' in {'k': 0} }} "
                 "{{ not 1 == 2 }} {{ 10 - 2 - 3 }} {{ 2 * 3 + 4 }}",
    "tojson": "{{ {'b': 1, 'a': [1.5, 'é\"\\n\u0001', none, true, {}], 'c': []}|tojson }}\n"
              "{{ {'b': 1, 'a': {'x': [1, 2]}, 'e': {}}|tojson(indent=2) }}\n{{ {'b': 1, 'a': 2}|tojson(sort_keys=true) }}\n"
              "{{ [1, 2]|tojson(separators=(',', ':')) if false else [1, 2]|tojson }} {{ 'x'|tojson }} {{ 3|tojson }}",
    "numbers": "{{ 0.1 + 0.2 }} {{ 1e100 }} {{ 123456789012345678 }} {{ 1 / 3 }} {{ 1e16 }} {{ 1e15 }} "
               "{{ 0.0001 }} {{ 0.00001 }} {{ 2.0 }} {{ -0.0 }} {{ 1_000 }} {{ 2.5e-3 }} {{ 10 / 4 }}",
    "python_str_of_values": "{{ [1, 'it\\'s', {'k': none}, 2.5, false] }} {{ {'q': 'say \"hi\"'} }} "
                            "{{ ['both \\' and \"', 'new\\nline', 'tab\\t'] }} {{ messages[0] }}",
    "dict_methods": "{% for k, v in {'a': 1, 'b': 2}.items() %}{{ k }}={{ v }};{% endfor %}{{ {'a': 1}.get('a') }}"
                    "{{ {'a': 1}.get('z', 'none') }}{{ {'a': 1}.get('z') }}{{ {'a': 1, 'b': 2}.keys()|list }}"
                    "{{ {'a': 1}.values()|list }}{% for k in {'x': 1, 'y': 2} %}{{ k }}{% endfor %}",
    "string_literals": "{{ 'tab\\there\\x41\\u00e9\\\\ \\d' }} {{ \"dq 'sq'\" }} {{ 'a' 'b' }} {{ '\\101' }}",
    "undefined_values": "[{{ nope }}][{{ nope is defined }}][{{ messages[0].missing is defined }}]"
                        "[{{ messages[0]['role'] }}][{{ messages[0].get('role') }}][{{ messages[0].missing }}]"
                        "[{{ none.x is defined }}][{{ nope|default(none) }}][{{ nope == nope }}][{{ nope ~ 'x' }}]",
    "generation_tags": "{% for m in messages %}{{ m.role }}: {% if m.role == 'assistant' %}{% generation %}"
                       "{{ m.content }}{{ eos_token }}{% endgeneration %}{% else %}{{ m.content }}{% endif %}\n{% endfor %}",
    "raise_exception": "{% if messages|length > 1 %}{{ raise_exception('Too many messages: ' ~ messages|length) }}{% endif %}",
}

SNIPPET_MESSAGES = [
    {"role": "system", "content": "Be brief."},
    {"role": "user", "content": "  Hi there  "},
    {"role": "assistant", "content": "Yo"},
    {"role": "user", "content": "Bye"},
]


def snippet_cases():
    # strata refuses a conversation with assistant messages that no loop visits
    # (it could not mark their text), so snippets that do not loop over the
    # messages get the conversation without its assistant message.
    cases = []
    without_assistant = [m for m in SNIPPET_MESSAGES if m["role"] != "assistant"]
    for name, source in SNIPPETS.items():
        loops = "in messages" in source or "generation" in source
        cases.append({"name": f"snippet_{name}", "source": source, "bos_token": "<s>",
                      "eos_token": "</s>", "add_generation_prompt": False,
                      "messages": SNIPPET_MESSAGES if loops else without_assistant})
    return cases


def write_fixtures():
    env = make_environment()
    cases = fixed_cases() + snippet_cases()
    for case in cases:
        source = case["source"] if "source" in case else load_template(case["template"])
        template = env.from_string(source)
        result = render_jinja(env, template, case)
        if "text" in result:
            case["expected"] = result["text"]
        else:
            message = result["error"]
            if not message.startswith("TemplateError: "):
                sys.exit(f"{case['name']}: jinja2 failed outside raise_exception: {message}")
            case["expected_error"] = message[len("TemplateError: "):]
    path = os.path.join(FIXTURES, "cases.json")
    with open(path, "w", encoding="utf-8") as f:
        json.dump(cases, f, ensure_ascii=False, indent=1)
        f.write("\n")
    print(f"wrote {len(cases)} cases to {os.path.relpath(path)}")


# ---------------------------------------------------------------- random conversations

PHRASES = ["Hello", "world", "  padded  ", "\n\nnew lines\n", "tab\there", "quote ' and \"",
           "back\\slash", "ünïcödé", "日本語のテキスト", "emoji 🙂", "<b>html</b> & more",
           "{{ not jinja }}", "{% raw %}", "a\u00a0b", "x" * 40, "1e5", "None", "", " ",
           "<think>", "</think>", "<tool_response>", "</tool_response>", "<|im_end|>"]


def random_text(rng, allow_empty=True):
    words = [rng.choice(PHRASES) for _ in range(rng.randint(0 if allow_empty else 1, 5))]
    text = rng.choice(["", " ", "\n"]).join(words)
    return text if (text or allow_empty) else "x"


def random_value(rng, depth=0):
    kind = rng.randint(0, 9 if depth < 2 else 5)
    if kind == 0:
        return rng.randint(-1000, 10**6)
    if kind == 1:
        return rng.choice([0.5, -2.25, 1e-7, 3.0, 123456789.125, 1e20, 0.1, 100.0])
    if kind == 2:
        return rng.choice([True, False, None])
    if kind <= 5:
        return random_text(rng)
    if kind <= 7:
        return [random_value(rng, depth + 1) for _ in range(rng.randint(0, 3))]
    return {f"k{rng.randint(0, 99)}_{i}": random_value(rng, depth + 1)
            for i in range(rng.randint(0, 3))}


def random_tools(rng):
    tools = []
    for i in range(rng.randint(1, 3)):
        properties = {f"p{j}": {"type": rng.choice(["string", "integer", "number"]),
                                "description": random_text(rng)} for j in range(rng.randint(0, 3))}
        function = {"name": f"tool_{i}", "description": random_text(rng),
                    "parameters": {"type": "object", "properties": properties,
                                   "required": sorted(properties)[:1]}}
        tools.append({"type": "function", "function": function})
    return tools


def random_tool_calls(rng, template):
    count = 1 if template == "llama3.1" else rng.randint(1, 3)
    alphabet = "abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ0123456789"
    calls = []
    for i in range(count):
        arguments = {f"a{j}": random_value(rng) for j in range(rng.randint(0, 3))}
        if template == "qwen3" and rng.random() < 0.2:
            arguments = json.dumps(arguments)
        wrapped = template in ("llama3.1", "mistral-v0.3") or rng.random() < 0.8
        id_ = "".join(rng.choice(alphabet) for _ in range(9)) if template == "mistral-v0.3" else None
        calls.append(call(f"tool_{i}", arguments, wrapped=wrapped, id_=id_))
    return calls


def random_case(rng, template):
    bos, eos = TOKENS[template]
    tools = random_tools(rng) if template in TOOL_TEMPLATES and rng.random() < 0.5 else None
    messages = []
    if rng.random() < 0.5:
        messages.append({"role": "system", "content": random_text(rng)})
    turns = rng.randint(1, 5)
    for turn in range(turns):
        user = {"role": "user", "content": random_text(rng)}
        if rng.random() < 0.1:  # Qwen3 counts these as tool output, not a query
            user["content"] = "<tool_response>" + user["content"] + "</tool_response>"
        if rng.random() < 0.1:
            user["name"] = random_text(rng)  # keys templates do not read
        messages.append(user)
        if turn == turns - 1 and rng.random() < 0.4:
            break  # ends with the user: the generation prompt case
        if template in TOOL_TEMPLATES and rng.random() < 0.35:
            content = (random_text(rng) if template in ("qwen2.5", "qwen3") and rng.random() < 0.5
                       else None)
            message = {"role": "assistant", "tool_calls": random_tool_calls(rng, template)}
            if content is not None or rng.random() < 0.5:
                message["content"] = content
            messages.append(message)
            for tool_call in message["tool_calls"]:
                content = random_text(rng)
                if template in ("llama3.1", "mistral-v0.3") and rng.random() < 0.3:
                    content = {rng.choice(["result", "content"]): random_value(rng)}
                result = {"role": "tool", "content": content}
                if "id" in tool_call:
                    result["tool_call_id"] = tool_call["id"]
                messages.append(result)
        message = {"role": "assistant", "content": random_text(rng)}
        if template == "qwen3" and rng.random() < 0.3:
            message["content"] = "<think>" + random_text(rng) + "</think>" + random_text(rng)
        if template == "qwen3" and rng.random() < 0.2:
            message["reasoning_content"] = random_text(rng)
        messages.append(message)
    if rng.random() < 0.05:  # a malformed conversation: both sides must refuse it, or neither
        broken = rng.choice(messages)
        if rng.random() < 0.5:
            broken.pop("content", None)
        else:
            broken["role"] = "critic"
    case = {"name": f"random_{template}", "template": template, "bos_token": bos,
            "eos_token": eos, "add_generation_prompt": rng.random() < 0.5, "messages": messages}
    if tools is not None:
        case["tools"] = tools
    return case


def run_driver(driver, template, cases):
    with tempfile.NamedTemporaryFile("w", suffix=".jsonl", encoding="utf-8", delete=False) as f:
        for case in cases:
            line = {k: case[k] for k in ("messages", "add_generation_prompt", "bos_token",
                                         "eos_token")}
            if "tools" in case:
                line["tools"] = case["tools"]
            f.write(json.dumps(line, ensure_ascii=False) + "\n")
        path = f.name
    try:
        with open(path, encoding="utf-8") as stdin:
            done = subprocess.run([driver, os.path.join(FIXTURES, template + ".jinja")], stdin=stdin,
                                  capture_output=True, check=True)
    finally:
        os.unlink(path)
    return [json.loads(line) for line in done.stdout.decode("utf-8").splitlines()]


def compare(driver, count, seed):
    env = make_environment()
    rng = random.Random(seed)
    fixed = fixed_cases()
    failures = 0
    print(f"seed {seed}, {count} random conversations per template")
    for template_name in TEMPLATES:
        template = env.from_string(load_template(template_name))
        cases = [c for c in fixed if c["template"] == template_name]
        cases += [random_case(rng, template_name) for _ in range(count)]
        ours = run_driver(driver, template_name, cases)
        agree = texts = errors = 0
        shown = False
        for case, mine in zip(cases, ours):
            theirs = render_jinja(env, template, case)
            if "text" in theirs:
                texts += 1
                same = mine.get("text") == theirs["text"]
            else:
                errors += 1
                same = "error" in mine
                if theirs["error"].startswith("TemplateError: "):
                    same = same and theirs["error"][len("TemplateError: "):] in mine["error"]
            if same:
                agree += 1
            elif not shown:
                shown = True
                print(f"  {template_name}: disagreement on {json.dumps(case, ensure_ascii=False)}")
                print(f"    jinja2: {json.dumps(theirs, ensure_ascii=False)}")
                print(f"    strata: {json.dumps(mine, ensure_ascii=False)}")
        failures += len(cases) - agree
        print(f"{template_name:9} {agree}/{len(cases)} agree ({texts} renderings, "
              f"{errors} errors in jinja2)")
    return failures


def main():
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--write-fixtures", action="store_true")
    parser.add_argument("--driver", help="the built chat_template_render")
    parser.add_argument("--random", type=int, default=300)
    parser.add_argument("--seed", type=int, default=1)
    args = parser.parse_args()
    if args.write_fixtures:
        write_fixtures()
    if args.driver:
        sys.exit(1 if compare(args.driver, args.random, args.seed) else 0)
    if not args.write_fixtures:
        parser.error("give --write-fixtures or --driver")


if __name__ == "__main__":
    main()
