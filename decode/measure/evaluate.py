"""Acceptance and speed of a drafter against plain decoding, side by side, in one run.

``python -m draftsmith.decode.measure.evaluate --target PATH --drafter PATH --drafter-kind draft_lm|ngram|...
--prompts FILE|demo --max-new-tokens 128 --num-draft-tokens N --temperature T --json OUT``

Every prompt is decoded, one at a time (batch 1, the latency setting), by plain target
decoding (Hugging Face ``generate``), by our speculative decoder, and, where one exists, by the
Hugging Face peer with the same draft (assisted generation for a draft LM, prompt lookup for the
n-gram drafter). EOS is ignored so that every method writes the same number of tokens.

Reported (docs/theory.md §5): ``tau`` (tokens per verification pass), ``alpha_per_position``,
``predicted_tau`` from those rates, tokens/s of each method, the measured speedup, and the
speedup predicted from the run's own tau and times, ``tau * T_1 / (T_draft + T_verify)``, where
``T_1`` is the baseline's time per token and ``T_draft``/``T_verify`` the measured time of one
round's drafting and verification.
"""

from __future__ import annotations

import argparse
from dataclasses import replace
from pathlib import Path
from typing import Any

import torch
from draftsmith.decode.cpu_threads import set_cpu_threads
from draftsmith.decode.defaults import LOOKUP_DRAFT_TOKENS, NUM_DRAFT_TOKENS
from draftsmith.decode.drafters.base import Drafter
from draftsmith.decode.loading import check_device
from draftsmith.decode.measure.machine import describe_machine, machine_record
from draftsmith.decode.measure.side_by_side import (
    EvalSettings,
    Method,
    MethodResult,
    add_repeats_argument,
    add_tree_arguments,
    at_least_one,
    at_least_zero,
    check_context,
    encode_prompt,
    hf_peer,
    measure_side_by_side,
    plain_method,
    seed_value,
    speculative_method,
    temperature_value,
    top_p_value,
    tree_flags_problem,
    tree_from_arguments,
)
from draftsmith.decode.precision import (
    DTYPE_NAMES,
    DtypeChoice,
    add_dtype_argument,
    announce,
    choose_dtype,
)
from draftsmith.decode.stats import DecodeStats, predicted_speedup


def load_target(path: str, device: str = "cpu", dtype: str = "float32", trust_remote_code=False):
    """A target causal LM (eval mode, on ``device``) and its tokenizer, safetensors only."""
    from draftsmith.decode import loading

    if Path(path).exists() and not Path(path).is_dir():
        raise ValueError(
            f"--target {path} is a file, not a model folder: pass the folder that holds its "
            "config.json and model.safetensors"
        )
    if not Path(path).is_dir():
        raise FileNotFoundError(
            f"target folder {path} does not exist: build the demo target with "
            "`python scripts/build_demo_target.py` or pass a Hugging Face model folder"
        )
    model = loading.load_causal_lm(
        path, dtype, device=device, trust_remote_code=trust_remote_code, flag="--target"
    )
    return model, loading.load_tokenizer(path, trust_remote_code, flag="--target")


def load_targets_for(args: argparse.Namespace) -> tuple[DtypeChoice, Any, Any, dict[str, Any]]:
    """A command's threads and dtype (``--threads``, ``--dtype``, ``--device``), the target in
    that dtype with its tokenizer, and the target again in each ``--plain-also`` dtype."""
    set_cpu_threads(args.threads)
    choice = choose_dtype(args.dtype, args.device)
    announce(choice)
    target, tokenizer = load_target(args.target, args.device, choice.name)
    copies = {
        name: load_target(args.target, args.device, name)[0]
        for name in plain_dtypes(args.plain_also, choice.name)
    }
    return choice, target, tokenizer, copies


