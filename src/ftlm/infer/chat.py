"""Chat prompts for generation: messages -> token ids in the post-training chat template.

The template is ``ftlm.data.chat`` (the one ``ftlm sft`` trains on), so a fine-tuned model is
served exactly as it learnt: ``<|bos|> <|user|> PROMPT <|end|> ... <|assistant|>``, the reply
cue last; the reply ends at ``<|end|>`` (or ``<|eos|>``), which ``chat_stop_ids`` lists.

Not responsible for: the template itself (``ftlm.data.chat``; change it there) or validating
request shapes (``ftlm.serve.protocol``).
"""

from __future__ import annotations

from collections.abc import Sequence

from ftlm.data.tokenizer import Tokenizer
from ftlm.data.chat import render


def render_chat(messages: Sequence[dict], tokenizer: Tokenizer) -> list[int]:
    """Token ids of ``messages`` (dicts with ``role`` and string ``content``) plus the reply cue."""
    ids, _ = render(tokenizer, messages)
    return ids + [tokenizer.token_id("<|assistant|>")]


def chat_stop_ids(tokenizer: Tokenizer) -> tuple[int, ...]:
    """Token ids that end an assistant reply."""
    return (tokenizer.token_id("<|end|>"), tokenizer.eos_id)
