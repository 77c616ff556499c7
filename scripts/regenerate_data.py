"""Let the target answer prompts and write its responses as datasets-loadable JSONL.

    python scripts/regenerate_data.py --target demo --prompts stdlib --num-prompts 2000 \\
        --max-new-tokens 224 --output data/demo-regenerated.jsonl
    python scripts/regenerate_data.py --target Qwen/Qwen2.5-0.5B-Instruct \\
        --prompts prompts.jsonl --output data/qwen-regenerated.jsonl

``--prompts`` is a .jsonl/.json file or a datasets name with a ``prompt`` (text) or
``messages`` (chat) field, or ``stdlib``: the first ``--prompt-tokens`` tokens of the embedded
corpus's training blocks. Train on the output with
``python train/distill.py --dataset <output>``.
"""

from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--target", default="demo", help="demo/bench/tiny, a folder or a hub id")
    parser.add_argument(
        "--target-dtype", default="float32", choices=["float32", "bfloat16", "float16"]
    )
    parser.add_argument("--prompts", required=True, help="prompts file, datasets name, or stdlib")
    parser.add_argument("--prompt-field", default="prompt")
    parser.add_argument("--messages-field", default="messages")
    parser.add_argument("--num-prompts", type=int, default=None, help="cap on prompts")
    parser.add_argument("--prompt-tokens", type=int, default=32, help="stdlib prompts: length")
    parser.add_argument("--max-files", type=int, default=None, help="stdlib prompts: file cap")
    parser.add_argument("--output", type=Path, required=True, help="JSONL file to write")
    parser.add_argument("--max-new-tokens", type=int, default=128)
    parser.add_argument("--temperature", type=float, default=1.0, help="0 = greedy")
    parser.add_argument("--top-k", type=int, default=0)
    parser.add_argument("--top-p", type=float, default=1.0)
    parser.add_argument("--batch-size", type=int, default=16)
    parser.add_argument("--seed", type=int, default=0)
    return parser.parse_args(argv)


def main(argv: list[str] | None = None) -> dict:
    args = parse_args(argv)
    import torch

    from decode.sampling import SamplingConfig
    from train.regenerate import corpus_prompts, regenerate
    from train.target_model import load_target, resolve_target

    target, tokenizer, name = load_target(resolve_target(args.target), args.target_dtype)
    if torch.cuda.is_available():
        target.to("cuda")
    if args.prompts == "stdlib":
        count = args.num_prompts or 1000
        prompts = corpus_prompts(tokenizer, args.prompt_tokens, count, args.max_files)
    else:
        from data.sources import load_prompts

        prompts = load_prompts(args.prompts, args.prompt_field, args.messages_field)
        prompts = prompts[: args.num_prompts] if args.num_prompts else prompts
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


if __name__ == "__main__":
    # libgomp busy-waiting collapses throughput on shared cores; set before torch loads.
    os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")
    main()
    sys.exit(0)
