#!/usr/bin/env python3
"""Renders conversations through real chat templates with HF transformers' apply_chat_template and writes the
expected strings to tests/fixtures/chat_templates/<family>.json, so that ferry's minijinja rendering can be checked
against them in CI (crates/ferry-core/tests/chat_templates.rs), where transformers does not run.

Tool conversations (tool definitions passed as `tools=`, assistant tool calls with their arguments as objects, as
ferry passes them after parsing OpenAI's JSON strings, and `tool` results) are rendered for the families whose
templates render tools: Qwen3's in the Hermes JSON format, Qwen3.5's in the XML one, GLM-4.5's keys and values,
gpt-oss's Harmony; DeepSeek-V3.1's template renders calls in the history only (it concatenates the arguments as a
string, so with objects transformers refuses those conversations, and ferry must too; its own conversations pass
the arguments as JSON text, which ferry's request layer gives it).

Templates: Qwen3, Mixtral-Instruct and OLMoE are the fixtures' tokenizer_config.json ones; the others are files in
tests/fixtures/chat_templates: Qwen3.5's (as shipped with Qwen3.6), gpt-oss's (openai/gpt-oss-120b, as llama.cpp's
models/templates keeps it), GLM-4.5's (zai-org/GLM-4.5) and DeepSeek-V3.1's (deepseek-ai/DeepSeek-V3.1). Each is
rendered with the qwen3_moe fixture's tokenizer or its own fixture's, whose bos/eos tokens the templates read.
gpt-oss's template writes the current date (`strftime_now`): the test compares with the date masked.

Usage: python3 scripts/make_template_refs.py [REPO_ROOT] [OUT_DIR] [--only FAMILY]   (needs transformers; run once,
commit output; --only remakes one family's file and leaves the others' bytes as they are)
"""

import json
import os
import sys

from transformers import AutoTokenizer

ONLY = sys.argv[sys.argv.index("--only") + 1] if "--only" in sys.argv else None
ARGS = [a for i, a in enumerate(sys.argv) if a != "--only" and (i == 0 or sys.argv[i - 1] != "--only")]
ROOT = ARGS[1] if len(ARGS) > 1 else os.path.join(os.path.dirname(__file__), "..")
OUT = ARGS[2] if len(ARGS) > 2 else os.path.join(ROOT, "tests/fixtures/chat_templates")

SYSTEM = {"role": "system", "content": "You are terse.\nAnswer in one line."}
USER1 = {"role": "user", "content": "What is 2+2? Say \"four\" — or 4 (ünïcödé, 世界)."}
ASSISTANT1 = {"role": "assistant", "content": "4"}
ASSISTANT_THINKING = {"role": "assistant", "content": "<think>\nadd them\n</think>\n\n4"}
USER2 = {"role": "user", "content": "  And 3+3?  "}
ASSISTANT2 = {"role": "assistant", "content": "6"}

WEATHER_TOOL = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "The weather forecast for a city.",
        "parameters": {
            "type": "object",
            "properties": {
                "city": {"type": "string", "description": "City name, e.g. \"Paris\""},
                "days": {"type": "integer"},
                "units": {"type": "string", "enum": ["metric", "imperial"]},
            },
            "required": ["city"],
        },
    },
}
SEARCH_TOOL = {
    "type": "function",
    "function": {
        "name": "search",
        "description": "Web search.",
        "parameters": {
            "type": "object",
            "properties": {"query": {"type": "string"}, "filters": {"type": "object"}, "sites": {"type": "array"}},
        },
    },
}
TOOLS = [WEATHER_TOOL, SEARCH_TOOL]


def tool_call(call_id, name, arguments):
    return {"id": call_id, "type": "function", "function": {"name": name, "arguments": arguments}}


