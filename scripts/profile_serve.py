"""Where serving time goes: the offline decoder against the same decoder behind the server.

    draftsmith-profile-serve --target DIR [--drafter DIR] [--clients 1 8] \\
        [--max-tokens 128] [--draft-policy fixed load-aware] [--decoder process thread] \\
        [--num-threads 2] [--json FILE]

The same prompts (scripts/load_test.py's) are decoded two ways in one process: by the
offline decoder (``SpeculativeDecoder.generate``, one prompt at a time, fixed N), and by an
in-process ``OpenAIServer`` (uvicorn on a loopback port) for each ``--draft-policy`` and each
place ``--decoder`` names (its own process, or a thread of the server's), with
``--clients`` streaming clients sending the prompts back to back. The offline decoder runs
again before each server starts, and each run is compared with the offline speed measured
just before it: on a shared 2-core machine one offline pass moved by a tenth between passes.
Printed per run: completion tokens/s, the served/offline ratio, and for each batch size the server's rounds ran at, the
mean time of a round by phase (``draftsmith_round_seconds_total``: draft, verify, commit,
handoff, other) and the decoder thread's busy share of the wall time (the rest is the event
loop, tokenising, streaming and waiting for requests), and the CPU seconds each process spent
(the decoder's own process, where it has one, and this one: the front end and the clients
together), which show what the front end takes from the cores the decoder runs on. Ratios
within one run are what it
measures; absolute speeds depend on the machine and its load. ``--json`` keeps the same
figures with the machine they were measured on (``round_parts_table`` renders them, for
``draftsmith-report``).
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import os
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

PHASES = ("draft", "verify", "commit", "handoff", "other")


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    from draftsmith.decode.measure.side_by_side import at_least_one
    from draftsmith.decode.serving.config import DECODER_PLACES, DRAFT_POLICIES

    parser = argparse.ArgumentParser(
        description=__doc__.split("\n\n")[0],
        epilog="example: draftsmith-profile-serve --target $DEMO_TARGET "
        "--drafter outputs/distill-demo/drafter --clients 1 8 --json rounds.json",
    )
    add_measured_flags(parser, drafter_help="drafter folder (none: plain)")
    parser.add_argument("--max-tokens", type=at_least_one, default=128)
    parser.add_argument("--clients", type=at_least_one, nargs="+", default=[1, 8])
    parser.add_argument(
        "--draft-policy", nargs="+", default=["fixed", "load-aware"], help="server policies"
    )
    parser.add_argument(
        "--decoder", nargs="+", default=["process"], help="where the server's decoder runs"
    )
    parser.add_argument("--seconds", type=float, default=20.0, help="per served run")
    parser.add_argument("--json", type=Path, default=None, help="write the figures here")
    args = parser.parse_args(argv)
    if not 0 < args.seconds < float("inf"):
        parser.error(f"--seconds must be a finite number > 0, got {args.seconds}")
    for flag, values, known in (
        ("--draft-policy", args.draft_policy, DRAFT_POLICIES),
        ("--decoder", args.decoder, DECODER_PLACES),
    ):
        unknown = sorted(set(values) - set(known))
        if unknown:
            parser.error(f"{flag} {' '.join(unknown)}: unknown; choose from {', '.join(known)}")
    return args


def offline_tokens_per_s(decoder: Any, prompts: list[list[int]], max_tokens: int) -> float:
    """The offline decoder on each prompt alone (batch 1, no EOS), after one warm-up pass."""
    import torch

    def one(ids: list[int]) -> int:
        out = decoder.generate(
            torch.tensor([ids]), max_new_tokens=max_tokens, eos_token_id=[], temperature=0.0
        )
        return out.sequences.shape[1] - len(ids)

    one(prompts[0])
    start, tokens = time.perf_counter(), 0
    for ids in prompts:
        tokens += one(ids)
    return tokens / (time.perf_counter() - start)


def cpu_seconds(pid: int | None) -> float | None:
    """User + system CPU seconds of process ``pid`` (None: this process) so far, every
    thread included; None where ``/proc`` cannot say (not Linux, or the process is gone)."""
    if pid is None:
        times = os.times()
        return times.user + times.system
    try:
        fields = Path(f"/proc/{pid}/stat").read_text().rpartition(")")[2].split()
    except OSError:
        return None
    # After the command's closing parenthesis: state is field 3, utime 14 and stime 15.
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def cpu_summary(cpu_s: dict[str, float | None], wall: float) -> str:
    """``"front_end_and_clients 3.1 s (0.16 cores), decoder_process ..."``."""
    return ", ".join(
        f"{name} {seconds:.1f} s ({seconds / wall:.2f} cores)"
        for name, seconds in cpu_s.items()
        if seconds is not None
    )


@contextlib.contextmanager
def running(server: Any) -> Iterator[str]:
    """``server`` under uvicorn in a thread on a free loopback port; yields its URL."""
    import uvicorn
    from draftsmith.scripts.load_sweep import free_port

    port = free_port()
    instance = uvicorn.Server(server.uvicorn_config("127.0.0.1", port, log_level="warning"))
    thread = threading.Thread(target=instance.run, daemon=True)
    thread.start()
    while not instance.started:
        time.sleep(0.05)
    try:
        yield f"http://127.0.0.1:{port}"
    finally:
        instance.should_exit = True
        thread.join(30)


async def served_run(
    url: str, prompts: list[list[int]], clients: int, max_tokens: int, seconds: float
) -> tuple[float, float]:
    """(completion tokens/s, wall seconds): ``clients`` streaming clients, each sending the
    prompts (as token ids) back to back with ``ignore_eos`` until ``seconds`` pass."""
    import httpx
    from draftsmith.scripts.load_test import one_request

    async def client(index: int, deadline: float, counts: list[int]) -> None:
        sent = 0
        while time.monotonic() < deadline:
            body = {
                "model": "m",
                "prompt": prompts[(index + sent * clients) % len(prompts)],
                "max_tokens": max_tokens,
                "temperature": 0.0,
                "ignore_eos": True,
                "stream": True,
                "stream_options": {"include_usage": True},
            }
            sent += 1
            result = await one_request(http, "/v1/completions", body)
            if not result.ok:
                raise RuntimeError(result.error)
            counts.append(result.completion_tokens)

    async with httpx.AsyncClient(base_url=url, timeout=600) as http:
        counts: list[int] = []
        start = time.monotonic()
        await asyncio.gather(*(client(i, start + seconds, counts) for i in range(clients)))
        wall = time.monotonic() - start
    return sum(counts) / wall, wall


def round_breakdown(before: dict, after: dict) -> dict[str, dict[str, float]]:
    """Per batch bucket: rounds, mean ms per phase, busy seconds (between two /metrics)."""
    rows: dict[str, dict[str, float]] = {}
    for (name, labels), value in after.items():
        labels = dict(labels)
        delta = value - before.get((name, frozenset(labels.items())), 0.0)
        if name == "draftsmith_rounds_total":
            rows.setdefault(labels["batch"], {}).setdefault("rounds", 0.0)
            rows[labels["batch"]]["rounds"] += delta
            width = float(labels["drafted"])
            rows[labels["batch"]]["drafted"] = (
                rows[labels["batch"]].get("drafted", 0.0) + delta * width
            )
        elif name == "draftsmith_round_seconds_total":
            rows.setdefault(labels["batch"], {})[labels["phase"]] = delta
    return {batch: row for batch, row in rows.items() if row.get("rounds")}


def metrics_of(url: str) -> dict:
    import httpx

    return parse_metrics(httpx.get(f"{url}/metrics", timeout=30).text)


def parse_metrics(text: str) -> dict:
    """Prometheus samples as {(name, frozenset(labels)): value} (our own exposition)."""
    import re

    samples = {}
    for line in text.splitlines():
        if line.startswith("#") or not line:
            continue
        head, value = line.rsplit(" ", 1)
        name, _, rest = head.partition("{")
        labels = frozenset(re.findall(r'(\w+)="((?:[^"\\]|\\.)*)"', rest))
        samples[(name, labels)] = float(value)
    return samples


def add_measured_flags(parser: argparse.ArgumentParser, drafter_help: str) -> None:
    """The flags ``load_measured`` reads: --target, --drafter, --drafter-kind,
    --num-draft-tokens, --dtype and --num-threads."""
    from draftsmith.decode.measure.side_by_side import at_least_one

    parser.add_argument("--target", required=True, help="target model folder")
    parser.add_argument("--drafter", default=None, help=drafter_help)
    parser.add_argument(
        "--drafter-kind", default=None, help="registry key (default: read from --drafter)"
    )
    parser.add_argument("--num-draft-tokens", type=at_least_one, default=4)
    parser.add_argument("--dtype", default="auto")
    parser.add_argument("--num-threads", type=int, default=None)


def load_measured(args: argparse.Namespace, **fields: Any) -> tuple[Any, Any, Any, Any, list]:
    """``(config, target, tokenizer, drafter, prompts)`` for a measuring command: the
    ``ServeConfig`` of ``args``' --target, --drafter, --drafter-kind, --num-draft-tokens,
    --dtype and --num-threads (``fields``: further settings), its loaded parts, and the load
    tester's prompts as token ids."""
    from draftsmith.decode.serving.config import ServeConfig
    from draftsmith.decode.serving.loading import load_components
    from draftsmith.scripts.load_test import PROMPTS

    config = ServeConfig(
        target=args.target,
        drafter=args.drafter,
        drafter_kind=args.drafter_kind,
        num_draft_tokens=args.num_draft_tokens,
        dtype=args.dtype,
        num_threads=args.num_threads,
        served_model_name="m",
        log_level="warning",
        **fields,
    )
    config.validate()
    target, tokenizer, drafter = load_components(config)
    prompts = [list(tokenizer(text)["input_ids"]) or [0] for text in PROMPTS]
    return config, target, tokenizer, drafter, prompts


