"""The chat template: messages -> token ids and the mask of tokens the model learns.

A conversation renders as::

    <|bos|> <|user|> PROMPT <|end|> <|assistant|> COMPLETION <|end|> ...

(``<|system|> TEXT <|end|>`` may come first). Role markers are special tokens inserted by id, so
no text can forge a turn (``ftlm.data.tokenizer``). The mask is 1 on the tokens of every assistant
turn's content and on its closing ``<|end|>`` (the model learns to answer and to stop), 0 on
everything else; ``mask[t] = 1`` means token ``t`` is a target, predicted from the tokens before it.
Post-training learns this template (``ftlm.post.data``) and inference prompts in it
(``ftlm.infer.chat``), so a fine-tuned model is served exactly as it learnt.

``HF_CHAT_TEMPLATE`` is the same rendering as a Jinja ``chat_template`` for a model exported to
Hugging Face (``ftlm convert``): ``tokenizer.apply_chat_template(messages,
add_generation_prompt=True)`` gives the ids ``ftlm.infer.chat.render_chat`` gives for text
without special-token strings. For text with them it differs, and that is the one place role
forgery can come back: transformers renders the template to a string and tokenises it with
special tokens recognised (it must, to turn the template's own markers into ids), so a user
message containing ``"<|user|>"`` becomes the role token there, while ftlm's ``encode`` never
produces a special token from text. A user of an exported model who passes untrusted text must
remove or escape those strings first (``docs/inference.md``).

Not responsible for: reading files (``ftlm.post.data``) or sampling (``ftlm.post.rollout``).
"""

from __future__ import annotations

from collections.abc import Sequence

from ftlm.data.tokenizer import SPECIAL_TOKENS, Tokenizer
from ftlm.errors import DataError

ROLES = ("system", "user", "assistant")

HF_CHAT_TEMPLATE = (
    "{{ bos_token }}"
    "{% for message in messages %}"
    "{% set role = 'system' if message['role'] == 'developer' else message['role'] %}"
    "{% if role not in ['system', 'user', 'assistant'] %}"
    "{{ raise_exception('role ' + role + ' is not supported: use system, user or assistant') }}"
    "{% endif %}"
    "{% if message['content'] is not string %}"
    "{{ raise_exception('message content must be a string') }}"
    "{% endif %}"
    "{{ '<|' + role + '|>' + message['content'] + '<|end|>' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|assistant|>' }}{% endif %}")
"""``render`` (plus the reply cue when ``add_generation_prompt``) as a transformers chat template."""


def render(tokenizer: Tokenizer, messages: Sequence[dict]) -> tuple[list[int], list[int]]:
    """Token ids of a conversation and its learn mask (1 on assistant content and its end)."""
    ids, mask = [tokenizer.bos_id], [0]
    end = tokenizer.token_id("<|end|>")
    for m in messages:
        role, content = (m.get("role"), m.get("content")) if isinstance(m, dict) else (None, None)
        if role not in ROLES or not isinstance(content, str):
            raise DataError(f"a message must be {{role, content}} with role one of "
                            f"{', '.join(ROLES)} and text content, got {str(m)[:80]}")
        body = tokenizer.encode(content)
        learn = 1 if role == "assistant" else 0
        ids += [tokenizer.token_id(f"<|{role}|>"), *body, end]
        mask += [0, *([learn] * len(body)), learn]
    return ids, mask


def prompt_ids(tokenizer: Tokenizer, prompt: str) -> list[int]:
    """The tokens a completion of ``prompt`` follows: the user turn and the assistant marker."""
    ids, _ = render(tokenizer, [{"role": "user", "content": prompt}])
    return ids + [tokenizer.token_id("<|assistant|>")]


def completion_ids(tokenizer: Tokenizer, completion: str) -> list[int]:
    """The tokens of an assistant answer, closed by ``<|end|>``."""
    return tokenizer.encode(completion) + [tokenizer.token_id("<|end|>")]


def completion_text(tokenizer: Tokenizer, ids: Sequence[int]) -> str:
    """The text of sampled completion ``ids``, up to (without) the first ``<|end|>``."""
    end = tokenizer.token_id("<|end|>")
    ids = list(ids)
    if end in ids:
        ids = ids[:ids.index(end)]
    # Special ids are 0 .. n-1; a stray sampled one (a second <|user|>...) is not answer text.
    return tokenizer.decode([i for i in ids if i >= len(SPECIAL_TOKENS)])
