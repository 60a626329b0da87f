"""Tool calls and reasoning through both doors, the router alone: a real Router (HTTP and gRPC on loopback)
over a scripted cluster that streams a reply of the test's choosing in pieces of the test's choosing, driven
by the official openai SDK (its stream helper accumulates the deltas) and the gRPC stub. What the doors make of
a reply is checked against the whole reply's parse (router.chat_reply); tests/router/test_tools_api.py runs
real SmolLM2 replies."""
from __future__ import annotations

import asyncio
import json
from types import SimpleNamespace

import grpc
import openai
import pytest

from pdserve.config import ClusterConfig, EngineConfig
from pdserve.engine.output import RequestOutput
from pdserve.engine.request import FinishReason
from pdserve.tiers import ServiceTier
from pdserve.v1 import generation_pb2 as pb
from pdserve.v1 import generation_pb2_grpc as pb_grpc
from router.chat_tools import MAX_FORCED_CALLS
from router.compose import build_router
from router.config import RouterConfig

pytestmark = pytest.mark.slow  # it reads SmolLM2's tokenizer (and chat template) from its file
MODEL = "scripted"
WEATHER = {"type": "function", "function": {"name": "get_weather", "description": "The weather in a city",
                                            "parameters": {"type": "object", "properties": {"city": {"type": "string"}},
                                                           "required": ["city"]}}}
CLOCK = {"type": "function", "function": {"name": "get_time", "parameters": {"type": "object", "properties": {}}}}
TOOLS = [WEATHER, CLOCK]
CHAT = [{"role": "user", "content": "What is the weather in Paris, and the time?"}]
TWO_CALLS = ('Let me look.\n<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>\n'
             '<tool_call>\n{"name": "get_time", "arguments": {}}\n</tool_call>')


class ScriptedCluster:
    """What the router needs of router.cluster.Cluster, streaming `reply` (text, finish reason) in pieces of
    `step` characters, one token an output, for every sample of a request."""

    def __init__(self, info):
        self.info = info
        self.config = ClusterConfig()
        self.scaling = SimpleNamespace(workers=[], catch_up=None)
        self.reply, self.step = ("", FinishReason.STOP), 3
        self.params = []

    def queued(self, tier: ServiceTier) -> int:
        return 0

    async def generate(self, prompt, params, request_id=None, tier=ServiceTier.DEFAULT, session=None):
        self.params.append(params)
        text, reason = self.reply
        pieces = [text[i:i + self.step] for i in range(0, len(text), self.step)] or [""]
        for i in range(params.n):
            for j, piece in enumerate(pieces):
                await asyncio.sleep(0)
                last = j + 1 == len(pieces)
                yield RequestOutput(request_id or "r", [100 + j], piece, reason if last else None, len(prompt), j + 1,
                                    placement=("p0", "d0") if last else (), index=i)


@pytest.fixture(scope="module")
def served(aloop):
    from pdserve.model.loader import default_model_path, load_info

    try:
        default_model_path()
    except FileNotFoundError as e:
        pytest.skip(str(e))
    cluster = ScriptedCluster(load_info(EngineConfig()))
    routers = {}
    for name, kw in {"plain": {}, "qwen3": dict(reasoning_parser="qwen3"),
                     "mistral": dict(tool_call_parser="mistral")}.items():
        routers[name] = build_router(cluster, RouterConfig(port=0, http_port=0, served_model_name=MODEL, **kw))
        aloop.run(routers[name].start())
    yield cluster, routers
    for r in routers.values():
        aloop.run(r.stop(grace=5))


def sdk(served, name="plain") -> openai.OpenAI:
    return openai.OpenAI(base_url=f"http://127.0.0.1:{served[1][name].http_port}/v1", api_key="unused",
                         max_retries=0, timeout=60)


def calls_of(message) -> list[tuple[str, dict]]:
    return [(c.function.name, json.loads(c.function.arguments)) for c in message.tool_calls or ()]


