"""Plain and speculative decoding measured side by side on the same prompts (batch 1, the
latency setting), the machinery under ``draftsmith.decode.measure.evaluate``, the benchmark, the ablation tool and
the main job's speed step: each method is a function of a prompt and its seed, every prompt is
decoded by every method in turn (so load drift hits all alike), and each method's time, tokens,
target passes and decoder statistics are summed (docs/theory.md §5).

On a shared machine a burst of load can slow whichever method runs during it. With
``repeats`` > 1 the whole interleaved pass runs again: every method re-seeds per prompt, so a
repeat decodes the very tokens the first decoded (same rounds, same acceptance), and each
prompt's time is the smallest over the repeats that reproduced them. Noise only ever adds
time, so the minimum estimates each method's own cost; plain and speculative rows get the same
treatment.

A method whose repeats decode other tokens (an adaptive policy at T > 0: its round shapes
follow measured times, so its draws differ from pass to pass) cannot take its own fastest
pass: that would pick its luckiest sample as well as its quietest moment. Its prompt is timed
on the prompt's quietest pass instead, the one in which the methods that did reproduce took
the least time together, a choice its own outcome plays no part in; its tokens and counters
come from that same pass (the first pass when no method reproduced)."""

from __future__ import annotations

import argparse
import math
import time
from collections.abc import Callable
from dataclasses import dataclass, field

import torch
from draftsmith.decode.defaults import MAX_SEED, NUM_DRAFT_TOKENS, TREE_TOP_K, TREE_TOTAL_TOKENS
from draftsmith.decode.drafters.base import Drafter, TreeSpec
from draftsmith.decode.engine import SpeculativeDecoder
from draftsmith.decode.sampling import SamplingConfig
from draftsmith.decode.stats import DecodeStats

# How ``measure_side_by_side`` times a method whose repeats decoded other tokens (recorded with
# benchmark results, whose older records kept such a method's first pass).
UNREPRODUCED_TIMING = "quietest pass"


@dataclass
class EvalSettings:
    num_draft_tokens: int = NUM_DRAFT_TOKENS
    max_new_tokens: int = 128
    temperature: float = 0.0
    top_k: int = 0
    top_p: float = 1.0
    seed: int = 0
    peer: bool = True
    tree: TreeSpec | None = None  # tree drafting (EAGLE-3, Medusa); None drafts chains
    lean_target: bool = True  # our CPU forward for Llama-family targets (SpeculativeDecoder)
    adaptive: bool = False  # per-round draft length in 0..N; with a tree, per-round tree shape
    repeats: int = 1  # interleaved passes over the prompts; each prompt timed by the fastest


def add_repeats_argument(parser: argparse.ArgumentParser) -> None:
    """``--repeats R`` for the commands that measure side by side (evaluate, benchmark)."""
    parser.add_argument(
        "--repeats",
        type=at_least_one,
        default=1,
        help="interleaved passes over the prompts; each prompt is timed by its fastest pass, "
        "every pass decoding the same tokens (draftsmith.decode.measure.side_by_side): for a shared machine",
    )


def add_tree_arguments(parser: argparse.ArgumentParser) -> None:
    """The tree shape flags of the commands that draft trees (evaluate, benchmark); read them
    back with :func:`tree_from_arguments`."""
    shape = {
        "--tree-top-k": (
            TREE_TOP_K,
            "children per expanded node (eagle3 sampled trees at T > 0: children of the root, "
            "each continued as a chain)",
        ),
        "--tree-total-tokens": (
            TREE_TOTAL_TOKENS,
            "nodes kept per tree (eagle3 sampled trees: the first child's chain gets up to "
            "--num-draft-tokens levels, the other children share the rest level by level)",
        ),
        "--tree-frontier": (
            0,
            "nodes of each eagle3 top-k tree level that grow --tree-top-k children (0: all of "
            "them, EAGLE-2's rule; 1: the greedy chain with its runners-up beside it, every "
            "level a one-row draft step; draftsmith.decode.drafters.base.TreeSpec)",
        ),
    }
    for flag, (default, text) in shape.items():
        parser.add_argument(flag, type=int, default=default, help=text)


def tree_from_arguments(args: argparse.Namespace) -> TreeSpec:
    """The :class:`TreeSpec` of :func:`add_tree_arguments`' flags (checked by ``TreeSpec``)."""
    return TreeSpec(args.tree_top_k, args.tree_total_tokens, frontier=args.tree_frontier)