def plain_dtypes(names: str, run_dtype: str) -> list[str]:
    """The ``--plain-also`` dtypes other than the run's, checked against ``draftsmith.decode.precision``."""
    chosen = [name.strip() for name in names.split(",") if name.strip()]
    for name in chosen:
        if name == "auto" or name not in DTYPE_NAMES:
            raise ValueError(
                f"--plain-also {name!r}: name dtypes among {', '.join(DTYPE_NAMES[1:])}"
            )
    return [name for name in dict.fromkeys(chosen) if name != run_dtype]


def check_same_tokenizer(target_tokenizer, drafter_path: str | None) -> None:
    """Refuse a drafter folder whose tokenizer differs from the target's."""
    if drafter_path is None or not (Path(drafter_path) / "tokenizer_config.json").is_file():
        return
    from transformers import AutoTokenizer

    draft_tokenizer = AutoTokenizer.from_pretrained(drafter_path)
    if draft_tokenizer.get_vocab() != target_tokenizer.get_vocab():
        raise ValueError(
            f"the drafter at {drafter_path} uses a different tokenizer from the target: "
            "drafters must share the target's vocabulary; retrain it on the target's tokenizer"
        )


# A method maps one prompt [1, T] to (sequence [1, T + new], our stats or None).


def evaluate_drafter(
    target: torch.nn.Module,
    drafter: Drafter,
    prompts: list[torch.Tensor],  # each [1, T]
    settings: EvalSettings,
    warmup: bool = True,
    plain_in_other_dtypes: dict[str, torch.nn.Module] | None = None,
) -> dict[str, object]:
    """Decode every prompt with HF ``generate``, draftsmith's own plain decoding (the same
    decoder and target forward with no drafter), our decoder with ``drafter`` and the HF peer;
    return the figures.

    ``plain_in_other_dtypes`` (dtype name -> the same target loaded in that dtype) adds
    draftsmith's plain decoding in those dtypes to the interleaved run, so that the report can
    state the speedup over the fastest plain decoding draftsmith has for the target
    (``speedup_over_fastest_plain``), not only over plain decoding in the drafter's dtype.
    """
    from draftsmith.decode.drafters.none import NoDrafter

    plain_settings = replace(settings, tree=None, adaptive=False)
    no_drafter = NoDrafter(vocab_size=drafter.vocab_size)
    methods: dict[str, Method] = {
        "baseline": plain_method(target, settings),
        "draftsmith_plain": speculative_method(target, no_drafter, plain_settings),
        "ours": speculative_method(target, drafter, settings),
    }
    methods |= plain_in_dtypes(target, plain_in_other_dtypes, no_drafter, plain_settings)
    peer = hf_peer(drafter, settings) if settings.peer else None
    if peer is not None:
        methods[peer[0]] = plain_method(target, settings, **peer[1])
    results = measure_side_by_side(target, methods, prompts, warmup, settings.repeats)
    peer_result = results[peer[0]] if peer is not None else None
    report = speculative_report(
        settings,
        drafter,
        results["baseline"],
        results["ours"],
        peer_result,
        own_plain=results["draftsmith_plain"],
    )
    return report | fastest_plain(target, results, report["tokens_per_s_speculative"])


PLAIN_IN = "draftsmith_plain_"  # + a dtype name: plain decoding of the target in that dtype


def plain_in_dtypes(
    target: torch.nn.Module,
    copies: dict[str, torch.nn.Module] | None,
    no_drafter: Drafter,
    plain_settings: EvalSettings,
) -> dict[str, Method]:
    """Draftsmith's plain decoding of ``copies`` (dtype name -> the target in that dtype),
    the target's own dtype left out (``draftsmith_plain`` measures it)."""
    return {
        f"{PLAIN_IN}{name}": speculative_method(model, no_drafter, plain_settings)
        for name, model in (copies or {}).items()
        if name != _dtype_name(target)
    }


def fastest_plain(
    target: torch.nn.Module, results: dict[str, MethodResult], tokens_per_s: float
) -> dict[str, object]:
    """Plain decoding's tokens/s per dtype and the speedup over the fastest of them."""
    rates = {_dtype_name(target): results["draftsmith_plain"].tokens_per_s} | {
        name.removeprefix(PLAIN_IN): result.tokens_per_s
        for name, result in results.items()
        if name.startswith(PLAIN_IN)
    }
    fastest = max(rates, key=rates.__getitem__)
    return {
        "dtype": _dtype_name(target),
        "tokens_per_s_draftsmith_plain_by_dtype": rates,
        "fastest_plain_dtype": fastest,
        "speedup_over_fastest_plain": tokens_per_s / rates[fastest] if rates[fastest] else 0.0,
    }