@pytest.mark.parametrize("step", [1, 3, 11, 1000])
def test_streamed_calls_accumulate_to_the_whole_reply(served, step):
    """The SDK's stream helper gathers the deltas into the message the non-streamed request returns: the same
    content, the same calls (each with its own call_ id), finish reason tool_calls; two samples each theirs."""
    cluster, _ = served
    cluster.reply, cluster.step = (TWO_CALLS, FinishReason.STOP), step
    client = sdk(served)
    whole = client.chat.completions.create(model=MODEL, messages=CHAT, tools=TOOLS, n=2)
    with client.chat.completions.stream(model=MODEL, messages=CHAT, tools=TOOLS, n=2) as stream:
        streamed = stream.get_final_completion()
    want = [("get_weather", {"city": "Paris"}), ("get_time", {})]
    for reply in (whole, streamed):
        assert len(reply.choices) == 2
        for choice in reply.choices:
            assert choice.finish_reason == "tool_calls"
            assert choice.message.content == "Let me look."
            assert calls_of(choice.message) == want
            ids = [c.id for c in choice.message.tool_calls]
            assert all(i.startswith("call_") and len(i) == 29 and i[5:].isalnum() for i in ids)
            assert len(set(ids)) == 2 and all(c.type == "function" for c in choice.message.tool_calls)
    params = cluster.params[-1]
    assert params.structured is None  # auto: free text, read for calls


def test_calls_and_finish_reasons(served):
    client = sdk(served)
    cluster = served[0]
    cluster.step = 4
    # Only a call: no content. parallel_tool_calls false: the first call alone.
    cluster.reply = ('<tool_call>{"name": "get_time", "arguments": {}}</tool_call>', FinishReason.STOP)
    r = client.chat.completions.create(model=MODEL, messages=CHAT, tools=TOOLS)
    assert r.choices[0].message.content is None and calls_of(r.choices[0].message) == [("get_time", {})]
    cluster.reply = (TWO_CALLS, FinishReason.STOP)
    r = client.chat.completions.create(model=MODEL, messages=CHAT, tools=TOOLS, parallel_tool_calls=False)
    assert calls_of(r.choices[0].message) == [("get_weather", {"city": "Paris"})]
    # A reply cut by max_tokens stays "length"; a call cut open is content.
    cluster.reply = (TWO_CALLS[:-20], FinishReason.LENGTH)
    r = client.chat.completions.create(model=MODEL, messages=CHAT, tools=TOOLS)
    assert r.choices[0].finish_reason == "length"
    assert calls_of(r.choices[0].message) == [("get_weather", {"city": "Paris"})]
    content = r.choices[0].message.content
    assert content.startswith("Let me look.") and '<tool_call>\n{"name": "get_time"' in content
    # Malformed JSON stays content; tool_choice none reads nothing.
    bad = '<tool_call>{"name": "get_time", "arguments": {</tool_call>'
    cluster.reply = (bad, FinishReason.STOP)
    r = client.chat.completions.create(model=MODEL, messages=CHAT, tools=TOOLS)
    assert r.choices[0].finish_reason == "stop" and r.choices[0].message.content == bad
    assert r.choices[0].message.tool_calls is None
    cluster.reply = (TWO_CALLS, FinishReason.STOP)
    r = client.chat.completions.create(model=MODEL, messages=CHAT, tools=TOOLS, tool_choice="none")
    assert r.choices[0].message.content == TWO_CALLS and r.choices[0].finish_reason == "stop"


