"""Build (or reuse) the demo target, print its metrics and a sample generation.

    python scripts/build_demo_target.py                      # ~19 min on 2 cores, then cached
    python scripts/build_demo_target.py --preset tiny --output-dir /tmp/t --force   # seconds

The folder (default ``$XDG_CACHE_HOME/draftsmith/targets/<preset>-<dtype>-<key>``) is a normal Hugging Face
model folder; the generation shown here is produced from it after reloading with
``AutoModelForCausalLM`` / ``AutoTokenizer``, greedy and sampled.
"""

from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path

DEFAULT_PROMPT = "import os\n\n\ndef"


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    from draftsmith.decode.command_line import check_output_folder
    from draftsmith.decode.measure.side_by_side import at_least_one, seed_value
    from draftsmith.decode.precision import add_dtype_argument  # after main set the OpenMP policy
    from draftsmith.train.target.demo import PRESETS

    parser = argparse.ArgumentParser(
        description=__doc__.split("\n\n")[0],
        epilog="example: draftsmith-build-demo-target --preset tiny --output-dir /tmp/tiny",
    )
    parser.add_argument("--preset", default="demo", choices=list(PRESETS), help="(default: demo)")
    parser.add_argument(
        "--output-dir", type=Path, default=None, help="default: the user cache directory"
    )
    parser.add_argument(
        "--max-minutes", type=float, default=None, help="training budget (preset default)"
    )
    parser.add_argument(
        "--max-steps", type=at_least_one, default=None, help="step cap (preset default)"
    )
    parser.add_argument("--force", action="store_true", help="rebuild even if a build exists")
    parser.add_argument("--seed", type=seed_value, default=0)
    parser.add_argument("--prompt", default=DEFAULT_PROMPT, help="prompt of the sample generation")
    parser.add_argument("--new-tokens", type=at_least_one, default=64, help="tokens to generate")
    add_dtype_argument(parser, subject="the target trains in (bfloat16: autocast, float32 masters)")
    parser.add_argument(
        "--threads", type=int, default=None, help="torch CPU threads (default: every core)"
    )
    args = parser.parse_args(argv)
    context = PRESETS[args.preset].context_length
    if args.new_tokens > context:
        parser.error(
            f"--new-tokens {args.new_tokens} passes the {args.preset} target's context of "
            f"{context} tokens; pass {context} or fewer"
        )
    if not args.prompt:
        parser.error("--prompt is empty; pass the text the sample generation continues")
    try:  # checked before training, which a bad folder would otherwise waste
        PRESETS[args.preset].with_budget(args.max_minutes, args.max_steps)
        if args.output_dir is not None:
            check_output_folder(args.output_dir, "--output-dir")
    except ValueError as error:
        parser.error(str(error))
    return args


def show_generation(folder: Path, prompt: str, new_tokens: int, seed: int) -> None:
    """Reload the saved folder offline and print a greedy and a sampled continuation."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(folder)
    model = AutoModelForCausalLM.from_pretrained(folder).eval()
    inputs = tokenizer(prompt, return_tensors="pt")
    for label, sampling in (("greedy", {"do_sample": False}), ("sampled (T=0.8)", None)):
        kwargs = sampling or {"do_sample": True, "temperature": 0.8, "top_k": 0, "top_p": 1.0}
        # generate() draws from the global RNG: fork it so the seed governs this call only.
        with torch.random.fork_rng(devices=[]), torch.no_grad():
            torch.manual_seed(seed)
            output = model.generate(**inputs, max_new_tokens=new_tokens, **kwargs)
        text = tokenizer.decode(output[0], skip_special_tokens=True)
        print(f"--- {label} ---\n{text}\n")


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    from draftsmith.decode.cpu_threads import set_cpu_threads
    from draftsmith.train.target.demo import build_demo_target

    set_cpu_threads(args.threads)
    folder = build_demo_target(
        output_dir=args.output_dir,
        preset=args.preset,
        max_minutes=args.max_minutes,
        max_steps=args.max_steps,
        force=args.force,
        seed=args.seed,
        dtype=args.dtype,
    )
    show_generation(folder, args.prompt, args.new_tokens, args.seed)
    return 0


if __name__ == "__main__":
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    # Before torch loads OpenMP: idle threads sleep at once only where ranks share the cores.
    from draftsmith.decode.cpu_threads import default_openmp_wait_policy

    default_openmp_wait_policy()
    from draftsmith.decode.command_line import run_command

    sys.exit(run_command(main))
