"""Tools on the chat API with real SmolLM2 replies, through the official openai SDK: on the shared 1P1D
cluster (conftest.smol_1p1d), and a named function's call also on a colocated worker. tool_choice "required" and a named function hold the
reply to the tools' schema (structured output): every call's arguments must parse and validate against its
function's schema, 10 prompts of 10, streamed and not. A multi-turn conversation with a tool's answer is
rendered in pdserve's Hermes prompt (SmolLM2's template knows no tools) and answered."""
from __future__ import annotations

import json
from concurrent.futures import ThreadPoolExecutor

import jsonschema
import openai
import pytest

from router.compose import build_router
from router.config import RouterConfig


pytestmark = pytest.mark.slow
MODEL = "smollm2"
WEATHER = {"type": "function", "function": {
    "name": "get_weather", "description": "Get the current weather in a city",
    "parameters": {"type": "object", "properties": {"city": {"type": "string", "maxLength": 40},
                                                    "unit": {"type": "string", "enum": ["celsius", "fahrenheit"]}},
                   "required": ["city", "unit"], "additionalProperties": False}}}
FLIGHT = {"type": "function", "function": {
    "name": "book_flight", "description": "Book a flight between two cities",
    "parameters": {"type": "object", "properties": {"origin": {"type": "string", "maxLength": 40},
                                                    "destination": {"type": "string", "maxLength": 40},
                                                    "passengers": {"type": "integer", "minimum": 1, "maximum": 9}},
                   "required": ["origin", "destination", "passengers"], "additionalProperties": False}}}
TOOLS = [WEATHER, FLIGHT]
SCHEMAS = {t["function"]["name"]: t["function"]["parameters"] for t in TOOLS}
PROMPTS = ["What's the weather like in Paris?", "Is it raining in Tokyo right now?",
           "Book me a flight from Berlin to Rome for two people.", "How warm is it in Cairo, in fahrenheit?",
           "I need to fly from Oslo to Madrid with my family of four.", "Weather in Lima please.",
           "Tell me the temperature in Sydney.", "Get one seat from Boston to Denver.",
           "Is it cold in Moscow today?", "Find a flight for 3 from Delhi to Dubai."]


def _sdk(aloop, cluster):
    """An OpenAI client of a router over the cluster; the router stopped when the client is done."""
    router = build_router(cluster, RouterConfig(port=0, http_port=0, served_model_name=MODEL))
    aloop.run(router.start())
    try:
        yield openai.OpenAI(base_url=f"http://127.0.0.1:{router.http_port}/v1", api_key="unused", max_retries=0,
                            timeout=300)
    finally:
        aloop.run(router.stop(grace=5))


@pytest.fixture(scope="module")
def sdk(aloop, smol_1p1d):
    """A router over the shared 1P1D cluster: the tool calls' path through a prefill and a decode worker."""
    yield from _sdk(aloop, smol_1p1d)


@pytest.fixture(scope="module")
def colocated_sdk(aloop, smol_colocated):
    """A router over the shared colocated worker (conftest.smol_colocated): a forced call's grammar on the one
    worker that prefills and decodes (the router's side is the same as over 1P1D, so the long tests run there
    alone)."""
    yield from _sdk(aloop, smol_colocated)


def ask(sdk, stream: bool, **kw):
    """One choice, whole or gathered by the SDK's stream helper from the deltas."""
    if not stream:
        return sdk.chat.completions.create(model=MODEL, **kw).choices[0]
    with sdk.chat.completions.stream(model=MODEL, **kw) as s:
        return s.get_final_completion().choices[0]


def gathered(sdk, **kw) -> tuple[str | None, str | None, list[tuple[str, str]]]:
    """(finish reason, content, calls) of a streamed reply, its deltas gathered as the SDK's helper does (which
    refuses a reply cut by max_tokens): content concatenated, a call's parts by its index."""
    finish, content, calls = None, None, {}
    for chunk in sdk.chat.completions.create(model=MODEL, stream=True, **kw):
        delta = chunk.choices[0].delta
        if delta.content:
            content = (content or "") + delta.content
        for c in delta.tool_calls or ():
            name, args = calls.get(c.index, ("", ""))
            calls[c.index] = (name + (c.function.name or ""), args + (c.function.arguments or ""))
        finish = chunk.choices[0].finish_reason or finish
    return finish, content, [calls[i] for i in sorted(calls)]


