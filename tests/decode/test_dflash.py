"""DFlash (and DSpark's options): the training forward over many anchors against one block
computed from scratch, the runtime drafter against recomputation round after round (ragged
batch, holes, the Markov head's in-order draws), greedy output equal to Hugging Face
``generate`` in float32, the confidence head's verify width read from the drafter alone, and
the folder. The sampled law (chi-square) is in test_engine_sampling.py, rows joining a running
batch in test_engine_session.py and the hybrid in test_hybrid.py."""

from __future__ import annotations

import json

import pytest
import torch
from decode_helpers import hf_greedy
from draftsmith.decode import SpeculativeDecoder
from draftsmith.decode.drafters.base import TreeSpec
from draftsmith.decode.drafters.dflash.drafter import DFlashDrafter, load_runtime_drafter
from draftsmith.decode.drafters.dflash.head import (
    DFLASH_ARCHITECTURE,
    DFlashConfig,
    DFlashHead,
    block_visibility,
)
from draftsmith.decode.drafters.eagle.head import build_vocab_maps
from draftsmith.decode.drafters.registry import detect_drafter_kind, load_drafter
from draftsmith.decode.sampling import SamplingConfig, logits_to_probs
from draftsmith.train.export.dflash import export_dflash
from engine_models import fit_dflash, greedy_corpus
from head_helpers import (
    check_needs_prefill_and_hidden_states,
    extend_committed,
    prefill_prompts,
    saved_and_loaded,
    scratch_pass,
)
from tiny_models import tiny_llama

BLOCK = 5


def _head(target: torch.nn.Module, seed: int = 0, **overrides) -> DFlashHead:
    torch.manual_seed(seed)
    config = DFlashConfig.for_target(target.config, block_size=BLOCK, **overrides)
    head = DFlashHead(config).double()
    with torch.no_grad():  # random norms and DSpark weights, so that a swapped one is caught
        for name, param in head.named_parameters():
            if name.endswith("norm.weight"):
                param.uniform_(0.5, 1.5)
            elif name.startswith(("markov.next", "confidence")):
                param.normal_(0.0, 0.5)
    return head


def _scratch_normed(head: DFlashHead, target: torch.nn.Module, committed: list[int]):
    """The block's final-normed rows 1..B-1 after ``committed`` (its last token pending),
    from the head's own modules over the whole context recomputed: [B-1, H]."""
    embed = target.get_input_embeddings()
    with torch.no_grad():
        prefix = torch.tensor([committed[:-1]])
        out = target(prefix, output_hidden_states=True)
        context = head.fuse(head.gather_aux(out.hidden_states))  # [1, S, H]
        ids = torch.tensor([[committed[-1]] + [head.config.mask_token_id] * (BLOCK - 1)])
        start = len(committed) - 1
        visible = torch.ones(1, BLOCK, start + BLOCK, dtype=torch.bool)
        normed = head(
            embed(ids), torch.arange(start, start + BLOCK)[None], context,
            torch.arange(start)[None], visible,
        )  # fmt: skip
    return normed[0, 1:]


def _scratch_logits(head, target, committed: list[int], drafts: list[int]) -> torch.Tensor:
    """Target-vocabulary logits of rows 1..len(drafts) (the Markov head reads ``drafts``)."""
    normed = _scratch_normed(head, target, committed)[: len(drafts)]
    previous = torch.tensor([committed[-1], *drafts[:-1]])
    with torch.no_grad():
        return head.to_target_logits(head.compute_logits(normed, previous))


def test_block_visibility_is_context_before_anchor_plus_own_block() -> None:
    limit = torch.tensor([[1, 1, 3, 3]])  # two blocks of two rows, anchored at 1 and 3
    context_valid = torch.tensor([[True, True, True, True]])
    block_of = torch.tensor([[0, 0, 1, 1]])
    seen = block_visibility(limit, context_valid, block_of, torch.ones(1, 4, dtype=torch.bool))
    assert seen[0].int().tolist() == [
        [1, 0, 0, 0, 1, 1, 0, 0],
        [1, 0, 0, 0, 1, 1, 0, 0],  # not causal inside the block
        [1, 1, 1, 0, 0, 0, 1, 1],
        [1, 1, 1, 0, 0, 0, 1, 1],
    ]


