"""The server's draft policies side by side, without HTTP, in interleaved windows.

    draftsmith-compare-policies --target DIR (--drafter DIR | --drafter-kind ngram) \\
        [--clients 8 16] [--temperatures 0 1] [--window 8] [--repeats 3] [--max-tokens 128] \\
        [--json FILE]

One ``BatchWorker`` per policy decodes in this process, on the same target: ``load-aware`` and
``fixed`` with the drafter, ``plain`` with no drafter (``--drafter-kind none``'s server). For
each temperature and client count, every worker first runs one untimed window (the load-aware
policy learns that load's costs), then the workers take turns, in an order reversed at every
repeat, for ``--repeats`` windows of ``--window`` seconds each: ``clients`` closed-loop
clients, each sending its next request (the load tester's prompts, ``--max-tokens`` tokens,
EOS ignored) as soon as its last one ended, their first requests of staggered lengths so that
they do not all finish together. A window counts the tokens delivered before its end; the rows
still decoding then are drained untimed.

Why not the HTTP sweep (``draftsmith-load-test --sweep``): on a shared 2-core machine one
20-second run of a server moved by up to a quarter against the next, so a comparison of
policies within 5% needs the policies' windows interleaved and short, and without the front
end's work beside them. What this leaves out (tokenising, streaming, the event loop) is what
``draftsmith-profile-serve`` measures. Printed per point: each policy's median tokens/s with
every window's figure, and load-aware's ratio to the better of the others in each repeat (the
ratio within a repeat, not of medians: neighbouring windows share the machine's state).
"""

from __future__ import annotations

import argparse
import statistics
import time
from pathlib import Path
from typing import Any

from draftsmith.decode.measure.order import ORDERS, balanced_order

POLICIES = ("load-aware", "fixed", "plain")


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    from draftsmith.decode.measure.side_by_side import at_least_one
    from draftsmith.scripts.profile_serve import add_measured_flags

    parser = argparse.ArgumentParser(
        description=__doc__.split("\n\n")[0],
        epilog="example: draftsmith-compare-policies --target $DEMO_TARGET "
        "--drafter outputs/distill-demo/drafter --clients 16 --json policies.json",
    )
    add_measured_flags(parser, drafter_help="drafter folder")
    parser.add_argument("--max-tokens", type=at_least_one, default=128)
    parser.add_argument("--max-batch-size", type=at_least_one, default=16)
    parser.add_argument("--clients", type=at_least_one, nargs="+", default=[8, 16])
    parser.add_argument("--temperatures", type=float, nargs="+", default=[0.0, 1.0])
    parser.add_argument("--policies", nargs="+", default=list(POLICIES), help="compared")
    parser.add_argument("--window", type=float, default=8.0, help="seconds per window")
    parser.add_argument("--repeats", type=at_least_one, default=3, help="windows per policy")
    parser.add_argument("--json", type=Path, default=None, help="write the figures here")
    args = parser.parse_args(argv)
    if args.drafter is None and args.drafter_kind in (None, "none"):
        parser.error(
            "the policies differ only with a drafter: give --drafter DIR, or --drafter-kind "
            "ngram (prompt lookup, no folder)"
        )
    unknown = sorted(set(args.policies) - set(POLICIES))
    if unknown:
        parser.error(f"--policies {' '.join(unknown)}: unknown; choose from {', '.join(POLICIES)}")
    if not 0 < args.window < float("inf"):
        parser.error(f"--window must be a finite number of seconds > 0, got {args.window}")
    bad = [t for t in args.temperatures if not 0 <= t < float("inf")]
    if bad:
        parser.error(f"--temperatures must be finite and >= 0, got {bad}")
    return args


