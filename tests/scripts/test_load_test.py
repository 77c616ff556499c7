"""scripts/load_test.py on hostile input: refused by name before any request, a server that
cannot be asked for its model named with the fix, a run that measured nothing not passed.
(tests/decode/test_serve.py runs it against a live server.)"""

from __future__ import annotations

import asyncio
import importlib.util
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