@pytest.mark.parametrize(("layers", "markov"), [(1, 0), (2, 0), (1, 3)])
def test_many_anchors_in_one_pass_equal_each_block_from_scratch(layers: int, markov: int) -> None:
    target = tiny_llama(num_layers=4)
    head = _head(target, num_hidden_layers=layers, markov_rank=markov, mask_token_id=60)
    sequence = [5, 17, 9, 33, 2, 40, 11, 8, 30, 12, 3]
    ids = torch.tensor([sequence])
    with torch.no_grad():
        out = target(ids, output_hidden_states=True)
        aux = head.gather_aux(out.hidden_states)
        anchors = torch.tensor([[1, 4, 7, 9]])
        valid = torch.tensor([[True, True, True, False]])  # a padding slot
        logits, confidence = head.blocks(
            aux, ids, target.get_input_embeddings(), torch.ones_like(ids), anchors, valid
        )
    assert logits.shape == (1, 4, BLOCK - 1, head.config.draft_vocab_size)
    assert confidence is None
    for m, anchor in enumerate([1, 4, 7]):
        committed = sequence[: anchor + 1]
        later = sequence[anchor + 1 : anchor + BLOCK] + [0] * BLOCK  # teacher-forced
        expected = _scratch_logits(head, target, committed, later[: BLOCK - 1])
        torch.testing.assert_close(head.to_target_logits(logits[0, m]), expected)


@pytest.mark.parametrize(("draft_vocab_size", "markov"), [(64, 0), (40, 0), (64, 3), (40, 2)])
def test_drafter_matches_recomputation_round_after_round(
    draft_vocab_size: int, markov: int
) -> None:
    target = tiny_llama(num_layers=4)
    head = _head(target, draft_vocab_size=draft_vocab_size, mask_token_id=17, markov_rank=markov)
    if draft_vocab_size < 64:
        counts = torch.rand(64, generator=torch.Generator().manual_seed(3))
        head.set_vocab_maps(*build_vocab_maps(counts, draft_vocab_size))
    drafter = DFlashDrafter(head, target)
    sampling = SamplingConfig(temperature=1.0)
    generator = torch.Generator().manual_seed(0)
    committed = prefill_prompts(drafter, target, [11, 17])  # the mask token's id is committed too
    widths = [3, 4, 1, 2, 4, 0, 3, 4]
    schedule = [[0, 2], [3, 0], [1, 0], [2, 1], [0, 0], [0, 0], [1, 3], [4, 4]]
    for width, accepted in zip(widths, schedule, strict=True):
        proposal = drafter.propose(width, sampling, generator)
        assert proposal.tokens.shape == (2, width)
        for row in range(2):
            if not width:
                break
            drafts = proposal.tokens[row].tolist()
            expected = logits_to_probs(
                _scratch_logits(head, target, committed[row], drafts), sampling
            )
            torch.testing.assert_close(proposal.probs[row], expected)
            assert proposal.probs[row].gather(1, proposal.tokens[row, :, None]).min() > 0
        num_accepted = torch.tensor(accepted).clamp(max=width)
        next_tokens = torch.randint(3, 64, (2,), generator=generator)
        rows = [committed[r] + proposal.tokens[r].tolist() for r in range(2)]
        drafter.commit(num_accepted, next_tokens, scratch_pass(target, rows, width + 1))
        extend_committed(committed, proposal.tokens, num_accepted, next_tokens)
    greedy = drafter.propose(BLOCK - 1, SamplingConfig(), None)
    assert greedy.probs is None
    for row in range(2):
        drafts = greedy.tokens[row].tolist()
        expected = _scratch_logits(head, target, committed[row], drafts)
        assert drafts == expected.argmax(-1).tolist()  # each argmax given the draft before it


