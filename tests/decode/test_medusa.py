"""Medusa heads: identity start, shapes, folders."""

from __future__ import annotations

import pytest
import torch
from draftsmith.decode.drafters.base import TargetPass, TreeSpec
from draftsmith.decode.drafters.medusa import (
    MedusaConfig,
    MedusaDrafter,
    MedusaHeads,
    load_runtime_drafter,
)
from draftsmith.decode.sampling import SamplingConfig, logits_to_probs
from head_helpers import (
    PROMPTS,
    check_from_pretrained_names_the_problem,
    check_needs_prefill_and_hidden_states,
    extend_committed,
    padded_prefill,
    path_verification,
    saved_and_loaded,
    scratch_pass,
    tree_pass,
)
from tiny_models import tiny_llama


def _trained_like(heads: MedusaHeads, seed: int = 0) -> MedusaHeads:
    """Random block weights, as after training (zero-init heads would hide ordering bugs)."""
    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for param in heads.blocks.parameters():
            param.copy_(torch.randn(param.shape, generator=generator, dtype=param.dtype) * 0.3)
    return heads


def test_heads_start_as_the_targets_lm_head() -> None:
    target = tiny_llama()
    heads = MedusaHeads.from_target(target, num_heads=3, num_layers=2)
    ids = torch.tensor([[3, 9, 27, 4]])
    with torch.no_grad():
        out = target(ids, output_hidden_states=True)
        logits = heads(out.hidden_states[-1])
    assert logits.shape == (1, 4, 3, 64)
    for i in range(3):
        torch.testing.assert_close(logits[:, :, i], out.logits)


def test_head_i_uses_block_i_and_lm_head_i() -> None:
    heads = _trained_like(MedusaHeads(MedusaConfig(hidden_size=8, vocab_size=11, num_heads=3)))
    hidden = torch.randn(2, 8)
    logits = heads(hidden)
    for i in range(3):
        x = hidden
        for layer in heads.blocks[i].layers:
            x = x + torch.nn.functional.silu(x @ layer.weight.T + layer.bias)
        torch.testing.assert_close(logits[:, i], x @ heads.lm_heads[i].weight.T)


def test_config_validation() -> None:
    with pytest.raises(ValueError, match="num_heads must be a positive integer"):
        MedusaConfig(hidden_size=8, vocab_size=11, num_heads=0)
    with pytest.raises(ValueError, match="unknown MedusaConfig fields"):
        MedusaConfig.from_dict({"hidden_size": 8, "vocab_size": 11, "medusa_num_heads": 2})


def test_native_folder_round_trip(tmp_path) -> None:
    heads = _trained_like(MedusaHeads.from_target(tiny_llama(), num_heads=2, num_layers=2))
    assert {tensor.dtype for tensor in heads.state_dict().values()} == {torch.float64}
    loaded = saved_and_loaded(heads, tmp_path / "medusa", "medusa")
    hidden = torch.randn(3, 32, dtype=torch.float64)
    assert torch.equal(loaded(hidden), heads(hidden))


def test_from_pretrained_names_the_problem(tmp_path) -> None:
    check_from_pretrained_names_the_problem(
        MedusaHeads, tmp_path, architecture="MedusaModel", kind="medusa", other_kind="eagle3"
    )


# -- runtime drafter ---------------------------------------------------------------------------
def _scratch_pass(target: torch.nn.Module, sequences: list[list[int]], width: int) -> TargetPass:
    """The target's logits and last hidden state over the last ``width`` tokens of each row."""
    return scratch_pass(target, sequences, width, last_layer_only=True)


def _prefill(drafter: MedusaDrafter, target: torch.nn.Module) -> list[list[int]]:
    """Prefill the left-padded PROMPTS with the target's greedy first token as pending."""
    input_ids, attention, target_pass = padded_prefill(target, last_layer_only=True)
    pending = target_pass.logits[:, -1].argmax(-1)
    drafter.prefill(input_ids, attention, target_pass, pending)
    return [[*p, int(t)] for p, t in zip(PROMPTS, pending, strict=True)]


