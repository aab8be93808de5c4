#!/usr/bin/env python3
"""Renders conversations through real chat templates with HF transformers' apply_chat_template and writes the
expected strings to tests/fixtures/chat_templates/<family>.json, so that ferry's minijinja rendering can be checked
against them in CI (crates/ferry-core/tests/chat_templates.rs), where transformers does not run.

Templates: Qwen3, Mixtral-Instruct and OLMoE are the fixtures' tokenizer_config.json ones; Qwen3.5's (as shipped
with Qwen3.6) is tests/fixtures/chat_templates/qwen3_5.jinja. Each is rendered with the qwen3_moe fixture's
tokenizer or its own fixture's, whose bos/eos tokens the templates read.

Usage: python3 scripts/make_template_refs.py [REPO_ROOT] [OUT_DIR]   (needs transformers; run once, commit output)
"""

import json
import os
import sys

from transformers import AutoTokenizer

ROOT = sys.argv[1] if len(sys.argv) > 1 else os.path.join(os.path.dirname(__file__), "..")
OUT = sys.argv[2] if len(sys.argv) > 2 else os.path.join(ROOT, "tests/fixtures/chat_templates")

SYSTEM = {"role": "system", "content": "You are terse.\nAnswer in one line."}
USER1 = {"role": "user", "content": "What is 2+2? Say \"four\" — or 4 (ünïcödé, 世界)."}
ASSISTANT1 = {"role": "assistant", "content": "4"}
ASSISTANT_THINKING = {"role": "assistant", "content": "<think>\nadd them\n</think>\n\n4"}
USER2 = {"role": "user", "content": "  And 3+3?  "}
ASSISTANT2 = {"role": "assistant", "content": "6"}

CONVERSATIONS = {
    "user": [USER1],
    "system_user": [SYSTEM, USER1],
    "multi_turn": [USER1, ASSISTANT1, USER2],
    "system_multi_turn": [SYSTEM, USER1, ASSISTANT1, USER2],
    "ends_with_assistant": [USER1, ASSISTANT1, USER2, ASSISTANT2],
    "thinking_in_history": [USER1, ASSISTANT_THINKING, USER2],
    "assistant_first": [ASSISTANT1, USER1],
}

# (name, fixture whose tokenizer renders it, template file or None for the fixture's own, kwargs variants)
FAMILIES = [
    ("qwen3", "qwen3_moe", None, [{}, {"enable_thinking": False}]),
    ("qwen3_5", "qwen3_moe", "tests/fixtures/chat_templates/qwen3_5.jinja", [{}, {"enable_thinking": False}]),
    ("mixtral", "mixtral", None, [{}]),
    ("olmoe", "olmoe", None, [{}]),
]


def main():
    os.makedirs(OUT, exist_ok=True)
    for name, fixture, template_file, variants in FAMILIES:
        tokenizer = AutoTokenizer.from_pretrained(os.path.join(ROOT, "tests/fixtures", fixture))
        if template_file:
            with open(os.path.join(ROOT, template_file)) as f:
                tokenizer.chat_template = f.read()
        cases = []
        for conversation, messages in CONVERSATIONS.items():
            for add_generation_prompt in (True, False):
                for kwargs in variants:
                    case = {
                        "conversation": conversation,
                        "messages": messages,
                        "add_generation_prompt": add_generation_prompt,
                        "chat_template_kwargs": kwargs,
                    }
                    try:
                        case["expected"] = tokenizer.apply_chat_template(
                            messages, tokenize=False, add_generation_prompt=add_generation_prompt, **kwargs
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
