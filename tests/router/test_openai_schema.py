"""The OpenAI request bodies alone (router.openai_schema), no cluster: what each turns into (one Ask per prompt,
echo's prompt logprobs, max_tokens 0) and which fields it declares."""
from __future__ import annotations

import typing

import openai
import pytest
from pydantic import ValidationError

from router.config import MAX_PROMPTS
from router.openai_schema import NOT_SUPPORTED, ChatCompletionRequest, CompletionRequest, unknown_field


def test_a_list_of_prompts_is_one_ask_each():
    body = CompletionRequest(model="m", prompt=[[1, 2], [3]], n=2, temperature=0.5)
    asks = body.asks()
    assert [(a.token_ids, a.prompt, a.prompts) for a in asks] == [([1, 2], None, 2), ([3], None, 2)]
    assert all(a.sampling["n"] == 2 and a.sampling["temperature"] == 0.5 for a in asks)
    assert asks[0].sampling is not asks[1].sampling
    texts = CompletionRequest(model="m", prompt=["a", "b", "c"]).asks()
    assert [a.prompt for a in texts] == ["a", "b", "c"] and all(a.token_ids is None for a in texts)
    assert [(a.prompt, a.token_ids) for a in CompletionRequest(model="m", prompt=[5, 6]).asks()] == [(None, [5, 6])]
    too_many = CompletionRequest(model="m", prompt=[[1]] * (MAX_PROMPTS + 1))
    assert [f for f, _ in too_many.refused()] == ["prompt"]


def test_echo_asks_for_the_prompts_logprobs_and_max_tokens_0_for_the_prompt_alone():
    ask = CompletionRequest(model="m", prompt="x", echo=True, logprobs=3, prompt_logprobs=1, max_tokens=0).asks()[0]
    assert ask.sampling["prompt_logprobs"] == 3 and ask.sampling["max_tokens"] == 1 and ask.prompt_only
    plain = CompletionRequest(model="m", prompt="x", echo=True, max_tokens=4).asks()[0]
    assert plain.sampling["prompt_logprobs"] is None and not plain.prompt_only
    assert [f for f, _ in CompletionRequest(model="m", prompt="x", max_tokens=0).refused()] == ["max_tokens"]


def test_undeclared_fields_are_refused():
    with pytest.raises(ValidationError) as e:
        CompletionRequest(model="m", prompt="x", frobnicate=3)
    assert e.value.errors()[0]["type"] == "extra_forbidden"
    assert unknown_field("frobnicate").startswith("frobnicate is not a field")
    assert unknown_field("audio") == "audio: only text output is supported"


@pytest.mark.parametrize("body,params_type", [
    (CompletionRequest, openai.types.CompletionCreateParams),
    (ChatCompletionRequest, openai.types.chat.CompletionCreateParams)], ids=["completions", "chat"])
def test_every_sdk_field_is_declared_or_named_as_not_supported(body, params_type):
    fields = {name for member in typing.get_args(params_type) for name in typing.get_type_hints(member)}
    assert fields - set(body.model_fields) - set(NOT_SUPPORTED) == set()