def tree_flags_problem(args: argparse.Namespace) -> str | None:
    """What contradicts in a command's tree flags (:func:`add_tree_arguments`, ``--tree``,
    ``--tree-when-sampling``), or None; the shape is checked by ``TreeSpec`` when ``--tree``."""
    if args.tree:
        try:
            tree_from_arguments(args)
        except ValueError as error:
            return str(error)
        return None
    changed = [
        flag
        for flag, default in (
            ("--tree-top-k", TREE_TOP_K),
            ("--tree-total-tokens", TREE_TOTAL_TOKENS),
            ("--tree-frontier", 0),
        )
        if getattr(args, flag[2:].replace("-", "_")) != default
    ]
    if args.tree_when_sampling:
        changed.append("--tree-when-sampling")
    if changed:
        return f"{', '.join(changed)} only apply with --tree: add --tree, or drop them"
    return None


def _checked(text: str, parse: type, accepts: Callable[[float], bool], requirement: str):
    """An argparse type's value: ``parse(text)`` when ``accepts`` it, else the error
    "must be ``requirement``, got ..." (NaN fails every ``accepts`` written as a range)."""
    try:
        value = parse(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"must be {requirement}, got {text!r}") from None
    if not accepts(value):
        raise argparse.ArgumentTypeError(f"must be {requirement}, got {value}")
    return value


def at_least_one(text: str) -> int:
    """An argparse type: an integer >= 1."""
    return _checked(text, int, lambda value: value >= 1, "an integer >= 1")


def at_least_zero(text: str) -> int:
    """An argparse type: an integer >= 0 (``--top-k``, 0 disables it)."""
    return _checked(text, int, lambda value: value >= 0, "an integer >= 0")


def seed_value(text: str) -> int:
    """An argparse type: a run seed in ``0..MAX_SEED``."""
    return _checked(text, int, lambda value: 0 <= value <= MAX_SEED, f"an integer in 0..{MAX_SEED}")


def temperature_value(text: str) -> float:
    """An argparse type: a finite temperature >= 0 (0 is greedy)."""
    return _checked(
        text, float, lambda value: 0 <= value < math.inf, "a finite number >= 0 (0 is greedy)"
    )


def share_value(text: str) -> float:
    """An argparse type: a share of the whole, in [0, 1]."""
    return _checked(text, float, lambda value: 0 <= value <= 1, "a number in [0, 1]")


def top_p_value(text: str) -> float:
    """An argparse type: a nucleus mass in (0, 1] (1 disables it)."""
    return _checked(text, float, lambda value: 0 < value <= 1, "a number in (0, 1] (1 disables it)")


def check_context(
    target: torch.nn.Module,
    prompts: list[torch.Tensor],
    max_new_tokens: int,
    flag: str = "--max-new-tokens",
) -> None:
    """``ValueError`` when the longest prompt plus ``max_new_tokens`` (the value of ``flag``)
    passes the target's context (``max_position_embeddings``) and its config scales no rope
    past it."""
    config = getattr(target, "config", None)
    context = getattr(config, "max_position_embeddings", None)
    if not isinstance(context, int) or _scales_rope(config) or not prompts:
        return
    longest = max(ids.shape[-1] for ids in prompts)
    if longest + max_new_tokens > context:
        raise ValueError(
            f"{flag} {max_new_tokens}: the longest prompt ({longest} tokens) plus "
            f"{max_new_tokens} new tokens passes the target's context of {context} tokens "
            f"(max_position_embeddings); pass {flag} {max(context - longest, 1)} or "
            "less, or shorter prompts"
        )


def _scales_rope(config: object) -> bool:
    """Whether ``config`` scales rope past its ``max_position_embeddings`` (any rope type but
    ``default``, in ``rope_scaling`` or transformers 5's ``rope_parameters``)."""
    for name in ("rope_scaling", "rope_parameters"):
        rope = getattr(config, name, None)
        if isinstance(rope, dict) and rope.get("rope_type", rope.get("type")) not in (
            None,
            "default",
        ):
            return True
    return False


def prompt_seed(seed: int, index: int) -> int:
    """The sampling seed of prompt ``index`` under run seed ``seed``: every method draws the
    same stream for a prompt, and a repeat of the prompt draws it again."""
    return seed * 1_000_003 + index


