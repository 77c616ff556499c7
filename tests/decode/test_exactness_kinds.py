"""Exactness of every drafter kind over the model families (not only the draft LM's chains).

``test_exactness_configs`` sweeps the families' rope and window variants with one drafter
kind. Here each kind the decoder ships (EAGLE-3 chains with a pruned vocabulary and two layers,
EAGLE-2 dynamic trees fixed and adaptive, P-EAGLE, Medusa chains and static trees, the hybrid,
the n-gram drafter with an adaptive length) runs over a sample of those variants (rope types,
sliding windows, the non-lean Gemma families, attention biases and tied heads), lean forward on
and off, batch 1 and a ragged left-padded batch of 3: greedy output must equal Hugging Face
``generate(do_sample=False)`` token for token in float32. Edge cases with a drafter that is
always right (so EOS and ``max_new_tokens`` fall inside an accepted block), rows joining and
leaving a session on windowed families, and chi-square checks of kinds not sampled elsewhere
(EAGLE-3 chains with a pruned vocabulary, Medusa chains) complete it.
"""

from __future__ import annotations

import pytest
import torch
from decode_helpers import (
    DRAFTER_KINDS,
    KIND_TREE,
    chi_square_p_value,
    exact_two_token_law,
    hf_greedy,
    noisy_copy,
    tiny_eagle_drafter,
    tiny_medusa_drafter,
)
from draftsmith.decode import DraftModelDrafter, SpeculativeDecoder
from draftsmith.decode.drafters.base import TreeSpec
from draftsmith.decode.drafters.hybrid import HybridDrafter
from draftsmith.decode.drafters.ngram import NgramDrafter
from draftsmith.decode.sampling import SamplingConfig
from family_variants import (
    LEAN_FAMILIES,
    NEW_TOKENS,
    PROMPT_LEN,
    VARIANTS,
    VOCAB,
    build_variant,
    ragged_prompts,
)
from tiny_models import tiny_llama

# A sample of family_variants.VARIANTS: rope types, windows, non-lean Gemma, biases and ties.
SAMPLED_VARIANTS = [
    "llama-yarn",
    "llama-longrope-long",
    "llama-biases-tied",
    "qwen3",
    "mistral-window",
    "qwen2-window",
    "gemma2-window",
    "gemma3-window",
]
WINDOWED = ["mistral-window", "qwen2-window", "gemma2-window", "gemma3-window"]


def _build(name: str) -> torch.nn.Module:
    """A float32 target of the variant (no greedy near-ties)."""
    return build_variant(name, torch.float32)


