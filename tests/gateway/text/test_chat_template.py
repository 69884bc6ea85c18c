"""Our renderer must give the same text as transformers' apply_chat_template for the same template."""
import functools

import pytest
from transformers import PreTrainedTokenizerFast

from gateway.text.chat_template import render_chat
from gateway.text.tokenizer import load_tokenizer
from core.errors import InvalidArgument

CHATS = [
    [{"role": "user", "content": "Hi!"}],
    [{"role": "system", "content": "Be terse."}, {"role": "user", "content": "2+2?"}],
    [
        {"role": "user", "content": "Translate: 猫"},
        {"role": "assistant", "content": "cat 🐈"},
        {"role": "user", "content": "  and   dog?\n\n"},
    ],
    [{"role": "tool", "content": '{"temp": 21}'}, {"role": "user", "content": "<|im_end|> is literal here"}],
]

# A Llama-2-style template: rejects chats that do not alternate, uses loopcontrols, tojson, namespace
# and the {% generation %} tag.
STRICT_TEMPLATE = """{% set ns = namespace(n=0) %}
{% for message in messages %}
    {% if (message['role'] == 'user') != (loop.index0 % 2 == 0) %}
        {{ raise_exception('Conversation roles must alternate user/assistant/user/assistant/...') }}
    {% endif %}
    {% if message['role'] == 'user' %}
{{ bos_token + '[INST] ' + message['content'] | trim + ' [/INST]' }}
    {% else %}
{% generation %}{{ ' ' + message['content'] | tojson + eos_token }}{% endgeneration %}
    {% endif %}
    {% set ns.n = ns.n + 1 %}
    {% if ns.n > 5 %}{% break %}{% endif %}
{% endfor %}
{% if add_generation_prompt %}{{ '<start>' }}{% endif %}"""


@functools.cache
def default_tokenizer():
    return load_tokenizer(None)


@functools.cache
def transformers_tokenizer(template: str, bos_token: str, eos_token: str) -> PreTrainedTokenizerFast:
    """transformers' own tokenizer class around the same tokenizer, for its apply_chat_template."""
    return PreTrainedTokenizerFast(
        tokenizer_object=default_tokenizer().tokenizer,
        chat_template=template,
        bos_token=bos_token,
        eos_token=eos_token,
    )


@pytest.mark.parametrize("add_generation_prompt", [True, False])
@pytest.mark.parametrize("chat", CHATS)
def test_default_template_matches_transformers(chat, add_generation_prompt):
    tokenizer = default_tokenizer()
    ours = render_chat(tokenizer.chat_template, chat, add_generation_prompt, tokenizer.bos_token, tokenizer.eos_token)
    reference = transformers_tokenizer(tokenizer.chat_template, tokenizer.bos_token, tokenizer.eos_token)
    expected = reference.apply_chat_template(chat, tokenize=False, add_generation_prompt=add_generation_prompt)
    assert ours == expected
    assert tokenizer.encode(ours, add_special_tokens=False) == reference.encode(expected, add_special_tokens=False)


def test_default_template_is_chatml_with_smollm_system_prompt():
    tokenizer = default_tokenizer()
    text = render_chat(tokenizer.chat_template, [{"role": "user", "content": "hi"}])
    assert text == (
        "<|im_start|>system\nYou are a helpful AI assistant named SmolLM, trained by Hugging Face<|im_end|>\n"
        "<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n"
    )


def test_strict_template_matches_transformers():
    chat = [
        {"role": "user", "content": " say \"<b>héllo</b>\" "},
        {"role": "assistant", "content": "<b>héllo</b> ✓"},
        {"role": "user", "content": "again"},
    ]
    ours = render_chat(STRICT_TEMPLATE, chat, True, "<s>", "</s>")
    reference = transformers_tokenizer(STRICT_TEMPLATE, "<s>", "</s>")
    assert ours == reference.apply_chat_template(chat, tokenize=False, add_generation_prompt=True)
    assert '"<b>héllo</b> ✓"</s>' in ours  # tojson keeps HTML and non-ASCII characters


def test_template_rejection_becomes_invalid_argument():
    chat = [{"role": "user", "content": "a"}, {"role": "user", "content": "b"}]
    with pytest.raises(InvalidArgument, match="roles must alternate") as caught:
        render_chat(STRICT_TEMPLATE, chat)
    assert caught.value.field == "messages" and "'user', 'user'" in str(caught.value)


@pytest.mark.parametrize(
    ("messages", "field", "shown"),
    [
        ("hello", "messages", "'hello'"),
        ([], "messages", "[]"),
        ([{"role": "user", "content": "ok"}, "hi"], "messages[1]", "'hi'"),
        ([{"content": "no role"}], "messages[0].role", "None"),
        ([{"role": "user"}], "messages[0].content", "None"),
        ([{"role": "user", "content": "ok"}, {"role": 7, "content": "x"}], "messages[1].role", "7"),
        ([{"role": "user", "content": ["a", "b"]}], "messages[0].content", "['a', 'b']"),
        ([{"role": "user", "content": None}], "messages[0].content", "None"),
        ([{"role": "", "content": "x"}], "messages[0].role", "''"),
    ],
)
def test_malformed_messages_name_field_and_index(messages, field, shown):
    with pytest.raises(InvalidArgument) as caught:
        render_chat(default_tokenizer().chat_template, messages)
    assert caught.value.field == field
    assert f"{field}={shown}" in str(caught.value)


def test_sandbox_blocks_attribute_escapes():
    with pytest.raises(Exception, match="unsafe|not safely"):
        render_chat("{{ messages.__class__.__mro__ }}", [{"role": "user", "content": "x"}])
    with pytest.raises(Exception, match="immutable|not safely|unsafe"):
        render_chat("{{ messages.append(1) }}", [{"role": "user", "content": "x"}])


def test_broken_template_is_a_server_error_not_a_client_one():
    with pytest.raises(ValueError, match="does not compile"):
        render_chat("{% for m in messages %}", [{"role": "user", "content": "x"}])