USER_WEATHER = {"role": "user", "content": "Weather in Paris and Oslo for 3 days?"}
CALL_PARIS = tool_call("call_1", "get_weather", {"city": "Paris", "days": 3})
CALL_OSLO = tool_call("call_2", "get_weather", {"city": "Oslo", "days": 3, "units": "metric"})
CALL_SEARCH = tool_call("call_3", "search", {"query": "fjords\nin winter", "filters": {"lang": "en", "safe": True},
                                            "sites": ["a.no", 2]})
ASSISTANT_CALL = {"role": "assistant", "content": "", "tool_calls": [CALL_PARIS]}
ASSISTANT_TEXT_AND_CALLS = {"role": "assistant", "content": "Checking both.", "tool_calls": [CALL_PARIS, CALL_OSLO]}
ASSISTANT_THINKING_CALL = {"role": "assistant", "content": "<think>\nneed data\n</think>\n\n", "tool_calls": [CALL_SEARCH]}
RESULT_PARIS = {"role": "tool", "content": "{\"temp\": 21}", "tool_call_id": "call_1"}
RESULT_OSLO = {"role": "tool", "content": "sunny, 4 C", "tool_call_id": "call_2"}
RESULT_SEARCH = {"role": "tool", "content": "<b>results</b>", "tool_call_id": "call_3"}
ASSISTANT_AFTER_TOOLS = {"role": "assistant", "content": "Paris 21, Oslo 4."}

CONVERSATIONS = {
    "user": [USER1],
    "system_user": [SYSTEM, USER1],
    "multi_turn": [USER1, ASSISTANT1, USER2],
    "system_multi_turn": [SYSTEM, USER1, ASSISTANT1, USER2],
    "ends_with_assistant": [USER1, ASSISTANT1, USER2, ASSISTANT2],
    "thinking_in_history": [USER1, ASSISTANT_THINKING, USER2],
    "assistant_first": [ASSISTANT1, USER1],
}

# Rendered with `tools=TOOLS` (and once without tools, as a history that carries calls from an earlier request).
TOOL_CONVERSATIONS = {
    "tools_offered": [USER_WEATHER],
    "tools_with_system": [SYSTEM, USER_WEATHER],
    "tool_call_then_result": [USER_WEATHER, ASSISTANT_CALL, RESULT_PARIS],
    "parallel_calls_and_answer": [SYSTEM, USER_WEATHER, ASSISTANT_TEXT_AND_CALLS, RESULT_PARIS, RESULT_OSLO,
                                  ASSISTANT_AFTER_TOOLS, USER2],
    "thinking_call_nested_arguments": [USER_WEATHER, ASSISTANT_THINKING_CALL, RESULT_SEARCH],
}

# gpt-oss's template renders an assistant's earlier reasoning from `thinking`: before a call that no later answer
# follows, and in a last assistant turn rendered without the generation prompt.
ASSISTANT_THOUGHT_CALL = {"role": "assistant", "content": "", "thinking": "Paris first.", "tool_calls": [CALL_PARIS]}
ASSISTANT_THOUGHT_ANSWER = {"role": "assistant", "content": "4", "thinking": "2+2 is 4."}
HARMONY_CONVERSATIONS = {
    "thought_then_call_then_result": ([SYSTEM, USER_WEATHER, ASSISTANT_THOUGHT_CALL, RESULT_PARIS], TOOLS),
    "thought_call_answered_later": ([USER_WEATHER, ASSISTANT_THOUGHT_CALL, RESULT_PARIS, ASSISTANT_AFTER_TOOLS,
                                     USER2], TOOLS),
    "thought_in_last_answer": ([USER1, ASSISTANT_THOUGHT_ANSWER], None),
    "thought_in_earlier_answer": ([USER1, ASSISTANT_THOUGHT_ANSWER, USER2], None),
}

