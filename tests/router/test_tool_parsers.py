"""Tool calls and reasoning read from reply text (router.tool_parsers, router.reasoning, router.chat_reply) and
a chat's tools checked and rendered (router.chat_tools), without a cluster. A stream cut anywhere must give
what the whole reply gives: every reply here is also fed cut at every position (and at every pair of
positions for the short ones)."""
from __future__ import annotations

import json
import shutil
from itertools import combinations

import jsonschema
import pytest

from router.chat_reply import Reply, ReplyPlan, plan
from router.chat_tools import FieldError, check_messages, check_template_kwargs, check_tools, hermes_messages, render
from router.reasoning import ReasoningStream, opens_reasoning
from router.tool_parsers import PARSERS, ToolCallStream, detect, family, parse

WEATHER = {"type": "function", "function": {"name": "get_weather", "parameters": {
    "type": "object", "properties": {"city": {"type": "string"}, "unit": {"enum": ["C", "F"]}}, "required": ["city"]}}}
CLOCK = {"type": "function", "function": {"name": "get_time", "description": "The time now"}}

# (family, reply, content, calls as (name, arguments))
CASES = [
    ("hermes", 'Sure.\n<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>\n'
               '<tool_call>{"name":"get_time","arguments":{}}</tool_call>',
     "Sure.", [("get_weather", {"city": "Paris"}), ("get_time", {})]),
    ("hermes", '<tool_call>{"name": "get_time", "arguments": {"tz": "UTC"}}</tool_call> and then some',
     "and then some", [("get_time", {"tz": "UTC"})]),
    ("hermes", '<tool_call>{"name": "f", "arguments": {</tool_call> after', '<tool_call>{"name": "f", "arguments": '
                                                                           '{</tool_call> after', []),  # bad JSON
    ("hermes", 'a <tool_call>{"arguments": {}}</tool_call>', 'a <tool_call>{"arguments": {}}</tool_call>', []),
    ("hermes", '<tool_call>{"name": "f", "arguments": "{\\"a\\": 1}"}</tool_call>', None, [("f", {"a": 1})]),
    ("hermes", 'open <tool_call>{"name": "f", "arguments": {}}', 'open <tool_call>{"name": "f", "arguments": {}}', []),
    ("hermes", "no calls at all, <tool but text", "no calls at all, <tool but text", []),
    ("llama3_json", '<|python_tag|>{"name": "get_weather", "parameters": {"city": "Oslo"}}; '
                    '{"name": "get_time", "parameters": {}}', None, [("get_weather", {"city": "Oslo"}), ("get_time", {})]),
    ("llama3_json", '{"name": "get_time", "arguments": {}}', None, [("get_time", {})]),
    ("llama3_json", '  {"name": "f", "parameters": {"x": [1, {"y": "}"}]}}\nDone.', "Done.", [("f", {"x": [1, {"y": "}"}]})]),
    ("llama3_json", 'The answer is {"name": "f"}', 'The answer is {"name": "f"}', []),
    ("llama3_json", '{"name": "f", "parameters": {"a": 1}', '{"name": "f", "parameters": {"a": 1}', []),
    ("llama3_json", '{"not": "a call"} text', '{"not": "a call"} text', []),
    ("mistral", '[TOOL_CALLS] [{"name": "get_weather", "arguments": {"city": "Rome"}}, {"name": "get_time", '
                '"arguments": {}}]', None, [("get_weather", {"city": "Rome"}), ("get_time", {})]),
    ("mistral", 'Checking.[TOOL_CALLS]get_weather[ARGS]{"city": "Lima"}[TOOL_CALLS]get_time[CALL_ID]a1B2c3D4e[ARGS]{}',
     "Checking.", [("get_weather", {"city": "Lima"}), ("get_time", {})]),
    ("mistral", '[TOOL_CALLS]get_time[ARGS]{"tz": ', '[TOOL_CALLS]get_time[ARGS]{"tz":', []),
    ("mistral", '[TOOL_CALLS] not a call', '[TOOL_CALLS] not a call', []),
    ("mistral", '[TOOL_CALLS][{"name": "f"}, 3]', '[TOOL_CALLS][{"name": "f"}, 3]', []),
]


def calls(got) -> list[tuple[str, dict]]:
    return [(c.name, json.loads(c.arguments)) for c in got]


def streamed(name: str, pieces: list[str], max_calls: int | None = None):
    s = ToolCallStream(family(name), max_calls)
    content, made = "", []
    for p in pieces:
        text, new = s.add(p)
        content, made = content + text, made + new
    text, new = s.finish()
    return content + text or None, made + new


