#!/usr/bin/env python3
"""The official `anthropic` Python package as a real client of `ferry serve`'s Messages API on the bundled tiny
checkpoint: `messages.create` and `messages.stream` give the same message at temperature 0, `count_tokens` counts the
prompt that generation consumes (as many tokens as the tokenizer, the `tokenizers` package, makes of the rendered
prompt), stop sequences end with `stop_sequence`, `messages.parse` with an `output_format` type gets an answer of that
type (structured outputs, after the model's thinking), and errors come back as the SDK's typed errors (so their status and
Anthropic shape are right). On the scripted XML checkpoint (Qwen3.5-style), `tool_use` blocks plain and streamed,
under `tool_choice` auto, any and a named tool, and the history of calls and results counted and answered.
Run by scripts/test.sh after the Rust tests: python scripts/anthropic_client_test.py path/to/ferry
"""

import os

from typing import Literal

import anthropic
import pydantic
import tokenizers

from openai_client_test import FIXTURE, KEY, MODEL, XML_FIXTURE, Server, run_tests


def client(server, key=KEY):
    return anthropic.Anthropic(base_url=server.base, api_key=key, max_retries=0, timeout=120)


# Anthropic's SDK no longer has a `temperature` argument; the API still takes the field.
GREEDY = {"extra_body": {"temperature": 0}}


def user(content):
    return [{"role": "user", "content": content}]


def blocks(message):
    """A message's content as (type, text) pairs."""
    return [(b.type, b.thinking if b.type == "thinking" else b.text) for b in message.content]


def prompt_tokens(usage):
    """The prompt's tokens: Anthropic's usage counts those read from the cache apart from `input_tokens`."""
    return usage.input_tokens + (usage.cache_read_input_tokens or 0)


def test_create_and_stream_agree(server):
    kwargs = dict(model=MODEL, max_tokens=24, messages=user("Tell me about ferries."), **GREEDY)
    whole = client(server).messages.create(**kwargs)
    assert whole.type == "message" and whole.role == "assistant", whole
    assert whole.stop_reason == "max_tokens", whole.stop_reason
    assert whole.usage.output_tokens == 24, whole.usage
    with client(server).messages.stream(**kwargs) as stream:
        text = "".join(stream.text_stream)
        final = stream.get_final_message()
    assert blocks(final) == blocks(whole), (blocks(final), blocks(whole))
    assert text == "".join(t for kind, t in blocks(whole) if kind == "text")
    assert final.stop_reason == "max_tokens"
    assert final.usage.output_tokens == 24 and prompt_tokens(final.usage) == prompt_tokens(whole.usage)
    # The same prompt again: its full blocks come from the prefix cache, which Anthropic counts apart.
    assert final.usage.cache_read_input_tokens > 0, final.usage


def test_a_prefill_is_continued(server):
    prefill = user("Tell me about ferries.") + [{"role": "assistant", "content": "Ferries are"}]
    kwargs = dict(model=MODEL, max_tokens=8, messages=prefill, **GREEDY)
    whole = client(server).messages.create(**kwargs)
    with client(server).messages.stream(**kwargs) as stream:
        text = "".join(stream.text_stream)
    assert text == "".join(t for kind, t in blocks(whole) if kind == "text") != "", (text, blocks(whole))
    fresh = client(server).messages.create(**{**kwargs, "messages": user("Tell me about ferries.")})
    assert blocks(fresh) != blocks(whole), "the prefill changed nothing"
    counted = client(server).messages.count_tokens(model=MODEL, messages=prefill)
    assert counted.input_tokens == prompt_tokens(whole.usage), (counted, whole.usage)


def test_count_tokens_counts_the_prompt(server):
    messages = user("How many tokens is this?")
    counted = client(server).messages.count_tokens(model=MODEL, messages=messages, system="Be brief.")
    made = client(server).messages.create(model=MODEL, max_tokens=1, messages=messages, system="Be brief.")
    assert counted.input_tokens == prompt_tokens(made.usage) > 0, (counted, made.usage)
    # The fixture's Qwen3 template renders the conversation so (its template reference tests hold it to transformers).
    rendered = (
        "<|im_start|>system\nBe brief.<|im_end|>\n<|im_start|>user\nHow many tokens is this?<|im_end|>\n"
        "<|im_start|>assistant\n"
    )
    tokenizer = tokenizers.Tokenizer.from_file(os.path.join(FIXTURE, "tokenizer.json"))
    assert counted.input_tokens == len(tokenizer.encode(rendered, add_special_tokens=False).ids), counted


