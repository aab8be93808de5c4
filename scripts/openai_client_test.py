#!/usr/bin/env python3
"""The official `openai` Python package as a real client of `ferry serve` on the bundled tiny checkpoint.

Checks what a user of the SDK relies on: plain and streamed results are equal at temperature 0, 8 concurrent
requests each get what they get alone, a client that hangs up mid-stream frees its KV (seen on /metrics), stop
strings and seeds work, and every error case comes back as the SDK's typed error with the right status.
Tool calls: the scripted checkpoints (scripts/make_tool_call_fixtures.py) write a Hermes call (Qwen3-style), two
XML calls (Qwen3.5-style), a GLM-4.5 call and a Harmony call after Harmony reasoning (gpt-oss-style) whatever the
prompt; the SDK must get them as `tool_calls`, plain and streamed, and `tool_choice` "required" or a named function
must force calls in the Hermes and XML formats (the XML script's own, which it writes unforced) and be a 400 in the
formats ferry has no grammar for.
Run by scripts/test.sh after the Rust tests: python scripts/openai_client_test.py path/to/ferry
"""

import concurrent.futures
import inspect
import json
import os
import re
import subprocess
import sys
import threading
import time
import traceback

import urllib.error
import urllib.request

import openai
from openai import OpenAI

def http(method, url, body=None, key=None):
    """(status, body text) of a plain HTTP request: the standard library, so the test needs only the SDK."""
    request = urllib.request.Request(url, data=body, method=method)
    if key:
        request.add_header("Authorization", f"Bearer {key}")
    if body is not None:
        request.add_header("Content-Type", "application/json")
    try:
        with urllib.request.urlopen(request, timeout=60) as response:
            return response.status, response.read().decode()
    except urllib.error.HTTPError as error:
        return error.code, error.read().decode()
    except urllib.error.URLError:
        return None, ""


ROOT = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..")
FIXTURE = os.path.join(ROOT, "tests/fixtures/qwen3_moe")
HERMES_FIXTURE = os.path.join(ROOT, "tests/fixtures/tool_calls_hermes")
XML_FIXTURE = os.path.join(ROOT, "tests/fixtures/tool_calls_qwen3_xml")
HARMONY_FIXTURE = os.path.join(ROOT, "tests/fixtures/tool_calls_harmony")
GLM_FIXTURE = os.path.join(ROOT, "tests/fixtures/tool_calls_glm")
KEY = "sdk-test-key"
MODEL = "tiny"


class Server:
    """A `ferry serve` process on a free port."""

    def __init__(self, ferry, *extra, fixture=FIXTURE):
        self.process = subprocess.Popen(
            [ferry, "serve", "--model", fixture, "--port", "0", "--served-model-name", MODEL, "--api-key", KEY, *extra],
            stderr=subprocess.PIPE,
            text=True,
            env={**os.environ, "NO_COLOR": "1"},
        )
        self.log = []
        address = None
        deadline = time.time() + 60
        while address is None and time.time() < deadline:
            line = self.process.stderr.readline()
            if not line:
                break
            self.log.append(line)
            match = re.search(r"listening on http://(\S+)", line)
            address = match and match.group(1)
        if address is None:
            raise RuntimeError("ferry serve did not start:\n" + "".join(self.log))
        threading.Thread(target=self._drain, daemon=True).start()
        self.base = f"http://{address}"
        while http("GET", self.base + "/health")[0] != 200:
            if time.time() > deadline:
                raise RuntimeError("ferry serve never became ready")
            time.sleep(0.02)
        self.client = OpenAI(base_url=self.base + "/v1", api_key=KEY, max_retries=0, timeout=120)

    def _drain(self):
        for line in self.process.stderr:
            self.log.append(line)

    def metric(self, name, default=None):
        """A sample from /metrics (`name` with its labels); `default` when a counter was never incremented."""
        text = http("GET", self.base + "/metrics", key=KEY)[1]
        for line in text.splitlines():
            if line.startswith(name + " "):
                return float(line.split()[-1])
        if default is None:
            raise AssertionError(f"no {name} in /metrics")
        return default

    def stop(self):
        self.process.terminate()
        try:
            self.process.wait(timeout=10)
        except subprocess.TimeoutExpired:
            self.process.kill()


def chat(content):
    return [{"role": "user", "content": content}]


