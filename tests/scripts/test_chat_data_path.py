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


SYSTEM = "You answer in one line."


def _mixed_modes(bodies: list[dict]):
    """A reasoning server that honours ``enable_thinking=False`` from chat_template_kwargs."""

    def answer(request: httpx.Request) -> httpx.Response:
        if request.url.path.endswith("/models"):
            return httpx.Response(200, json={"data": [{"id": "qwen3"}]})
        body = json.loads(request.content)
        bodies.append(body)
        question = body["messages"][-1]["content"]
        message = {"role": "assistant", "content": f"Answer to {question}"}
        if body.get("chat_template_kwargs", {}).get("enable_thinking", True):
            message["reasoning_content"] = f"Thinking about {question}"
        return httpx.Response(
            200,
            json={"choices": [{"message": message, "finish_reason": "stop"}],
                  "usage": {"completion_tokens": 9}},
        )  # fmt: skip

    return answer


def test_a_system_prompt_and_a_thinking_mix_reach_the_engine_and_the_training_rows(
    tmp_path: Path,
) -> None:
    from draftsmith.data.chat_context import prompts_with_system_prompt, thinking_off_indices

    prompts = [[{"role": "user", "content": f"question {i}"}] for i in range(6)]
    prompts[5] = [{"role": "system", "content": "Its own system turn."}, *prompts[5]]
    off = thinking_off_indices(len(prompts), 0.5, seed=0)
    assert len(off) == 3 and off == thinking_off_indices(len(prompts), 0.5, seed=0)
    bodies: list[dict] = []
    output = tmp_path / "mixed.jsonl"
    with httpx.Client(transport=httpx.MockTransport(_mixed_modes(bodies))) as client:
        report = regenerate_through_endpoint(
            prompts_with_system_prompt(prompts, SYSTEM), output,
            GenerationSettings(max_tokens=32, thinking_off=off),
            EndpointConfig(url="http://engine/v1", concurrency=1), progress=False, client=client,
        )  # fmt: skip
    assert report.written == 6
    # The engine is asked to skip thinking for exactly the chosen prompts.
    switched = {int(b["messages"][-1]["content"].split()[-1]) for b in bodies
                if b.get("chat_template_kwargs") == {"enable_thinking": False}}  # fmt: skip
    assert switched == set(off)
    records = {r["index"]: r for r in map(json.loads, output.read_text().splitlines())}
    for index, record in records.items():
        system = record["messages"][0]
        assert system["role"] == "system"
        assert system["content"] == ("Its own system turn." if index == 5 else SYSTEM)
        assert record.get("thinking", True) == (index not in off)
        assert record["messages"][-1]["content"].startswith("<think>") == (index not in off)

    # Training reads both modes: a thinking answer from its <think>, a plain one from its first
    # word (the empty think block is the prompt an engine gives with thinking off); the system
    # turn is context, never trained.
    tokenizer = family_tokenizer(QWEN3)
    think = tokenizer.convert_tokens_to_ids("<think>")
    rows = _rows(output, tokenizer)
    assert len(rows) == 6
    for row in rows:
        ids, mask = list(row["input_ids"]), list(row["loss_mask"])
        text = tokenizer.decode(ids)
        trained = tokenizer.decode([i for i, m in zip(ids, mask, strict=True) if m])
        index = int(text.split("question ")[1].split("<")[0])
        assert ("<think>" in trained) == (index not in off)
        assert trained.startswith("<think>" if index not in off else "Answer to")
        assert SYSTEM not in trained and "Its own" not in trained
        assert (SYSTEM in text) == (index != 5)
        assert ids[next(j for j, m in enumerate(mask) if m)] == think or index in off


def test_the_recipes_system_prompt_opens_conversations_without_one(tmp_path: Path) -> None:
    data = _jsonl(tmp_path / "openai.jsonl", [
        {"messages": [{"role": "system", "content": "Be brief."},
                      {"role": "user", "content": "Capital of France?"},
                      {"role": "assistant", "content": "Paris."}]},
        {"messages": [{"role": "user", "content": "Spell cat."},
                      {"role": "assistant", "content": "c-a-t"}]},
    ] * 2)  # fmt: skip
    tokenizer = family_tokenizer(LLAMA31)
    sets = load_sequences(
        str(data), tokenizer, block_size=4096, validation_fraction=0.5, seed=0,
        system_prompt=SYSTEM,
    )  # fmt: skip
    for row in [*sets.train, *sets.held_out]:
        ids, mask = list(row["input_ids"]), list(row["loss_mask"])
        text = tokenizer.decode(ids)
        trained = tokenizer.decode([i for i, m in zip(ids, mask, strict=True) if m])
        assert ("Be brief." in text) != (SYSTEM in text)  # its own system turn wins
        assert ("Be brief." in text) == ("Paris." in text)
        assert SYSTEM not in trained and trained.endswith("<|eot_id|>")


def test_a_generation_prompt_with_thinking_off_holds_the_empty_think_block() -> None:
    from draftsmith.train.regeneration.in_process import make_record, prompt_ids

    tokenizer = family_tokenizer(QWEN3)
    prompt = [{"role": "user", "content": "hi"}]
    on = tokenizer.decode(prompt_ids(tokenizer, prompt))
    off = tokenizer.decode(prompt_ids(tokenizer, prompt, thinking=False))
    assert on.endswith("<|im_start|>assistant\n")
    assert off == on + "<think>\n\n</think>\n\n"
    # A template without the switch ignores it.
    llama = family_tokenizer(LLAMA31)
    assert prompt_ids(llama, prompt, thinking=False) == prompt_ids(llama, prompt)
    assert make_record(prompt, "x", thinking=False)["thinking"] is False
    assert "thinking" not in make_record(prompt, "x")
