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

Reasoning models. Qwen3's template renders an assistant turn one way when it is the last turn
(``<think>\n{reasoning}\n</think>\n\n{answer}``, an empty think block when there is no
reasoning) and another way once a later user turn follows (the answer alone: the engine drops
past reasoning from the context it serves). Each assistant turn is masked in the form the full
rendering gives it: the final turn with its ``<think>`` span, exactly the tokens the target
emits after the generation prompt (``<think>`` and ``</think>`` are ordinary added tokens, not
special ones, so the span runs on to the turn's end token); a past turn as its answer, up to its
end token. A think block written into an assistant message's content (what
``scripts/regenerate_data.py`` records from a reasoning target) is what the template reads. An
answer without one (a target served with thinking off) is masked from its first token: the empty
think block the template writes before it is the prompt such a target was given.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

from transformers import PreTrainedTokenizerBase

THINK_END = "</think>"  # the end of a reasoning model's think span (Qwen3, DeepSeek-R1)


def _render(
    tokenizer: PreTrainedTokenizerBase,
    messages: Sequence[Mapping[str, Any]],
    add_generation_prompt: bool,
    **template_kwargs: Any,
) -> list[int]:
    text = tokenizer.apply_chat_template(
        [dict(message) for message in messages],
        tokenize=False,
        add_generation_prompt=add_generation_prompt,
        **template_kwargs,
    )
    # The template writes bos/eos itself where it wants them: add nothing more.
    return list(tokenizer(text, add_special_tokens=False)["input_ids"])


def _common_length(prefix_ids: list[int], full_ids: list[int]) -> int:
    agreed = 0
    for a, b in zip(prefix_ids, full_ids, strict=False):
        if a != b:
            break
        agreed += 1
    return agreed


def _agrees(prefix_ids: list[int], agreed: int) -> bool:
    """One differing token at the end is tolerated (a BPE merge across the boundary)."""
    return agreed >= len(prefix_ids) - 1


def _agreed_prefix(prefix_ids: list[int], full_ids: list[int], what: str) -> int:
    """Length of the common prefix of a prefix rendering and the full rendering.

    One differing token at the end is tolerated (a BPE merge across the boundary); more means
    the template renders earlier turns differently once later turns exist.
    """
    agreed = _common_length(prefix_ids, full_ids)
    if not _agrees(prefix_ids, agreed):
        raise ValueError(
            f"the chat template renders {what} differently on its own than inside the full "
            f"conversation (token ids agree for {agreed} of {len(prefix_ids)}), e.g. because it "
            "rewrites earlier turns; render_conversation needs a template whose rendering of a "
            "conversation prefix is a prefix of the full rendering"
        )
    return agreed


def _past_empty_think_block(
    tokenizer: PreTrainedTokenizerBase,
    prompt: Sequence[Mapping[str, Any]],
    full_ids: list[int],
    start: int,
) -> int:
    """Where an answer without reasoning starts, after any empty think block the template wrote.

    A reasoning template writes ``<think>\n\n</think>\n\n`` before an answer that has no
    reasoning; the target emits no such block: served with ``enable_thinking=False`` the engine
    puts it in the prompt, which is what this rendering of the prompt shows. Templates without
    that switch render the same prompt, and ``start`` stands.
    """
    quiet = _render(tokenizer, prompt, add_generation_prompt=True, enable_thinking=False)
    agreed = _common_length(quiet, full_ids)
    return agreed if agreed == len(quiet) and agreed > start else start


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
            "draftsmith.data.tokenizer.CHATML_TEMPLATE) or use the tokenizer of a chat model"
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
        if THINK_END not in message["content"]:
            start = _past_empty_think_block(tokenizer, messages[:index], full_ids, start)
        turn_ids = _render(tokenizer, messages[: index + 1], add_generation_prompt=False)
        end = _common_length(turn_ids, full_ids)
        if not _agrees(turn_ids, end):
            # The template writes this turn differently once later turns follow (a reasoning
            # model's past turn loses its think block): mask its form in the full rendering,
            # up to the turn's end token. Only a past turn can differ, never the last message.
            end = len(full_ids)
        for position in range(start, end):
            loss_mask[position] = 1
            if full_ids[position] in special_ids:
                break
    if max_length is not None:
        full_ids, loss_mask = full_ids[:max_length], loss_mask[:max_length]
    return {"input_ids": full_ids, "loss_mask": loss_mask}