def streamed_chat(client, **kwargs):
    """Content, reasoning, finish reason and usage gathered from a streamed chat completion."""
    content, reasoning, finish, usage = "", "", None, None
    for chunk in client.chat.completions.create(stream=True, stream_options={"include_usage": True}, **kwargs):
        if chunk.usage is not None:
            usage = chunk.usage
        for choice in chunk.choices:
            content += choice.delta.content or ""
            reasoning += (choice.delta.model_extra or {}).get("reasoning_content") or ""
            finish = choice.finish_reason or finish
    return content, reasoning, finish, usage


def test_plain_and_streamed_chat_agree(server):
    kwargs = dict(model=MODEL, messages=chat("Tell me about ferries."), max_tokens=32, temperature=0)
    whole = server.client.chat.completions.create(**kwargs)
    message = whole.choices[0].message
    content, reasoning, finish, usage = streamed_chat(server.client, **kwargs)
    assert content == (message.content or ""), (content, message.content)
    assert reasoning == ((message.model_extra or {}).get("reasoning_content") or "")
    assert finish == whole.choices[0].finish_reason == "length"
    assert usage.completion_tokens == whole.usage.completion_tokens == 32
    assert usage.prompt_tokens == whole.usage.prompt_tokens > 0


def test_plain_and_streamed_text_completions_agree(server):
    kwargs = dict(model=MODEL, prompt="The quick brown fox", max_tokens=16, temperature=0)
    whole = server.client.completions.create(**kwargs)
    streamed = "".join(c.choices[0].text for c in server.client.completions.create(stream=True, **kwargs) if c.choices)
    assert streamed == whole.choices[0].text
    assert whole.usage.completion_tokens == 16


def test_eight_concurrent_requests_get_what_they_get_alone(server):
    prompts = [f"Question number {i}: what is {i} + {i}?" for i in range(8)]

    def ask(prompt):
        r = server.client.chat.completions.create(model=MODEL, messages=chat(prompt), max_tokens=24, temperature=0)
        return r.choices[0].message.content

    alone = [ask(p) for p in prompts]
    with concurrent.futures.ThreadPoolExecutor(8) as pool:
        together = list(pool.map(ask, prompts))
    assert together == alone


def test_a_client_that_hangs_up_frees_its_kv(server):
    stream = server.client.chat.completions.create(
        model=MODEL, messages=chat("Go on and on."), max_tokens=3000, temperature=0, stream=True
    )
    chunks = iter(stream)
    next(chunks), next(chunks)
    deadline = time.time() + 20
    while server.metric("ferry_kv_blocks_used") == 0 or server.metric("ferry_decode_tokens_per_second") == 0:
        assert time.time() < deadline, "no KV in use or no decode speed while streaming"
        time.sleep(0.01)
    stream.close()
    while server.metric("ferry_kv_blocks_used") > 0:
        assert time.time() < deadline, "KV not freed after the client hung up"
        time.sleep(0.02)
    assert server.metric("ferry_running_requests") == 0
    assert server.metric("ferry_decode_tokens_per_second") == 0, "an idle engine decodes nothing"


def test_a_client_that_times_out_on_a_plain_request_frees_its_kv_too(server):
    cancelled = 'ferry_requests_total{outcome="cancelled"}'
    cancelled_before = server.metric(cancelled, default=0)
    impatient = OpenAI(base_url=server.base + "/v1", api_key=KEY, max_retries=0, timeout=0.5)
    try:
        impatient.chat.completions.create(
            model=MODEL, messages=chat("Go on and on."), max_tokens=3000, temperature=0, extra_body={"ignore_eos": True}
        )
        raise AssertionError("3000 tokens in half a second")
    except openai.APITimeoutError:
        pass
    deadline = time.time() + 20
    while server.metric("ferry_kv_blocks_used") > 0 or server.metric("ferry_running_requests") > 0:
        assert time.time() < deadline, "KV not freed after the client gave up"
        time.sleep(0.02)
    assert server.metric(cancelled) == cancelled_before + 1, "the request ran on instead of being cancelled"


def test_echo_scores_the_prompt_as_lm_eval_reads_it(server):
    # lm-eval's loglikelihood: the context and continuation as token ids, echoed with logprobs, one token generated.
    context = server.client.completions.create(model=MODEL, prompt="The quick brown fox", max_tokens=4, temperature=0,
                                               logprobs=1, extra_body={"return_token_ids": True})
    ids = context.choices[0].model_extra["prompt_token_ids"] + context.choices[0].model_extra["token_ids"]
    scored = server.client.completions.create(model=MODEL, prompt=ids, max_tokens=1, temperature=0, echo=True,
                                              logprobs=1)
    logprobs = scored.choices[0].logprobs
    assert len(logprobs.tokens) == len(ids) + 1 and logprobs.token_logprobs[0] is None, logprobs
    continuation = logprobs.token_logprobs[len(ids) - 4:len(ids)]
    assert continuation == context.choices[0].logprobs.token_logprobs, (continuation, context.choices[0].logprobs)
    assert scored.choices[0].text == "".join(logprobs.tokens)


