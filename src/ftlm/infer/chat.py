"""The chat prompt format the engine and server use: messages -> token ids.

Each message becomes ``<|role|> content <|end|>`` with the role's special token (``<|system|>``,
``<|user|>``, ``<|assistant|>``) inserted by id (text never forges one, see
``ftlm.data.tokenizer``), and the prompt ends with ``<|assistant|>`` so the model writes the
reply; the reply ends at ``<|end|>`` (or ``<|eos|>``), which ``chat_stop_ids`` lists.

Not responsible for: training on chats (the post-training commands own their template; this one
must match it, so change both together) or validating message shapes (``ftlm.serve.protocol``).
"""

from __future__ import annotations

from collections.abc import Sequence

from ftlm.data.tokenizer import Tokenizer
from ftlm.errors import ConfigError

ROLES = ("system", "user", "assistant")


def render_chat(messages: Sequence[dict], tokenizer: Tokenizer) -> list[int]:
    """Token ids of ``messages`` (dicts with ``role`` and string ``content``) plus the reply cue."""
    ids: list[int] = []
    for i, message in enumerate(messages):
        role, content = message.get("role"), message.get("content")
        if role not in ROLES:
            raise ConfigError(f"messages[{i}].role={role!r} is not one of {', '.join(ROLES)}")
        if not isinstance(content, str):
            raise ConfigError(f"messages[{i}].content must be a string")
        ids.append(tokenizer.token_id(f"<|{role}|>"))
        ids.extend(tokenizer.encode(content))
        ids.append(tokenizer.token_id("<|end|>"))
    ids.append(tokenizer.token_id("<|assistant|>"))
    return ids


def chat_stop_ids(tokenizer: Tokenizer) -> tuple[int, ...]:
    """Token ids that end an assistant reply."""
    return (tokenizer.token_id("<|end|>"), tokenizer.eos_id)
