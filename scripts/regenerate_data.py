"""Let the target answer prompts and write its responses as datasets-loadable JSONL.

    python scripts/regenerate_data.py --target demo --prompts stdlib --num-prompts 2000 \\
        --max-new-tokens 224 --output data/demo-regenerated.jsonl
    python scripts/regenerate_data.py --target Qwen/Qwen2.5-0.5B-Instruct \\
        --prompts prompts.jsonl --output data/qwen-regenerated.jsonl

``--prompts`` is a .jsonl/.json file or a datasets name with a ``prompt`` (text) or
``messages`` (chat) field; ``stdlib``: the first ``--prompt-tokens`` tokens of the embedded
corpus's training blocks; or ``stdlib-defs``: the ``--prompt-chars`` characters of code up to a
``def``/``class`` line of its training files, the form of the demo's evaluation prompts. Train
on the output with ``python train/distill.py --dataset <output>``.

With ``--endpoint`` the target is not loaded here: any OpenAI-compatible server answers
(vLLM, SGLang, ``decode/serve.py``), chat prompts through /v1/chat/completions (the server
applies the chat template), text prompts through /v1/completions; ``--concurrency`` requests
at a time, retried with exponential backoff on connection errors, 429 and 5xx. The output is
appended record by record and a rerun answers only the prompts still missing
(``draftsmith.train.regeneration.endpoint``); the exit status is 1 when any prompt failed::

    vllm serve Qwen/Qwen2.5-7B-Instruct --port 8000 &
    python scripts/regenerate_data.py --endpoint http://127.0.0.1:8000/v1 \\
        --prompts prompts.jsonl --output data/qwen7b-regenerated.jsonl --concurrency 64
"""

from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path
from typing import Any


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    from draftsmith.decode.measure.prompts import add_system_prompt_argument
    from draftsmith.decode.measure.side_by_side import (
        at_least_one,
        at_least_zero,
        seed_value,
        share_value,
        temperature_value,
        top_p_value,
    )
    from draftsmith.train.target.model import add_target_arguments

    parser = argparse.ArgumentParser(
        description=__doc__.split("\n\n")[0],
        epilog="example: draftsmith-regenerate --prompts stdlib-defs --output outputs/defs.jsonl",
    )
    add_target_arguments(parser)
    parser.add_argument(
        "--prompts", required=True, help="prompts file, datasets name, stdlib or stdlib-defs"
    )
    parser.add_argument("--prompt-field", default="prompt")
    parser.add_argument("--messages-field", default="messages")
    parser.add_argument("--num-prompts", type=at_least_one, default=None, help="cap on prompts")
    add_system_prompt_argument(
        parser, "none; training and benchmarks reuse the recipe's data.system_prompt, so pass it"
    )
    parser.add_argument(
        "--no-thinking-share",
        type=share_value,
        default=0.0,
        help="chat prompts: the share answered with thinking off (Qwen3's enable_thinking=False), "
        "a seeded choice (--seed); the rest think as the template's default. Default 0",
    )
    parser.add_argument(
        "--prompt-tokens", type=int, default=32, help="stdlib prompts: length (>= 2)"
    )
    parser.add_argument(
        "--prompt-chars",
        type=at_least_one,
        default=None,
        help="stdlib-defs prompts: characters (400)",
    )
    parser.add_argument(
        "--max-files", type=at_least_one, default=None, help="stdlib prompts: file cap"
    )
    parser.add_argument("--output", type=Path, required=True, help="JSONL file to write")
    parser.add_argument("--max-new-tokens", type=at_least_one, default=128)
    parser.add_argument("--temperature", type=temperature_value, default=1.0, help="0 = greedy")
    parser.add_argument("--top-k", type=at_least_zero, default=0)
    parser.add_argument("--top-p", type=top_p_value, default=1.0)
    parser.add_argument("--batch-size", type=at_least_one, default=16)
    parser.add_argument("--seed", type=seed_value, default=0)
    parser.add_argument("--no-progress", action="store_true", help="no progress bar")
    remote = parser.add_argument_group("serving engine (--endpoint)")
    remote.add_argument(
        "--endpoint", default=None, help="OpenAI-compatible API base, e.g. http://host:8000/v1"
    )
    remote.add_argument(
        "--api-key", default=os.environ.get("DRAFTSMITH_API_KEY"), help="bearer key, if any"
    )
    remote.add_argument("--model", default=None, help="model name (default: GET /v1/models)")
    remote.add_argument("--concurrency", type=at_least_one, default=8, help="requests in flight")
    remote.add_argument("--max-retries", type=at_least_zero, default=6, help="per request")
    remote.add_argument("--timeout", type=float, default=600.0, help="seconds per request")
    remote.add_argument(
        "--limit", type=at_least_one, default=None, help="answer at most N this run"
    )
    args = parser.parse_args(argv)
    problem = flags_problem(args, parser)
    if problem:
        parser.error(problem)
    return args