def test_stop_strings_cut_the_output(server):
    kwargs = dict(model=MODEL, prompt="The quick brown fox", max_tokens=16, temperature=0)
    full = server.client.completions.create(**kwargs).choices[0].text
    words = full.split()
    assert len(words) >= 3, full
    stop = words[2]
    cut = server.client.completions.create(stop=[stop], **kwargs).choices[0]
    assert cut.finish_reason == "stop"
    assert cut.text == full[: full.index(stop)], (cut.text, full, stop)


def test_a_seed_repeats_a_sampled_answer(server):
    kwargs = dict(model=MODEL, messages=chat("Surprise me."), max_tokens=16, temperature=1.0, top_p=0.9, extra_body={"top_k": 50})
    first = server.client.chat.completions.create(seed=7, **kwargs).choices[0].message.content
    again = server.client.chat.completions.create(seed=7, **kwargs).choices[0].message.content
    assert first == again


def test_n_choices_plain_and_streamed(server):
    kwargs = dict(model=MODEL, messages=chat("Surprise me."), max_tokens=8, temperature=1.0, seed=11, n=3)
    whole = server.client.chat.completions.create(**kwargs)
    assert [c.index for c in whole.choices] == [0, 1, 2]
    alone = server.client.chat.completions.create(**{**kwargs, "n": 1, "seed": 12})
    assert whole.choices[1].message.content == alone.choices[0].message.content
    contents = ["", "", ""]
    for chunk in server.client.chat.completions.create(stream=True, **kwargs):
        for choice in chunk.choices:
            contents[choice.index] += choice.delta.content or ""
    assert contents == [c.message.content for c in whole.choices]


def test_penalties_and_template_kwargs_are_accepted(server):
    r = server.client.chat.completions.create(
        model=MODEL,
        messages=chat("hi"),
        max_tokens=8,
        temperature=0,
        presence_penalty=1.5,
        frequency_penalty=1.5,
        extra_body={"chat_template_kwargs": {"enable_thinking": False}},
    )
    assert r.choices[0].finish_reason in ("stop", "length")
    assert not (r.choices[0].message.model_extra or {}).get("reasoning_content")


def expect_error(status, call, param=None, code=None):
    try:
        call()
    except openai.APIStatusError as e:
        assert e.status_code == status, (e.status_code, e.body)
        assert isinstance(e.body, dict) and e.body.get("message"), e.body
        if param is not None:
            assert e.body.get("param") == param, e.body
        if code is not None:
            assert e.body.get("code") == code, e.body
        return e
    raise AssertionError(f"expected an error {status}")


def test_every_bad_request_is_an_openai_error(server):
    c = server.client.chat.completions
    ok = dict(model=MODEL, messages=chat("hi"))
    expect_error(400, lambda: c.create(n=0, **ok), param="n")
    expect_error(400, lambda: c.create(max_tokens=-1, **ok), param="max_tokens")
    expect_error(400, lambda: c.create(max_completion_tokens=0, **ok), param="max_completion_tokens")
    expect_error(400, lambda: c.create(temperature=-0.5, **ok), param="temperature")
    expect_error(400, lambda: c.create(top_p=1.5, **ok), param="top_p")
    expect_error(400, lambda: c.create(frequency_penalty=3, **ok), param="frequency_penalty")
    expect_error(400, lambda: c.create(model=MODEL, messages=[]), param="messages")
    expect_error(400, lambda: c.create(model=MODEL, messages=[{"role": "user", "content": 5}]), param="messages[0].content")
    expect_error(400, lambda: c.create(extra_body={"temperature": "warm"}, **ok), param="temperature")
    long = expect_error(400, lambda: c.create(model=MODEL, messages=chat("ferry " * 5000)), code="context_length_exceeded")
    assert "4096" in long.body["message"], long.body
    expect_error(404, lambda: c.create(model="gpt-4", messages=chat("hi")), code="model_not_found")
    wrong_key = OpenAI(base_url=server.base + "/v1", api_key="wrong", max_retries=0)
    expect_error(401, lambda: wrong_key.chat.completions.create(**ok))
    status, text = http("POST", server.base + "/v1/chat/completions", body=b'{"messages": [', key=KEY)
    assert status == 400 and json.loads(text)["error"]["type"] == "invalid_request_error", text
    assert http("GET", server.base + "/health")[0] == 200, "still serving"