# DeepSeek-V3.1's template concatenates a call's arguments as a string: the JSON text, as OpenAI clients send it.
TEXT_CALL_PARIS = tool_call("call_1", "get_weather", json.dumps(CALL_PARIS["function"]["arguments"]))
TEXT_CALL_OSLO = tool_call("call_2", "get_weather", json.dumps(CALL_OSLO["function"]["arguments"]))
DEEPSEEK_CONVERSATIONS = {
    "text_arguments_parallel_calls_and_answer": (
        [SYSTEM, USER_WEATHER, {**ASSISTANT_TEXT_AND_CALLS, "tool_calls": [TEXT_CALL_PARIS, TEXT_CALL_OSLO]},
         RESULT_PARIS, RESULT_OSLO, ASSISTANT_AFTER_TOOLS, USER2], TOOLS),
    "text_arguments_call_then_result": (
        [USER_WEATHER, {**ASSISTANT_CALL, "tool_calls": [TEXT_CALL_PARIS]}, RESULT_PARIS], TOOLS),
}

# (name, fixture whose tokenizer renders it, template file or None for the fixture's own, kwargs variants,
#  whether the template renders tools, conversations of its own: {name: (messages, tools)})
FAMILIES = [
    ("qwen3", "qwen3_moe", None, [{}, {"enable_thinking": False}], True, {}),
    ("qwen3_5", "qwen3_moe", "tests/fixtures/chat_templates/qwen3_5.jinja", [{}, {"enable_thinking": False}], True,
     {}),
    ("mixtral", "mixtral", None, [{}], False, {}),
    ("olmoe", "olmoe", None, [{}], False, {}),
    ("gpt_oss", "qwen3_moe", "tests/fixtures/chat_templates/gpt_oss.jinja",
     [{}, {"reasoning_effort": "low"}, {"reasoning_effort": "high"}], True, HARMONY_CONVERSATIONS),
    ("glm4_5", "qwen3_moe", "tests/fixtures/chat_templates/glm4_5.jinja", [{}, {"enable_thinking": False}], True,
     {}),
    ("deepseek_v3_1", "qwen3_moe", "tests/fixtures/chat_templates/deepseek_v3_1.jinja", [{}, {"thinking": True}],
     True, DEEPSEEK_CONVERSATIONS),
]


def conversations(renders_tools, own):
    """(name, messages, tools) of every case a family renders."""
    for name, messages in CONVERSATIONS.items():
        yield name, messages, None
    if renders_tools:
        for name, messages in TOOL_CONVERSATIONS.items():
            yield name, messages, TOOLS
        yield "tool_history_without_tools", TOOL_CONVERSATIONS["parallel_calls_and_answer"], None
    for name, (messages, tools) in own.items():
        yield name, messages, tools


def main():
    os.makedirs(OUT, exist_ok=True)
    for name, fixture, template_file, variants, renders_tools, own in FAMILIES:
        if ONLY and name != ONLY:
            continue
        tokenizer = AutoTokenizer.from_pretrained(os.path.join(ROOT, "tests/fixtures", fixture))
        if template_file:
            with open(os.path.join(ROOT, template_file)) as f:
                tokenizer.chat_template = f.read()
        cases = []
        for conversation, messages, tools in conversations(renders_tools, own):
            for add_generation_prompt in (True, False):
                for kwargs in variants:
                    case = {
                        "conversation": conversation,
                        "messages": messages,
                        "add_generation_prompt": add_generation_prompt,
                        "chat_template_kwargs": kwargs,
                    }
                    if tools:
                        case["tools"] = tools
                    try:
                        case["expected"] = tokenizer.apply_chat_template(
                            messages, tools=tools, tokenize=False, add_generation_prompt=add_generation_prompt,
                            **kwargs
                        )
                    except Exception as e:  # the template refuses this conversation: ferry must refuse it too
                        case["error"] = f"{type(e).__name__}: {e}"
                    cases.append(case)
        out = {
            "fixture": fixture,
            "template_file": template_file,
            "transformers_version": __import__("transformers").__version__,
            "cases": cases,
        }
        path = os.path.join(OUT, f"{name}.json")
        with open(path, "w") as f:
            json.dump(out, f, ensure_ascii=False, indent=1)
            f.write("\n")
        print(f"{path}: {len(cases)} cases, {sum('error' in c for c in cases)} refused")


if __name__ == "__main__":
    main()