def _dtype_name(model: torch.nn.Module) -> str:
    return str(next(model.parameters()).dtype).removeprefix("torch.")


def speculative_report(
    settings: EvalSettings,
    drafter: Drafter,
    baseline: MethodResult,
    ours: MethodResult,
    peer: MethodResult | None = None,
    own_plain: MethodResult | None = None,
) -> dict[str, object]:
    """The evaluation JSON (docs/interfaces.md) of one speculative method against plain.

    ``speedup`` is over Hugging Face ``generate`` (``baseline``); ``speedup_over_draftsmith_plain``
    over our own decoder with no drafter (``own_plain``), which isolates what drafting adds.
    Per-component times: ``draft_step_ms`` (one drafted token), ``verify_pass_ms`` (one verify
    pass), ``target_step_ms`` (one plain target step of our decoder) and their ratio
    ``draft_cost_ratio = draft_step_ms / target_step_ms``.
    """
    stats = ours.stats or DecodeStats()
    verify_ms = stats.verify_ms_per_pass
    draft_round_ms = stats.draft_ms_per_round
    draft_step_ms = (
        1000 * stats.draft_seconds / stats.draft_positions if stats.draft_positions else 0.0
    )
    baseline_token_ms = 1000 / baseline.tokens_per_s if baseline.tokens_per_s else 0.0
    predicted = predicted_speedup(stats.tau, baseline_token_ms, draft_round_ms, verify_ms)
    speedup = ours.tokens_per_s / baseline.tokens_per_s if baseline.tokens_per_s else 0.0
    greedy_matches = sum(
        int(torch.equal(a, b)) for a, b in zip(ours.outputs, baseline.outputs, strict=True)
    )
    peer_report = None
    if peer is not None:
        peer_report = {
            "name": peer.name,
            "tokens_per_s": peer.tokens_per_s,
            "tau": peer.tokens_per_pass,
            "speedup": peer.tokens_per_s / baseline.tokens_per_s if baseline.tokens_per_s else 0.0,
        }
    report: dict[str, object] = {
        "drafter_kind": drafter.kind,
        "lean_target": settings.lean_target,
        "adaptive": settings.adaptive,
        "tree": None if settings.tree is None else settings.tree.__dict__,
        "num_draft_tokens": settings.num_draft_tokens,
        "temperature": settings.temperature,
        "top_k": settings.top_k,
        "top_p": settings.top_p,
        "num_prompts": len(ours.outputs),
        "repeats": settings.repeats,
        "max_new_tokens": settings.max_new_tokens,
        "tau": stats.tau,
        "alpha_per_position": stats.alpha_per_position,
        "predicted_tau": stats.predicted_tau,
        "tokens_per_s_baseline": baseline.tokens_per_s,
        "tokens_per_s_speculative": ours.tokens_per_s,
        "speedup": speedup,
        "predicted_speedup": predicted,
        "speedup_over_predicted": speedup / predicted if predicted else 0.0,
        "target_forward_ms": verify_ms,
        "verify_pass_ms": verify_ms,
        "baseline_token_ms": baseline_token_ms,
        "draft_step_ms": draft_step_ms,
        "greedy_equal_to_baseline": greedy_matches if settings.temperature == 0 else None,
        "distinct_4gram_share": ours.distinct_4gram_share,
        "distinct_4gram_share_baseline": baseline.distinct_4gram_share,
        "peer": peer_report,
        "drafter_usage": drafter.usage(),
    }
    if own_plain is not None:
        plain_stats = own_plain.stats or DecodeStats()
        target_step_ms = plain_stats.verify_ms_per_pass
        own_token_ms = 1000 / own_plain.tokens_per_s if own_plain.tokens_per_s else 0.0
        predicted_own = predicted_speedup(stats.tau, own_token_ms, draft_round_ms, verify_ms)
        over_own = ours.tokens_per_s / own_plain.tokens_per_s if own_plain.tokens_per_s else 0.0
        report.update(
            tokens_per_s_draftsmith_plain=own_plain.tokens_per_s,
            speedup_over_draftsmith_plain=over_own,
            predicted_speedup_over_draftsmith_plain=predicted_own,
            target_step_ms=target_step_ms,
            draft_cost_ratio=draft_step_ms / target_step_ms if target_step_ms else 0.0,
            verify_cost_ratio=verify_ms / target_step_ms if target_step_ms else 0.0,
            draftsmith_plain_greedy_equal_to_baseline=sum(
                int(torch.equal(a, b))
                for a, b in zip(own_plain.outputs, baseline.outputs, strict=True)
            )
            if settings.temperature == 0
            else None,
        )
    return report


