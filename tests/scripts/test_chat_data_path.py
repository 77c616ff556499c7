"""From a chat dataset to training rows: ShareGPT and OpenAI files -> the target's chat template
-> scripts/regenerate_data.py --endpoint (our own server) -> assistant-only loss masks, checked
token by token against the template's turn markers; a reasoning target's think span included."""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest
from draftsmith.data.sequences import load_sequences
from draftsmith.train.regeneration.endpoint import (
    EndpointConfig,
    GenerationSettings,
    regenerate_through_endpoint,
)
from real_targets import LLAMA31, QWEN3, family_tokenizer
from script_helpers import load_script
from serve_helpers import serving

SHAREGPT = [
    {"id": "a", "conversations": [
        {"from": "system", "value": "You are terse."},
        {"from": "human", "value": "Name a prime."},
        {"from": "gpt", "value": "Seven."},
        {"from": "human", "value": "Another one?"},
        {"from": "gpt", "value": "Eleven."},
    ]},
    {"id": "b", "conversations": [{"from": "human", "value": "Say hi."}]},
    {"id": "c", "conversations": [
        {"from": "human", "value": "What is 2 + 3?"}, {"from": "gpt", "value": "5"},
    ]},
]  # fmt: skip
OPENAI = [
    {"messages": [{"role": "system", "content": "Be brief."},
                  {"role": "user", "content": "Capital of France?"}]},
    {"messages": [{"role": "user", "content": "Count to three."},
                  {"role": "assistant", "content": "1 2 3"},
                  {"role": "user", "content": "Now backwards."}]},
    {"messages": [{"role": "user", "content": "Spell cat."}]},
]  # fmt: skip


def _jsonl(path: Path, records: list[dict]) -> Path:
    path.write_text("".join(json.dumps(r) + "\n" for r in records))
    return path


def _find(ids: list[int], pattern: list[int], start: int = 0) -> Iterator[int]:
    for i in range(start, len(ids) - len(pattern) + 1):
        if ids[i : i + len(pattern)] == pattern:
            yield i


def _expected_mask(ids: list[int], header: list[int], end_id: int, newlines: set[int]) -> list[int]:
    """1 from after each assistant header (its role tokens and the newlines after them) through
    the turn's end token, 0 elsewhere: the template's own markers, found without
    draftsmith.data.templates."""
    mask = [0] * len(ids)
    for at in _find(ids, header):
        position = at + len(header)
        while position < len(ids) and ids[position] in newlines:
            position += 1
        while position < len(ids):
            mask[position] = 1
            if ids[position] == end_id:
                break
            position += 1
    return mask


def _ids(tokenizer, text: str) -> list[int]:
    return tokenizer(text, add_special_tokens=False)["input_ids"]


def _newlines(tokenizer) -> set[int]:
    return {i for text in ("\n", "\n\n") for i in _ids(tokenizer, text)}


def _rows(output: Path, tokenizer) -> list[dict]:
    sets = load_sequences(str(output), tokenizer, block_size=4096, validation_fraction=0.34, seed=0)
    return [*sets.train, *sets.held_out]


