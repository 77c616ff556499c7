"""P-EAGLE: the one-pass training forward against a plain causal pass, the runtime drafter
against recomputation round after round (ragged batch, holes, wider rounds), greedy output
equal to Hugging Face ``generate`` in float32 (batch 1 and a ragged batch). The sampled law
(chi-square) is in test_engine_sampling.py, rows joining a running batch in
test_engine_session.py and the server's continuous batching in test_serve_units.py."""

from __future__ import annotations

import pytest
import torch
from decode_helpers import hf_greedy, randomize_later_layers, tiny_peagle_drafter
from draftsmith.decode import SpeculativeDecoder
from draftsmith.decode.drafters.base import TreeSpec
from draftsmith.decode.drafters.eagle.head import build_vocab_maps
from draftsmith.decode.drafters.eagle.peagle import (
    PEagleConfig,
    PEagleDrafter,
    PEagleHead,
    load_runtime_drafter,
    parallel_visibility,
)
from draftsmith.decode.drafters.registry import load_drafter
from draftsmith.decode.sampling import SamplingConfig, logits_to_probs
from head_helpers import (
    check_needs_prefill_and_hidden_states,
    extend_committed,
    prefill_prompts,
    saved_and_loaded,
    scratch_pass,
)
from tiny_models import tiny_llama

DEPTHS = 4


def _head(target: torch.nn.Module, seed: int = 0, **overrides) -> PEagleHead:
    torch.manual_seed(seed)
    config = PEagleConfig.for_target(target.config, num_depths=DEPTHS, **overrides)
    head = PEagleHead(config).double()
    with torch.no_grad():  # random norms, so that a swapped norm would be caught
        for name, param in head.named_parameters():
            if name.endswith("norm.weight"):
                param.uniform_(0.5, 1.5)
    randomize_later_layers(head)
    return head


def _scratch_logits(head: PEagleHead, target: torch.nn.Module, committed: list[int], depths: int):
    """Draft logits of depths 1..``depths`` after ``committed`` (its last token pending), from
    one plain causal pass of the head over [committed entries, mask rows]: for a single anchor
    P-EAGLE's mask is exactly causal."""
    embed = target.get_input_embeddings()
    with torch.no_grad():
        out = target(torch.tensor([committed[:-1]]), output_hidden_states=True)
        length = len(committed) - 1
        mask_hidden, mask_embeds = head.mask_inputs(1, depths - 1)
        hidden = torch.cat((head.fuse(head.gather_aux(out.hidden_states)), mask_hidden), 1)
        embeds = torch.cat((head.embed(embed, torch.tensor([committed[1:]])), mask_embeds), 1)
        prenorm, _ = head(hidden, embeds, torch.arange(length + depths - 1)[None])
        return head.to_target_logits(head.compute_logits(prenorm[0, length - 1 :]))


def test_parallel_visibility_is_context_plus_own_chain() -> None:
    depth = torch.tensor([0, 0, 0, 1, 1, 2])
    anchor = torch.tensor([[0, 1, 2, 0, 2, 0]])
    valid = torch.tensor([[True, True, True, True, True, True]])
    seen = parallel_visibility(depth, anchor, valid)[0].int().tolist()
    assert seen == [
        [1, 0, 0, 0, 0, 0],
        [1, 1, 0, 0, 0, 0],
        [1, 1, 1, 0, 0, 0],
        [1, 0, 0, 1, 0, 0],  # depth 2 at anchor 0: context <= 0, itself
        [1, 1, 1, 0, 1, 0],  # depth 2 at anchor 2: context <= 2, not anchor 0's chain
        [1, 0, 0, 1, 0, 1],  # depth 3 at anchor 0: its chain's depth 2
    ]
    valid[0, 1] = False  # an invalid committed row is seen by no one but itself
    seen = parallel_visibility(depth, anchor, valid)[0]
    assert seen[:, 1].tolist() == [False, True, False, False, False, False]


@pytest.mark.parametrize("head_layers", [1, 2])
def test_one_pass_over_all_depths_equals_a_causal_pass_per_anchor(head_layers: int) -> None:
    target = tiny_llama(num_layers=4)
    head = _head(target, num_hidden_layers=head_layers)
    sequence = [5, 17, 9, 33, 2, 40, 11, 8, 30]
    ids = torch.tensor([sequence])
    length = len(sequence) - 1
    with torch.no_grad():
        out = target(ids[:, :-1], output_hidden_states=True)
        aux = head.gather_aux(out.hidden_states)  # [1, T, A*H]
        next_embeds = head.embed(target.get_input_embeddings(), ids[:, 1:])
        anchors = [torch.arange(length)[None] for _ in range(DEPTHS - 1)]
        valid = [torch.ones(1, length, dtype=torch.bool) for _ in anchors]
        logits = head.parallel(aux, next_embeds, torch.ones(1, length), anchors, valid)
        sparse = head.parallel(  # COD keeps a nested subset of anchors per depth
            aux,
            next_embeds,
            torch.ones(1, length),
            [torch.tensor([[1, 3, 6]]), torch.tensor([[3, 6]]), torch.tensor([[6, 6]])],
            [torch.ones(1, 3, dtype=torch.bool), torch.ones(1, 2, dtype=torch.bool),
             torch.tensor([[True, False]])],
        )  # fmt: skip
    for t in range(length):
        expected = _scratch_logits(head, target, sequence[: t + 2], DEPTHS)
        got = torch.stack([head.to_target_logits(depth[0, t]) for depth in logits])
        torch.testing.assert_close(got, expected)
    for k, chosen in ((1, [1, 3, 6]), (2, [3, 6]), (3, [6])):
        torch.testing.assert_close(sparse[k][0, : len(chosen)], logits[k][0, chosen])


