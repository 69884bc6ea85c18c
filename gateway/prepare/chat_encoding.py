"""A chat -> prompt token ids, where only the chat template may write control tokens.

A client's message content is text. If it holds a special token's string (`<|im_end|>`,
`<|start_header_id|>`, ...) and the rendered prompt were tokenized as a whole, that string would
become the control token itself and the client could forge turns (prompt injection into the chat
format). So when any content holds one, the template's own text is tokenized with special tokens
and each content span with special tokens read as plain text.

Where each content lands in the rendered prompt is found by rendering the chat again with a unique
marker in place of each content, so this works for any template; a template that changes content
(trims it, splits it) cannot be mapped back, and such a chat is refused instead of tokenized unsafely.
"""
from __future__ import annotations

import re
import uuid

from core.errors import InvalidArgument
from gateway.text.chat_template import render_chat
from gateway.text.tokenizer import TextTokenizer


def encode_chat(tokenizer: TextTokenizer, messages: list[dict], add_generation_prompt: bool = True,
                **template_kwargs: object) -> list[int]:
    """messages: validated [{"role", "content"}, ...]; the template must exist (tokenizer.chat_template).
    template_kwargs: more variables for the template (tools=...), written as the template's own text."""
    template = tokenizer.chat_template
    render = lambda chat: render_chat(template, chat, add_generation_prompt=add_generation_prompt,  # noqa: E731
                                      bos_token=tokenizer.bos_token, eos_token=tokenizer.eos_token,
                                      **template_kwargs)
    text = render(messages)
    specials = tokenizer.special_tokens
    holding = [index for index, message in enumerate(messages) if any(s in message["content"] for s in specials)]
    if not holding:  # the common case: one pass, exactly the ids a whole-text encode gives
        return tokenizer.encode(text, add_special_tokens=False)
    nonce = uuid.uuid4().hex
    markers = [f"\ue000{nonce}:{index}\ue001" for index in range(len(messages))]
    marked = render([{**message, "content": marker} for message, marker in zip(messages, markers)])
    parts = re.split(f"(\ue000{nonce}:\\d+\ue001)", marked)  # template text, marker, template text, ...
    found = [markers.index(part) for part in parts[1::2]]
    rebuilt = "".join(messages[found[i // 2]]["content"] if i % 2 else part for i, part in enumerate(parts))
    if rebuilt != text:
        index = holding[0]
        token = next(s for s in specials if s in messages[index]["content"])
        raise InvalidArgument(f"messages[{index}].content", messages[index]["content"],
                              f"holds the special token {token!r}, and this model's chat template rewrites message "
                              "content, so it cannot be kept as plain text; remove the token")
    ids: list[int] = []
    for i, part in enumerate(parts):
        if i % 2:
            ids += tokenizer.encode_as_text(messages[found[i // 2]]["content"])
        elif part:
            ids += tokenizer.encode(part, add_special_tokens=False)
    return ids
