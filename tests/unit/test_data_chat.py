"""Which tokens of a chat are targets under the reasoning templates (Qwen3's
<think> blocks, gpt-oss's harmony channels), checked against transformers'
own assistant mask of the same template with {% generation %} tags."""

from __future__ import annotations

import pytest

from finetune.data.chat import IGNORE, ChatEncoder
from sft_models import HARMONY, HARMONY_TAGGED, QWEN3, QWEN3_TAGGED, chat_tokenizer, conversations

THINKING = [
    {"role": "system", "content": "You answer briefly."},
    {"role": "user", "content": "What does sorted do?"},
    {"role": "assistant", "content": "It returns the lines sorted.", "reasoning_content": "the user asks about sorted",
     "thinking": "the user asks about sorted"},
    {"role": "user", "content": "And then?"},
    {"role": "assistant", "content": "It writes them back.", "reasoning_content": "then the file is written",
     "thinking": "then the file is written"},
]
# Qwen3 also reads reasoning written into the content as a <think> block.
EMBEDDED = [m if m["role"] != "assistant" else
            {"role": "assistant", "content": f"<think>\n{m['reasoning_content']}\n</think>\n\n{m['content']}"}
            for m in THINKING]


def tokenizer_for(template: str):
    texts = [m["content"] for row in conversations(100) for m in row["messages"]]
    return chat_tokenizer(texts + [m["content"] for m in THINKING], template)


def oracle(tokenizer, tagged: str, messages) -> list[bool]:
    tokenizer.chat_template = tagged
    rendered = tokenizer.apply_chat_template(messages, tokenize=True, return_dict=True,
                                             return_assistant_tokens_mask=True)
    return [bool(m) for m in rendered["assistant_masks"]]


@pytest.mark.parametrize("template, tagged, messages", [
    (QWEN3, QWEN3_TAGGED, THINKING), (QWEN3, QWEN3_TAGGED, EMBEDDED), (HARMONY, HARMONY_TAGGED, THINKING),
], ids=["qwen3-reasoning_content", "qwen3-think-block", "harmony"])
def test_every_answer_with_its_reasoning_and_channel_headers_is_a_target(template, tagged, messages):
    """The last answer's reasoning block and both answers (harmony: their
    channel headers too) through their end-of-turn token, as the tags mark them."""
    tokenizer = tokenizer_for(template)
    tokenizer.chat_template = template
    encoded = ChatEncoder(tokenizer, "chat", train_on_prompt=False).encode({"messages": messages}, 0)
    expected = oracle(tokenizer, tagged, messages)
    assert len(encoded.labels) == len(expected)
    assert [label != IGNORE for label in encoded.labels] == expected


@pytest.mark.parametrize("template", [QWEN3, HARMONY], ids=["qwen3", "harmony"])
def test_without_reasoning_the_reasoning_is_context_not_a_target(template):
    tokenizer = tokenizer_for(template)
    tokenizer.chat_template = template
    encoder = ChatEncoder(tokenizer, "chat", train_on_prompt=False, train_on_reasoning=False)
    encoded = encoder.encode({"messages": THINKING}, 0)
    trained = tokenizer.decode([t for t in encoded.labels if t != IGNORE])
    assert "then the file is written" in tokenizer.decode(encoded.input_ids)
    assert "then the file" not in trained and "It writes them back." in trained
    assert "It returns the lines sorted." in trained
    with_reasoning = ChatEncoder(tokenizer, "chat", train_on_prompt=False).encode({"messages": THINKING}, 0)
    assert "then the file is written" in tokenizer.decode([t for t in with_reasoning.labels if t != IGNORE])