@pytest.mark.parametrize("stream", [False, True])
def test_forced_choices_are_read_from_their_json(served, stream):
    """required: the reply is a JSON list of calls, under a schema in SamplingParams.structured; a named function:
    the reply is its arguments."""
    cluster = served[0]
    client = sdk(served)

    def ask(reply: str, **kw):
        cluster.reply, cluster.step = (reply, FinishReason.STOP), 5
        if not stream:
            return client.chat.completions.create(model=MODEL, messages=CHAT, tools=TOOLS, **kw).choices[0]
        with client.chat.completions.stream(model=MODEL, messages=CHAT, tools=TOOLS, **kw) as s:
            return s.get_final_completion().choices[0]

    got = ask('[{"name": "get_weather", "arguments": {"city": "Oslo"}}, {"name": "get_time", "arguments": {}}]',
              tool_choice="required")
    assert got.finish_reason == "tool_calls" and got.message.content is None
    assert calls_of(got.message) == [("get_weather", {"city": "Oslo"}), ("get_time", {})]
    schema = json.loads(cluster.params[-1].structured.spec)
    assert cluster.params[-1].structured.kind == "json_schema" and schema["type"] == "array"
    assert [a["properties"]["name"]["const"] for a in schema["items"]["anyOf"]] == ["get_weather", "get_time"]
    assert schema["maxItems"] == MAX_FORCED_CALLS
    ask('[{"name": "get_time", "arguments": {}}]', tool_choice="required", parallel_tool_calls=False)
    assert json.loads(cluster.params[-1].structured.spec)["maxItems"] == 1
    got = ask('{"city": "Rome"}', tool_choice={"type": "function", "function": {"name": "get_weather"}})
    assert got.finish_reason == "tool_calls" and calls_of(got.message) == [("get_weather", {"city": "Rome"})]
    assert json.loads(cluster.params[-1].structured.spec) == WEATHER["function"]["parameters"]


def test_mistral_calls_keep_their_special_tokens(served):
    """--tool-call-parser mistral: [TOOL_CALLS] is a special token, kept in the text of a request read for calls
    (SamplingParams.skip_special_tokens false) and left out of every other."""
    cluster = served[0]
    cluster.reply, cluster.step = ('[TOOL_CALLS]get_weather[ARGS]{"city": "Nice"}', FinishReason.STOP), 6
    client = sdk(served, "mistral")
    r = client.chat.completions.create(model=MODEL, messages=CHAT, tools=TOOLS)
    assert calls_of(r.choices[0].message) == [("get_weather", {"city": "Nice"})] and r.choices[0].message.content is None
    assert cluster.params[-1].skip_special_tokens is False
    for kw in (dict(tools=TOOLS, tool_choice="none"), {}):
        client.chat.completions.create(model=MODEL, messages=CHAT, **kw)
        assert cluster.params[-1].skip_special_tokens is True
    sdk(served).chat.completions.create(model=MODEL, messages=CHAT, tools=TOOLS)  # hermes: nothing to keep
    assert cluster.params[-1].skip_special_tokens is True


@pytest.mark.parametrize("stream", [False, True])
def test_reasoning_content(served, stream):
    """--reasoning-parser qwen3: <think>...</think> is reasoning_content, the rest content, read for calls."""
    cluster = served[0]
    cluster.reply, cluster.step = ("<think>\nThe user wants the time.\n</think>\n\n" + TWO_CALLS[13:],
                                   FinishReason.STOP), 3
    client = sdk(served, "qwen3")
    if stream:
        with client.chat.completions.stream(model=MODEL, messages=CHAT, tools=TOOLS) as s:
            chunks = [e.chunk for e in s if e.type == "chunk"]
            message = s.get_final_completion().choices[0].message
        reasoning = "".join(getattr(c.choices[0].delta, "reasoning_content", None) or "" for c in chunks if c.choices)
    else:
        message = client.chat.completions.create(model=MODEL, messages=CHAT, tools=TOOLS).choices[0].message
        reasoning = message.reasoning_content
    assert reasoning == "\nThe user wants the time.\n"
    assert message.content is None and [n for n, _ in calls_of(message)] == ["get_weather", "get_time"]
    cluster.reply = ("No thinking here.", FinishReason.STOP)
    plain = client.chat.completions.create(model=MODEL, messages=CHAT).choices[0].message
    assert plain.content == "No thinking here." and plain.reasoning_content is None