def format_table(report: dict[str, object]) -> str:
    """A plain-text summary of one report: speedups over HF ``generate`` and over draftsmith's
    own plain decoding, side by side."""
    own = report.get("tokens_per_s_draftsmith_plain")
    rows = [("plain (HF generate)", report["tokens_per_s_baseline"], 1.0)]
    if own:
        rows.append(("draftsmith plain (no drafter)", own, 1.0))
    for name, rate in report.get("tokens_per_s_draftsmith_plain_by_dtype", {}).items():
        if name != report.get("dtype"):
            rows.append((f"draftsmith plain, {name}", rate, 1.0))
    rows.append((f"draftsmith {report['drafter_kind']}", report["tokens_per_s_speculative"], None))
    peer = report.get("peer")
    if peer:
        rows.append((peer["name"], peer["tokens_per_s"], peer["tau"]))
    lines = [f"machine: {describe_machine(report['machine'])}"] if "machine" in report else []
    lines.append(f"{'method':<32}{'tokens/s':>10}{'vs HF':>8}{'vs ours plain':>15}{'tau':>7}")
    for name, rate, tau in rows:
        tau = report["tau"] if tau is None else tau
        over_hf = rate / report["tokens_per_s_baseline"] if report["tokens_per_s_baseline"] else 0
        over_own = f"{rate / own:>14.2f}x" if own else f"{'-':>15}"
        lines.append(f"{name:<32}{rate:>10.1f}{over_hf:>7.2f}x{over_own}{tau:>7.2f}")
    alphas = " ".join(f"{alpha:.2f}" for alpha in report["alpha_per_position"])
    lines.append(f"alpha per position: {alphas}")
    if "speedup_over_fastest_plain" in report:
        lines.append(
            f"dtype {report['dtype']}; speedup over the fastest draftsmith plain decoding "
            f"({report['fastest_plain_dtype']}): {report['speedup_over_fastest_plain']:.2f}x"
        )
    lines.append(
        f"distinct 4-grams of the output: {report['distinct_4gram_share']:.2f} "
        f"(HF plain {report['distinct_4gram_share_baseline']:.2f})"
    )
    lines.append(
        f"predicted tau {report['predicted_tau']:.2f}; predicted speedup over HF "
        f"{report['predicted_speedup']:.2f}x (measured/predicted "
        f"{report['speedup_over_predicted']:.2f})"
    )
    timing = (
        f"draft {report['draft_step_ms']:.2f} ms/token, verify pass "
        f"{report['verify_pass_ms']:.2f} ms, HF plain {report['baseline_token_ms']:.2f} ms/token"
    )
    if own:
        timing += (
            f", target step {report['target_step_ms']:.2f} ms (draft/target "
            f"{report['draft_cost_ratio']:.2f}, verify/target {report['verify_cost_ratio']:.2f})"
        )
    lines.append(timing)
    usage = report.get("drafter_usage")
    if usage:
        lines.append("drafter usage: " + ", ".join(f"{k} {v:.3g}" for k, v in usage.items()))
    return "\n".join(lines)


