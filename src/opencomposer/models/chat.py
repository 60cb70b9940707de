"""The prompt a local model sees: harness messages + tool schemas -> one string.

``render_prompt`` is THE single place that builds prompts. The agent loop samples from
it and RL training recomputes log-probabilities from it, so the two must agree byte for
byte; nothing else may assemble chat text by hand.

How each harness message is rendered (Hermes / Qwen convention, see ``models/codec.py``):

* the first system message gets ``codec.tools_system_prompt(tools)`` appended (a system
  message is created if the conversation has none and there are tools);
* assistant messages are ``codec.format_assistant(content, tool_calls)``, i.e. prose then
  ``<tool_call>`` blocks, exactly as the model would have written them, in the model's tool
  syntax (``json`` or ``xml``, see ``codec``): ``set_tool_syntax`` keeps it in the tokenizer's
  ``init_kwargs``, so ``save_pretrained`` writes it to tokenizer_config.json and an exported
  model is read back speaking the syntax it was trained in;
* tool results become ``<tool_response>\\n...\\n</tool_response>``. If the model's chat
  template already speaks that dialect (Qwen2.5, Qwen3, Hermes), they go in as ``tool``
  messages and the template wraps them; otherwise (SmolLM2, Llama, plain ChatML) we wrap
  them ourselves and send consecutive results as one ``user`` turn, as Qwen does.

Test: ``pytest tests/unit/models/test_models_chat.py``.
"""

from __future__ import annotations

import re
from typing import Any

from opencomposer.models import codec
from opencomposer.protocols import Message

# Plain ChatML, the format SmolLM2 and Qwen are trained on; used only for tokenizers that
# arrive without a template (base models), so every loaded model can render a prompt.
CHATML_TEMPLATE = (
    "{% for message in messages %}"
    "{{ '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>\\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}"
)

ROLES = ("system", "user", "assistant", "tool")
# How Qwen/Hermes templates test for a tool message: ``message.role == "tool"``.
_TOOL_ROLE = re.compile(r"""==\s*["']tool["']""")


class PromptError(ValueError):
    """Messages that cannot be rendered (unknown role, tokenizer without a template)."""


def ensure_chat_template(tokenizer: Any) -> None:
    """Give a template-less tokenizer the ChatML template; leave any existing one alone."""
    if not getattr(tokenizer, "chat_template", None):
        tokenizer.chat_template = CHATML_TEMPLATE


def tool_syntax(tokenizer: Any) -> str:
    """How this model writes tool calls: ``json`` (Hermes, the default) or ``xml``."""
    return (getattr(tokenizer, "init_kwargs", None) or {}).get("tool_syntax", "json")


def set_tool_syntax(tokenizer: Any, syntax: str | None) -> None:
    """Make ``tokenizer`` render tool calls in ``syntax``; None leaves what it was saved with."""
    if syntax is not None:
        tokenizer.init_kwargs["tool_syntax"] = codec.check_syntax(syntax)


def render_prompt(tokenizer: Any, messages: list[Message], tools: list[dict[str, Any]]) -> str:
    """The exact text the model is asked to continue, ending with the assistant header."""
    if not getattr(tokenizer, "chat_template", None):
        raise PromptError(
            "tokenizer has no chat template; load it with opencomposer.models.load_model "
            "or call opencomposer.models.chat.ensure_chat_template(tokenizer)"
        )
    chat = to_template_messages(messages, tools, native_tool_role=speaks_hermes(tokenizer),
                                syntax=tool_syntax(tokenizer))
    return tokenizer.apply_chat_template(chat, tokenize=False, add_generation_prompt=True)


def encode_prompt(tokenizer: Any, prompt: str) -> list[int]:
    """Token ids of a rendered prompt.

    ``add_special_tokens=False`` because the template already wrote every special token
    the model expects; letting the tokenizer add a BOS as well would double it.
    """
    return tokenizer(prompt, add_special_tokens=False)["input_ids"]


def to_template_messages(
    messages: list[Message], tools: list[dict[str, Any]], native_tool_role: bool = False, syntax: str = "json"
) -> list[dict[str, str]]:
    """Harness messages -> the ``{"role", "content"}`` dicts handed to the chat template."""
    out: list[dict[str, str]] = []
    for i, m in enumerate(messages):
        if m.role not in ROLES:
            raise PromptError(f"message {i}: unknown role {m.role!r}; expected one of {ROLES}")
        if m.role == "assistant":
            out.append({"role": "assistant", "content": codec.format_assistant(m.content, m.tool_calls, syntax)})
        elif m.role == "tool" and native_tool_role:
            out.append({"role": "tool", "content": m.content})
        elif m.role == "tool":
            block = f"<tool_response>\n{m.content}\n</tool_response>"
            if i > 0 and messages[i - 1].role == "tool":  # one user turn per batch of results
                out[-1]["content"] += "\n" + block
            else:
                out.append({"role": "user", "content": block})
        else:
            out.append({"role": m.role, "content": m.content})
    if tools:
        block = codec.tools_system_prompt(tools, syntax)
        if out and out[0]["role"] == "system":
            out[0]["content"] = f"{out[0]['content'].rstrip()}\n\n{block}" if out[0]["content"].strip() else block
        else:
            out.insert(0, {"role": "system", "content": block})
    return out


def speaks_hermes(tokenizer: Any) -> bool:
    """Whether the template has its own ``tool`` role that wraps results in <tool_response>."""
    template = tokenizer.chat_template
    if isinstance(template, dict):  # some tokenizers keep several named templates
        template = template.get("default") or next(iter(template.values()), "")
    return "<tool_response>" in template and _TOOL_ROLE.search(template) is not None


def stop_token_ids(model: Any, tokenizer: Any) -> set[int]:
    """Every id that ends a turn: the tokenizer's EOS, the model's EOS ids, and <|im_end|>.

    ChatML models (SmolLM2, Qwen) end a turn with <|im_end|> even when their EOS is
    <|endoftext|>, so it is added whenever the vocabulary has it.
    """
    ids: set[int] = set()
    for source in (tokenizer.eos_token_id, getattr(model.generation_config, "eos_token_id", None)):
        if isinstance(source, int):
            ids.add(source)
        elif source:
            ids.update(int(i) for i in source)
    im_end = tokenizer.convert_tokens_to_ids("<|im_end|>")
    if isinstance(im_end, int) and im_end != tokenizer.unk_token_id:
        ids.add(im_end)
    if not ids:
        raise ValueError("model and tokenizer define no EOS token; cannot tell when a turn ends")
    return ids