@pytest.fixture(scope="module")
def llama_endpoint(llama31_target: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    log = tmp_path_factory.mktemp("serve") / "server.log"
    with serving(llama31_target, log, "--served-model-name", "llama") as url:
        yield url


@pytest.mark.slow  # ~1 min: builds the scaled Llama-3.1 target and starts the server
@pytest.mark.parametrize("shape", ["sharegpt", "openai"])
def test_chat_file_through_our_server_to_assistant_only_masks(
    shape: str, llama_endpoint: str, llama31_target: Path, tmp_path: Path
) -> None:
    records = SHAREGPT if shape == "sharegpt" else OPENAI
    prompts = _jsonl(tmp_path / f"{shape}.jsonl", records)
    output = tmp_path / "regenerated.jsonl"
    summary = load_script("regenerate_data").main(
        ["--endpoint", llama_endpoint, "--prompts", str(prompts), "--output", str(output),
         "--max-new-tokens", "6", "--temperature", "0", "--concurrency", "2", "--no-progress"]
    )  # fmt: skip
    assert summary["records"] == 3 and summary["failed"] == 0
    written = {r["index"]: r for r in map(json.loads, output.read_text().splitlines())}
    # The prompt is the conversation minus its final assistant turn, roles in OpenAI's names.
    assert [m["role"] for m in written[0]["messages"]] == (
        ["system", "user", "assistant", "user", "assistant"]
        if shape == "sharegpt"
        else ["system", "user", "assistant"]
    )
    assert written[0]["messages"][-2]["content"] == (
        "Another one?" if shape == "sharegpt" else "Capital of France?"
    )
    assert all(r["messages"][-1]["role"] == "assistant" for r in written.values())

    tokenizer = family_tokenizer(LLAMA31)
    rows = _rows(output, tokenizer)
    assert len(rows) == 3
    header = _ids(tokenizer, "<|start_header_id|>assistant<|end_header_id|>")
    eot = tokenizer.convert_tokens_to_ids("<|eot_id|>")
    for row in rows:
        ids, mask = list(row["input_ids"]), list(row["loss_mask"])
        assert ids[0] == tokenizer.bos_token_id  # the template's own bos, once
        assert mask == _expected_mask(ids, header, eot, _newlines(tokenizer)), tokenizer.decode(ids)
        assert sum(mask) >= 1 and mask[-1] == 1 and ids[-1] == eot  # learns to stop


def _reasoning_answer(request: httpx.Request) -> httpx.Response:
    """A server with a reasoning parser: the think span comes apart from the answer."""
    if request.url.path.endswith("/models"):
        return httpx.Response(200, json={"data": [{"id": "qwen3"}]})
    body = json.loads(request.content)
    question = body["messages"][-1]["content"]
    message = {"role": "assistant", "content": f"Answer to {question}",
               "reasoning_content": f"The user asks {question}\nThink."}  # fmt: skip
    return httpx.Response(
        200,
        json={"choices": [{"message": message, "finish_reason": "stop"}],
              "usage": {"completion_tokens": 9}},
    )  # fmt: skip


def test_a_reasoning_targets_think_span_is_trained_as_it_emits_it(tmp_path: Path) -> None:
    prompts = [[{"role": "user", "content": f"question {i}"}] for i in range(3)]
    output = tmp_path / "qwen3.jsonl"
    with httpx.Client(transport=httpx.MockTransport(_reasoning_answer)) as client:
        report = regenerate_through_endpoint(
            prompts, output, GenerationSettings(max_tokens=32),
            EndpointConfig(url="http://engine/v1"), progress=False, client=client,
        )  # fmt: skip
    assert report.written == 3
    record = json.loads(output.read_text().splitlines()[0])
    assert record["messages"][-1]["content"].startswith("<think>\nThe user asks question")

    tokenizer = family_tokenizer(QWEN3)
    header = _ids(tokenizer, "<|im_start|>assistant")
    im_end = tokenizer.convert_tokens_to_ids("<|im_end|>")
    think = tokenizer.convert_tokens_to_ids(["<think>", "</think>"])
    for row in _rows(output, tokenizer):
        ids, mask = list(row["input_ids"]), list(row["loss_mask"])
        assert mask == _expected_mask(ids, header, im_end, _newlines(tokenizer))
        start = next(_find(ids, header)) + len(header) + 1  # after "assistant\n"
        assert ids[start] == think[0] and mask[start] == 1  # the target's first token: <think>
        assert think[1] in [i for i, m in zip(ids, mask, strict=True) if m]


def test_qwen3_past_turns_lose_their_think_and_a_plain_answer_skips_the_empty_block(
    tmp_path: Path,
) -> None:
    conversation = [
        {"role": "user", "content": "first"},
        {"role": "assistant", "content": "<think>\nold reasoning\n</think>\n\nold answer"},
        {"role": "user", "content": "second"},
        {"role": "assistant", "content": "<think>\nnew reasoning\n</think>\n\nnew answer"},
    ]
    plain = [{"role": "user", "content": "third"}, {"role": "assistant", "content": "plain"}]
    data = _jsonl(tmp_path / "chat.jsonl", [{"messages": conversation}, {"messages": plain}] * 2)
    tokenizer = family_tokenizer(QWEN3)
    im_end = tokenizer.convert_tokens_to_ids("<|im_end|>")
    for row in _rows(data, tokenizer):
        ids, mask = list(row["input_ids"]), list(row["loss_mask"])
        text = tokenizer.decode(ids)
        trained = tokenizer.decode([i for i, m in zip(ids, mask, strict=True) if m])
        if "first" in text:
            # The template drops the past turn's reasoning; the last turn keeps its think span.
            assert "old reasoning" not in text
            assert trained == (
                "old answer<|im_end|><think>\nnew reasoning\n</think>\n\nnew answer<|im_end|>"
            )
        else:
            # The template writes an empty think block the target never emitted: prompt, not
            # target, as an engine serving with thinking off puts it in the prompt.
            assert "<think>\n\n</think>\n\nplain" in text
            assert trained == "plain<|im_end|>"
            assert ids[[j for j, m in enumerate(mask) if m][-1]] == im_end