def main(argv: list[str] | None = None) -> int:
    from draftsmith.decode.engine import SpeculativeDecoder
    from draftsmith.decode.measure.machine import machine_record
    from draftsmith.decode.serve import build_server

    args = parse_args(argv)
    config, target, _, drafter, prompts = load_measured(
        args, max_tokens_limit=max(args.max_tokens, 16)
    )
    decoder = SpeculativeDecoder(target, drafter, args.num_draft_tokens)
    record: dict[str, Any] = {
        "machine": machine_record(),
        "settings": {
            "drafter": args.drafter is not None,
            "drafter_kind": args.drafter_kind,
            "num_draft_tokens": args.num_draft_tokens,
            "max_tokens": args.max_tokens,
            "seconds": args.seconds,
            "dtype": str(next(target.parameters()).dtype).removeprefix("torch."),
            "temperature": 0.0,
        },
        "offline_tokens_per_s": None,  # the mean of the passes below
        "runs": [],
    }
    runs = [(policy, place) for place in args.decoder for policy in args.draft_policy]
    passes = []
    for policy, place in runs:
        offline = offline_tokens_per_s(decoder, prompts, args.max_tokens)
        passes.append(offline)
        print(f"offline decoder, batch 1, fixed N={args.num_draft_tokens}: {offline:.1f} tokens/s")
        config.draft_policy, config.decoder = policy, place
        server = build_server(config)
        with running(server) as url:
            asyncio.run(served_run(url, prompts, 1, args.max_tokens, 1e-3))  # a warm-up
            for clients in args.clients:
                before = metrics_of(url)
                # A decoder thread has no process of its own: its time is the front end's.
                decoder_pid = getattr(server.backend, "pid", None)
                cpu_before = (cpu_seconds(None), decoder_pid and cpu_seconds(decoder_pid))
                rate, wall = asyncio.run(
                    served_run(url, prompts, clients, args.max_tokens, args.seconds)
                )
                cpu_after = (cpu_seconds(None), decoder_pid and cpu_seconds(decoder_pid))
                run = {
                    "policy": policy,
                    "decoder": place,
                    "clients": clients,
                    "tokens_per_s": rate,
                    "offline_tokens_per_s": offline,
                    "wall_s": wall,
                    "batches": round_parts(round_breakdown(before, metrics_of(url)), wall),
                    "cpu_s": {
                        name: None if after is None or start is None else after - start
                        for name, start, after in zip(
                            ("front_end_and_clients", "decoder_process"),
                            cpu_before,
                            cpu_after,
                            strict=True,
                        )
                    },
                }
                record["runs"].append(run)
                print(
                    f"served, {policy}, decoder in a {place}, {clients} client(s): {rate:.1f} tokens/s "
                    f"({rate / offline:.2f} of offline at batch 1)"
                )
                print("  CPU seconds: " + cpu_summary(run["cpu_s"], wall))
                for batch, parts in run["batches"].items():
                    phases = ", ".join(f"{phase} {parts['ms'][phase]:.2f}" for phase in PHASES)
                    print(
                        f"  batch {batch:>5}: {parts['rounds']} rounds, "
                        f"{parts['drafts_per_row']:.2f} drafts/row, ms per round: {phases}; "
                        f"rounds {parts['wall_share']:.0%} of the wall time"
                    )
        server.backend.stop()
    record["offline_tokens_per_s"] = sum(passes) / len(passes)
    if args.json is not None:
        from draftsmith.data.atomic_io import write_json_atomic

        write_json_atomic(args.json, record)
        print(f"wrote {args.json}")
    return 0