def test_a_full_queue_is_a_503(ferry):
    server = Server(ferry, "--max-running-requests", "1", "--max-queued-requests", "0")
    try:
        stream = server.client.chat.completions.create(
            model=MODEL, messages=chat("Go on."), max_tokens=3000, temperature=0, stream=True
        )
        next(iter(stream))
        expect_error(503, lambda: server.client.chat.completions.create(model=MODEL, messages=chat("me too")), code="queue_full")
        stream.close()
    finally:
        server.stop()


WEATHER_TOOL = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "The weather forecast for a city.",
        "parameters": {
            "type": "object",
            "properties": {"city": {"type": "string"}, "days": {"type": "integer"}},
            "required": ["city"],
        },
    },
}
WEATHER_QUESTION = chat("What is the weather in Paris and Oslo?")


def streamed_tool_calls(client, **kwargs):
    """Content, reasoning, finish reason and tool calls [(id, name, arguments)] gathered from streamed deltas, each
    delta checked against OpenAI's shape (a call's first delta: index, id, type, name, arguments "")."""
    content, reasoning, finish, calls = "", "", None, []
    for chunk in client.chat.completions.create(stream=True, **kwargs):
        for choice in chunk.choices:
            content += choice.delta.content or ""
            reasoning += (choice.delta.model_extra or {}).get("reasoning_content") or ""
            finish = choice.finish_reason or finish
            for call in choice.delta.tool_calls or []:
                if call.index == len(calls):
                    assert call.id and call.type == "function" and call.function.name, call
                    assert call.function.arguments == "", call
                    calls.append([call.id, call.function.name, ""])
                else:
                    assert call.index == len(calls) - 1 and call.id is None and call.function.name is None, call
                    calls[call.index][2] += call.function.arguments
    return content, reasoning, finish, [tuple(c) for c in calls]


def plain_tool_calls(message):
    return [(c.id, c.function.name, c.function.arguments) for c in message.tool_calls or []]


# The weather tool with its city listed: forced greedy output cannot run on in a free string.
FORCED_WEATHER_TOOL = {
    "type": "function",
    "function": {
        **WEATHER_TOOL["function"],
        "parameters": {
            "type": "object",
            "properties": {
                "city": {"type": "string", "enum": ["Paris", "Oslo"]},
                "days": {"type": "integer", "minimum": 1, "maximum": 9},
            },
            "required": ["city"],
            "additionalProperties": False,
        },
    },
}


def check_forced_tool_calls(client, reasoning, unforced_calls, same_as_unforced):
    """`tool_choice` "required" and a named function give one call of the weather tool (parallel calls off), plain
    and streamed alike, after the model's thinking and with no content; `same_as_unforced`: the call is the model's
    first unforced one (a script the grammar allows as it is)."""
    kwargs = dict(
        model=MODEL, messages=WEATHER_QUESTION, tools=[FORCED_WEATHER_TOOL], temperature=0, parallel_tool_calls=False
    )
    named = {"type": "function", "function": {"name": "get_weather"}}
    for choice in ("required", named):
        forced = client.chat.completions.create(tool_choice=choice, **kwargs).choices[0]
        assert forced.finish_reason == "tool_calls" and forced.message.content is None, forced
        assert (forced.message.model_extra or {}).get("reasoning_content") == reasoning, forced.message
        calls = plain_tool_calls(forced.message)
        assert len(calls) == 1 and calls[0][1] == "get_weather", calls
        assert json.loads(calls[0][2])["city"] in ("Paris", "Oslo"), calls
        if same_as_unforced:
            assert calls[0][1:] == unforced_calls[0][1:], (calls, unforced_calls)
        content, streamed_reasoning, finish, streamed = streamed_tool_calls(client, tool_choice=choice, **kwargs)
        assert (content, streamed_reasoning, finish) == ("", reasoning, "tool_calls")
        assert [c[1:] for c in streamed] == [c[1:] for c in calls], (streamed, calls)