def cuts(text: str):
    """The text cut at every position, and at every pair of positions for a short one."""
    for i in range(len(text) + 1):
        yield [text[:i], text[i:]]
    if len(text) <= 90:
        for i, j in combinations(range(len(text) + 1), 2):
            yield [text[:i], text[i:j], text[j:]]
    yield list(text)


@pytest.mark.parametrize("name, reply, content, want", CASES)
def test_family_parses_whole_and_cut_anywhere(name, reply, content, want):
    got_content, got = parse(family(name), reply)
    assert (got_content, calls(got)) == (content, want)
    for pieces in cuts(reply):
        c, g = streamed(name, pieces)
        assert (c, calls(g)) == (content, want), pieces


def test_calls_have_ids_and_parallel_false_keeps_the_first():
    _, got = parse(family("hermes"), CASES[0][1])
    assert all(c.id.startswith("call_") and len(c.id) == 29 and c.id[5:].isalnum() for c in got)
    assert len({c.id for c in got}) == len(got)
    assert calls(parse(family("hermes"), CASES[0][1], max_calls=1)[1]) == [("get_weather", {"city": "Paris"})]
    assert calls(streamed("mistral", list(CASES[14][1]), max_calls=1)[1]) == [("get_weather", {"city": "Lima"})]


REASONING = [  # (parser, the prompt's tail, reply, reasoning, content)
    ("qwen3", "<|im_start|>assistant\n", "<think>\nStep one.\n</think>\n\nThe answer.", "\nStep one.\n", "The answer."),
    ("qwen3", "<|im_start|>assistant\n<think>\n\n</think>\n\n", "Straight answer.", "", "Straight answer."),
    ("qwen3", "<|im_start|>assistant\n<think>\n", "Opened by the template.</think>Answer", "Opened by the template.",
     "Answer"),
    ("qwen3", "<|im_start|>assistant\n", "<think>cut before the end", "cut before the end", ""),
    ("qwen3", "<|im_start|>assistant\n", "Text with </think> inside", "", "Text with </think> inside"),
    ("deepseek_r1", "<｜Assistant｜>", "Reasoning without a tag</think>\nAnswer", "Reasoning without a tag", "Answer"),
    ("deepseek_r1", "<｜Assistant｜><think>\n", "<think>Tagged</think>Answer", "Tagged", "Answer"),
]


@pytest.mark.parametrize("parser, tail, reply, reasoning, content", REASONING)
def test_reasoning_whole_and_cut_anywhere(parser, tail, reply, reasoning, content):
    opened = opens_reasoning(parser, tail)
    for pieces in [[reply], *cuts(reply)]:
        s = ReasoningStream(opened)
        parts = [s.add(p) for p in pieces] + [s.finish()]
        assert ("".join(r for r, _ in parts), "".join(c for _, c in parts)) == (reasoning, content), pieces
        assert (s.reasoning, s.content) == (reasoning, content)


def test_reply_reads_calls_after_reasoning_and_forced_json():
    tools = check_tools([WEATHER, CLOCK], None, None)
    reply = "<think>Need weather.</think>\n" + CASES[0][1]
    for pieces in cuts(reply):
        r = Reply(ReplyPlan("qwen3", "hermes", tools), False)
        got = [r.add(p) for p in pieces] + [r.add("", final=True)]
        assert "".join(g.reasoning for g in got) == "Need weather." and "".join(g.content for g in got) == "Sure."
        assert calls(c for g in got for c in g.calls) == CASES[0][3]
        assert r.content == "Sure." and r.finish_reason("stop") == "tool_calls" and r.finish_reason("length") == "length"
    forced = check_tools([WEATHER, CLOCK], "required", None)
    r = Reply(ReplyPlan("none", "hermes", forced), False)
    assert r.add('[{"name": "get_time", ') .calls == [] and calls(r.add('"arguments": {}}]', final=True).calls) == \
        [("get_time", {})]
    assert r.content is None
    cut = Reply(ReplyPlan("none", "hermes", forced), False)
    assert cut.add('[{"name": "get_ti', final=True).content == '[{"name": "get_ti' and cut.calls == []
    named = Reply(ReplyPlan("none", "hermes", check_tools([WEATHER, CLOCK], {"type": "function", "function": {
        "name": "get_weather"}}, False)), False)
    assert calls(named.add('{"city": "Bern"}', final=True).calls) == [("get_weather", {"city": "Bern"})]
    assert plan(None, "hermes", "none") is None and plan(check_tools([CLOCK], "none", None), "hermes", "none") is None