def encode_prompt(tokenizer, prompt: str | list[dict[str, str]]) -> torch.Tensor:  # [1, T]
    if isinstance(prompt, str):
        ids = tokenizer(prompt, return_tensors="pt").input_ids
    else:
        if not getattr(tokenizer, "chat_template", None):
            raise ValueError(
                "a prompt is a chat conversation but the target's tokenizer has no chat "
                'template; pass text prompts (a text file or {"prompt": ...} records) or a '
                "target folder whose tokenizer has one"
            )
        ids = tokenizer.apply_chat_template(prompt, add_generation_prompt=True, return_tensors="pt")
        ids = ids if isinstance(ids, torch.Tensor) else ids["input_ids"]
    if ids.shape[1] == 0:
        raise ValueError(f"prompt {str(prompt)[:80]!r} encodes to no tokens; drop it from the file")
    return ids


class ForwardCounter:
    """Counts a model's forward passes (to measure a peer's tau from outside)."""

    def __init__(self, model: torch.nn.Module) -> None:
        self.count = 0
        self._handle = model.register_forward_hook(self._hook)

    def _hook(self, *_: object) -> None:
        self.count += 1

    def close(self) -> None:
        self._handle.remove()


def _sampling_kwargs(settings: EvalSettings) -> dict[str, object]:
    """HF ``generate`` settings that sample as our decoder does (greedy below the floor too)."""
    sampling = SamplingConfig(settings.temperature, settings.top_k, settings.top_p)
    if sampling.greedy:
        return {"do_sample": False}
    return {
        "do_sample": True,
        "temperature": settings.temperature,
        "top_k": settings.top_k or None,
        "top_p": settings.top_p,
    }


def hf_peer(drafter: Drafter, settings: EvalSettings) -> tuple[str, dict[str, object]] | None:
    """The Hugging Face method that uses the same drafter, with fair settings, or None."""
    if drafter.kind == "draft_lm":
        assistant = drafter.model
        # HF reads these from the assistant's generation config, not from generate()'s kwargs.
        assistant.generation_config.num_assistant_tokens = settings.num_draft_tokens
        assistant.generation_config.num_assistant_tokens_schedule = "constant"
        assistant.generation_config.assistant_confidence_threshold = 0.0
        return "hf_assisted", {"assistant_model": assistant}
    if drafter.kind == "ngram":
        return "hf_prompt_lookup", {"prompt_lookup_num_tokens": settings.num_draft_tokens}
    return None


@dataclass
class MethodResult:
    """What one decoding method did over all prompts."""

    name: str
    seconds: float = 0.0
    tokens: int = 0
    target_passes: int = 0  # forward calls of the target (prefill included)
    outputs: list[torch.Tensor] = field(default_factory=list)
    prompt_lengths: list[int] = field(default_factory=list)
    stats: DecodeStats | None = None  # our decoder's acceptance counters
    unreproduced: int = 0  # repeats whose output differed from the first pass's

    def record(
        self,
        ids: torch.Tensor,  # [1, T] the prompt
        sequence: torch.Tensor,  # [1, T + new]
        target_passes: int,
    ) -> None:
        """Add one prompt's output and its count of target passes."""
        self.target_passes += target_passes
        self.tokens += sequence.shape[1] - ids.shape[1]
        self.outputs.append(sequence)
        self.prompt_lengths.append(ids.shape[1])

    def add_time(self, seconds: float, stats: DecodeStats | None) -> None:
        """Add one prompt's time and our decoder's counters from the same (timed) call."""
        self.seconds += seconds
        if stats is not None:
            self.stats = stats if self.stats is None else self.stats.merge(stats)

    @property
    def distinct_4gram_share(self) -> float:
        return distinct_ngram_share(self.outputs, self.prompt_lengths, 4)

    @property
    def tokens_per_s(self) -> float:
        return self.tokens / self.seconds if self.seconds else 0.0

    @property
    def tokens_per_pass(self) -> float:
        """A peer's tau seen from outside: new tokens per target forward call."""
        return self.tokens / self.target_passes if self.target_passes else 0.0


# A method decodes one prompt [1, T] with the prompt's index (its sampling seed, ``prompt_seed``)
# into (sequence [1, T + new], our decoder's stats or None).
Method = Callable[[torch.Tensor, int], tuple[torch.Tensor, DecodeStats | None]]


def plain_method(target: torch.nn.Module, settings: EvalSettings, **hf_kwargs: object) -> Method:
    """Hugging Face ``generate``: plain decoding, or a peer's with ``hf_kwargs``."""
    sampling = _sampling_kwargs(settings)

    def run(ids: torch.Tensor, index: int) -> tuple[torch.Tensor, None]:
        if sampling["do_sample"]:  # HF samples from the global generator
            torch.manual_seed(prompt_seed(settings.seed, index))
        out = target.generate(
            input_ids=ids,
            eos_token_id=[],
            max_new_tokens=settings.max_new_tokens,
            **sampling,
            **hf_kwargs,
        )
        return out, None

    return run