def test_a_stop_sequence_ends_the_message(server):
    kwargs = dict(model=MODEL, max_tokens=24, messages=user("Tell me about ferries."), **GREEDY)
    whole = client(server).messages.create(**kwargs)
    text = "".join(t for _, t in blocks(whole))
    stop = text[len(text) // 2 :][:3]
    assert stop.strip(), text
    cut = client(server).messages.create(stop_sequences=[stop], **kwargs)
    assert cut.stop_reason == "stop_sequence" and cut.stop_sequence == stop, cut
    assert cut.usage.output_tokens < 24


class Reply(pydantic.BaseModel):
    answer: Literal["yes", "no"]
    sure: bool


def test_parse_gets_the_output_format_s_type(server):
    # A thinking budget ends the random model's thinking; the JSON follows it.
    parsed = client(server).messages.parse(
        model=MODEL, max_tokens=80, messages=user("Yes or no, and are you sure?"), output_format=Reply,
        thinking={"type": "enabled", "budget_tokens": 8}, **GREEDY,
    )
    assert parsed.stop_reason == "end_turn", parsed
    assert [kind for kind, _ in blocks(parsed)] == ["thinking", "text"], parsed
    assert isinstance(parsed.parsed_output, Reply), parsed


def expect(error_type, call):
    try:
        call()
    except error_type as error:
        return error
    raise AssertionError(f"expected {error_type.__name__}")


def test_errors_are_the_sdk_s_typed_errors(server):
    ok = dict(model=MODEL, max_tokens=4, messages=user("hi"))
    expect(anthropic.AuthenticationError, lambda: client(server, "wrong").messages.create(**ok))
    expect(anthropic.NotFoundError, lambda: client(server).messages.create(**{**ok, "model": "claude-x"}))
    image = {"type": "image", "source": {"type": "base64", "media_type": "image/png", "data": "AA=="}}
    error = expect(anthropic.BadRequestError, lambda: client(server).messages.create(**{**ok, "messages": user([image])}))
    assert error.body["type"] == "error" and error.body["error"]["type"] == "invalid_request_error", error.body
    assert "text-only" in error.body["error"]["message"], error.body


WEATHER_TOOL = {
    "name": "get_weather",
    "description": "The weather forecast for a city.",
    "input_schema": {
        "type": "object",
        "properties": {"city": {"type": "string"}, "days": {"type": "integer"}},
        "required": ["city"],
    },
}
# What the scripted XML checkpoint calls, whatever it is asked ("3" read as an integer, as the schema says).
SCRIPTED_CALLS = [("get_weather", {"city": "Paris", "days": 3}), ("get_weather", {"city": "Oslo"})]


def tool_uses(message):
    return [(b.name, b.input) for b in message.content if b.type == "tool_use"]


def test_tool_use_blocks_plain_and_streamed(ferry):
    server = Server(ferry, fixture=XML_FIXTURE)
    try:
        question = user("What is the weather in Paris and Oslo?")
        kwargs = dict(model=MODEL, max_tokens=200, messages=question, tools=[WEATHER_TOOL], **GREEDY)
        named = {"type": "tool", "name": "get_weather", "disable_parallel_tool_use": True}
        for choice, expected in (({"type": "auto"}, SCRIPTED_CALLS), ({"type": "any"}, SCRIPTED_CALLS), (named, SCRIPTED_CALLS[:1])):
            whole = client(server).messages.create(tool_choice=choice, **kwargs)
            assert whole.stop_reason == "tool_use" and tool_uses(whole) == expected, (choice, whole)
            assert all(b.id.startswith("toolu_") for b in whole.content if b.type == "tool_use"), whole
            assert [b.type for b in whole.content] == ["thinking"] + ["tool_use"] * len(expected), whole
            with client(server).messages.stream(tool_choice=choice, **kwargs) as stream:
                final = stream.get_final_message()
            assert final.stop_reason == "tool_use" and tool_uses(final) == expected, (choice, final)

        # The calls and their results go back in the history, as an agent sends them; count_tokens counts it.
        whole = client(server).messages.create(**kwargs)
        results = [
            {"type": "tool_result", "tool_use_id": b.id, "content": "sunny"} for b in whole.content if b.type == "tool_use"
        ]
        history = question + [
            {"role": "assistant", "content": [b.model_dump(exclude_none=True) for b in whole.content]},
            {"role": "user", "content": results},
        ]
        counted = client(server).messages.count_tokens(model=MODEL, messages=history, tools=[WEATHER_TOOL])
        again = client(server).messages.create(**{**kwargs, "messages": history})
        assert counted.input_tokens == prompt_tokens(again.usage) > prompt_tokens(whole.usage), (counted, again.usage)
    finally:
        server.stop()


def main():
    run_tests(anthropic, [(name, fn) for name, fn in globals().items() if name.startswith("test_")])

if __name__ == "__main__":
    main()
