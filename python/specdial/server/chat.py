"""Chat prompts: the tokenizer's chat template when it has one, else a simple documented one.

The simple template (used for the built-in models and any tokenizer without ``chat_template``)
writes each message as a role marker line and its content, then opens the assistant's turn::

    <|system|>
    You are terse.
    <|user|>
    Write a sort function.
    <|assistant|>

i.e. ``"<|{role}|>\\n{content}\\n"`` per message, followed by ``"<|assistant|>\\n"``; a
message with OpenAI's ``name`` writes its marker as ``"<|{role}:{name}|>"``. The
markers are plain text, not special tokens, and no stop string is added implicitly: pass
``stop: ["<|user|>"]`` to end at the next turn. With either template the OpenAI ``developer``
role is passed as ``system`` (the role chat templates know).
"""

from __future__ import annotations

from typing import Any

__all__ = ["SIMPLE_TEMPLATE_GENERATION_PROMPT", "render_chat", "simple_chat_prompt"]

#: What the simple template appends to open the assistant's turn.
SIMPLE_TEMPLATE_GENERATION_PROMPT = "<|assistant|>\n"


def _role(role: str) -> str:
    return "system" if role == "developer" else role


def simple_chat_prompt(messages: list[dict[str, str]]) -> str:
    """The simple template (module docstring) over ``[{"role", "content"}]`` messages, each
    with an optional ``name``."""
    lines = [f"<|{_role(m['role'])}{':' + m['name'] if m.get('name') else ''}|>\n{m['content']}\n"
             for m in messages]
    return "".join(lines) + SIMPLE_TEMPLATE_GENERATION_PROMPT


def has_chat_template(tokenizer: Any) -> bool:
    """Whether ``tokenizer`` is an HF tokenizer carrying a non-empty ``chat_template``."""
    return bool(getattr(tokenizer, "chat_template", None)) and hasattr(
        tokenizer, "apply_chat_template")


def render_chat(tokenizer: Any, messages: list[dict[str, str]]) -> tuple[str, bool]:
    """The prompt text for ``messages`` and whether it came from the tokenizer's template
    (such text already holds its special tokens, e.g. BOS, so encode it without adding them).

    Raises ``ValueError`` when the tokenizer's template rejects the messages (e.g. roles that
    do not alternate)."""
    if has_chat_template(tokenizer):
        messages = [{**m, "role": _role(m["role"])} for m in messages]
        try:
            text = tokenizer.apply_chat_template(messages, tokenize=False,
                                                 add_generation_prompt=True)
        except Exception as e:  # jinja2 TemplateError and friends
            raise ValueError(f"the model's chat template rejected the messages: {e}") from e
        return str(text), True
    return simple_chat_prompt(messages), False