STDLIB_PROMPTS = ("stdlib", "stdlib-defs")
"""The ``--prompts`` values cut from the embedded corpus (every other value names a file or a
``datasets`` name)."""

# Flags that do something only in some runs; given elsewhere they are refused, not ignored.
CORPUS_FLAGS = {
    "--prompt-tokens": ("stdlib",),
    "--prompt-chars": ("stdlib-defs",),
    "--max-files": STDLIB_PROMPTS,
}
FILE_FLAGS = ("--prompt-field", "--messages-field")
CHAT_FLAGS = ("--system-prompt", "--no-thinking-share")  # what a chat prompt is answered under
ENDPOINT_FLAGS = ("--model", "--concurrency", "--max-retries", "--timeout", "--limit")
LOCAL_FLAGS = ("--batch-size", "--dtype")  # the server runs the target with --endpoint


def flags_problem(args: argparse.Namespace, parser: argparse.ArgumentParser) -> str | None:
    """What is wrong with ``args`` before anything loads: an empty value, a stdlib prompt
    length that cannot be cut, a flag given where it does nothing (it would be ignored
    silently), a bad ``--output`` path; None when nothing is."""
    from draftsmith.decode.command_line import check_output_file

    def given(flag: str) -> bool:
        dest = flag[2:].replace("-", "_")
        return getattr(args, dest) != parser.get_default(dest)

    if not args.prompts.strip():
        return (
            "--prompts is empty; pass a .jsonl/.json file, a datasets name, stdlib or stdlib-defs"
        )
    if Path(args.prompts).expanduser().is_dir():
        return f"--prompts {args.prompts} is a folder; pass a .jsonl or .json file in it"
    for flag, value in (
        ("--prompt-field", args.prompt_field),
        ("--messages-field", args.messages_field),
        ("--endpoint", args.endpoint),
        ("--model", args.model),
    ):
        if value is not None and not value.strip():
            return f"{flag} is empty; pass a value, or drop {flag}"
    if args.prompt_tokens < 2:
        return (
            f"--prompt-tokens must be >= 2 (a stdlib prompt is a packed block of tokens), got "
            f"{args.prompt_tokens}"
        )
    for flag, sources in CORPUS_FLAGS.items():
        if given(flag) and args.prompts not in sources:
            return f"{flag} only applies with --prompts {' or '.join(sources)}: drop it"
    for flag in FILE_FLAGS:
        if given(flag) and args.prompts in STDLIB_PROMPTS:
            return f"{flag} names a field of a prompts file: drop it with --prompts {args.prompts}"
    for flag in CHAT_FLAGS:
        if given(flag) and args.prompts in STDLIB_PROMPTS:
            return (
                f"{flag} applies to chat prompts, and --prompts {args.prompts} gives plain code "
                "prompts: drop it, or pass a file of conversations"
            )
    for flag in ENDPOINT_FLAGS:
        if given(flag) and args.endpoint is None:
            return f"{flag} only applies with --endpoint: add --endpoint URL, or drop {flag}"
    for flag in LOCAL_FLAGS:
        if given(flag) and args.endpoint is not None:
            return f"{flag} does nothing with --endpoint (the server runs the target): drop it"
    try:
        check_output_file(args.output, "--output")
    except ValueError as error:
        return str(error)
    return None


def main(argv: list[str] | None = None) -> dict:
    args = parse_args(argv)
    if args.endpoint is not None:
        return _through_endpoint(args)
    import torch
    from draftsmith.decode.measure.side_by_side import check_context
    from draftsmith.decode.precision import announce, choose_dtype
    from draftsmith.decode.sampling import SamplingConfig
    from draftsmith.train.regeneration.in_process import check_prompts, prompt_ids, regenerate
    from draftsmith.train.target.model import load_target, resolve_target

    ref = resolve_target(args.target)
    # A prompts file is read before the target loads: a bad file costs no loading time.
    prompts = None if args.prompts == "stdlib" else _prompts(args, None)
    if prompts is not None:
        check_prompts(prompts)
    choice = choose_dtype(args.dtype, "cuda" if torch.cuda.is_available() else "cpu")
    announce(choice)
    target, tokenizer, name = load_target(ref, choice.name)
    if torch.cuda.is_available():
        target.to("cuda")
    if prompts is None:
        prompts = _prompts(args, tokenizer)
    # Every prompt encodes to tokens, and none runs past the target's context.
    thinking_off = _thinking_off(args, prompts)
    encoded = [
        torch.tensor([prompt_ids(tokenizer, prompt, i not in thinking_off)])
        for i, prompt in enumerate(prompts)
    ]
    check_context(target, encoded, args.max_new_tokens)
    sampling = SamplingConfig(temperature=args.temperature, top_k=args.top_k, top_p=args.top_p)
    result = regenerate(
        target,
        tokenizer,
        prompts,
        args.output,
        args.max_new_tokens,
        sampling,
        seed=args.seed,
        batch_size=args.batch_size,
        progress=not args.no_progress,
        thinking_off=thinking_off,
    )
    print(
        f"{result['records']} responses ({result['response_tokens']:,} tokens) from {name} "
        f"written to {result['output']}"
    )
    return result


