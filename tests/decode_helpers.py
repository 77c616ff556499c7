"""Drafters with a known relation to the target, and exact reference distributions."""

from __future__ import annotations

import copy

import torch
from draftsmith.decode.drafters.base import Drafter, DraftProposal, TargetPass, TreeSpec
from draftsmith.decode.drafters.hybrid import HybridDrafter
from draftsmith.decode.drafters.ngram import NgramDrafter
from draftsmith.decode.sampling import SamplingConfig, logits_to_probs


def noisy_copy(model: torch.nn.Module, scale: float, seed: int = 7) -> torch.nn.Module:
    """The model with Gaussian noise on every weight: a draft that is right only sometimes."""
    noisy = copy.deepcopy(model)
    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for parameter in noisy.parameters():
            noise = torch.randn(parameter.shape, generator=generator, dtype=parameter.dtype)
            parameter.add_(noise * scale * parameter.std().clamp(min=1e-3))
    return noisy


class AdversarialDrafter(Drafter):
    """Proposes the token the target finds least likely, deterministically (one-hot q)."""

    kind = "adversarial"

    def __init__(self, target: torch.nn.Module) -> None:
        self.target = target

    @property
    def vocab_size(self) -> int:
        return self.target.get_output_embeddings().weight.shape[0]

    def prefill(self, input_ids, attention_mask, target_pass: TargetPass, pending) -> None:
        self._last = target_pass.logits[:, -1]

    def propose(self, num_tokens: int, sampling: SamplingConfig, generator) -> DraftProposal:
        worst = self._last.argmin(-1)
        return DraftProposal(tokens=worst[:, None].repeat(1, num_tokens), probs=None)

    def commit(self, num_accepted, next_tokens, target_pass: TargetPass) -> None:
        self._last = target_pass.logits.gather(
            1, num_accepted[:, None, None].expand(-1, 1, target_pass.logits.shape[-1])
        ).squeeze(1)


def exact_two_token_law(
    target: torch.nn.Module,
    prompt: torch.Tensor,  # [T]
    sampling: SamplingConfig,
) -> tuple[torch.Tensor, torch.Tensor]:  # p(x1) [V], p(x2) marginal [V]
    """The target's exact law of the first two sampled tokens after ``prompt``."""
    with torch.no_grad():
        first = logits_to_probs(target(prompt[None]).logits[0, -1], sampling)  # [V]
        vocab = first.shape[0]
        every_token = torch.arange(vocab, device=prompt.device)[:, None]  # [V, 1]
        extended = torch.cat([prompt[None].repeat(vocab, 1), every_token], 1)
        second = logits_to_probs(target(extended).logits[:, -1], sampling)  # [V, V]
    return first.double(), (first.double()[:, None] * second.double()).sum(0)


def chi_square_p_value(
    counts: torch.Tensor,  # [V] observed
    probs: torch.Tensor,  # [V] expected law
    min_expected: float = 5.0,
) -> float:
    """Pearson's chi-square goodness of fit, rare cells pooled so each expects >= 5."""
    total = counts.sum().double()
    expected = probs.double() * total
    order = torch.argsort(expected, descending=True)
    expected, counts = expected[order], counts.double()[order]
    common = expected >= min_expected
    observed_bins = torch.cat([counts[common], counts[~common].sum()[None]])
    expected_bins = torch.cat([expected[common], expected[~common].sum()[None]])
    if expected_bins[-1] < min_expected:  # fold a small pooled bin into the last big one
        observed_bins = torch.cat([observed_bins[:-2], observed_bins[-2:].sum()[None]])
        expected_bins = torch.cat([expected_bins[:-2], expected_bins[-2:].sum()[None]])
    # Cells the law forbids must stay empty.
    if bool((counts[expected == 0] > 0).any()):
        return 0.0
    statistic = ((observed_bins - expected_bins) ** 2 / expected_bins).sum()
    dof = observed_bins.numel() - 1
    return float(torch.special.gammaincc(torch.tensor(dof / 2.0), statistic / 2.0))


def tiny_eagle_drafter(
    target: torch.nn.Module, num_layers: int = 1, draft_vocab_size: int | None = None
):
    """A random EAGLE-3 head on the target's own LM head, so drafts are sometimes right; with
    ``draft_vocab_size`` a random head over that pruned vocabulary instead."""
    from draftsmith.decode.drafters.eagle.drafter import Eagle3Drafter
    from draftsmith.decode.drafters.eagle.head import Eagle3Config, Eagle3Head

    torch.manual_seed(0)
    config = Eagle3Config.for_target(
        target.config, num_hidden_layers=num_layers, draft_vocab_size=draft_vocab_size
    )
    head = Eagle3Head(config).double()
    if draft_vocab_size is None:
        with torch.no_grad():  # reuse the target's head so drafts are sometimes right
            head.lm_head.weight.copy_(target.get_output_embeddings().weight)
    randomize_later_layers(head, scale=0.02)  # small: random drafts still accepted at times
    return Eagle3Drafter(head, target)


def randomize_later_layers(head: torch.nn.Module, scale: float = 0.2) -> None:
    """Random ``o_proj`` / ``down_proj`` in a head's later layers, which initialise to zero (an
    identity layer would hide a mistake in its math from an exactness test)."""
    generator = torch.Generator().manual_seed(7)
    with torch.no_grad():
        for layer in head.layers.values():
            for weight in (layer.self_attn.o_proj.weight, layer.mlp.down_proj.weight):
                noise = torch.randn(weight.shape, generator=generator, dtype=torch.float64)
                weight.copy_(noise * scale)