def check_tool_calls(
    fixture, ferry, content, reasoning, expected_arguments, forced_as_unforced, unparsed_markup="<tool_call>"
):
    """Plain and streamed requests against a scripted checkpoint get the same calls, content and reasoning.
    `forced_as_unforced`: see check_forced_tool_calls.
    `unparsed_markup`: what the content shows of a call when no tools are offered (Harmony: nothing, the call is a
    message to no known tool, which stays reasoning)."""
    server = Server(ferry, fixture=fixture)
    try:
        kwargs = dict(model=MODEL, messages=WEATHER_QUESTION, tools=[WEATHER_TOOL])
        whole = server.client.chat.completions.create(**kwargs)
        choice = whole.choices[0]
        assert choice.finish_reason == "tool_calls", choice
        assert choice.message.content == content, choice.message
        assert (choice.message.model_extra or {}).get("reasoning_content") == reasoning, choice.message
        calls = plain_tool_calls(choice.message)
        assert [(name, json.loads(arguments)) for _, name, arguments in calls] == [
            ("get_weather", arguments) for arguments in expected_arguments
        ], calls
        assert all(call_id.startswith("call_") for call_id, _, _ in calls) and len({c[0] for c in calls}) == len(calls)

        streamed_content, streamed_reasoning, finish, streamed_calls = streamed_tool_calls(server.client, **kwargs)
        assert finish == "tool_calls"
        assert streamed_content == (content or "") and streamed_reasoning == reasoning
        assert [c[1:] for c in streamed_calls] == [c[1:] for c in calls], (streamed_calls, calls)

        # The SDK's own stream helper accumulates the deltas into the same completion.
        with server.client.chat.completions.stream(**kwargs) as stream:
            final = stream.get_final_completion()
        assert [c[1:] for c in plain_tool_calls(final.choices[0].message)] == [c[1:] for c in calls]

        # The calls and their results go back in the history, as an agent sends them.
        history = WEATHER_QUESTION + [
            choice.message.model_dump(exclude_none=True, include={"role", "content", "tool_calls"}),
            *({"role": "tool", "tool_call_id": call_id, "content": "sunny"} for call_id, _, _ in calls),
        ]
        again = server.client.chat.completions.create(model=MODEL, messages=history, tools=[WEATHER_TOOL])
        assert again.usage.prompt_tokens > whole.usage.prompt_tokens

        # tool_choice "none": no calls come back (the scripted model writes its markup anyway: it is content).
        none = server.client.chat.completions.create(tool_choice="none", **kwargs).choices[0]
        assert none.message.tool_calls is None and none.finish_reason == "stop", none
        if unparsed_markup:
            assert unparsed_markup in none.message.content
        else:
            assert not none.message.content and '"city"' in none.message.model_extra["reasoning_content"], none
        check_forced_tool_calls(server.client, reasoning, calls, forced_as_unforced)
        return server.client.chat.completions.create(parallel_tool_calls=False, **kwargs).choices[0].message
    finally:
        server.stop()


def test_hermes_tool_calls_plain_and_streamed(ferry):
    # Forced, the script's "Let me check." before its call is not allowed: the model writes another call.
    check_tool_calls(
        HERMES_FIXTURE, ferry, "Let me check.", "\nThe user wants the weather.\n", [{"city": "Paris", "days": 3}], False
    )


def test_xml_tool_calls_plain_and_streamed(ferry):
    # "3" in the XML is the integer 3: the tool's schema says `days` is an integer.
    one_call = check_tool_calls(
        XML_FIXTURE, ferry, None, "Two cities, two calls.\n", [{"city": "Paris", "days": 3}, {"city": "Oslo"}], True
    )
    assert len(one_call.tool_calls) == 1, "parallel_tool_calls=False keeps the first call"


def test_glm_tool_call_plain_and_streamed(ferry):
    check_tool_calls(GLM_FIXTURE, ferry, None, "The user wants the weather.", [{"city": "Paris", "days": 3}], True)