def round_parts(breakdown: dict[str, dict[str, float]], wall: float) -> dict[str, dict[str, Any]]:
    """``round_breakdown``'s totals per batch bucket as means per round, busiest bucket
    first: rounds, drafts per row, ms per phase (and their sum) and the rounds' share of the
    run's wall time."""
    parts = {}
    for batch, row in sorted(breakdown.items(), key=lambda item: -item[1]["rounds"]):
        rounds = row["rounds"]
        ms = {phase: 1000 * row.get(phase, 0.0) / rounds for phase in PHASES}
        parts[batch] = {
            "rounds": int(rounds),
            "drafts_per_row": row.get("drafted", 0.0) / rounds,
            "ms": {**ms, "total": sum(ms.values())},
            "wall_share": sum(row.get(phase, 0.0) for phase in PHASES) / wall,
        }
    return parts


def cores_cell(cpu_s: dict[str, float | None], wall: float) -> str:
    """``"0.31 / 1.85"``: the cores the front end (with the clients) and the decoder process
    kept busy on average; – where a run did not measure one."""
    cores = [cpu_s.get(name) for name in ("front_end_and_clients", "decoder_process")]
    return " / ".join("–" if seconds is None else f"{seconds / wall:.2f}" for seconds in cores)


def round_parts_table(record: dict[str, Any], min_share: float = 0.05) -> str:
    """Markdown of a ``--json`` record: per policy, clients and batch bucket (buckets that
    held at least ``min_share`` of the run's rounds), served tokens/s against the offline
    decoder's and a round's mean ms per phase; then the machine."""
    from draftsmith.decode.measure.machine import describe_machine
    from draftsmith.decode.measure.tables import markdown_table

    header = ["policy", "clients", "tokens/s (x offline)", "batch", "rounds", "drafts/row"]
    header += [f"{phase} ms" for phase in PHASES] + ["round ms", "rounds' share of wall"]
    header.append("cores: front end / decoder")
    rows = []
    for run in record["runs"]:
        total = sum(parts["rounds"] for parts in run["batches"].values()) or 1
        offline = run.get("offline_tokens_per_s", record["offline_tokens_per_s"])
        speed = f"{run['tokens_per_s']:.1f} ({run['tokens_per_s'] / offline:.2f})"
        for batch, parts in run["batches"].items():
            if parts["rounds"] < min_share * total:
                continue
            policy = run["policy"] + (f", {run['decoder']}" if "decoder" in run else "")
            cells = [policy, str(run["clients"]), speed, batch, str(parts["rounds"])]
            cells.append(f"{parts['drafts_per_row']:.2f}")
            cells += [f"{parts['ms'][phase]:.2f}" for phase in (*PHASES, "total")]
            cells.append(f"{parts['wall_share']:.0%}")
            cells.append(cores_cell(run.get("cpu_s", {}), run["wall_s"]))
            rows.append(cells)
    settings = record["settings"]
    lines = markdown_table(header, rows)
    passes = [
        run["offline_tokens_per_s"] for run in record["runs"] if "offline_tokens_per_s" in run
    ]
    spread = (
        f", {min(passes):.1f}-{max(passes):.1f} over its passes" if len(set(passes)) > 1 else ""
    )
    lines += [
        "",
        "x offline: over the offline decoder's pass just before the server started (a record "
        "from before such passes: over its one pass).",
        f"The offline decoder: {record['offline_tokens_per_s']:.1f} tokens/s{spread} (batch 1, chains of "
        f"{settings['num_draft_tokens']}); {settings['max_tokens']} tokens per request, "
        f"T = {settings['temperature']:g}, {settings['seconds']:g} s per run, the target in "
        f"{settings['dtype']}; {describe_machine(record['machine'])}.",
    ]
    return "\n".join(lines)


if __name__ == "__main__":
    import sys

    from draftsmith.decode.command_line import run_command

    sys.exit(run_command(main))