def tiny_peagle_drafter(target: torch.nn.Module, num_depths: int = 3, num_layers: int = 1):
    """A random P-EAGLE head on the target's own LM head, so drafts are sometimes right."""
    from draftsmith.decode.drafters.eagle.peagle import PEagleConfig, PEagleDrafter, PEagleHead

    torch.manual_seed(0)
    config = PEagleConfig.for_target(
        target.config, num_depths=num_depths, num_hidden_layers=num_layers
    )
    head = PEagleHead(config).to(target.dtype)
    with torch.no_grad():
        head.lm_head.weight.copy_(target.get_output_embeddings().weight)
    randomize_later_layers(head, scale=0.02)  # small: random drafts still accepted at times
    return PEagleDrafter(head, target)


def tiny_dflash_drafter(
    target: torch.nn.Module,
    block_size: int = 4,
    num_layers: int = 1,
    **options,
):
    """A random DFlash head on the target's own LM head (``options``: markov_rank,
    confidence_head, draft_vocab_size), so drafts are sometimes right."""
    from draftsmith.decode.drafters.dflash.drafter import DFlashDrafter
    from draftsmith.decode.drafters.dflash.head import DFlashConfig, DFlashHead

    torch.manual_seed(0)
    config = DFlashConfig.for_target(
        target.config, block_size=block_size, num_hidden_layers=num_layers, **options
    )
    head = DFlashHead(config).to(target.dtype)
    with torch.no_grad():  # reuse the target's head so drafts are sometimes right
        head.lm_head.weight.copy_(head.to_draft_vocab(target.get_output_embeddings().weight.T).T)
        for layer in head.layers:  # small attention and MLP outputs: drafts near the target's
            layer.self_attn.o_proj.weight.mul_(0.05)
            layer.mlp.down_proj.weight.mul_(0.05)
    return DFlashDrafter(head, target)


def tiny_medusa_drafter(target: torch.nn.Module, num_heads: int = 3):
    """Medusa heads from the target's LM head with random residual blocks."""
    from draftsmith.decode.drafters.medusa import MedusaDrafter, MedusaHeads

    heads = MedusaHeads.from_target(target, num_heads=num_heads).double()
    generator = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for param in heads.blocks.parameters():
            param.copy_(torch.randn(param.shape, generator=generator, dtype=param.dtype) * 0.3)
    return MedusaDrafter(heads, target)


def hf_greedy(
    target: torch.nn.Module,
    ids: torch.Tensor,  # [B, T] left-padded prompts
    max_new_tokens: int,
    mask: torch.Tensor | None = None,  # [B, T]; all ones when None
) -> torch.Tensor:  # [B, T + max_new_tokens]
    """Hugging Face ``generate``'s greedy continuation of ``ids`` with no EOS stop: the
    reference every exactness test compares the decoder's greedy output with."""
    return target.generate(
        input_ids=ids, attention_mask=torch.ones_like(ids) if mask is None else mask,
        max_new_tokens=max_new_tokens, do_sample=False, eos_token_id=None, pad_token_id=0,
    )  # fmt: skip


def ragged_greedy_batch(
    target: torch.nn.Module, max_new_tokens: int
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Three left-padded prompts (row 1 padded by 4) and the target's own greedy continuation
    of them: ``(ids [3, 9], mask [3, 9], reference [3, 9 + max_new_tokens])``."""
    ids = torch.randint(3, 64, (3, 9), generator=torch.Generator().manual_seed(1))
    mask = torch.ones_like(ids)
    mask[1, :4] = 0
    ids = ids.masked_fill(mask == 0, 0)
    reference = target.generate(
        input_ids=ids, attention_mask=mask, max_new_tokens=max_new_tokens, do_sample=False
    )
    return ids, mask, reference


# Every drafter kind the decoder ships, as (drafter factory for a target, tree, adaptive):
# EAGLE-3 chains (two layers, pruned vocabulary), EAGLE-2 trees fixed / frontier one /
# adaptive, P-EAGLE, Medusa chains and static trees, the hybrids, the n-gram drafter.
KIND_TREE = TreeSpec(top_k=3, total_tokens=10)
DRAFTER_KINDS = {
    "eagle3-two-layers-pruned": (
        lambda t: tiny_eagle_drafter(t, num_layers=2, draft_vocab_size=40), None, False
    ),
    "eagle3-tree": (tiny_eagle_drafter, KIND_TREE, False),
    "eagle3-frontier-one": (
        tiny_eagle_drafter, TreeSpec(top_k=3, total_tokens=9, frontier=1), False
    ),
    "eagle3-tree-adaptive": (tiny_eagle_drafter, KIND_TREE, True),
    "peagle": (tiny_peagle_drafter, None, False),
    "medusa": (tiny_medusa_drafter, None, False),
    "medusa-tree": (tiny_medusa_drafter, TreeSpec(), False),
    "hybrid-eagle3": (lambda t: HybridDrafter(tiny_eagle_drafter(t)), None, False),
    "hybrid-peagle-adaptive": (lambda t: HybridDrafter(tiny_peagle_drafter(t)), None, True),
    "ngram-adaptive": (lambda t: NgramDrafter(t.config.vocab_size), None, True),
}  # fmt: skip


class ScriptedWidths:
    """A chain-length policy that plays ``widths`` in turn (0: a round without drafts)."""

    def __init__(self, widths: list[int]) -> None:
        self.widths, self.rounds = widths, 0

    def choose(self, limit: int) -> int:
        width = self.widths[self.rounds % len(self.widths)]
        self.rounds += 1
        return min(width, limit)

    def update(self, width: int, num_accepted: torch.Tensor, seconds: float) -> None:
        pass
