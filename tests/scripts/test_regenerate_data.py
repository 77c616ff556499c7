"""scripts/regenerate_data.py: target responses as datasets-loadable JSONL that distill reads."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from types import ModuleType

import datasets
import httpx
import pytest
from script_helpers import load_script
from serve_helpers import serving

REPO = Path(__file__).resolve().parents[2]
API_KEY = "regenerate-key"


def _script() -> ModuleType:
    return load_script("regenerate_data")


def test_plain_prompts_become_prompt_response_records(tmp_path: Path, target: Path) -> None:
    prompts = tmp_path / "prompts.jsonl"
    prompts.write_text(
        "".join(json.dumps({"prompt": f"def f{i}(x):\n    "}) + "\n" for i in range(5))
    )
    out = tmp_path / "regen.jsonl"
    argv = ["--target", str(target), "--prompts", str(prompts), "--output", str(out),
            "--max-new-tokens", "12", "--batch-size", "2", "--seed", "3"]  # fmt: skip
    result = _script().main(argv)
    assert result["records"] == 5
    table = datasets.load_dataset("json", data_files=str(out), split="train")
    assert table.column_names == ["prompt", "response", "text"]
    assert table[0]["text"] == table[0]["prompt"] + table[0]["response"]
    first = out.read_text()
    _script().main(argv)
    assert out.read_text() == first  # seeded: the same responses again
    assert not list(tmp_path.glob(".regen.jsonl.tmp-*"))

    from train.distill import main

    summary = main(["--config", str(REPO / "configs" / "tiny.yaml"), "--target", str(target),
                    "--output_dir", str(tmp_path / "run"), "--dataset", str(out),
                    "--validation_fraction", "0.4", "--eval_source", "data", "--max_steps", "2",
                    "--per_device_batch_size", "2"])  # fmt: skip
    assert "prompt_response" in summary["data"]


def test_chat_prompts_become_conversations(tmp_path: Path, target: Path) -> None:
    prompts = tmp_path / "chat.jsonl"
    record = {"messages": [{"role": "user", "content": "write a loop"}]}
    prompts.write_text(json.dumps(record) + "\n" + json.dumps(record) + "\n")
    out = tmp_path / "chat-out.jsonl"
    _script().main(["--target", str(target), "--prompts", str(prompts), "--output", str(out),
                    "--max-new-tokens", "6"])  # fmt: skip
    rows = [json.loads(line) for line in out.read_text().splitlines()]
    assert [m["role"] for m in rows[0]["messages"]] == ["user", "assistant"]


def test_corpus_prompts(tmp_path: Path, target: Path) -> None:
    out = tmp_path / "corpus.jsonl"
    result = _script().main(["--target", str(target), "--prompts", "stdlib", "--num-prompts", "4",
                             "--max-files", "20", "--prompt-tokens", "8", "--output", str(out),
                             "--max-new-tokens", "5"])  # fmt: skip
    assert result["records"] == 4


def test_corpus_definition_prompts_through_the_script(tmp_path: Path, target: Path) -> None:
    out = tmp_path / "defs.jsonl"
    result = _script().main(["--target", str(target), "--prompts", "stdlib-defs",
                             "--num-prompts", "3", "--max-files", "20", "--prompt-chars", "120",
                             "--output", str(out), "--max-new-tokens", "4"])  # fmt: skip
    rows = [json.loads(line) for line in out.read_text().splitlines()]
    assert result["records"] == 3 and len(rows) == 3
    for row in rows:
        assert len(row["prompt"]) == 120
        assert row["prompt"].splitlines()[-1].lstrip().startswith(("def ", "class "))
        assert row["text"] == row["prompt"] + row["response"]


# -- through a served engine (--endpoint) ---------------------------------------------------------


@pytest.fixture(scope="module")
def endpoint(target: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    """decode/serve.py serving the tiny target (no drafter) on a free loopback port."""
    log = tmp_path_factory.mktemp("serve") / "server.log"
    with serving(target, log, "--served-model-name", "tiny", "--api-key", API_KEY) as url:
        yield url


def _prompts_file(path: Path, count: int) -> Path:
    lines = [json.dumps({"prompt": f"def f{i}(x):\n    return "}) for i in range(count)]
    path.write_text("\n".join(lines) + "\n")
    return path


def _remote(endpoint: str, prompts: Path, out: Path, *flags: str) -> list[str]:
    return ["--endpoint", endpoint, "--api-key", API_KEY, "--prompts", str(prompts),
            "--output", str(out), "--max-new-tokens", "8", "--temperature", "0",
            "--concurrency", "3", "--no-progress", *flags]  # fmt: skip


def _by_index(out: Path) -> dict[int, dict]:
    rows = [json.loads(line) for line in out.read_text().splitlines()]
    by_index = {row["index"]: row for row in rows}
    assert len(by_index) == len(rows), "a prompt was answered twice"
    return by_index


def test_endpoint_run_interrupted_by_a_limit_and_a_torn_line_resumes_exactly(
    tmp_path: Path, endpoint: str
) -> None:
    prompts = _prompts_file(tmp_path / "prompts.jsonl", 10)
    whole = tmp_path / "whole.jsonl"
    result = _script().main(_remote(endpoint, prompts, whole))
    assert result["written"] == 10 and result["failed"] == 0 and result["completion_tokens"] > 0
    expected = _by_index(whole)
    assert sorted(expected) == list(range(10))
    assert all(r["text"] == r["prompt"] + r["response"] for r in expected.values())

    out = tmp_path / "resumed.jsonl"
    first = _script().main(_remote(endpoint, prompts, out, "--limit", "4"))
    assert first["written"] == 4 and first["missing"] == 6
    with out.open("ab") as stream:  # a writer killed mid-line
        stream.write(b'{"index": 9, "prompt": "def f9(x):\\n    ret')
    second = _script().main(_remote(endpoint, prompts, out))
    assert second["already_done"] == 4 and second["written"] == 6 and second["missing"] == 0
    assert _by_index(out) == expected  # greedy: the same answers, none lost, none twice
    again = _script().main(_remote(endpoint, prompts, out))
    assert again["written"] == 0 and again["records"] == 10

    table = datasets.load_dataset("json", data_files=str(out), split="train")
    assert {"prompt", "response", "text"} <= set(table.column_names)


@pytest.mark.slow
def test_endpoint_run_killed_midway_loses_and_repeats_nothing(
    tmp_path: Path, endpoint: str
) -> None:
    prompts = _prompts_file(tmp_path / "prompts.jsonl", 24)
    out = tmp_path / "out.jsonl"
    argv = _remote(endpoint, prompts, out, "--max-new-tokens", "24", "--concurrency", "2")
    env = {**os.environ, "HF_HUB_OFFLINE": "1"}
    process = subprocess.Popen(
        [sys.executable, str(REPO / "scripts" / "regenerate_data.py"), *argv],
        cwd=REPO, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE,
    )  # fmt: skip
    deadline = time.monotonic() + 300
    while process.poll() is None and time.monotonic() < deadline:
        if out.exists() and out.read_bytes().count(b"\n") >= 3:
            break
        time.sleep(0.02)
    process.send_signal(signal.SIGKILL)
    stderr = process.communicate()[1].decode()
    assert process.returncode == -signal.SIGKILL, f"finished before the kill: {stderr[-2000:]}"
    before = out.read_bytes().count(b"\n")
    assert 3 <= before < 24
    result = _script().main(argv)
    assert result["already_done"] == before and result["written"] == 24 - before
    assert sorted(_by_index(out)) == list(range(24))


def test_endpoint_chat_prompts_get_the_servers_chat_template(tmp_path: Path, endpoint: str) -> None:
    prompts = tmp_path / "chat.jsonl"
    record = {"messages": [{"role": "user", "content": "write a loop"}]}
    prompts.write_text(json.dumps(record) + "\n" + json.dumps(record) + "\n")
    out = tmp_path / "chat-out.jsonl"
    result = _script().main(_remote(endpoint, prompts, out))
    assert result["written"] == 2
    rows = _by_index(out)
    assert [m["role"] for m in rows[0]["messages"]] == ["user", "assistant"]
    assert rows[0]["messages"][0] == record["messages"][0]


def test_endpoint_output_of_other_prompts_is_refused(tmp_path: Path, endpoint: str) -> None:
    out = tmp_path / "out.jsonl"
    _script().main(_remote(endpoint, _prompts_file(tmp_path / "a.jsonl", 2), out))
    other = tmp_path / "b.jsonl"
    other.write_text(json.dumps({"prompt": "something else"}) + "\n" * 2)
    with pytest.raises(ValueError, match="belongs to another prompts file"):
        _script().main(_remote(endpoint, other, out))


def test_a_wrong_key_fails_every_prompt_without_retrying(tmp_path: Path, endpoint: str) -> None:
    prompts = _prompts_file(tmp_path / "prompts.jsonl", 3)
    argv = _remote(endpoint, prompts, tmp_path / "out.jsonl", "--model", "tiny")
    argv[argv.index(API_KEY)] = "wrong-key"
    result = _script().main(argv)
    assert result["failed"] == 3 and result["written"] == 0 and result["retries"] == 0
    assert "HTTP 401" in result["failures"][0]


# -- retries, without a server ----------------------------------------------------------------------


def _answer(text: str) -> httpx.Response:
    body = {"choices": [{"text": text, "finish_reason": "stop"}], "usage": {"completion_tokens": 1}}
    return httpx.Response(200, json=body)


def test_transient_errors_are_retried_with_backoff_and_client_errors_are_not(
    tmp_path: Path,
) -> None:
    from train.regenerate_endpoint import (
        EndpointConfig,
        GenerationSettings,
        regenerate_through_endpoint,
    )

    script: dict[str, list] = {
        "p0": [httpx.ConnectError("refused"), httpx.Response(503), _answer(" a")],
        "p1": [httpx.Response(429, headers={"Retry-After": "0"}), _answer(" b")],
        "p2": [httpx.Response(400, json={"error": {"message": "bad"}}), _answer(" never")],
        "p3": [httpx.Response(500)] * 3,  # more failures than retries
    }
    seen: list[str] = []

    def handler(request: httpx.Request) -> httpx.Response:
        prompt = json.loads(request.content)["prompt"]
        seen.append(prompt)
        step = script[prompt].pop(0)
        if isinstance(step, Exception):
            raise step
        return step

    client = httpx.Client(transport=httpx.MockTransport(handler))
    endpoint = EndpointConfig("http://engine/v1", model="m", max_retries=2, backoff_s=0.0)
    out = tmp_path / "out.jsonl"
    report = regenerate_through_endpoint(
        ["p0", "p1", "p2", "p3"], out, GenerationSettings(4), endpoint, progress=False,
        client=client,
    )  # fmt: skip
    assert (report.written, report.failed, report.missing) == (2, 2, 2)
    assert seen.count("p0") == 3 and seen.count("p1") == 2
    assert seen.count("p2") == 1  # a 400 is not retried
    assert seen.count("p3") == 3  # 1 try + 2 retries
    assert report.retries == 2 + 1 + 0 + 2
    rows = _by_index(out)
    assert {i: r["response"] for i, r in rows.items()} == {0: " a", 1: " b"}
    assert any("HTTP 400" in f for f in report.failures)