def _prompts(args: argparse.Namespace, tokenizer: Any) -> list:
    """The prompts ``--prompts`` names, at most ``--num-prompts`` (1000 from the corpus)."""
    from draftsmith.train.regeneration.in_process import corpus_definition_prompts, corpus_prompts

    count = args.num_prompts or 1000
    if args.prompts == "stdlib":
        return corpus_prompts(tokenizer, args.prompt_tokens, count, args.max_files)
    if args.prompts == "stdlib-defs":
        return corpus_definition_prompts(count, args.max_files, args.prompt_chars)
    from draftsmith.data.chat_context import prompts_with_system_prompt
    from draftsmith.data.sources import load_prompts

    prompts = load_prompts(args.prompts, args.prompt_field, args.messages_field)
    prompts = prompts[: args.num_prompts] if args.num_prompts else prompts
    chat = any(not isinstance(p, str) for p in prompts)
    for flag, given in (
        ("--system-prompt", args.system_prompt is not None),
        ("--no-thinking-share", args.no_thinking_share > 0),
    ):
        if given and not chat:
            raise ValueError(
                f"{flag} applies to chat prompts, and {args.prompts} holds plain text prompts "
                f"(field {args.prompt_field!r}): drop {flag}, or pass conversations"
            )
    return prompts_with_system_prompt(prompts, args.system_prompt)


def _thinking_off(args: argparse.Namespace, prompts: list) -> frozenset[int]:
    """The prompts answered with thinking off (``--no-thinking-share``, seeded by ``--seed``)."""
    from draftsmith.data.chat_context import thinking_off_indices

    return thinking_off_indices(len(prompts), args.no_thinking_share, args.seed)


def _through_endpoint(args: argparse.Namespace) -> dict:
    """Regenerate through a served engine; the summary (``failed`` > 0: exit status 1)."""
    from dataclasses import asdict

    from draftsmith.train.regeneration.endpoint import (
        EndpointConfig,
        GenerationSettings,
        regenerate_through_endpoint,
    )

    endpoint = EndpointConfig(
        url=args.endpoint,
        model=args.model,
        api_key=args.api_key,
        concurrency=args.concurrency,
        max_retries=args.max_retries,
        timeout_s=args.timeout,
    )
    tokenizer = None
    if args.prompts == "stdlib":
        from draftsmith.train.target.model import load_tokenizer, resolve_target, target_location

        tokenizer = load_tokenizer(target_location(resolve_target(args.target))[0])
    prompts = _prompts(args, tokenizer)
    settings = GenerationSettings(
        max_tokens=args.max_new_tokens,
        temperature=args.temperature,
        top_p=args.top_p,
        top_k=args.top_k,
        seed=args.seed,
        thinking_off=_thinking_off(args, prompts),
    )
    report = regenerate_through_endpoint(
        prompts, args.output, settings, endpoint, limit=args.limit, progress=not args.no_progress
    )
    print(
        f"{report.written} responses written this run ({report.completion_tokens:,} tokens, "
        f"{report.tokens_per_s:.1f} tokens/s, {report.retries} retries) from {report.model}; "
        f"{report.already_done} were already in {report.output}; {report.failed} failed; "
        f"{report.missing} of {report.total} prompts still without a response"
    )
    for failure in report.failures:
        print(f"  failed: {failure}", file=sys.stderr)
    if report.missing:
        print("rerun the same command to answer the missing prompts", file=sys.stderr)
    return {
        **asdict(report),
        "records": report.already_done + report.written,
        "missing": report.missing,
        "tokens_per_s": report.tokens_per_s,
    }


if __name__ == "__main__":
    # Before torch loads OpenMP: idle threads sleep at once only where ranks share the cores.
    from draftsmith.decode.cpu_threads import default_openmp_wait_policy

    default_openmp_wait_policy()
    from draftsmith.decode.command_line import run_command

    result = run_command(main)
    sys.exit(1 if result.get("failed") else 0)
