"""render_prompt: the one prompt builder. Real SmolLM2 tokenizer (via tiny-random), no mocks.

Run: ``pytest tests/unit/models/test_models_chat.py``.
"""

from __future__ import annotations

import json

import pytest
from transformers import AutoTokenizer

from opencomposer.models import codec
from opencomposer.models.chat import (
    CHATML_TEMPLATE,
    PromptError,
    encode_prompt,
    render_prompt,
    set_tool_syntax,
    to_template_messages,
    tool_syntax,
)
from opencomposer.models.registry import load_model, model_cache_dir
from opencomposer.protocols import Message

# Qwen2.5's tool-message handling, trimmed to the parts that matter here.
QWEN_STYLE = (
    "{%- for message in messages %}"
    "{%- if message.role == \"tool\" %}"
    "{%- if loop.index0 == 0 or messages[loop.index0 - 1].role != \"tool\" %}{{- '<|im_start|>user' }}{%- endif %}"
    "{{- '\\n<tool_response>\\n' + message.content + '\\n</tool_response>' }}"
    "{%- if loop.last or messages[loop.index0 + 1].role != \"tool\" %}{{- '<|im_end|>\\n' }}{%- endif %}"
    "{%- else %}{{- '<|im_start|>' + message.role + '\\n' + message.content + '<|im_end|>\\n' }}{%- endif %}"
    "{%- endfor %}"
    "{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}{%- endif %}"
)


def fresh_tokenizer(template: str | None):
    tok = AutoTokenizer.from_pretrained(model_cache_dir("tiny-random"))
    tok.chat_template = template
    return tok


def test_prompt_holds_tools_calls_and_results(tiny, conversation, tools):
    _, tok = tiny
    prompt = render_prompt(tok, conversation, tools)
    assert prompt.startswith("<|im_start|>system\nYou are a careful coding agent.\n\n")
    assert codec.tools_system_prompt(tools) in prompt
    for schema in tools:
        assert json.dumps(schema) in prompt
    assert codec.format_assistant(conversation[2].content, conversation[2].tool_calls) in prompt
    # both results in one user turn, each wrapped Hermes-style
    assert (
        "<|im_start|>user\n<tool_response>\ndef add(a, b):\n    return a - b\n\n</tool_response>\n"
        "<tool_response>\n1 failed, 3 passed\n</tool_response><|im_end|>\n"
    ) in prompt
    assert prompt.endswith("<|im_start|>assistant\n")
    assert prompt.count("<|im_start|>") == 5  # system, user, assistant, tool results, header


def test_prompt_is_deterministic(tiny, conversation, tools):
    _, tok = tiny
    first = render_prompt(tok, conversation, tools)
    assert render_prompt(tok, conversation, tools) == first
    _, reloaded = load_model("tiny-random")  # a fresh tokenizer from the cache dir
    assert render_prompt(reloaded, conversation, tools) == first
    assert encode_prompt(reloaded, first) == encode_prompt(tok, first)


def test_tokens_round_trip_without_extra_bos(tiny, conversation, tools):
    _, tok = tiny
    prompt = render_prompt(tok, conversation, tools)
    ids = encode_prompt(tok, prompt)
    assert tok.decode(ids) == prompt
    assert ids[0] == tok.convert_tokens_to_ids("<|im_start|>") and ids[1] != ids[0]


def test_tools_without_system_message_get_one(tiny, tools):
    _, tok = tiny
    prompt = render_prompt(tok, [Message("user", "hi")], tools)
    assert prompt.startswith("<|im_start|>system\n" + codec.tools_system_prompt(tools) + "<|im_end|>")
    assert "SmolLM" not in prompt  # our system turn replaces the template's default one


def test_no_tools_leaves_conversation_alone(tiny):
    _, tok = tiny
    prompt = render_prompt(tok, [Message("user", "Say hello")], [])
    assert "<tools>" not in prompt
    assert "<|im_start|>user\nSay hello<|im_end|>\n<|im_start|>assistant\n" in prompt


def test_hermes_native_template_gets_tool_role_and_same_bytes(conversation, tools):
    """A Qwen-style template wraps tool results itself; the text must match our wrapping."""
    native = fresh_tokenizer(QWEN_STYLE)
    plain = fresh_tokenizer(CHATML_TEMPLATE)
    roles = [m["role"] for m in to_template_messages(conversation, tools, native_tool_role=True)]
    assert roles == ["system", "user", "assistant", "tool", "tool"]
    text = render_prompt(native, conversation, tools)
    assert text.count("<tool_response>") == 2  # wrapped once, not twice
    assert text == render_prompt(plain, conversation, tools)


def test_bad_inputs_raise_clear_errors(conversation, tools):
    with pytest.raises(PromptError, match="message 0: unknown role 'developer'"):
        to_template_messages([Message("developer", "x")], tools)
    with pytest.raises(PromptError, match="no chat template"):
        render_prompt(fresh_tokenizer(None), conversation, tools)


def test_tool_syntax_travels_with_the_tokenizer(tmp_path, conversation, tools):
    """xml renders calls and the preamble in that syntax; a saved tokenizer is read back speaking it."""
    tok = fresh_tokenizer(CHATML_TEMPLATE)
    assert tool_syntax(tok) == "json"
    set_tool_syntax(tok, "xml")
    prompt = render_prompt(tok, conversation, tools)
    after_system = prompt.split("<|im_end|>", 1)[1]
    assert "<function=example_function>" in prompt and "<function=" in after_system and '{"name":' not in after_system
    tok.save_pretrained(tmp_path)
    assert tool_syntax(AutoTokenizer.from_pretrained(tmp_path)) == "xml"
    set_tool_syntax(tok, None)  # None keeps it
    assert tool_syntax(tok) == "xml"
    with pytest.raises(ValueError, match="tool_syntax 'yaml'"):
        set_tool_syntax(tok, "yaml")
