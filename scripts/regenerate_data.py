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
(``train.regenerate_endpoint``); the exit status is 1 when any prompt failed::

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
    from train.target_model import add_target_arguments

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
    parser.add_argument("--num-prompts", type=int, default=None, help="cap on prompts")
    parser.add_argument("--prompt-tokens", type=int, default=32, help="stdlib prompts: length")
    parser.add_argument(
        "--prompt-chars", type=int, default=None, help="stdlib-defs prompts: characters (400)"
    )
    parser.add_argument("--max-files", type=int, default=None, help="stdlib prompts: file cap")
    parser.add_argument("--output", type=Path, required=True, help="JSONL file to write")
    parser.add_argument("--max-new-tokens", type=int, default=128)
    parser.add_argument("--temperature", type=float, default=1.0, help="0 = greedy")
    parser.add_argument("--top-k", type=int, default=0)
    parser.add_argument("--top-p", type=float, default=1.0)
    parser.add_argument("--batch-size", type=int, default=16)
    parser.add_argument("--seed", type=int, default=0)
    remote = parser.add_argument_group("serving engine (--endpoint)")
    remote.add_argument(
        "--endpoint", default=None, help="OpenAI-compatible API base, e.g. http://host:8000/v1"
    )
    remote.add_argument(
        "--api-key", default=os.environ.get("DRAFTSMITH_API_KEY"), help="bearer key, if any"
    )
    remote.add_argument("--model", default=None, help="model name (default: GET /v1/models)")
    remote.add_argument("--concurrency", type=int, default=8, help="requests in flight")
    remote.add_argument("--max-retries", type=int, default=6, help="per request")
    remote.add_argument("--timeout", type=float, default=600.0, help="seconds per request")
    remote.add_argument("--limit", type=int, default=None, help="answer at most N this run")
    remote.add_argument("--no-progress", action="store_true", help="no progress bar")
    return parser.parse_args(argv)


def main(argv: list[str] | None = None) -> dict:
    args = parse_args(argv)
    if args.endpoint:
        return _through_endpoint(args)
    import torch

    from decode.precision import announce, choose_dtype
    from decode.sampling import SamplingConfig
    from train.regenerate import regenerate
    from train.target_model import load_target, resolve_target

    choice = choose_dtype(args.dtype, "cuda" if torch.cuda.is_available() else "cpu")
    announce(choice)
    target, tokenizer, name = load_target(resolve_target(args.target), choice.name)
    if torch.cuda.is_available():
        target.to("cuda")
    prompts = _prompts(args, tokenizer)
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
    )
    print(
        f"{result['records']} responses ({result['response_tokens']:,} tokens) from {name} "
        f"written to {result['output']}"
    )
    return result


def _prompts(args: argparse.Namespace, tokenizer: Any) -> list:
    """The prompts ``--prompts`` names, at most ``--num-prompts`` (1000 from the corpus)."""
    from train.regenerate import corpus_definition_prompts, corpus_prompts

    count = args.num_prompts or 1000
    if args.prompts == "stdlib":
        return corpus_prompts(tokenizer, args.prompt_tokens, count, args.max_files)
    if args.prompts == "stdlib-defs":
        return corpus_definition_prompts(count, args.max_files, args.prompt_chars)
    from data.sources import load_prompts

    prompts = load_prompts(args.prompts, args.prompt_field, args.messages_field)
    return prompts[: args.num_prompts] if args.num_prompts else prompts


def _through_endpoint(args: argparse.Namespace) -> dict:
    """Regenerate through a served engine; the summary (``failed`` > 0: exit status 1)."""
    from dataclasses import asdict

    from train.regenerate_endpoint import (
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
        from train.target_model import load_tokenizer, resolve_target, target_location

        tokenizer = load_tokenizer(target_location(resolve_target(args.target))[0])
    prompts = _prompts(args, tokenizer)
    settings = GenerationSettings(
        max_tokens=args.max_new_tokens,
        temperature=args.temperature,
        top_p=args.top_p,
        top_k=args.top_k,
        seed=args.seed,
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
    from decode.cpu_threads import default_openmp_wait_policy

    default_openmp_wait_policy()
    from decode.command_line import run_command

    result = run_command(main)
    sys.exit(1 if result.get("failed") else 0)
