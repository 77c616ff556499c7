"""Assistant-only loss mask: exactly the assistant text and its end token are marked."""

from __future__ import annotations

import pytest
from draftsmith.data.templates import render_conversation

CONVERSATION = [
    {"role": "system", "content": "You write Python."},
    {"role": "user", "content": "Sort a list."},
    {"role": "assistant", "content": "sorted(xs)"},
    {"role": "user", "content": "In place?"},
    {"role": "assistant", "content": "xs.sort()  # returns None"},
]


def _masked_runs(ids: list[int], mask: list[int]) -> list[list[int]]:
    runs: list[list[int]] = []
    previous = 0
    for token, bit in zip(ids, mask, strict=True):
        if bit and not previous:
            runs.append([])
        if bit:
            runs[-1].append(token)
        previous = bit
    return runs


def test_mask_covers_assistant_text_and_end_token(chat_tokenizer) -> None:
    rendered = render_conversation(CONVERSATION, chat_tokenizer)
    ids, mask = rendered["input_ids"], rendered["loss_mask"]
    assert len(ids) == len(mask)
    assert chat_tokenizer.decode(ids) == chat_tokenizer.apply_chat_template(
        CONVERSATION, tokenize=False
    )
    runs = [chat_tokenizer.decode(run) for run in _masked_runs(ids, mask)]
    assert runs == ["sorted(xs)<|im_end|>", "xs.sort()  # returns None<|im_end|>"]
    unmasked = chat_tokenizer.decode([t for t, bit in zip(ids, mask, strict=True) if not bit])
    assert "Sort a list." in unmasked and "You write Python." in unmasked
    assert "sorted" not in unmasked


def test_truncation_and_no_assistant(chat_tokenizer) -> None:
    full = render_conversation(CONVERSATION, chat_tokenizer)
    cut = render_conversation(CONVERSATION, chat_tokenizer, max_length=12)
    assert cut["input_ids"] == full["input_ids"][:12]
    assert cut["loss_mask"] == full["loss_mask"][:12]
    prompt_only = render_conversation(CONVERSATION[:2], chat_tokenizer)
    assert not any(prompt_only["loss_mask"])


def test_other_template_without_special_end_token(chat_tokenizer) -> None:
    plain = chat_tokenizer.__class__(
        tokenizer_object=chat_tokenizer.backend_tokenizer,
        eos_token="<|endoftext|>",
        chat_template=(
            "{% for m in messages %}{% if m['role'] == 'user' %}User: {{ m['content'] }}\n"
            "{% else %}Bot: {{ m['content'] }}\n{% endif %}{% endfor %}"
            "{% if add_generation_prompt %}Bot:{% endif %}"
        ),
    )
    messages = [
        {"role": "user", "content": "ping"},
        {"role": "assistant", "content": "pong"},
        {"role": "user", "content": "again"},
        {"role": "assistant", "content": "pong pong"},
    ]
    rendered = render_conversation(messages, plain)
    runs = [plain.decode(run) for run in _masked_runs(rendered["input_ids"], rendered["loss_mask"])]
    # The generation prompt ends at "Bot:", so the space after it belongs to the answer; with no
    # special end token the whole turn, newline included, is the assistant's.
    assert runs == [" pong\n", " pong pong\n"]


def test_errors(chat_tokenizer) -> None:
    no_template = chat_tokenizer.__class__(tokenizer_object=chat_tokenizer.backend_tokenizer)
    with pytest.raises(ValueError, match="no chat_template"):
        render_conversation(CONVERSATION, no_template)
    with pytest.raises(ValueError, match="'role' and 'content'"):
        render_conversation([{"role": "user"}], chat_tokenizer)
    with pytest.raises(ValueError, match="empty conversation"):
        render_conversation([], chat_tokenizer)
    rewriting = chat_tokenizer.__class__(
        tokenizer_object=chat_tokenizer.backend_tokenizer,
        chat_template="{{ messages | length }}{% for m in messages %}|{{ m['content'] }}{% endfor %}",
    )
    with pytest.raises(ValueError, match="prefix"):
        render_conversation(
            [{"role": "user", "content": "a"}, {"role": "assistant", "content": "b"}], rewriting
        )
