"""Prompts without a server: completions' prompt shapes, chat messages through a chat template
in the sandbox, and the plain transcript of models without one."""

from __future__ import annotations

import pytest

from latentkv.server.errors import APIError
from latentkv.server.prompts import ChatRenderer, completion_prompts
from latentkv.server.protocol import ChatMessage
from latentkv.tokenizer import Tokenizer

CHATML = (
    "{% for m in messages %}<|im_start|>{{ m.role }}\n{{ m.content }}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)


def _messages(*pairs: tuple[str, str]) -> list[ChatMessage]:
    return [ChatMessage(role=role, content=content) for role, content in pairs]


@pytest.fixture(scope="module")
def tokenizer(tiny_dir):
    return Tokenizer(tiny_dir)


def test_a_chat_template_renders_the_whole_conversation():
    renderer = ChatRenderer(CHATML, {})
    text = renderer.render(
        _messages(("system", "be brief"), ("user", "hi"), ("assistant", "hello"), ("user", "more"))
    )
    assert text == (
        "<|im_start|>system\nbe brief<|im_end|>\n<|im_start|>user\nhi<|im_end|>\n"
        "<|im_start|>assistant\nhello<|im_end|>\n<|im_start|>user\nmore<|im_end|>\n<|im_start|>assistant\n"
    )
    assert not renderer.add_special_tokens  # the template writes its own special tokens


def test_content_parts_are_joined_as_text():
    renderer = ChatRenderer(CHATML, {})
    message = ChatMessage(role="user", content=[{"type": "text", "text": "a"}, {"type": "text", "text": "b"}])
    assert "user\nab<|im_end|>" in renderer.render([message])


@pytest.mark.parametrize(
    "template, needle",
    [
        ("{{ messages.__class__.__mro__ }}", "the chat template failed"),  # the sandbox refuses
        ("{{ raise_exception('no system role') }}", "no system role"),
        ("{{ messages[0].content + 1 }}", "the chat template failed"),  # a TypeError in the template
    ],
)
def test_a_failing_template_is_a_400_for_the_request(template, needle):
    with pytest.raises(APIError) as info:
        ChatRenderer(template, {}).render(_messages(("user", "x")))
    assert info.value.status == 400 and needle in info.value.message and info.value.param == "messages"


def test_without_a_template_the_plain_transcript_of_latentkv_chat():
    renderer = ChatRenderer(None, {})
    text = renderer.render(_messages(("system", "s"), ("user", "a"), ("assistant", " b"), ("user", "c")))
    assert text == "s\n\nUser: a\nAssistant: b\nUser: c\nAssistant:"
    assert renderer.add_special_tokens
    with pytest.raises(APIError):
        renderer.render(_messages(("user", "a"), ("tool", "{}")))


def test_the_four_prompt_shapes(tokenizer):
    assert [p.ids for p in completion_prompts("ab", tokenizer, 256)] == [[97, 98]]
    assert [p.ids for p in completion_prompts(["a", "b"], tokenizer, 256)] == [[97], [98]]
    assert [p.ids for p in completion_prompts([5, 6], tokenizer, 256)] == [[5, 6]]
    assert [p.ids for p in completion_prompts([[5], [6, 7]], tokenizer, 256)] == [[5], [6, 7]]
    assert completion_prompts([5], tokenizer, 256)[0].text is None
    for bad in ([], [[5], []], [5, 256], ""):
        with pytest.raises(APIError):
            completion_prompts(bad, tokenizer, 256)