def test_harmony_reasoning_and_tool_call_plain_and_streamed(ferry):
    # A gpt_oss model. Forced, the script's second header (one plain token spelling the markup, as each scripted token
    # predicts one next token) is not allowed where the grammar wants Harmony's special tokens: the call is another.
    check_tool_calls(
        HARMONY_FIXTURE, ferry, None, "The user wants the weather in Paris.", [{"city": "Paris", "days": 3}], False, None
    )
    server = Server(ferry, fixture=HARMONY_FIXTURE)
    try:
        for effort in ("low", "high"):
            r = server.client.chat.completions.create(
                model=MODEL, messages=WEATHER_QUESTION, tools=[WEATHER_TOOL], reasoning_effort=effort
            )
            assert r.choices[0].finish_reason == "tool_calls", r
        # The call goes back with its reasoning, as vLLM takes it: gpt-oss's template renders the reasoning before
        # the call (an analysis message), so the prompt grows by it.
        call = r.choices[0].message.model_dump(exclude_none=True)
        result = {"role": "tool", "tool_call_id": call["tool_calls"][0]["id"], "content": "sunny"}
        prompts = []
        for fields in ({"role", "content", "tool_calls"}, {"role", "content", "tool_calls", "reasoning_content"}):
            message = {k: v for k, v in call.items() if k in fields}
            history = WEATHER_QUESTION + [message, result]
            again = server.client.chat.completions.create(model=MODEL, messages=history, tools=[WEATHER_TOOL])
            prompts.append(again.usage.prompt_tokens)
        assert call["reasoning_content"] and prompts[1] > prompts[0], (call, prompts)
    finally:
        server.stop()


def test_reasoning_effort_needs_a_template_that_takes_it(server):
    expect_error(
        400,
        lambda: server.client.chat.completions.create(model=MODEL, messages=chat("hi"), reasoning_effort="low"),
        param="reasoning_effort",
    )
    expect_error(
        400,
        lambda: server.client.chat.completions.create(model=MODEL, messages=chat("hi"), reasoning_effort="max"),
        param="reasoning_effort",
    )


def run_tests(package, tests):
    """Runs `tests` (name, function) against one `ferry serve` on the bundled fixture, each given the server, or the
    binary when it names a `ferry` parameter (those start their own); prints a line each and exits non-zero on a
    failure, with the server's log."""
    ferry = sys.argv[1] if len(sys.argv) > 1 else os.path.join(ROOT, "target/debug/ferry")
    print(f"{package.__name__} {package.__version__} against {ferry}")
    passed, failed = 0, 0
    server = Server(ferry)
    try:
        for name, fn in tests:
            started = time.time()
            try:
                fn(ferry if "ferry" in inspect.signature(fn).parameters else server)
                passed += 1
                print(f"ok     {name} ({time.time() - started:.1f} s)")
            except Exception:
                failed += 1
                print(f"FAILED {name}\n{traceback.format_exc()}")
    finally:
        server.stop()
    if failed:
        print("server log:\n" + "".join(server.log[-40:]))
    print(f"{passed} passed, {failed} failed")
    sys.exit(1 if failed else 0)


def main():
    run_tests(openai, [(name, fn) for name, fn in globals().items() if name.startswith("test_")])


# The Responses API (`client.responses`): stateless, over the same neutral layer as chat.
RESPONSES_WEATHER_TOOL = {"type": "function", **WEATHER_TOOL["function"]}


def streamed_response(client, **kwargs):
    """The response a stream spells, checked: `response.created` first, events numbered from 0, the SDK's stream
    helper accumulating them into the same final response the last event carries."""
    events = list(client.responses.create(stream=True, **kwargs))
    assert [e.sequence_number for e in events] == list(range(len(events))), [e.type for e in events]
    assert events[0].type == "response.created" and events[1].type == "response.in_progress", events[:2]
    assert events[-1].type in ("response.completed", "response.incomplete"), events[-1]
    deltas = "".join(e.delta for e in events if e.type == "response.output_text.delta")
    assert deltas == events[-1].response.output_text, (deltas, events[-1].response)
    return events[-1].response


def test_responses_in_the_background_are_read_later_and_cancelled(server):
    kwargs = dict(model=MODEL, input="Tell me about ferries.", max_output_tokens=12, temperature=0)
    whole = server.client.responses.create(**kwargs)
    started = server.client.responses.create(background=True, **kwargs)
    assert started.status == "in_progress" and started.background is True, started
    deadline = time.time() + 60
    read = server.client.responses.retrieve(started.id)
    while read.status == "in_progress":
        assert time.time() < deadline, read
        time.sleep(0.02)
        read = server.client.responses.retrieve(started.id)
    assert read.output_text == whole.output_text, (read, whole)
    long = server.client.responses.create(background=True, **{**kwargs, "max_output_tokens": 3000})
    cancelled = server.client.responses.cancel(long.id)
    assert cancelled.status == "cancelled", cancelled
    assert server.client.responses.retrieve(long.id).status == "cancelled"