def build_parser() -> argparse.ArgumentParser:
    from draftsmith.decode.measure.prompts import add_system_prompt_argument

    parser = argparse.ArgumentParser(
        prog="python -m draftsmith.decode.measure.evaluate",
        description=__doc__.split("\n\n")[0],
        epilog="example: draftsmith-evaluate --target DIR --drafter DIR --json report.json",
    )
    parser.add_argument("--target", required=True, help="target model folder")
    parser.add_argument("--drafter", default=None, help="drafter folder (not needed for ngram)")
    parser.add_argument(
        "--drafter-kind",
        default=None,
        help="draft_lm | ngram | medusa | eagle3 | peagle | hybrid (lookup + the folder's "
        "drafter) | none (default: read from the folder)",
    )
    parser.add_argument(
        "--lookup-tokens",
        type=at_least_one,
        default=None,
        help="with --drafter-kind hybrid: the most tokens a lookup round copies when no row "
        f"runs the network (default {LOOKUP_DRAFT_TOKENS}, at least --num-draft-tokens)",
    )
    parser.add_argument(
        "--prompts",
        default="demo",
        help="'demo' (held-out stdlib code), 'ood' (installed third-party code) or a file",
    )
    parser.add_argument(
        "--benchmark",
        action="append",
        metavar="NAME=FILE",
        help="a benchmark's prompt file in its published shape (MT-Bench question.jsonl, GSM8K "
        "test.jsonl, HumanEval.jsonl; draftsmith.decode.measure.benchmarks), evaluated on its own; repeat it: one "
        "accept length per benchmark, as SpecForge and speculators report (replaces --prompts)",
    )
    add_system_prompt_argument(parser, "the one the drafter was trained with, if any")
    parser.add_argument("--num-prompts", type=int, default=8)
    add_repeats_argument(parser)
    parser.add_argument("--max-new-tokens", type=at_least_one, default=128)
    parser.add_argument("--num-draft-tokens", type=at_least_one, default=NUM_DRAFT_TOKENS)
    parser.add_argument("--temperature", type=temperature_value, default=0.0)
    parser.add_argument("--top-k", type=at_least_zero, default=0)
    parser.add_argument("--top-p", type=top_p_value, default=1.0)
    parser.add_argument("--seed", type=seed_value, default=0)
    parser.add_argument(
        "--tree",
        action="store_true",
        help="draft trees (eagle3: EAGLE-2 dynamic at T = 0, and with --tree-when-sampling at "
        "T > 0 a sampled tree: root children drawn from the head's q without replacement, each "
        "continued as a sampled chain; medusa: static choices)",
    )
    parser.add_argument(
        "--tree-when-sampling",
        action="store_true",
        help="keep --tree at temperature > 0 (by default sampling drafts chains: top-k trees "
        "accept a child only with the target's probability of it and lose to chains there; "
        "eagle3 then drafts sampled trees instead)",
    )
    add_tree_arguments(parser)
    parser.add_argument("--no-peer", action="store_true", help="skip the Hugging Face peer")
    parser.add_argument(
        "--adaptive",
        action="store_true",
        help="choose each round's draft length in 0..N from measured acceptance and times; "
        "with --tree each round's shape (a plain step, a chain or a tree up to --tree-top-k x "
        "--tree-total-tokens; draftsmith.decode.trees.policy)",
    )
    parser.add_argument(
        "--model-forward",
        action="store_true",
        help="verify with the target's own forward instead of the lean CPU forward",
    )
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    add_dtype_argument(parser)
    parser.add_argument(
        "--plain-also",
        default="float32",
        help="comma-separated dtypes in which draftsmith's plain decoding is measured too, so "
        "speedups are stated over the fastest plain decoding ('' for none; the run's own dtype "
        "is always measured)",
    )
    parser.add_argument(
        "--threads", type=int, default=None, help="torch CPU threads (default: every core)"
    )
    parser.add_argument("--json", default=None, help="write the report here")
    return parser