def test_forced_schemas_hold_calls_to_their_own_function():
    required = check_tools([WEATHER, CLOCK], "required", None).forced_schema()
    jsonschema.Draft202012Validator.check_schema(required)
    ok = [{"name": "get_weather", "arguments": {"city": "Paris", "unit": "C"}}, {"name": "get_time", "arguments": {}}]
    jsonschema.validate(ok, required)
    for bad in ([], [{"name": "get_weather", "arguments": {}}], [{"name": "nope", "arguments": {}}],
                [{"name": "get_weather", "arguments": {"city": "Paris", "unit": "K"}}]):
        with pytest.raises(jsonschema.ValidationError):
            jsonschema.validate(bad, required)
    one = check_tools([WEATHER, CLOCK], "required", False).forced_schema()
    with pytest.raises(jsonschema.ValidationError):
        jsonschema.validate(ok, one)
    named = check_tools([WEATHER], {"type": "function", "function": {"name": "get_weather"}}, None)
    assert named.forced_schema() == WEATHER["function"]["parameters"]
    assert json.loads(named.structured().spec) == WEATHER["function"]["parameters"]
    assert check_tools([CLOCK], None, None).structured() is None  # auto: free text
    assert check_tools([CLOCK], None, None).tools[0]["function"]["parameters"] == {"type": "object", "properties": {}}


@pytest.mark.parametrize("tools, choice, param", [
    ([WEATHER], {"type": "function", "function": {"name": "get_time"}}, "tool_choice"),
    (None, "required", "tool_choice"),
    ([WEATHER, WEATHER], None, "tools.1.function.name"),
    ([{"type": "function", "function": {"name": "f", "parameters": {"type": "string"}}}], None,
     "tools.0.function.parameters"),
    ([{"type": "function", "function": {"name": "f", "parameters": {"type": "object", "properties": 5}}}], None,
     "tools.0.function.parameters"),
    ([{"type": "function", "function": {"name": "f", "extra": 1}}], None, "tools.0.function"),
    ([WEATHER] * 0 + [{"type": "function", "function": {"name": ""}}], None, "tools.0.function.name"),
    ([WEATHER], {"type": "function"}, "tool_choice"),
])
def test_bad_tools_name_the_field(tools, choice, param):
    with pytest.raises(FieldError) as e:
        check_tools(tools, choice, None)
    assert e.value.param == param


def test_messages_and_template_kwargs_checked():
    good = [{"role": "assistant", "content": None, "tool_calls": [
        {"id": "call_1", "type": "function", "function": {"name": "f", "arguments": '{"a": 1}'}}]},
        {"role": "tool", "tool_call_id": "call_1", "content": "1"}]
    check_messages(good)
    for bad, param in (([{"role": "assistant", "tool_calls": [{"function": {"name": "f", "arguments": "[1]"}}]}],
                        "messages.0.tool_calls.0.function.arguments"),
                       ([{"role": "user", "tool_calls": []}], "messages.0.tool_calls"),
                       ([{"role": "tool", "tool_call_id": 7}], "messages.0.tool_call_id")):
        with pytest.raises(FieldError) as e:
            check_messages(bad)
        assert e.value.param == param
    assert check_template_kwargs({"enable_thinking": False}) == {"enable_thinking": False}
    for bad in ("x", {"add_generation_prompt": False}, {"tools": []}, {"tokenize": True}):
        with pytest.raises(FieldError):
            check_template_kwargs(bad)


def test_detect_the_family():
    assert detect(None, set()) == "hermes" and detect("{{ messages }}", {"<|python_tag|>"}) == "hermes"
    assert detect("{% if tools %}<tool_call>{% endif %}", set()) == "hermes"
    assert detect("{% if tools %}[TOOL_CALLS]{% endif %}", set()) == "mistral"
    assert detect("{% if tools %}ipython{% endif %}", set()) == "llama3_json"
    assert detect("{% for t in tools %}{% endfor %}", {"[TOOL_CALLS]"}) == "mistral"
    assert set(PARSERS) == {"auto", "hermes", "llama3_json", "mistral"}


# -- rendering, with SmolLM2's tokenizer ---------------------------------------------------------------