def test_responses_plain_and_streamed_agree(server):
    kwargs = dict(model=MODEL, input="Tell me about ferries.", instructions="Be brief.", max_output_tokens=24,
                  temperature=0, metadata={"run": "sdk"})
    whole = server.client.responses.create(**kwargs)
    assert whole.object == "response" and whole.id.startswith("resp_"), whole
    assert whole.status == "incomplete" and whole.incomplete_details.reason == "max_output_tokens", whole
    assert whole.metadata == {"run": "sdk"} and whole.instructions == "Be brief."
    assert whole.model_extra.get("store") is True, "kept, as OpenAI's API keeps responses unless told not to"
    assert whole.usage.output_tokens == 24
    assert whole.usage.total_tokens == whole.usage.input_tokens + 24
    streamed = streamed_response(server.client, **kwargs)
    assert streamed.output_text == whole.output_text
    assert [item.type for item in streamed.output] == [item.type for item in whole.output]
    assert streamed.usage.input_tokens_details.cached_tokens > 0, "the same prompt again: from the prefix cache"


def test_responses_logprobs_through_the_sdk(server):
    kwargs = dict(model=MODEL, input="Tell me about ferries.", max_output_tokens=8, temperature=0,
                  include=["message.output_text.logprobs"], top_logprobs=2)
    whole = server.client.responses.create(**kwargs)
    part = next(item for item in whole.output if item.type == "message").content[0]
    assert part.logprobs, whole
    for entry in part.logprobs:
        assert len(entry.top_logprobs) == 2 and entry.top_logprobs[0].token == entry.token, entry
        assert entry.logprob <= 0 and bytes(entry.bytes).decode("utf-8", "replace") == entry.token, entry
    assert "".join(entry.token for entry in part.logprobs) == part.text
    events = list(server.client.responses.create(stream=True, **kwargs))
    streamed = [lp for e in events if e.type == "response.output_text.delta" for lp in e.logprobs]
    assert [lp.token for lp in streamed] == [entry.token for entry in part.logprobs]
    assert [lp.logprob for lp in streamed] == [entry.logprob for entry in part.logprobs]


def test_responses_text_format_is_enforced(server):
    schema = {"type": "object", "properties": {"answer": {"type": "string", "enum": ["yes", "no"]}},
              "required": ["answer"], "additionalProperties": False}
    # Thinking off (vLLM's chat_template_kwargs): the random model, let think before its JSON, would not stop.
    r = server.client.responses.create(
        model=MODEL, input="Yes or no?", max_output_tokens=200, temperature=0,
        text={"format": {"type": "json_schema", "name": "reply", "schema": schema}},
        extra_body={"chat_template_kwargs": {"enable_thinking": False}},
    )
    assert r.status == "completed", r
    assert json.loads(r.output_text)["answer"] in ("yes", "no"), r.output_text


def test_responses_are_kept_continued_and_deleted(server):
    r = server.client.responses
    first = r.create(model=MODEL, input="Tell me about ferries.", max_output_tokens=8, temperature=0)
    assert r.retrieve(first.id).output_text == first.output_text
    second = r.create(model=MODEL, input="And boats?", previous_response_id=first.id, max_output_tokens=8,
                      temperature=0)
    assert second.previous_response_id == first.id
    resent = r.create(model=MODEL, max_output_tokens=8, temperature=0, store=False,
                      input=[{"role": "user", "content": "Tell me about ferries."},
                             *[item.model_dump(exclude_none=True) for item in first.output],
                             {"role": "user", "content": "And boats?"}])
    assert second.output_text == resent.output_text
    items = list(r.input_items.list(first.id, order="asc"))
    assert [(i.type, i.role, i.content[0].text) for i in items] == [("message", "user", "Tell me about ferries.")]
    r.delete(first.id)
    expect_error(404, lambda: r.retrieve(first.id))
    expect_error(400, lambda: r.create(model=MODEL, input="hi", previous_response_id=second.id),
                 param="previous_response_id")


def test_responses_refuse_what_this_server_cannot_do(server):
    r = server.client.responses
    expect_error(400, lambda: r.create(model=MODEL, input=[{"role": "user", "content": [{"type": "input_image",
                 "image_url": "https://example.com/a.png"}]}]), param="input[0].content[0].type")
    expect_error(404, lambda: r.create(model="other", input="hi"), code="model_not_found")