@pytest.mark.parametrize(
    ("lean_target", "options"),
    [(True, {}), (False, {}), (True, {"num_layers": 2}), (True, {"markov_rank": 4}),
     (True, {"confidence_head": True, "draft_vocab_size": 48})],
)  # fmt: skip
def test_greedy_output_equals_hf_generate_in_float32(lean_target: bool, options: dict) -> None:
    target = tiny_llama(num_layers=4, dtype=torch.float32)
    layers = options.pop("num_layers", 1)
    head = fit_dflash(target, greedy_corpus(target, rows=12, length=32), 6, 30, **options,
                      num_hidden_layers=layers)  # fmt: skip
    drafter = DFlashDrafter(head, target)
    decoder = SpeculativeDecoder(target, drafter, 5, lean_target=lean_target)
    prompts = [[5, 17, 9, 33, 2, 40], [7, 21, 8], [44, 45, 46, 47, 44, 45, 46]]
    width = max(map(len, prompts))
    ids = torch.tensor([[0] * (width - len(p)) + p for p in prompts])
    mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in prompts])
    out = decoder.generate(ids, attention_mask=mask, max_new_tokens=20, eos_token_id=[])
    for row, prompt in enumerate(prompts):
        expected = hf_greedy(target, torch.tensor([prompt]), 20)[0, len(prompt) :].tolist()
        assert out.sequences[row, width:].tolist() == expected
    alone = decoder.generate(torch.tensor([prompts[0]]), max_new_tokens=20, eos_token_id=[])
    expected = hf_greedy(target, torch.tensor([prompts[0]]), 20)[0, 6:].tolist()
    assert alone.sequences[0, 6:].tolist() == expected
    assert out.stats.accepted_per_position[0] > 0  # drafts are accepted: the path is exercised


def test_confidence_width_reads_the_drafter_alone() -> None:
    """The verify width depends on the drafter's outputs only: the same drafter state gives the
    same width and drafts whatever the target would do next, and the threshold moves it."""
    target = tiny_llama(num_layers=4)
    head = _head(target, confidence_head=True)
    drafter = DFlashDrafter(head, target)
    prefill_prompts(drafter, target, [11, 17])
    widths = {}
    for threshold in (0.0, 0.3, 1.0):
        drafter.confidence_threshold = threshold
        proposal = drafter.propose(BLOCK - 1, SamplingConfig(), None)
        widths[threshold] = proposal.tokens.shape[1]
        again = drafter.propose(BLOCK - 1, SamplingConfig(), None)
        assert torch.equal(again.tokens, proposal.tokens)
    assert widths[0.0] == BLOCK - 1 and widths[1.0] == 1
    assert widths[0.0] >= widths[0.3] >= widths[1.0]


def test_folder_round_trip_registry_and_refusals(tmp_path) -> None:
    target = tiny_llama(num_layers=4)
    head = _head(target, markov_rank=2, confidence_head=True)
    loaded = saved_and_loaded(head, tmp_path / "native", "dflash")
    assert isinstance(loaded, DFlashHead) and loaded.config.block_size == BLOCK
    drafter = load_drafter(tmp_path / "native", target)
    assert isinstance(drafter, DFlashDrafter) and drafter.kind == "dflash"
    assert not drafter.supports_trees and drafter.needs_hidden_states
    assert drafter.max_draft_tokens == BLOCK - 1
    assert isinstance(load_runtime_drafter(tmp_path / "native", target), DFlashDrafter)
    with pytest.raises(ValueError, match="needs a folder"):
        load_runtime_drafter(None, target)
    with pytest.raises(ValueError, match="chains only"):
        SpeculativeDecoder(target, drafter, 3, tree=TreeSpec())
    with pytest.raises(ValueError, match="at most 4"):
        SpeculativeDecoder(target, drafter, BLOCK)
    with pytest.raises(ValueError, match="block_size"):
        DFlashConfig.for_target(target.config, block_size=1)
    with pytest.raises(ValueError, match="markov_rank"):
        DFlashConfig.for_target(target.config, markov_rank=-1)
    for variant in ({"fc_norm": True}, {"rope_scaling": {"rope_type": "linear", "factor": 2.0}}):
        with pytest.raises(ValueError, match="does not implement"):
            DFlashConfig.for_target(target.config, **variant)
    check_needs_prefill_and_hidden_states(DFlashDrafter(head, target))


def test_a_vllm_export_loads_by_its_architecture(tmp_path) -> None:
    """The registry finds a qwen3_dflash folder by its architecture (no drafter.json), and the
    loaded drafter proposes what the trained head proposes."""
    target = tiny_llama(num_layers=4)
    head = _head(target)
    folder = export_dflash(head, tmp_path / "vllm")
    assert DFLASH_ARCHITECTURE in json.loads((folder / "config.json").read_text())["architectures"]
    assert detect_drafter_kind(folder) == "dflash"
    drafter = load_drafter(folder, target)
    assert isinstance(drafter, DFlashDrafter)
    for name, tensor in head.state_dict().items():
        if name != "t2d":
            assert torch.equal(tensor, drafter.head.state_dict()[name]), name