@pytest.mark.parametrize("body, param", [
    (dict(tools=TOOLS, tool_choice={"type": "function", "function": {"name": "nope"}}), "tool_choice"),
    (dict(tool_choice="auto"), "tool_choice"),
    (dict(tools=[WEATHER, WEATHER]), "tools.1.function.name"),
    (dict(tools=[{"type": "function", "function": {"name": "f", "parameters": {"type": "array"}}}]),
     "tools.0.function.parameters"),
    (dict(tools=[{"type": "function", "function": {"name": "f", "parameters": {"type": "object", "required": 3}}}]),
     "tools.0.function.parameters"),
    (dict(tools=[{"type": "code_interpreter"}]), "tools.0"),
    (dict(tools=[{"type": "function", "function": {"name": "has space"}}]), "tools.0.function.name"),
    (dict(tools=TOOLS, tool_choice="sometimes"), "tool_choice"),
    (dict(tools=TOOLS, parallel_tool_calls="maybe"), "parallel_tool_calls"),
    (dict(functions=[WEATHER["function"]]), "functions"),
    (dict(function_call="auto"), "function_call"),
    (dict(chat_template_kwargs=[1]), "chat_template_kwargs"),
    (dict(chat_template_kwargs={"tokenize": False}), "chat_template_kwargs"),
    (dict(messages=[*CHAT, {"role": "assistant", "content": None, "tool_calls": [
        {"id": "call_1", "type": "function", "function": {"name": "get_time", "arguments": "{not json"}}]}]),
     "messages.1.tool_calls.0.function.arguments"),
    (dict(messages=[{"role": "user", "content": "hi", "tool_calls": []}]), "messages.0.tool_calls"),
])
def test_bad_tools_are_400_naming_the_field(served, body, param):
    body = dict(body)
    cluster = served[0]
    before = len(cluster.params)
    args = dict(model=MODEL, messages=CHAT, max_tokens=4)
    with pytest.raises(openai.BadRequestError) as e:
        extra = {k: body.pop(k) for k in list(body) if k == "chat_template_kwargs"}  # not the SDK's own
        sdk(served).chat.completions.create(**{**args, **body}, extra_body=extra)
    assert e.value.status_code == 400 and e.value.body["param"] == param, e.value.body
    assert len(cluster.params) == before  # refused before any work


def test_grpc_tools_and_reasoning(served):
    """The gRPC door: tools as its messages, calls on the sample's last message, reasoning in reasoning_text."""
    cluster = served[0]
    cluster.reply, cluster.step = ("<think>hmm</think>" + TWO_CALLS, FinishReason.STOP), 4
    tools = [pb.Tool(type="function", function=pb.FunctionDefinition(
        name=t["function"]["name"], description=t["function"].get("description", ""),
        parameters=json.dumps(t["function"]["parameters"]))) for t in TOOLS]
    request = pb.GenerateRequest(messages=pb.ChatMessages(messages=[pb.ChatMessage(role="user", content="hi")]),
                                 tools=tools, max_tokens=64)
    with grpc.insecure_channel(f"127.0.0.1:{served[1]['qwen3'].port}") as channel:
        msgs = list(pb_grpc.GenerationStub(channel).Generate(request, timeout=60))
        assert "".join(m.reasoning_text for m in msgs) == "hmm"
        assert "".join(m.text for m in msgs) == "Let me look."
        assert [len(m.tool_calls) for m in msgs] == [0] * (len(msgs) - 1) + [2]
        calls = msgs[-1].tool_calls
        assert [(c.function.name, json.loads(c.function.arguments)) for c in calls] == \
            [("get_weather", {"city": "Paris"}), ("get_time", {})]
        assert calls[0].id.startswith("call_") and calls[0].type == "function"
        assert msgs[-1].finish_reason == pb.FINISH_REASON_STOP
        bad = pb.GenerateRequest(messages=request.messages, tools=tools,
                                 tool_choice=pb.ToolChoice(mode="function", name="nope"))
        with pytest.raises(grpc.RpcError) as e:
            list(pb_grpc.GenerationStub(channel).Generate(bad, timeout=60))
        assert e.value.code() == grpc.StatusCode.INVALID_ARGUMENT and "tool_choice" in e.value.details()