def closed_loop_window(
    worker: Any,
    prompts: list[list[int]],
    clients: int,
    max_tokens: int,
    temperature: float,
    seconds: float,
) -> float:
    """Tokens/s ``worker`` delivers to ``clients`` closed-loop clients over ``seconds``; the
    rows still decoding at the end are drained, untimed. Client i's first request asks for
    ``max_tokens * (i + 1) / clients`` tokens (staggered), every later one for ``max_tokens``."""
    from draftsmith.decode.sampling import SamplingConfig
    from draftsmith.decode.serving.jobs import DoneEvent, GenerationJob, SamplingParams, TokensEvent

    params = SamplingParams(SamplingConfig(temperature=temperature), ignore_eos=True)
    delivered, sent = [0], [0]
    deadline = time.perf_counter() + seconds

    def send(client: int, tokens: int) -> None:
        prompt = prompts[(client + sent[0]) % len(prompts)]
        sent[0] += 1
        sink = lambda event: on_event(client, event)  # noqa: E731
        worker.queue.put(GenerationJob(prompt, tokens, params, sink=sink))

    def on_event(client: int, event: Any) -> None:
        if time.perf_counter() >= deadline:
            return
        if isinstance(event, TokensEvent):
            delivered[0] += len(event.tokens)
        elif isinstance(event, DoneEvent):
            send(client, max_tokens)

    for client in range(clients):
        send(client, max(1, max_tokens * (client + 1) // clients))
    start = time.perf_counter()
    while time.perf_counter() < deadline:
        worker.tick()
    rate = delivered[0] / (time.perf_counter() - start)
    worker.drain()
    return rate


def compare(
    workers: dict[str, Any],
    prompts: list[list[int]],
    clients: int,
    temperature: float,
    max_tokens: int,
    window: float,
    repeats: int,
) -> dict[str, Any]:
    """One point: an untimed window per worker, then ``repeats`` rounds of one window each in
    turn (``balanced_order``); each worker's tokens/s per window, their medians, and
    load-aware's ratio to the better of the others per repeat (where both are measured)."""
    run = lambda worker: closed_loop_window(  # noqa: E731
        worker, prompts, clients, max_tokens, temperature, window
    )
    for worker in workers.values():
        run(worker)
    windows: dict[str, list[float]] = {name: [] for name in workers}
    for repeat in range(repeats):
        for name in balanced_order(list(workers), repeat):
            windows[name].append(run(workers[name]))
    point: dict[str, Any] = {
        "clients": clients,
        "temperature": temperature,
        "tokens_per_s": windows,
        "median_tokens_per_s": {name: statistics.median(rates) for name, rates in windows.items()},
    }
    others = [name for name in workers if name != "load-aware"]
    if "load-aware" in workers and others:
        point["load_aware_over_better"] = [
            windows["load-aware"][repeat] / max(windows[name][repeat] for name in others)
            for repeat in range(repeats)
        ]
    return point


def describe(point: dict[str, Any]) -> str:
    """The printed lines of one point."""
    lines = [f"T = {point['temperature']:g}, {point['clients']} client(s):"]
    for name, rates in point["tokens_per_s"].items():
        each = " ".join(f"{rate:.1f}" for rate in rates)
        lines.append(f"  {name}: {point['median_tokens_per_s'][name]:.1f} tokens/s ({each})")
    ratios = point.get("load_aware_over_better")
    if ratios:
        each = " ".join(f"{ratio:.2f}" for ratio in ratios)
        lines.append(
            f"  load-aware / the better other, per repeat: {each} "
            f"(median {statistics.median(ratios):.2f})"
        )
    return "\n".join(lines)


def policy_windows_table(record: dict[str, Any]) -> str:
    """Markdown of a ``--json`` record: per temperature and client count, each policy's median
    tokens/s, and load-aware's ratio to the better other in each repeat; then the machine."""
    from draftsmith.decode.measure.machine import describe_machine
    from draftsmith.decode.measure.tables import markdown_table

    policies = list(record["points"][0]["tokens_per_s"]) if record["points"] else []
    header = ["T", "clients", *(f"{name} tokens/s" for name in policies)]
    header += ["load-aware / better other, per repeat", "median"]
    rows = []
    for point in record["points"]:
        cells = [f"{point['temperature']:g}", str(point["clients"])]
        cells += [f"{point['median_tokens_per_s'][name]:.1f}" for name in policies]
        ratios = point.get("load_aware_over_better") or []
        cells.append(" ".join(f"{ratio:.2f}" for ratio in ratios) or "–")
        cells.append(f"{statistics.median(ratios):.2f}" if ratios else "–")
        rows.append(cells)
    settings = record["settings"]
    return "\n".join(
        [
            *markdown_table(header, rows),
            "",
            f"Each policy's median over {settings['repeats']} windows of {settings['window']:g} s "
            f"in turn, {ORDERS[settings.get('order', 'same')]} (one untimed window each "
            f"first), closed-loop clients straight into the decoder (no HTTP), "
            f"{settings['max_tokens']} tokens per request; "
            f"{describe_machine(record['machine'])}.",
        ]
    )


def main(argv: list[str] | None = None) -> int:
    from draftsmith.decode.drafters.registry import load_no_drafter
    from draftsmith.decode.measure.machine import machine_record
    from draftsmith.decode.serving.jobs import RequestQueue
    from draftsmith.decode.serving.scheduler import BatchWorker
    from draftsmith.scripts.profile_serve import load_measured

    args = parse_args(argv)
    _, target, tokenizer, drafter, prompts = load_measured(args, max_batch_size=args.max_batch_size)
    pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else 0

    def worker(policy: str) -> BatchWorker:
        plain = policy == "plain"
        made = BatchWorker(
            target,
            load_no_drafter(None, target) if plain else drafter.spawn(),  # a state of its own
            RequestQueue(4 * args.max_batch_size),
            num_draft_tokens=args.num_draft_tokens,
            draft_policy="fixed" if plain else policy,
            max_batch_size=args.max_batch_size,
            eos_token_ids=[],
            pad_token_id=pad,
            seed=0,
        )
        made.warm_up()
        return made

    workers = {policy: worker(policy) for policy in args.policies}
    record: dict[str, Any] = {
        "machine": machine_record(),
        "settings": {
            key: getattr(args, key)
            for key in ("num_draft_tokens", "max_tokens", "max_batch_size", "window", "repeats")
        }
        | {"order": "alternating"},
        "points": [],
    }
    for temperature in args.temperatures:
        for clients in args.clients:
            point = compare(
                workers, prompts, clients, temperature, args.max_tokens, args.window, args.repeats
            )
            record["points"].append(point)
            print(describe(point), flush=True)
    if args.json is not None:
        from draftsmith.data.atomic_io import write_json_atomic

        write_json_atomic(args.json, record)
        print(f"wrote {args.json}")
    return 0


if __name__ == "__main__":
    from draftsmith.decode.command_line import run_command

    run_command(main)
