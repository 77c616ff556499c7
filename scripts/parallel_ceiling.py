"""Measure the acceptance ceiling of parallel drafting (P-EAGLE) on a target at T = 1.

    draftsmith-parallel-ceiling --target demo --prompts demo --num-prompts 6 --depths 4

The target continues held-out prompts at T = 1; at evenly spread points of each continuation
the committed text is a context, and for each draft depth k >= 2 the script reports the best
acceptance any proposal fixed from the context alone can reach (``draftsmith.decode.measure.parallel_ceiling``:
the depth-k law averaged over the target's own paths to it), what the forward-KL optimum (the
mixture of those laws) reaches, and the tokens per verify pass a chain of parallel drafts
would reach at the caps, against ``N + 1`` for a chain drafter. Compare the caps with a
trained head's ``overlap@k`` (its training log or ``draftsmith-ablate``): a head near its cap
is limited by the target's uncertainty, one far below it by its training.
"""

from __future__ import annotations

import argparse
from dataclasses import asdict
from pathlib import Path
from typing import Any


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    from draftsmith.decode.measure.side_by_side import seed_value
    from draftsmith.train.target.model import add_target_arguments

    parser = argparse.ArgumentParser(
        description=__doc__.split("\n\n")[0],
        epilog="example: draftsmith-parallel-ceiling --target demo --prompts demo --depths 4",
    )
    add_target_arguments(parser)
    parser.add_argument("--prompts", default="demo", help="demo (held-out), ood, or a file")
    parser.add_argument("--num-prompts", type=int, default=6)
    parser.add_argument("--new-tokens", type=int, default=64, help="T = 1 tokens per prompt")
    parser.add_argument(
        "--contexts-per-prompt", type=int, default=8, help="points of each continuation measured"
    )
    parser.add_argument("--depths", type=int, default=4, help="draft depths measured (>= 2)")
    parser.add_argument("--top-k", type=int, default=16, help="tokens each path is extended by")
    parser.add_argument("--beam", type=int, default=64, help="paths kept per depth")
    parser.add_argument("--seed", type=seed_value, default=0)
    parser.add_argument("--output", type=Path, default=None, help="write the figures as JSON")
    args = parser.parse_args(argv)
    for name in ("num_prompts", "new_tokens", "contexts_per_prompt", "top_k", "beam"):
        if getattr(args, name) < 1:
            parser.error(f"--{name.replace('_', '-')} must be >= 1, got {getattr(args, name)}")
    if args.depths < 2:
        parser.error(f"--depths must be >= 2 (depth 1 is never capped), got {args.depths}")
    if not args.prompts.strip():
        parser.error("--prompts is empty; pass demo, ood or a prompts file")
    return args


def contexts_of(
    target: Any, tokenizer: Any, prompts: list[str], args: argparse.Namespace
) -> list[Any]:
    """Prompt plus the first i sampled tokens, at ``--contexts-per-prompt`` spread values of i."""
    import torch
    from draftsmith.decode.measure.side_by_side import check_context
    from draftsmith.decode.sampling import SamplingConfig
    from draftsmith.train.generation import left_pad, sample_continuations

    generator = torch.Generator().manual_seed(args.seed)
    contexts = []
    for prompt in prompts:
        ids = tokenizer(prompt, add_special_tokens=False)["input_ids"] or [tokenizer.eos_token_id]
        check_context(target, [torch.tensor(ids)], args.new_tokens, "--new-tokens")
        batch, mask = left_pad([ids], tokenizer.pad_token_id or 0)
        out = sample_continuations(
            target,
            batch,
            mask,
            args.new_tokens,
            SamplingConfig(temperature=1.0),
            generator,
            eos_token_id=tokenizer.eos_token_id,
            pad_token_id=tokenizer.pad_token_id or 0,
        )
        sampled = out.tokens[0][out.valid[0]]
        if not len(sampled):
            continue
        points = torch.linspace(0, len(sampled), args.contexts_per_prompt).round().long().unique()
        for i in points.tolist():
            contexts.append(torch.cat((torch.tensor(ids), sampled[:i])))
    return contexts


def main(argv: list[str] | None = None) -> dict[str, Any]:
    args = parse_args(argv)
    import torch
    from draftsmith.decode.command_line import check_output_file

    if args.output is not None:  # before the measurement, which a bad path would waste
        check_output_file(args.output, "--output")

    from draftsmith.data.atomic_io import write_json_atomic
    from draftsmith.decode.measure.machine import machine_record
    from draftsmith.decode.measure.parallel_ceiling import parallel_ceilings, tau_cap
    from draftsmith.decode.measure.prompts import load_eval_prompts
    from draftsmith.decode.precision import announce, choose_dtype
    from draftsmith.train.target.model import load_target, resolve_target

    # The target's name and the prompts are checked before the target loads.
    ref = resolve_target(args.target)
    prompts = [p for p in load_eval_prompts(args.prompts, args.num_prompts) if isinstance(p, str)]
    if not prompts:
        raise ValueError(
            f"--prompts {args.prompts}: no text prompt to continue (chat prompts are not "
            "measured); pass a text file, demo or ood"
        )
    choice = choose_dtype(args.dtype, "cuda" if torch.cuda.is_available() else "cpu")
    announce(choice)
    target, tokenizer, name = load_target(ref, choice.name)
    target.eval()
    contexts = contexts_of(target, tokenizer, prompts, args)
    ceilings = parallel_ceilings(target, contexts, args.depths, args.top_k, args.beam)
    folder = Path(str(getattr(target, "name_or_path", "") or args.target))
    result = {
        "target": folder.name or args.target,  # a folder's or hub id's last part, no home path
        "dtype": choice.name,
        "prompts": args.prompts,
        "contexts": len(contexts),
        "top_k": args.top_k,
        "beam": args.beam,
        "depths": [asdict(c) for c in ceilings],
        "tau_cap": {n: tau_cap(ceilings, n) for n in range(1, args.depths + 1)},
        "machine": machine_record(),
    }
    print(f"{name} ({choice.name}), {len(contexts)} contexts of T = 1 text ({args.prompts}):")
    print("depth  cap (any parallel q)  forward-KL optimum  beam coverage  cap over all paths")
    for c in ceilings:
        print(
            f"{c.depth:>5}  {c.ceiling:>20.3f}  {c.mixture:>18.3f}  {c.coverage:>13.3f}  "
            f"[{c.lower:.3f}, {c.upper:.3f}]"
        )
    for n, tau in result["tau_cap"].items():
        print(f"N = {n}: at most {tau:.2f} tokens per verify pass (a chain drafter: {n + 1})")
    if args.output is not None:
        write_json_atomic(args.output, result)
    return result


if __name__ == "__main__":
    # Before torch loads OpenMP: idle threads sleep at once only where ranks share the cores.
    from draftsmith.decode.cpu_threads import default_openmp_wait_policy

    default_openmp_wait_policy()
    from draftsmith.decode.command_line import run_command

    run_command(main)
