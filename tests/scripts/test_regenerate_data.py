"""scripts/regenerate_data.py: target responses as datasets-loadable JSONL that distill reads."""

from __future__ import annotations

import json
import os
import re
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

    from draftsmith.train.distill import main

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
    from draftsmith.train.regeneration.endpoint import (
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


# -- hostile input --------------------------------------------------------------------------------


def _no_loading(monkeypatch: pytest.MonkeyPatch) -> None:
    """Make loading the target fail the test: what is checked here must be checked before."""
    import draftsmith.train.target.model

    def refuse(*_: object, **__: object) -> None:
        raise AssertionError("the target loaded before the bad input was refused")

    monkeypatch.setattr(draftsmith.train.target.model, "load_target", refuse)


def test_hostile_flags_are_refused_by_name_before_anything_loads(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """Counts below 1, bad sampling values and seeds, flags that would be ignored silently
    where they do nothing, empty values and output paths that cannot be written: exit 2."""
    prompts = _prompts_file(tmp_path / "prompts.jsonl", 2)
    (tmp_path / "afile").write_text("x")
    base = ["--target", "tiny", "--prompts", str(prompts), "--output", str(tmp_path / "o.jsonl")]
    endpoint = ["--endpoint", "http://127.0.0.1:9/v1"]
    for flags, message in (
        (["--num-prompts", "0"], "argument --num-prompts: must be an integer >= 1, got 0"),
        (["--num-prompts", "-1"], "argument --num-prompts: must be an integer >= 1, got -1"),
        (["--max-new-tokens", "0"], "argument --max-new-tokens: must be an integer >= 1"),
        (["--batch-size", "-1"], "argument --batch-size: must be an integer >= 1"),
        (["--temperature", "-1"], "argument --temperature: must be a finite number >= 0"),
        (["--temperature", "nan"], "argument --temperature: must be a finite number >= 0"),
        (["--top-p", "0"], "argument --top-p: must be a number in (0, 1]"),
        (["--top-k", "-1"], "argument --top-k: must be an integer >= 0"),
        (["--seed", "-1"], "argument --seed: must be an integer in 0..4294967295"),
        (["--seed", str(2**70)], "argument --seed: must be an integer in 0..4294967295"),
        (["--prompts", ""], "--prompts is empty"),
        (["--prompts", str(tmp_path)], "is a folder; pass a .jsonl or .json file in it"),
        (["--prompt-field", ""], "--prompt-field is empty"),
        (["--prompt-chars", "50"], "--prompt-chars only applies with --prompts stdlib-defs"),
        (["--max-files", "3"], "--max-files only applies with --prompts stdlib or stdlib-defs"),
        (["--prompts", "stdlib", "--prompt-tokens", "1"], "--prompt-tokens must be >= 2"),
        (["--prompts", "stdlib", "--prompt-field", "x"], "--prompt-field names a field of a"),
        (["--concurrency", "4"], "--concurrency only applies with --endpoint"),
        (["--model", "m"], "--model only applies with --endpoint"),
        (["--endpoint", ""], "--endpoint is empty"),
        ([*endpoint, "--limit", "0"], "argument --limit: must be an integer >= 1"),
        ([*endpoint, "--max-retries", "-1"], "argument --max-retries: must be an integer >= 0"),
        ([*endpoint, "--batch-size", "4"], "--batch-size does nothing with --endpoint"),
        (["--output", str(tmp_path)], "is a folder; pass a file path"),
        (["--output", str(tmp_path / "afile" / "o.jsonl")], "afile is a file, not a folder"),
        (["--system-prompt", ""], "--system-prompt is empty; pass the text, @FILE, or none"),
        (["--system-prompt", "@" + str(tmp_path / "none.txt")], "no such file; pass @FILE"),
        (["--no-thinking-share", "1.5"], "argument --no-thinking-share: must be a number in"),
        (["--prompts", "stdlib-defs", "--system-prompt", "x"], "--system-prompt applies to chat"),
        (["--prompts", "stdlib", "--no-thinking-share", "0.5"], "--no-thinking-share applies to"),
    ):
        with pytest.raises(SystemExit) as exit_info:
            _script().parse_args([*base, *flags])
        assert exit_info.value.code == 2 and message in capsys.readouterr().err, flags


def test_bad_prompts_and_endpoints_are_refused_before_the_target_loads(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    _no_loading(monkeypatch)
    output = ["--output", str(tmp_path / "o.jsonl")]
    local = ["--target", "tiny", *output, "--prompts"]
    (tmp_path / "empty.jsonl").write_text("")
    (tmp_path / "cut.json").write_text('[{"prompt": "a"}, {"pro')
    (tmp_path / "number.json").write_text("42")
    chat = {"messages": [{"role": "user", "content": "b"}]}
    (tmp_path / "mixed.jsonl").write_text(f"{json.dumps({'prompt': 'a'})}\n{json.dumps(chat)}\n")
    plain = _prompts_file(tmp_path / "plain.jsonl", 2)
    for argv, error, message in (
        ([*local, str(tmp_path / "missing.jsonl")], FileNotFoundError, "does not exist"),
        ([*local, str(tmp_path / "empty.jsonl")], ValueError, "holds no records"),
        ([*local, str(tmp_path / "cut.json")], ValueError, "is not valid JSON"),
        ([*local, str(tmp_path / "number.json")], ValueError, "holds a JSON int"),
        ([*local, str(tmp_path / "mixed.jsonl")], ValueError, "mix plain strings and chat"),
        ([*local, str(plain), "--system-prompt", "Be brief."], ValueError,
         "--system-prompt applies to chat prompts, and"),
        ([*local, str(plain), "--no-thinking-share", "0.5"], ValueError,
         "--no-thinking-share applies to chat prompts"),
        ([*local, "no-such-dataset"], FileNotFoundError, "no-such-dataset: not a file or folder here"),
        (["--endpoint", "http://", "--prompts", "stdlib", *output], ValueError, "names no host"),
        (["--endpoint", "http://h:port/v1", "--prompts", "stdlib", *output], ValueError, "Port"),
        (["--endpoint", "http://h/v1", "--timeout", "nan", "--prompts", "stdlib", *output],
         ValueError, "--timeout must be a finite number of seconds > 0, got nan"),
    ):  # fmt: skip
        with pytest.raises(error, match=re.escape(message)):
            _script().main(argv)
    assert not (tmp_path / "o.jsonl").exists()


def test_new_tokens_past_the_targets_context_are_refused_before_generating(
    tmp_path: Path, target: Path
) -> None:
    prompts = _prompts_file(tmp_path / "prompts.jsonl", 2)
    out = tmp_path / "o.jsonl"
    argv = ["--target", str(target), "--prompts", str(prompts), "--output", str(out),
            "--max-new-tokens", "100000"]  # fmt: skip
    with pytest.raises(ValueError, match="passes the target's context of 2048 tokens"):
        _script().main(argv)
    assert not out.exists()


def test_a_bad_flag_ends_the_command_with_one_line_and_status_2(tmp_path: Path) -> None:
    (tmp_path / "cut.jsonl").write_text('{"prompt": "a"}\n{"prompt": ')
    argv = ["--target", "tiny", "--prompts", str(tmp_path / "cut.jsonl"), "--output",
            str(tmp_path / "o.jsonl")]  # fmt: skip
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "XDG_CACHE_HOME": str(tmp_path / "cache")}
    result = subprocess.run(
        [sys.executable, str(REPO / "scripts" / "regenerate_data.py"), *argv],
        cwd=REPO, env=env, capture_output=True, text=True, timeout=120,
    )  # fmt: skip
    assert result.returncode == 2, result.stderr
    assert "Traceback" not in result.stderr and "cut.jsonl:2 is not valid JSON" in result.stderr
    assert not (tmp_path / "cache").exists()  # the demo target was neither built nor loaded


def test_an_output_this_script_did_not_write_is_refused_and_left_as_it_was(
    tmp_path: Path,
) -> None:
    """Resuming cut everything after the last newline before reading the file: an unrelated
    --output (a JSON document on one line, say) lost its content. Now it is read first."""
    from draftsmith.train.regeneration.endpoint import completed_indices

    prompts = ["def f(x):\n"]
    for content, message in (
        (b'{"settings": {"a": 1}}', "ends with a line that is no regenerated record"),
        (b'{"a": 1}\n{"b": 2', "ends with a line that is no regenerated record"),
        (b'{"a": 1}\n{"index": 0, "prom', ":1: not a regenerated record"),
        (b"\xff\xfe\x00binary\n", "is not UTF-8 text"),
        (b'{"index": 0, "messages": [1]}\n', "the record's prompt differs from prompt 0"),
    ):
        output = tmp_path / "other.jsonl"
        output.write_bytes(content)
        with pytest.raises(ValueError, match=re.escape(message)):
            completed_indices(output, prompts)
        assert output.read_bytes() == content
    ours = json.dumps({"index": 0, "prompt": prompts[0], "response": "a"}).encode()
    output.write_bytes(ours + b'\n{"index": 1, "pro')  # a writer killed mid-line
    assert completed_indices(output, [*prompts, "b"]) == {0}
    assert output.read_bytes() == ours + b"\n"