def valid_calls(choice, names: set[str]) -> list[tuple[str, dict]]:
    assert choice.finish_reason == "tool_calls", (choice.finish_reason, choice.message.content)
    calls = choice.message.tool_calls
    assert calls, choice.message.content
    out = []
    for call in calls:
        assert call.type == "function" and call.id.startswith("call_") and call.function.name in names
        args = json.loads(call.function.arguments)
        jsonschema.validate(args, SCHEMAS[call.function.name])
        out.append((call.function.name, args))
    return out


def test_required_calls_validate_ten_of_ten(sdk):
    """The ten prompts whole and streamed, all twenty at once (the workers batch them): greedy, so each prompt's
    streamed reply gathers to its whole one."""
    def one(job: tuple[str, bool]):
        prompt, stream = job
        # Room for MAX_FORCED_CALLS calls: greedy SmolLM2 goes on to the bound (router.chat_tools).
        return ask(sdk, stream, messages=[{"role": "user", "content": prompt}], tools=TOOLS, tool_choice="required",
                   max_tokens=240, temperature=0.0)

    jobs = [(p, stream) for stream in (False, True) for p in PROMPTS]
    with ThreadPoolExecutor(len(jobs)) as pool:
        choices = list(pool.map(one, jobs))
    for choice in choices:
        valid_calls(choice, set(SCHEMAS))
        assert choice.message.content is None
    whole, streamed = choices[:len(PROMPTS)], choices[len(PROMPTS):]
    assert [[(c.function.name, json.loads(c.function.arguments)) for c in ch.message.tool_calls] for ch in whole] == \
        [[(c.function.name, json.loads(c.function.arguments)) for c in ch.message.tool_calls] for ch in streamed]


@pytest.mark.usefixtures("smol_colocated")  # reached through colocated_sdk, by name below
@pytest.mark.parametrize("shape", ["1p1d", "colocated"])
@pytest.mark.parametrize("stream", [False, True], ids=["whole", "streamed"])
def test_named_function_and_one_call(request, shape, stream):
    sdk = request.getfixturevalue("sdk" if shape == "1p1d" else "colocated_sdk")
    named = {"type": "function", "function": {"name": "book_flight"}}
    choice = ask(sdk, stream, messages=[{"role": "user", "content": PROMPTS[2]}], tools=TOOLS, tool_choice=named,
                 max_tokens=120, temperature=0.0)
    assert [n for n, _ in valid_calls(choice, {"book_flight"})] == ["book_flight"]
    choice = ask(sdk, stream, messages=[{"role": "user", "content": PROMPTS[0]}], tools=TOOLS, tool_choice="required",
                 parallel_tool_calls=False, max_tokens=120, temperature=0.0)
    assert len(valid_calls(choice, set(SCHEMAS))) == 1


def test_auto_streamed_equals_whole_and_a_tool_answer_is_rendered(sdk):
    """tool_choice auto (free text read for Hermes calls): greedy, the stream gathers what the whole reply has.
    Then the conversation goes on with the assistant's call and the tool's answer: the prompt counts the
    rendered turns (more tokens than without them) and the model answers."""
    first = [{"role": "user", "content": PROMPTS[0]}]
    whole = ask(sdk, False, messages=first, tools=TOOLS, max_tokens=80, temperature=0.0)
    calls = [(c.function.name, c.function.arguments) for c in whole.message.tool_calls or ()]
    assert gathered(sdk, messages=first, tools=TOOLS, max_tokens=80, temperature=0.0) == \
        (whole.finish_reason, whole.message.content, calls)
    turns = first + [
        {"role": "assistant", "content": None, "tool_calls": [{"id": "call_0123456789abcdefghijklmn", "type": "function",
                                                               "function": {"name": "get_weather",
                                                                            "arguments": '{"city": "Paris", "unit": "celsius"}'}}]},
        {"role": "tool", "tool_call_id": "call_0123456789abcdefghijklmn", "content": '{"temperature": 18, "sky": "sunny"}'}]
    short = sdk.chat.completions.create(model=MODEL, messages=first, tools=TOOLS, max_tokens=1, temperature=0.0)
    reply = sdk.chat.completions.create(model=MODEL, messages=turns, tools=TOOLS, max_tokens=40, temperature=0.0)
    assert reply.usage.prompt_tokens > short.usage.prompt_tokens + 30
    assert reply.choices[0].message.content or reply.choices[0].message.tool_calls