def test_responses_client_that_hangs_up_is_cancelled(server):
    cancelled = 'ferry_requests_total{outcome="cancelled"}'
    before = server.metric(cancelled, default=0)
    stream = server.client.responses.create(model=MODEL, input="Write a long story.", max_output_tokens=4000,
                                            stream=True)
    for event in stream:
        if event.type == "response.output_text.delta" or event.type == "response.reasoning_text.delta":
            break
    stream.close()
    deadline = time.time() + 10
    while server.metric("ferry_running_requests") > 0 or server.metric(cancelled, default=0) < before + 1:
        assert time.time() < deadline, "the request ran on instead of being cancelled"
        time.sleep(0.05)


def test_responses_tool_calls_plain_and_streamed(ferry):
    server = Server(ferry, fixture=HERMES_FIXTURE)
    try:
        question = [{"role": "user", "content": "What is the weather in Paris?"}]
        kwargs = dict(model=MODEL, input=question, tools=[RESPONSES_WEATHER_TOOL])
        whole = server.client.responses.create(**kwargs)
        assert whole.status == "completed", whole
        assert [item.type for item in whole.output] == ["reasoning", "message", "function_call"], whole.output
        assert whole.output[0].content[0].text == "\nThe user wants the weather.\n", whole.output[0]
        assert whole.output_text == "Let me check."
        call = whole.output[2]
        assert call.name == "get_weather" and json.loads(call.arguments) == {"city": "Paris", "days": 3}, call
        assert 0 < whole.usage.output_tokens_details.reasoning_tokens < whole.usage.output_tokens, whole.usage

        streamed = streamed_response(server.client, **kwargs)
        assert [(i.type, i.model_dump(exclude={"id", "call_id"})) for i in streamed.output] == [
            (i.type, i.model_dump(exclude={"id", "call_id"})) for i in whole.output]
        # The SDK's stream helper accumulates the events into the same response.
        with server.client.responses.stream(**kwargs) as stream:
            final = stream.get_final_response()
        assert [i.type for i in final.output] == [i.type for i in whole.output]
        assert final.output[2].arguments == call.arguments

        # The output and the call's result go back as the next input, as an agent sends them.
        history = question + [item.model_dump(exclude_none=True) for item in whole.output]
        history.append({"type": "function_call_output", "call_id": call.call_id, "output": "sunny"})
        again = server.client.responses.create(model=MODEL, input=history, tools=[RESPONSES_WEATHER_TOOL])
        assert again.usage.input_tokens > whole.usage.input_tokens

        # A client that keeps nothing asks for the reasoning sealed and gives back only the seal (as Codex CLI does):
        # the next prompt is the same as with the reasoning's text given back.
        sealed = server.client.responses.create(include=["reasoning.encrypted_content"], **kwargs)
        seal = sealed.output[0].encrypted_content
        assert seal, sealed.output[0]
        result = {"type": "function_call_output", "call_id": sealed.output[2].call_id, "output": "sunny"}
        rest = [item.model_dump(exclude_none=True) for item in sealed.output[1:]] + [result]
        seal_only = {"type": "reasoning", "id": sealed.output[0].id, "summary": [], "encrypted_content": seal}
        text_only = {"type": "reasoning", "id": sealed.output[0].id, "summary": [],
                     "content": [{"type": "reasoning_text", "text": sealed.output[0].content[0].text}]}
        prompts = [server.client.responses.create(model=MODEL, input=question + [item] + rest,
                                                  tools=[RESPONSES_WEATHER_TOOL]).usage.input_tokens
                   for item in (seal_only, text_only)]
        assert prompts[0] == prompts[1] > whole.usage.input_tokens, prompts
        expect_error(400, lambda: server.client.responses.create(model=MODEL, include=["file_search_call.results"],
                     input="hi"), param="include[0]")

        # Forced (the schema's cities listed: forced greedy output cannot run on in a free string), schemas enforced.
        named = {"type": "function", "name": "get_weather"}
        forced_tool = {"type": "function", **FORCED_WEATHER_TOOL["function"], "strict": True}
        forced = server.client.responses.create(model=MODEL, input=question, tools=[forced_tool], tool_choice=named,
                                                parallel_tool_calls=False, temperature=0)
        calls = [item for item in forced.output if item.type == "function_call"]
        assert len(calls) == 1 and json.loads(calls[0].arguments)["city"] in ("Paris", "Oslo"), forced.output
        assert forced.tools[0].strict is True
        none = server.client.responses.create(tool_choice="none", **kwargs)
        assert all(item.type != "function_call" for item in none.output), none.output
    finally:
        server.stop()

if __name__ == "__main__":
    main()