def flags_problem(args: argparse.Namespace) -> str | None:
    """What contradicts in ``args`` before anything loads: tree flags without ``--tree`` (or a
    bad tree shape), a drafter folder for a kind that takes none, no drafter at all."""
    if args.drafter_kind in ("ngram", "none") and args.drafter is not None:
        return (
            f"--drafter-kind {args.drafter_kind} takes no --drafter folder: drop --drafter "
            f"{args.drafter}, or drop --drafter-kind to use the folder's drafter"
        )
    if args.drafter is None and args.drafter_kind is None:
        return "give --drafter FOLDER (a trained drafter), or --drafter-kind ngram (no folder)"
    return tree_flags_problem(args)


def main(argv: list[str] | None = None) -> dict[str, object]:
    from draftsmith.decode.command_line import check_output_file
    from draftsmith.decode.drafters.hybrid import lookup_tokens_problem, set_lookup_tokens
    from draftsmith.decode.drafters.registry import load_drafter
    from draftsmith.decode.measure.benchmarks import (
        format_benchmarks,
        parse_benchmark_flags,
        run_benchmarks,
    )
    from draftsmith.decode.measure.prompts import drafters_system_prompt, load_eval_prompts

    parser = build_parser()
    args = parser.parse_args(argv)
    if args.num_prompts < 1:  # a negative count would slice prompts off the end
        parser.error(f"--num-prompts must be >= 1, got {args.num_prompts}")
    problem = lookup_tokens_problem(args.lookup_tokens, args.drafter_kind) or flags_problem(args)
    if problem:
        parser.error(problem)
    check_device(args.device)
    if args.json:
        check_output_file(args.json, "--json")
    # Prompt files are read before any model loads: a bad file costs no loading time.
    drafters = [args.drafter] if args.drafter is not None else []
    system_prompt = drafters_system_prompt(args.system_prompt, drafters)
    texts = (
        [] if args.benchmark else load_eval_prompts(args.prompts, args.num_prompts, system_prompt)
    )
    files = parse_benchmark_flags(args.benchmark) if args.benchmark else {}
    choice, target, tokenizer, plain_also = load_targets_for(args)
    check_same_tokenizer(tokenizer, args.drafter)
    drafter = load_drafter(args.drafter, target, kind=args.drafter_kind)
    set_lookup_tokens(drafter, args.lookup_tokens, "--lookup-tokens")
    prompts = [encode_prompt(tokenizer, p) for p in texts]
    check_context(target, prompts, args.max_new_tokens)
    settings = EvalSettings(
        num_draft_tokens=args.num_draft_tokens,
        max_new_tokens=args.max_new_tokens,
        temperature=args.temperature,
        top_k=args.top_k,
        top_p=args.top_p,
        seed=args.seed,
        repeats=args.repeats,
        peer=not args.no_peer,
        lean_target=not args.model_forward,
        adaptive=args.adaptive,
        tree=tree_from_arguments(args)
        if args.tree and (args.temperature == 0 or args.tree_when_sampling)
        else None,
    )

    def measure(prompts: list[torch.Tensor]) -> dict[str, object]:
        return evaluate_drafter(
            target, drafter, prompts, settings, plain_in_other_dtypes=plain_also
        )

    setting = {
        "target": args.target,
        "drafter": args.drafter,
        "system_prompt": system_prompt,
        **choice.record(),
        "machine": machine_record(args.device),
    }
    if args.benchmark:

        def encode(prompt: str | list[dict[str, str]]) -> torch.Tensor:
            ids = encode_prompt(tokenizer, prompt)
            check_context(target, [ids], args.max_new_tokens)
            return ids

        result = run_benchmarks(files, args.num_prompts, encode, measure, system_prompt)
        report = {**setting, **result}
        print(format_benchmarks(result))
    else:
        report = {**setting, **measure(prompts)}
        print(format_table(report))
    if args.json:
        from draftsmith.data.atomic_io import write_json_atomic

        write_json_atomic(args.json, report)
    return report


if __name__ == "__main__":
    from draftsmith.decode.command_line import run_command

    run_command(main)
