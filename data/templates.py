"""Render a conversation with the tokenizer's chat template and mark the assistant tokens.

The loss is taken only where the model should produce text: on assistant tokens, including the
token that ends an assistant turn (so the model learns to stop), and never on system, user or
template tokens (role headers, turn separators). This is the standard recipe for supervised
fine-tuning on chat data (Ouyang et al. 2022, InstructGPT; the "assistant-only loss" of TRL).

The assistant spans are found without ``{% generation %}`` markers, so any chat template works:
for assistant message ``i`` the span starts where ``messages[:i]`` rendered with
``add_generation_prompt=True`` ends and stops where ``messages[:i + 1]`` rendered ends, both
measured in token ids of the full rendering. Inside the span, tokens after the first special
token (e.g. ``<|im_end|>``, ``<|eot_id|>``, ``</s>``) are template separators (ChatML's
trailing newline) and get 0.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

from transformers import PreTrainedTokenizerBase


def _render(
    tokenizer: PreTrainedTokenizerBase,
    messages: Sequence[Mapping[str, Any]],
    add_generation_prompt: bool,
) -> list[int]:
    text = tokenizer.apply_chat_template(
        [dict(message) for message in messages],
        tokenize=False,
        add_generation_prompt=add_generation_prompt,
    )
    # The template writes bos/eos itself where it wants them: add nothing more.
    return list(tokenizer(text, add_special_tokens=False)["input_ids"])


def _agreed_prefix(prefix_ids: list[int], full_ids: list[int], what: str) -> int:
    """Length of the common prefix of a prefix rendering and the full rendering.

    One differing token at the end is tolerated (a BPE merge across the boundary); more means
    the template renders earlier turns differently once later turns exist.
    """
    agreed = 0
    for a, b in zip(prefix_ids, full_ids, strict=False):
        if a != b:
            break
        agreed += 1
    if agreed < len(prefix_ids) - 1:
        raise ValueError(
            f"the chat template renders {what} differently on its own than inside the full "
            f"conversation (token ids agree for {agreed} of {len(prefix_ids)}), e.g. because it "
            "rewrites earlier turns; render_conversation needs a template whose rendering of a "
            "conversation prefix is a prefix of the full rendering"
        )
    return agreed


def render_conversation(
    messages: list[dict],
    tokenizer: PreTrainedTokenizerBase,
    max_length: int | None = None,
) -> dict[str, list[int]]:
    """Token ids of the rendered conversation and its assistant-only ``loss_mask``.

    Returns ``input_ids`` and ``loss_mask`` (same length; 1 on assistant tokens including the
    turn's end token, 0 elsewhere), truncated to ``max_length`` tokens when given. A
    conversation without an assistant message gets an all-zero mask.
    """
    if not getattr(tokenizer, "chat_template", None):
        raise ValueError(
            "the tokenizer has no chat_template; set tokenizer.chat_template (for instance "
            "data.tokenizer.CHATML_TEMPLATE) or use the tokenizer of a chat model"
        )
    if max_length is not None and max_length < 1:
        raise ValueError(f"max_length must be >= 1 or None (no truncation), got {max_length}")
    if len(messages) == 0:
        raise ValueError("render_conversation got an empty conversation; pass at least one message")
    for index, message in enumerate(messages):
        if not isinstance(message, Mapping) or "role" not in message or "content" not in message:
            raise ValueError(
                f"message {index} is {message!r}; each message must be a dict with 'role' and "
                "'content'"
            )

    full_ids = _render(tokenizer, messages, add_generation_prompt=False)
    special_ids = set(tokenizer.all_special_ids)
    loss_mask = [0] * len(full_ids)
    for index, message in enumerate(messages):
        if message["role"] != "assistant":
            continue
        start = _agreed_prefix(
            _render(tokenizer, messages[:index], add_generation_prompt=True),
            full_ids,
            f"the prompt before message {index}",
        )
        end = _agreed_prefix(
            _render(tokenizer, messages[: index + 1], add_generation_prompt=False),
            full_ids,
            f"the conversation up to message {index}",
        )
        for position in range(start, end):
            loss_mask[position] = 1
            if full_ids[position] in special_ids:
                break
    if max_length is not None:
        full_ids, loss_mask = full_ids[:max_length], loss_mask[:max_length]
    return {"input_ids": full_ids, "loss_mask": loss_mask}