def _prompts(batch: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Ragged left-padded prompts whose tails repeat, so prompt lookup finds matches."""
    return ragged_prompts(batch, repeat_tail=True)


@pytest.mark.parametrize("name", SAMPLED_VARIANTS)
def test_every_drafter_kind_equals_generate(name: str) -> None:
    target = _build(name)
    lean_options = (True, False) if VARIANTS[name][0] in LEAN_FAMILIES else (False,)
    for batch in (1, 3):
        ids, mask = _prompts(batch)
        reference = target.generate(
            input_ids=ids, attention_mask=mask, max_new_tokens=NEW_TOKENS, do_sample=False
        )
        for lean in lean_options:
            for kind, (make, tree, adaptive) in DRAFTER_KINDS.items():
                decoder = SpeculativeDecoder(
                    target, make(target), 3, tree=tree, lean_target=lean, adaptive=adaptive
                )
                out = decoder.generate(ids, mask, max_new_tokens=NEW_TOKENS)
                assert torch.equal(out.sequences, reference), (batch, lean, kind)


@pytest.mark.parametrize("name", ["mistral-window", "gemma3-window"])
def test_eos_and_limits_inside_an_accepted_block(name: str) -> None:
    """A drafter that is always right (the target itself; the hybrid and trees around it where
    they apply) accepts whole blocks, so an EOS, or the end of ``max_new_tokens`` < the draft
    length, falls inside an accepted block; the output is cut there as ``generate`` cuts it."""
    target = _build(name)
    ids, mask = _prompts(3)
    free = hf_greedy(target, ids, NEW_TOKENS, mask)
    eos = [int(free[0, PROMPT_LEN + 4]), int(free[2, PROMPT_LEN + 6])]  # mid-block in two rows
    makers = {
        "perfect": (lambda: DraftModelDrafter(target), None),
        "hybrid-perfect": (lambda: HybridDrafter(DraftModelDrafter(target)), None),
        "eagle3-tree": (lambda: tiny_eagle_drafter(target), KIND_TREE),
        "medusa-tree": (lambda: tiny_medusa_drafter(target), TreeSpec()),
        "ngram": (lambda: NgramDrafter(VOCAB), None),
    }
    for max_new, eos_ids in ((1, []), (2, []), (3, []), (NEW_TOKENS, eos)):
        reference = target.generate(
            input_ids=ids, attention_mask=mask, max_new_tokens=max_new, do_sample=False,
            eos_token_id=eos_ids or None, pad_token_id=0,
        )  # fmt: skip
        for kind, (make, tree) in makers.items():
            decoder = SpeculativeDecoder(target, make(), 4, tree=tree)
            out = decoder.generate(
                ids, mask, max_new_tokens=max_new, eos_token_id=eos_ids, pad_token_id=0
            )
            assert torch.equal(out.sequences, reference), (kind, max_new, eos_ids)


SESSION_PROMPTS = [
    [5, 9, 12, 5, 9, 12, 5],
    [3, 17, 40],
    [22, 8, 31, 14, 60, 27, 11, 9, 4, 30, 2, 19],
    [7],
    [44, 45, 46, 47, 44, 45],
]
SESSION_LIMITS = [14, 6, 11, 17, 9]


@pytest.mark.parametrize("name", WINDOWED)
def test_rows_joining_and_leaving_on_windowed_families(name: str) -> None:
    """Continuous batching where the cache's windows are kept by position: rows merged in at
    other lengths (holes in front), compacted when others retire, with chains and trees."""
    target = _build(name)
    lean = VARIANTS[name][0] in LEAN_FAMILIES
    expected = []
    for prompt, limit in zip(SESSION_PROMPTS, SESSION_LIMITS, strict=True):
        ids = torch.tensor([prompt])
        out = hf_greedy(target, ids, limit)
        expected.append(out[0, len(prompt) :].tolist())
    makers = {
        "draft_lm": (lambda: DraftModelDrafter(noisy_copy(target, 0.3)), None),
        "eagle3-tree": (lambda: tiny_eagle_drafter(target), TreeSpec(top_k=3, total_tokens=8)),
        "medusa-tree": (lambda: tiny_medusa_drafter(target), TreeSpec()),
        "hybrid-eagle3": (lambda: HybridDrafter(tiny_eagle_drafter(target)), None),
    }
    for kind, (make, tree) in makers.items():
        decoder = SpeculativeDecoder(target, make(), 3, tree=tree, lean_target=lean)
        rows: list[int] = []  # request of each session row
        tokens: dict[int, list[int]] = {}

        def collect(update, rows=rows, tokens=tokens) -> None:
            for row, new in enumerate(update.tokens):
                tokens.setdefault(rows[row], []).extend(new)

        session = decoder.session(eos_token_id=[], streamer=collect)

        def join(requests: list[int], session=session, rows=rows) -> None:
            width = max(len(SESSION_PROMPTS[r]) for r in requests)
            ids = torch.zeros(len(requests), width, dtype=torch.long)
            mask = torch.zeros_like(ids)
            for row, request in enumerate(requests):
                ids[row, width - len(SESSION_PROMPTS[request]) :] = torch.tensor(
                    SESSION_PROMPTS[request]
                )
                mask[row, width - len(SESSION_PROMPTS[request]) :] = 1
            rows += requests
            session.add_rows(ids, mask, [SESSION_LIMITS[r] for r in requests])

        def retire(session=session, rows=rows) -> None:
            done = set(session.finished_rows())
            session.retire(sorted(done))
            rows[:] = [r for row, r in enumerate(rows) if row not in done]

        join([0])
        session.step()
        session.step()
        join([1, 2])
        session.step()
        retire()
        join([3])
        rounds = 0
        while session.room() > 0:
            session.step()
            retire()
            rounds += 1
            if rounds == 2:
                join([4])
        for request in range(len(SESSION_PROMPTS)):
            assert tokens[request] == expected[request], (kind, request)


@pytest.mark.parametrize(
    ("kind", "temperature", "top_k", "top_p"),
    [
        ("eagle3-pruned", 1.0, 0, 1.0),
        ("eagle3-pruned", 0.7, 10, 0.9),
        ("medusa", 1.0, 0, 1.0),
        ("eagle3-adaptive", 1.0, 0, 1.0),
    ],
)
def test_sampled_chains_of_head_kinds_follow_target_law(
    kind: str, temperature: float, top_k: int, top_p: float
) -> None:
    """EAGLE-3 chains whose q lives on a pruned vocabulary (scattered back to the target's),
    Medusa chains (one head per position) and EAGLE-3 under an adaptive length: the first two
    emitted tokens of 3000 rows follow the target's exact law (chi-square)."""
    target = tiny_llama(seed=0, dtype=torch.float32)
    drafter = (
        tiny_eagle_drafter(target, draft_vocab_size=40)
        if kind.startswith("eagle3")
        else tiny_medusa_drafter(target)
    )
    prompt = torch.tensor([5, 9, 5, 9, 5, 9, 5, 9, 5])
    sampling = SamplingConfig(temperature=temperature, top_k=top_k, top_p=top_p)
    first_law, second_law = exact_two_token_law(target, prompt, sampling)
    adaptive = kind.endswith("adaptive")
    decoder = SpeculativeDecoder(target, drafter, 3, adaptive=adaptive)
    if adaptive:  # estimates that make drafting worth it (the prefill emits the first token)
        for _ in range(2):  # a warm-up round, then a timed one, of each length
            decoder.draft_length.update(3, torch.tensor([3]), 0.004)
            decoder.draft_length.update(0, torch.tensor([0]), 0.003)
    out = decoder.generate(
        prompt[None].repeat(3000, 1),
        max_new_tokens=3 if adaptive else 2,
        sampling=sampling,
        eos_token_id=[],
        generator=torch.Generator().manual_seed(0),
    )
    new = out.sequences[:, prompt.numel() :]
    for column, law in ((0, first_law), (1, second_law)):
        counts = torch.bincount(new[:, column], minlength=law.numel())
        if int((law > 0).sum()) > 1:  # a one-token law has nothing to test
            assert chi_square_p_value(counts, law) > 1e-4, (kind, column)
        else:
            assert int(counts[law > 0].sum()) == counts.sum()
    assert out.stats.alpha_per_position[0] > 0  # drafts were accepted too, not only rejected