# A tool-aware template of this test's own: the tools as JSON, each call with its arguments as an object, a
# None content concatenated (it would render "None"), a thinking switch.
TOOL_TEMPLATE = """{%- if tools %}<|im_start|>system
{% if messages[0].role == 'system' %}{{ messages[0].content }}
{% endif %}TOOLS:{% for t in tools %}{{ '\\n' }}{{ t | tojson }}{% endfor %}<|im_end|>
{% endif %}{%- for m in messages %}{% if not (tools and m.role == 'system') %}<|im_start|>{{ m.role }}
{% for c in m.tool_calls or [] %}CALL {{ c.function.name }} {{ c.function.arguments.city }} {{ c.id }}
{% endfor %}{{ m.content }}{% if m.role == 'tool' %} (for {{ m.tool_call_id }}){% endif %}<|im_end|>
{% endif %}{% endfor %}{%- if add_generation_prompt %}<|im_start|>assistant
{% if enable_thinking is defined and not enable_thinking %}<think>

</think>

{% endif %}{% endif %}"""

CONVERSATION = [
    {"role": "system", "content": "Be brief."},
    {"role": "user", "content": "Weather in Paris?"},
    {"role": "assistant", "content": None, "tool_calls": [
        {"id": "call_abc", "type": "function", "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'}}]},
    {"role": "tool", "tool_call_id": "call_abc", "content": "18 C, sunny"},
]


@pytest.fixture(scope="module")
def smol_tokenizer_dir():
    from pdserve.model.loader import default_model_path
    from pdserve.model.tokenizer import _cached_gguf_tokenizer_dir

    try:
        return _cached_gguf_tokenizer_dir(default_model_path())
    except FileNotFoundError as e:
        pytest.skip(str(e))


def test_a_tool_aware_template_gets_tools_and_the_conversation(smol_tokenizer_dir, tmp_path):
    from pdserve.model.tokenizer import Tokenizer

    for f in smol_tokenizer_dir.iterdir():
        shutil.copy(f, tmp_path / f.name)
    (tmp_path / "chat_template.jinja").write_text(TOOL_TEMPLATE)
    tok = Tokenizer.from_pretrained(tmp_path)
    assert tok.renders_tools
    tools = check_tools([WEATHER, CLOCK], None, None)
    check_messages(CONVERSATION)
    text = tok.decode(render(tok, CONVERSATION, tools, {"enable_thinking": False}), skip_special_tokens=False)
    listed = text[text.index("TOOLS:\n") + 7:text.index("<|im_end|>")].split("\n")
    assert [json.loads(t) for t in listed] == list(tools.tools)
    assert "<|im_start|>system\nBe brief.\nTOOLS:" in text
    assert "<|im_start|>assistant\nCALL get_weather Paris call_abc\n<|im_end|>" in text  # arguments as an object, None as ""
    assert "<|im_start|>tool\n18 C, sunny (for call_abc)<|im_end|>" in text
    assert text.endswith("<|im_start|>assistant\n<think>\n\n</think>\n\n")
    assert not opens_reasoning("qwen3", text)
    plain = tok.decode(render(tok, CONVERSATION[:2], None), skip_special_tokens=False)
    assert "TOOLS" not in plain and plain.endswith("<|im_start|>assistant\n")


def test_a_template_without_tools_gets_the_hermes_prompt(smol_tokenizer_dir):
    from pdserve.model.tokenizer import Tokenizer

    tok = Tokenizer.from_pretrained(smol_tokenizer_dir)  # SmolLM2's plain ChatML
    assert not tok.renders_tools
    tools = check_tools([WEATHER], None, False)
    text = tok.decode(render(tok, CONVERSATION, tools), skip_special_tokens=False)
    system = text[:text.index("<|im_end|>")]
    assert system.startswith("<|im_start|>system\nBe brief.\n\n# Tools")
    assert "<tools>\n" + json.dumps(tools.tools[0]) + "\n</tools>" in system
    assert "<tool_call>" in system and "Call one function at most." in system
    assert ('<|im_start|>assistant\n<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n'
            '</tool_call><|im_end|>') in text
    assert "<|im_start|>tool\n<tool_response>\n18 C, sunny\n</tool_response><|im_end|>" in text
    # No system message: the tools' prompt is one (in place of the template's default).
    first = hermes_messages(CONVERSATION[1:2], tools)[0]
    assert first["role"] == "system" and first["content"].startswith("# Tools")
    assert hermes_messages(CONVERSATION[1:2], None) == [{"role": "user", "content": "Weather in Paris?"}]
