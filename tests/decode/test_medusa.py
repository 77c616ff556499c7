"""Medusa heads: identity start, shapes, folders."""

from __future__ import annotations

import json

import pytest
import torch
from tiny_models import tiny_llama

from decode.drafters.base import TargetPass, TreeSpec
from decode.drafters.medusa import (
    MedusaConfig,
    MedusaDrafter,
    MedusaHeads,
    load_runtime_drafter,
)
from decode.kv_cache import CachedSequence
from decode.sampling import SamplingConfig, logits_to_probs
from decode.tree import TreeVerification, tree_attention_mask, tree_positions


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
    heads.save_pretrained(tmp_path / "medusa")
    assert json.loads((tmp_path / "medusa" / "drafter.json").read_text())["kind"] == "medusa"
    loaded = MedusaHeads.from_pretrained(tmp_path / "medusa")
    assert loaded.config == heads.config
    for name, tensor in heads.state_dict().items():
        assert torch.equal(loaded.state_dict()[name], tensor), name
        assert loaded.state_dict()[name].dtype == torch.float64
    hidden = torch.randn(3, 32, dtype=torch.float64)
    assert torch.equal(loaded(hidden), heads(hidden))


def test_from_pretrained_names_the_problem(tmp_path) -> None:
    with pytest.raises(FileNotFoundError, match=r"config\.json"):
        MedusaHeads.from_pretrained(tmp_path)
    (tmp_path / "config.json").write_text(json.dumps({"architectures": ["LlamaForCausalLM"]}))
    with pytest.raises(ValueError, match="MedusaModel"):
        MedusaHeads.from_pretrained(tmp_path)
    (tmp_path / "drafter.json").write_text(json.dumps({"kind": "eagle3"}))
    with pytest.raises(ValueError, match="not 'medusa'"):
        MedusaHeads.from_pretrained(tmp_path)


# -- runtime drafter ---------------------------------------------------------------------------
PROMPTS = [[5, 17, 9, 33, 2, 40], [7, 21, 8]]


def _scratch_pass(target: torch.nn.Module, sequences: list[list[int]], width: int) -> TargetPass:
    logits, hidden = [], []
    with torch.no_grad():
        for sequence in sequences:
            out = target(torch.tensor([sequence]), output_hidden_states=True)
            logits.append(out.logits[0, -width:])
            hidden.append(out.hidden_states[-1][0, -width:])
    return TargetPass(torch.stack(logits), (torch.stack(hidden),))


def _prefill(drafter: MedusaDrafter, target: torch.nn.Module) -> list[list[int]]:
    """Prefill the left-padded PROMPTS with the target's greedy first token as pending."""
    width = max(map(len, PROMPTS))
    input_ids = torch.tensor([[0] * (width - len(p)) + p for p in PROMPTS])
    attention = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in PROMPTS])
    hidden = torch.zeros(2, width, 32, dtype=torch.float64)
    logits = torch.zeros(2, width, 64, dtype=torch.float64)
    for row, prompt in enumerate(PROMPTS):
        row_pass = _scratch_pass(target, [prompt], len(prompt))
        hidden[row, width - len(prompt) :] = row_pass.hidden_states[-1][0]
        logits[row, width - len(prompt) :] = row_pass.logits[0]
    pending = logits[:, -1].argmax(-1)
    drafter.prefill(input_ids, attention, TargetPass(logits, (hidden,)), pending)
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
        for row in range(2):
            n = accepted[row]
            committed[row] += [*proposal.tokens[row, :n].tolist(), int(next_tokens[row])]


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
        for row in range(2):
            n = accepted[row]
            committed[row] += [*proposal.tokens[row, :n].tolist(), int(next_tokens[row])]
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
        logits, hidden = [], []
        with torch.no_grad():
            for row in range(2):
                cached = CachedSequence(target, batch_size=1, device=torch.device("cpu"))
                cached.extend(torch.tensor([committed[row][:-1]]))
                out = cached.extend(
                    torch.cat((torch.tensor(committed[row][-1:]), tree.tokens[row]))[None],
                    tree_mask=tree_attention_mask(tree.parents[row]),
                    positions=tree_positions(tree.depths[row], cached.lengths),
                    output_hidden_states=True,
                )
                logits.append(out.logits[0])
                hidden.append(out.hidden_states[-1][0])
        nodes = torch.full((2, 3), -1)
        for row, end in enumerate(end_nodes):
            path, walk = [], end
            while walk >= 0:
                path.insert(0, walk)
                walk = int(tree.parents[row, walk])
            nodes[row, : len(path)] = torch.tensor(path)
        tokens = torch.where(nodes >= 0, tree.tokens.gather(1, nodes.clamp(min=0)), 0)
        result = TreeVerification(nodes, (nodes >= 0).sum(1), tokens, torch.tensor([6, 7]))
        drafter.commit_tree(result, TargetPass(torch.stack(logits), (torch.stack(hidden),)))
        for row in range(2):
            n = int(result.num_accepted[row])
            committed[row] += [*tokens[row, :n].tolist(), int(result.next_tokens[row])]
            with torch.no_grad():
                state = target(torch.tensor([committed[row][:-1]]), output_hidden_states=True)
            torch.testing.assert_close(drafter._hidden[row], state.hidden_states[-1][0, -1])


def test_drafter_checks_its_inputs() -> None:
    target = tiny_llama()
    drafter = MedusaDrafter(MedusaHeads.from_target(target, num_heads=2), target)
    assert drafter.kind == "medusa" and drafter.needs_hidden_states and drafter.vocab_size == 64
    with pytest.raises(RuntimeError, match="prefill"):
        drafter.propose(1, SamplingConfig(), None)
    with pytest.raises(ValueError, match="output_hidden_states=True"):
        drafter.prefill(
            torch.ones(1, 2, dtype=torch.long),
            torch.ones(1, 2),
            TargetPass(torch.zeros(1, 2, 64)),
            torch.ones(1, dtype=torch.long),
        )
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