def speculative_method(target: torch.nn.Module, drafter: Drafter, settings: EvalSettings) -> Method:
    """Our decoder with ``drafter`` under ``settings`` (seeded per prompt, ``prompt_seed``)."""
    decoder = SpeculativeDecoder(
        target,
        drafter,
        settings.num_draft_tokens,
        tree=settings.tree,
        lean_target=settings.lean_target,
        adaptive=settings.adaptive,
    )
    device = next(target.parameters()).device
    generator = torch.Generator(device=device)  # seeded per prompt

    def run(ids: torch.Tensor, index: int) -> tuple[torch.Tensor, DecodeStats]:
        generator.manual_seed(prompt_seed(settings.seed, index))
        out = decoder.generate(
            ids,
            max_new_tokens=settings.max_new_tokens,
            temperature=settings.temperature,
            top_k=settings.top_k,
            top_p=settings.top_p,
            eos_token_id=[],
            generator=generator,
        )
        return out.sequences, out.stats

    return run


def measure_side_by_side(
    target: torch.nn.Module,
    methods: dict[str, Method],
    prompts: list[torch.Tensor],  # each [1, T]
    warmup: bool = True,
    repeats: int = 1,
) -> dict[str, MethodResult]:
    """Run every method on every prompt, interleaved per prompt so load drift hits all alike;
    with ``repeats`` > 1 run the whole pass again and time each prompt by its fastest
    reproduction, or a method that did not reproduce by the prompt's quietest pass (see the
    module docstring)."""
    if repeats < 1:
        raise ValueError(f"repeats must be >= 1, got {repeats}")
    device = next(target.parameters()).device
    passes: dict[tuple[str, int], list[_Pass]] = {}  # (method, prompt) -> one per repeat
    with torch.inference_mode():
        if warmup:  # first calls pay for lazy initialisation; keep them out of the figures
            for method in methods.values():
                method(prompts[0][:, :16].to(device), 0)
        for _ in range(repeats):
            for index, ids in enumerate(prompts):
                ids = ids.to(device)
                for name, method in methods.items():
                    counter = ForwardCounter(target)
                    _synchronize(device)
                    start = time.perf_counter()
                    sequence, stats = method(ids, index)
                    _synchronize(device)
                    seconds = time.perf_counter() - start
                    counter.close()
                    run = _Pass(seconds, stats, sequence.cpu(), counter.count)
                    passes.setdefault((name, index), []).append(run)
    results = {name: MethodResult(name=name) for name in methods}
    for index, ids in enumerate(prompts):
        runs = {name: passes[name, index] for name in methods}
        reproduced = {
            name: [torch.equal(run.sequence, their[0].sequence) for run in their]
            for name, their in runs.items()
        }
        steady = [name for name in methods if all(reproduced[name])]
        load = [sum(runs[name][r].seconds for name in steady) for r in range(repeats)]
        quietest = min(range(repeats), key=load.__getitem__)  # pass 0 when none is steady
        for name, their in runs.items():
            chosen = min(their, key=lambda run: run.seconds) if name in steady else their[quietest]
            result = results[name]
            result.unreproduced += reproduced[name].count(False)
            result.record(ids, chosen.sequence, chosen.target_passes)
            result.add_time(chosen.seconds, chosen.stats)
    return results


@dataclass
class _Pass:
    """One method's decoding of one prompt in one repeat."""

    seconds: float
    stats: DecodeStats | None
    sequence: torch.Tensor  # [1, T + new] on the CPU
    target_passes: int


def _synchronize(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def distinct_ngram_share(
    sequences: list[torch.Tensor], prompt_lengths: list[int], n: int = 4
) -> float:
    """The share of distinct n-grams among all n-grams of the generated tokens (1 = no
    repetition): text that repeats itself makes greedy acceptance look better than it is."""
    total, distinct = 0, 0
    for sequence, start in zip(sequences, prompt_lengths, strict=True):
        new = sequence.reshape(-1)[start:].tolist()
        grams = [tuple(new[i : i + n]) for i in range(len(new) - n + 1)]
        total += len(grams)
        distinct += len(set(grams))
    return distinct / total if total else 1.0