@pytest.mark.parametrize(("draft_vocab_size", "head_layers"), [(64, 1), (40, 1), (40, 2)])
def test_drafter_matches_recomputation_round_after_round(
    draft_vocab_size: int, head_layers: int
) -> None:
    target = tiny_llama(num_layers=4)
    head = _head(
        target, draft_vocab_size=draft_vocab_size, mask_token_id=17, num_hidden_layers=head_layers
    )
    if draft_vocab_size < 64:
        counts = torch.rand(64, generator=torch.Generator().manual_seed(3))
        head.set_vocab_maps(*build_vocab_maps(counts, draft_vocab_size))
    drafter = PEagleDrafter(head, target)
    sampling = SamplingConfig(temperature=1.0)
    generator = torch.Generator().manual_seed(0)
    committed = prefill_prompts(drafter, target, [11, 17])  # the mask token's id is committed too
    widths = [3, 3, 4, 1, 2, 4, 4, 0, 3]  # a round wider than the last runs its own mask pass
    schedule = [[0, 2], [3, 0], [0, 4], [1, 0], [2, 1], [0, 0], [4, 1], [0, 0], [1, 3]]
    for round_index, (width, accepted) in enumerate(zip(widths, schedule, strict=True)):
        proposal = drafter.propose(width, sampling, generator)
        assert proposal.tokens.shape == (2, width)
        for row in range(2):
            if not width:
                break
            expected = logits_to_probs(
                _scratch_logits(head, target, committed[row], width), sampling
            )
            torch.testing.assert_close(proposal.probs[row], expected)
            assert proposal.probs[row].gather(1, proposal.tokens[row, :, None]).min() > 0
        num_accepted = torch.tensor(accepted).clamp(max=width)
        next_tokens = torch.randint(3, 64, (2,), generator=generator)
        rows = [committed[r] + proposal.tokens[r].tolist() for r in range(2)]
        if round_index == 4:  # the mask rows' inputs follow an in-place change of the head
            with torch.no_grad():
                head.mask_hidden.mul_(-1.0)
        drafter.commit(num_accepted, next_tokens, scratch_pass(target, rows, width + 1))
        extend_committed(committed, proposal.tokens, num_accepted, next_tokens)
    greedy = drafter.propose(3, SamplingConfig(), None)
    assert greedy.probs is None
    for row in range(2):
        expected = _scratch_logits(head, target, committed[row], 3)
        assert greedy.tokens[row].tolist() == expected.argmax(-1).tolist()


def test_folder_round_trip_registry_and_refusals(tmp_path) -> None:
    target = tiny_llama(num_layers=4)
    head = _head(target)
    loaded = saved_and_loaded(head, tmp_path / "native", "peagle")
    assert isinstance(loaded, PEagleHead) and loaded.config.num_depths == DEPTHS
    drafter = load_drafter(tmp_path / "native", target)
    assert isinstance(drafter, PEagleDrafter) and drafter.kind == "peagle"
    assert not drafter.supports_trees and drafter.needs_hidden_states
    assert isinstance(load_runtime_drafter(tmp_path / "native", target), PEagleDrafter)
    with pytest.raises(ValueError, match="needs a folder"):
        load_runtime_drafter(None, target)
    with pytest.raises(ValueError, match="chains only"):
        SpeculativeDecoder(target, drafter, 3, tree=TreeSpec())
    with pytest.raises(ValueError, match="mask_token_id"):
        PEagleConfig.for_target(target.config, mask_token_id=64)
    check_needs_prefill_and_hidden_states(PEagleDrafter(head, target))


def _greedy_reference(target: torch.nn.Module, prompt: list[int], new: int) -> list[int]:
    ids = torch.tensor([prompt])
    out = hf_greedy(target, ids, new)
    return out[0, len(prompt) :].tolist()


@pytest.mark.parametrize(("lean_target", "head_layers"), [(True, 1), (False, 1), (True, 2)])
def test_greedy_output_equals_hf_generate_in_float32(lean_target: bool, head_layers: int) -> None:
    target = tiny_llama(num_layers=4, dtype=torch.float32)
    drafter = tiny_peagle_drafter(target, 4, num_layers=head_layers)
    decoder = SpeculativeDecoder(target, drafter, 4, lean_target=lean_target)
    prompts = [[5, 17, 9, 33, 2, 40], [7, 21, 8], [44, 45, 46, 47, 44, 45, 46]]
    width = max(map(len, prompts))
    ids = torch.tensor([[0] * (width - len(p)) + p for p in prompts])
    mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in prompts])
    out = decoder.generate(ids, attention_mask=mask, max_new_tokens=20, eos_token_id=[])
    for row, prompt in enumerate(prompts):
        assert out.sequences[row, width:].tolist() == _greedy_reference(target, prompt, 20)
    alone = decoder.generate(torch.tensor([prompts[0]]), max_new_tokens=20, eos_token_id=[])
    assert alone.sequences[0, 6:].tolist() == _greedy_reference(target, prompts[0], 20)
    assert out.stats.accepted_per_position[0] > 0  # drafts are accepted: the path is exercised