def test_identity_heads_propose_the_targets_own_next_token_after_each_commit() -> None:
    """Zero-initialised heads equal the target's LM head, so under greedy every head proposes
    the pending token: this pins which hidden state the drafter keeps after each commit."""
    target = tiny_llama()
    drafter = MedusaDrafter(MedusaHeads.from_target(target, num_heads=3), target)
    committed = _prefill(drafter, target)
    for accepted in ([0, 2], [3, 0], [1, 1]):
        proposal = drafter.propose(3, SamplingConfig(), None)
        assert proposal.probs is None
        for row in range(2):
            assert proposal.tokens[row].tolist() == [committed[row][-1]] * 3
        rows = [committed[r] + proposal.tokens[r].tolist() for r in range(2)]
        verify = _scratch_pass(target, rows, 4)
        num_accepted = torch.tensor(accepted)
        next_tokens = verify.logits[torch.arange(2), num_accepted].argmax(-1)  # greedy
        drafter.commit(num_accepted, next_tokens, verify)
        extend_committed(committed, proposal.tokens, num_accepted, next_tokens)


def test_sampled_chain_draws_each_token_from_its_heads_law() -> None:
    target = tiny_llama()
    heads = _trained_like(MedusaHeads.from_target(target, num_heads=4))
    drafter = MedusaDrafter(heads, target)
    committed = _prefill(drafter, target)
    sampling = SamplingConfig(temperature=0.8, top_k=20)
    generator = torch.Generator().manual_seed(0)
    for accepted in ([0, 3], [2, 0]):
        proposal = drafter.propose(3, sampling, generator)
        for row in range(2):
            with torch.no_grad():
                state = target(torch.tensor([committed[row][:-1]]), output_hidden_states=True)
                expected = logits_to_probs(heads(state.hidden_states[-1][0, -1])[:3], sampling)
            torch.testing.assert_close(proposal.probs[row], expected)
            assert expected.gather(1, proposal.tokens[row, :, None]).min() > 0
        rows = [committed[r] + proposal.tokens[r].tolist() for r in range(2)]
        next_tokens = torch.tensor([3, 4])
        drafter.commit(torch.tensor(accepted), next_tokens, _scratch_pass(target, rows, 4))
        extend_committed(committed, proposal.tokens, accepted, next_tokens)
    with pytest.raises(ValueError, match=r"at most one token per head"):
        drafter.propose(5, sampling, generator)


def test_static_tree_round_keeps_the_accepted_paths_hidden_state() -> None:
    target = tiny_llama()
    heads = _trained_like(MedusaHeads.from_target(target, num_heads=3))
    drafter = MedusaDrafter(heads, target)
    committed = _prefill(drafter, target)
    spec = TreeSpec(choices=((0,), (1,), (0, 0), (0, 1), (1, 0), (0, 0, 0)))
    for end_nodes in ([5, 1], [4, 2]):  # accept root-to-node paths of different lengths
        tree = drafter.propose_tree(spec, depth=3)
        assert tree.tokens.shape == (2, 6)
        assert int(tree.depths.max()) == 3
        verify = tree_pass(target, committed, tree, last_layer_only=True)
        result = path_verification(tree, end_nodes, torch.tensor([6, 7]))
        drafter.commit_tree(result, verify)
        extend_committed(committed, result.accepted_tokens, result.num_accepted, result.next_tokens)
        for row in range(2):
            with torch.no_grad():
                state = target(torch.tensor([committed[row][:-1]]), output_hidden_states=True)
            torch.testing.assert_close(drafter._hidden[row], state.hidden_states[-1][0, -1])


def test_drafter_checks_its_inputs() -> None:
    target = tiny_llama()
    drafter = MedusaDrafter(MedusaHeads.from_target(target, num_heads=2), target)
    assert drafter.kind == "medusa" and drafter.needs_hidden_states and drafter.vocab_size == 64
    check_needs_prefill_and_hidden_states(drafter)
    with pytest.raises(ValueError, match="one target"):
        MedusaDrafter(MedusaHeads(MedusaConfig(hidden_size=16, vocab_size=64)), target)


def test_registry_loader_reads_a_saved_folder(tmp_path) -> None:
    target = tiny_llama()
    heads = _trained_like(MedusaHeads.from_target(target, num_heads=2))
    heads.save_pretrained(tmp_path / "medusa")
    drafter = load_runtime_drafter(tmp_path / "medusa", target)
    assert isinstance(drafter, MedusaDrafter)
    hidden = torch.randn(2, 32, dtype=torch.float64)
    assert torch.equal(drafter.heads(hidden), heads(hidden))
    with pytest.raises(ValueError, match="needs a folder"):
        load_runtime_drafter(None, target)
