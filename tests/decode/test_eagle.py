"""EAGLE-3 head: layer math against Hugging Face Llama, vocab maps, unrolling, folders."""

from __future__ import annotations

import pytest
import torch
from decode_helpers import randomize_later_layers, tiny_eagle_drafter, tiny_peagle_drafter
from draftsmith.decode.drafters.base import TreeSpec
from draftsmith.decode.drafters.eagle.drafter import Eagle3Drafter, load_runtime_drafter
from draftsmith.decode.drafters.eagle.head import (
    Eagle3Config,
    Eagle3Head,
    build_vocab_maps,
    default_aux_layer_ids,
)
from draftsmith.decode.drafters.eagle.layers import append_kv, block_visibility, positions_from_mask
from draftsmith.decode.sampling import SamplingConfig, logits_to_probs
from draftsmith.decode.trees.verify import verify_tree_greedy
from head_helpers import (
    PROMPTS,
    check_from_pretrained_names_the_problem,
    check_needs_prefill_and_hidden_states,
    extend_committed,
    path_verification,
    prefill_prompts,
    saved_and_loaded,
    scratch_pass,
    tree_pass,
)
from tiny_models import tiny_llama
from transformers.models.llama.modeling_llama import LlamaDecoderLayer, LlamaRotaryEmbedding


def _head(target: torch.nn.Module, seed: int = 0, **overrides) -> Eagle3Head:
    torch.manual_seed(seed)
    head = Eagle3Head(Eagle3Config.for_target(target.config, **overrides)).double()
    with torch.no_grad():  # random norms, so that a swapped norm would be caught
        for name, param in head.named_parameters():
            if name.endswith("norm.weight"):
                param.uniform_(0.5, 1.5)
    randomize_later_layers(head)
    return head


def test_default_aux_layer_ids_follow_eagle3_and_clamp_for_shallow_targets() -> None:
    assert default_aux_layer_ids(32) == (2, 16, 29)
    assert default_aux_layer_ids(8) == (2, 4, 5)
    assert default_aux_layer_ids(4) == (1, 2, 3)
    assert default_aux_layer_ids(5) == (1, 2, 4)
    assert default_aux_layer_ids(3) == (0, 1, 2)  # the embedding output is id 0
    assert default_aux_layer_ids(2) == (0, 1)  # engines capture a layer once: no repeats
    for depth in range(2, 40):
        ids = default_aux_layer_ids(depth)
        assert list(ids) == sorted(set(ids)) and ids[0] >= 0 and ids[-1] <= depth - 1
    with pytest.raises(ValueError, match="at least 2 decoder layers"):
        default_aux_layer_ids(1)


def test_config_rejects_bad_layer_ids_and_vocab() -> None:
    base = dict(
        hidden_size=32,
        num_attention_heads=4,
        num_key_value_heads=2,
        intermediate_size=64,
        target_vocab_size=64,
        target_num_hidden_layers=4,
    )
    with pytest.raises(ValueError, match=r"in \[0, 3\]"):
        Eagle3Config(**base, aux_hidden_state_layer_ids=(1, 2, 4))
    for repeated in ((1, 1, 1), (1, 3, 2)):
        with pytest.raises(ValueError, match="strictly increasing"):
            Eagle3Config(**base, aux_hidden_state_layer_ids=repeated)
    with pytest.raises(ValueError, match="draft_vocab_size"):
        Eagle3Config(**base, draft_vocab_size=65)
    with pytest.raises(ValueError, match="unknown Eagle3Config fields"):
        Eagle3Config.from_dict({**base, "hidden_act": "gelu"})


def test_midlayer_equals_a_hf_llama_layer_when_the_embedding_half_is_zero() -> None:
    """With the embedding columns of q/k/v zeroed, EAGLE-3's layer is a Llama layer on g."""
    target = tiny_llama(num_layers=4)
    head = _head(target)
    hf_layer = LlamaDecoderLayer(target.config, layer_idx=0).double().eval()
    rotary = LlamaRotaryEmbedding(target.config).double()
    mid = head.midlayer
    hidden = head.config.hidden_size
    with torch.no_grad():
        for name in ("q_proj", "k_proj", "v_proj"):
            ours = getattr(mid.self_attn, name).weight
            ours[:, :hidden] = 0
            getattr(hf_layer.self_attn, name).weight.copy_(ours[:, hidden:])
        hf_layer.self_attn.o_proj.weight.copy_(mid.self_attn.o_proj.weight)
        hf_layer.input_layernorm.weight.copy_(mid.hidden_norm.weight)
        hf_layer.post_attention_layernorm.weight.copy_(mid.post_attention_layernorm.weight)
        for name in ("gate_proj", "up_proj", "down_proj"):
            getattr(hf_layer.mlp, name).weight.copy_(getattr(mid.mlp, name).weight)
    generator = torch.Generator().manual_seed(0)
    g = torch.randn(2, 6, hidden, generator=generator, dtype=torch.float64)
    embeds = torch.randn(2, 6, hidden, generator=generator, dtype=torch.float64)
    positions = torch.tensor([[0, 1, 2, 3, 4, 5], [3, 4, 5, 6, 7, 8]])
    ours, _ = head(g, embeds, positions)
    causal = torch.full((6, 6), float("-inf"), dtype=torch.float64).triu(1)[None, None]
    expected = hf_layer(g, attention_mask=causal, position_embeddings=rotary(g, positions))
    expected = expected[0] if isinstance(expected, tuple) else expected
    torch.testing.assert_close(ours, expected)


def test_incremental_cache_equals_one_pass_and_padding_is_ignored() -> None:
    target = tiny_llama()
    head = _head(target)
    generator = torch.Generator().manual_seed(1)
    g = torch.randn(1, 7, 32, generator=generator, dtype=torch.float64)
    embeds = torch.randn(1, 7, 32, generator=generator, dtype=torch.float64)
    positions = torch.arange(7)[None]
    full, _ = head(g, embeds, positions)
    first, kv = head(g[:, :4], embeds[:, :4], positions[:, :4])
    rest, _ = head(g[:, 4:], embeds[:, 4:], positions[:, 4:], past=kv)
    torch.testing.assert_close(torch.cat((first, rest), 1), full)
    # The same row left-padded by two junk entries gives the same outputs on its real part.
    junk = torch.randn(1, 2, 32, generator=generator, dtype=torch.float64)
    mask = torch.tensor([[0, 0] + [1] * 7])
    visible = block_visibility(None, mask.bool())
    padded, _ = head(
        torch.cat((junk, g), 1),
        torch.cat((junk, embeds), 1),
        positions_from_mask(mask),
        None,
        visible,
    )
    torch.testing.assert_close(padded[:, 2:], full)


def test_build_vocab_maps_keeps_the_most_frequent_tokens() -> None:
    counts = torch.tensor([5, 0, 9, 9, 1, 7, 0, 3])
    d2t, t2d = build_vocab_maps(counts, 4)
    kept = torch.arange(4) + d2t
    assert kept.tolist() == [0, 2, 3, 5]
    assert t2d.tolist() == [True, False, True, True, False, True, False, False]
    assert d2t.dtype == torch.int64 and t2d.dtype == torch.bool
    # ties towards lower ids
    d2t, _ = build_vocab_maps(torch.tensor([1, 1, 1, 1]), 2)
    assert (torch.arange(2) + d2t).tolist() == [0, 1]
    with pytest.raises(ValueError, match="draft_vocab_size"):
        build_vocab_maps(counts, 9)
    with pytest.raises(ValueError, match="1-D"):
        build_vocab_maps(counts[None], 2)


def test_pruned_vocab_logits_map_back_to_target_ids() -> None:
    target = tiny_llama()
    head = _head(target, draft_vocab_size=16)
    counts = torch.arange(64).flip(0).double()  # token 0 most frequent
    counts[40] = 1000
    d2t, t2d = build_vocab_maps(counts, 16)
    head.set_vocab_maps(d2t, t2d)
    draft_logits = torch.randn(2, 3, 16, dtype=torch.float64)
    full = head.to_target_logits(draft_logits)
    assert full.shape == (2, 3, 64)
    assert torch.isinf(full[..., ~t2d]).all()
    torch.testing.assert_close(head.to_draft_vocab(full), draft_logits)
    assert full.argmax(-1).eq(head.draft_to_target_ids[draft_logits.argmax(-1)]).all()
    assert 40 in head.draft_to_target_ids.tolist()
    with pytest.raises(ValueError, match="t2d must mark"):
        head.set_vocab_maps(d2t, ~t2d)
    swapped = d2t.clone()
    swapped[[0, 1]] = torch.stack((d2t[1] + 1, d2t[0] - 1))  # same ids, out of order
    with pytest.raises(ValueError, match="strictly increasing"):
        head.set_vocab_maps(swapped, t2d)


@pytest.mark.parametrize("head_layers", [1, 2])
def test_unroll_step_k_matches_drafting_k_tokens_past_each_position(head_layers: int) -> None:
    """Training-time test sees at (step k, position t) what the drafter sees when drafting."""
    target = tiny_llama(num_layers=4)
    head = _head(target, num_hidden_layers=head_layers)
    generator = torch.Generator().manual_seed(2)
    batch, length, steps = 2, 6, 3
    aux = torch.randn(batch, length, 3 * 32, generator=generator, dtype=torch.float64)
    tokens = torch.randint(0, 64, (batch, length + 1), generator=generator)
    embed = target.get_input_embeddings()
    next_embeds = embed(tokens[:, 1:])
    mask = torch.ones(batch, length)
    mask[1, :2] = 0  # a left-padded row
    with torch.no_grad():
        unrolled = head.unroll(aux, next_embeds, mask, steps)
        # Reference: for position t, run the committed prefix causally, then draft step by step
        # feeding the ground-truth tokens x_{t+2}, x_{t+3}, ...
        for row in range(batch):
            start = int((mask[row] == 0).sum())
            g = head.fuse(aux[row : row + 1, start:])
            emb = next_embeds[row : row + 1, start:]
            pos = torch.arange(length - start)[None]
            prenorm, kv = head(g, emb, pos)
            for t in range(length - start - steps + 1):
                past = [(k[:, :, : t + 1], v[:, :, : t + 1]) for k, v in kv]  # per layer
                hidden = prenorm[:, t : t + 1]
                torch.testing.assert_close(
                    head.compute_logits(hidden)[0, 0], unrolled[0][row, start + t]
                )
                for k in range(1, steps):
                    token_embed = emb[:, t + k : t + k + 1]
                    hidden, new = head(hidden, token_embed, pos[:, t : t + 1] + k, past=past)
                    past = append_kv(past, new)
                    torch.testing.assert_close(
                        head.compute_logits(hidden)[0, 0], unrolled[k][row, start + t]
                    )


def test_native_folder_round_trip(tmp_path) -> None:
    target = tiny_llama(num_layers=4)
    head = _head(target, draft_vocab_size=20, aux_hidden_state_layer_ids=(1, 2, 3))
    d2t, t2d = build_vocab_maps(torch.rand(64, generator=torch.Generator().manual_seed(0)), 20)
    head.set_vocab_maps(d2t, t2d)
    loaded = saved_and_loaded(head, tmp_path / "eagle", "eagle3")
    aux = torch.randn(1, 5, 96, dtype=torch.float64)
    embeds = torch.randn(1, 5, 32, dtype=torch.float64)
    with torch.no_grad():
        expected = head.unroll(aux, embeds, torch.ones(1, 5), 2)
        got = loaded.unroll(aux, embeds, torch.ones(1, 5), 2)
    for a, b in zip(expected, got, strict=True):
        assert torch.equal(a, b)


def test_from_pretrained_names_the_problem(tmp_path) -> None:
    check_from_pretrained_names_the_problem(
        Eagle3Head,
        tmp_path,
        architecture="LlamaForCausalLMEagle3",
        kind="eagle3",
        other_kind="medusa",
    )


# -- runtime drafter ---------------------------------------------------------------------------
def _scratch_draft_logits(
    head: Eagle3Head, target: torch.nn.Module, committed: list[int], drafts: list[int]
) -> torch.Tensor:  # [len(drafts), V]
    """Draft logits recomputed over the whole committed sequence (its last token is pending)."""
    embed = target.get_input_embeddings()
    with torch.no_grad():
        out = target(torch.tensor([committed[:-1]]), output_hidden_states=True)
        fused = head.fuse(head.gather_aux(out.hidden_states))
        length = len(committed) - 1
        prenorm, past = head(
            fused, embed(torch.tensor([committed[1:]])), torch.arange(length)[None]
        )
        hidden = prenorm[:, -1:]
        logits = [head.to_target_logits(head.compute_logits(hidden))]
        for step, token in enumerate(drafts[:-1]):
            hidden, new = head(
                hidden, embed(torch.tensor([[token]])), torch.tensor([[length + step]]), past
            )
            past = append_kv(past, new)
            logits.append(head.to_target_logits(head.compute_logits(hidden)))
    return torch.cat(logits, 1)[0]


@pytest.mark.parametrize(("draft_vocab_size", "head_layers"), [(64, 1), (40, 1), (40, 3)])
def test_drafter_matches_recomputation_round_after_round(
    draft_vocab_size: int, head_layers: int
) -> None:
    target = tiny_llama(num_layers=4)
    head = _head(target, draft_vocab_size=draft_vocab_size, num_hidden_layers=head_layers)
    if draft_vocab_size < 64:
        counts = torch.rand(64, generator=torch.Generator().manual_seed(3))
        head.set_vocab_maps(*build_vocab_maps(counts, draft_vocab_size))
    drafter = Eagle3Drafter(head, target)
    sampling = SamplingConfig(temperature=1.0)
    generator = torch.Generator().manual_seed(0)
    committed = prefill_prompts(drafter, target, [11, 12])
    num_drafts, appended = 3, drafter._state.valid.shape[1]
    schedule = [[0, 2], [0, 0], [3, 0], [0, 0], [0, 0], [0, 0], [1, 0], [0, 3]]  # accepted
    for accepted in schedule:
        proposal = drafter.propose(num_drafts, sampling, generator)
        assert proposal.tokens.shape == (2, num_drafts)
        assert proposal.probs.shape == (2, num_drafts, 64)
        for row in range(2):
            drafts = proposal.tokens[row].tolist()
            expected = logits_to_probs(
                _scratch_draft_logits(head, target, committed[row], drafts), sampling
            )
            torch.testing.assert_close(proposal.probs[row], expected)
            assert proposal.probs[row].gather(1, proposal.tokens[row, :, None]).min() > 0
        num_accepted = torch.tensor(accepted)
        next_tokens = torch.randint(3, 64, (2,), generator=generator)
        rows = [committed[r] + proposal.tokens[r].tolist() for r in range(2)]
        drafter.commit(num_accepted, next_tokens, scratch_pass(target, rows, num_drafts + 1))
        appended += num_drafts + 1
        extend_committed(committed, proposal.tokens, num_accepted, next_tokens)
    assert drafter._read_state().valid.shape[1] < appended  # holes were compacted away
    greedy = drafter.propose(2, SamplingConfig(), None)
    assert greedy.probs is None
    for row in range(2):
        expected = _scratch_draft_logits(head, target, committed[row], greedy.tokens[row].tolist())
        assert greedy.tokens[row].tolist() == expected.argmax(-1).tolist()


def test_dynamic_tree_decoding_is_greedy_exact_and_keeps_state_in_step() -> None:
    target = tiny_llama(num_layers=4)
    head = _head(target)
    drafter = Eagle3Drafter(head, target)
    with torch.no_grad():  # the target's own first token, so the whole output is greedy
        firsts = [int(target(torch.tensor([p])).logits[0, -1].argmax()) for p in PROMPTS]
    committed = prefill_prompts(drafter, target, firsts)
    for _ in range(4):
        tree = drafter.propose_tree(TreeSpec(top_k=3, total_tokens=8), depth=3)
        assert tree.tokens.shape == (2, 8) and tree.draft_probs is None
        verify = tree_pass(target, committed, tree)
        result = verify_tree_greedy(tree, verify.logits)
        drafter.commit_tree(result, verify)
        extend_committed(committed, result.accepted_tokens, result.num_accepted, result.next_tokens)
        for row in range(2):
            expected = _scratch_draft_logits(head, target, committed[row], [0])[0]
            torch.testing.assert_close(drafter._read_state().logits[row], expected)
    with torch.no_grad():
        for row, prompt in enumerate(PROMPTS):
            sequence = list(prompt)
            while len(sequence) < len(committed[row]):
                sequence.append(int(target(torch.tensor([sequence])).logits[0, -1].argmax()))
            assert sequence == committed[row]


def test_drafter_rejects_a_mismatched_target_and_missing_states() -> None:
    head = _head(tiny_llama(num_layers=4))
    with pytest.raises(ValueError, match="4-layer target, this target has 2"):
        Eagle3Drafter(head, tiny_llama(num_layers=2))
    drafter = Eagle3Drafter(head, tiny_llama(num_layers=4))
    check_needs_prefill_and_hidden_states(drafter)


def test_drafter_loads_from_a_folder(tmp_path) -> None:
    target = tiny_llama(num_layers=4)
    head = _head(target)
    head.save_pretrained(tmp_path / "native")
    drafter = Eagle3Drafter.from_pretrained(tmp_path / "native", target)
    assert drafter.kind == "eagle3" and drafter.needs_hidden_states and drafter.vocab_size == 64
    loaded = load_runtime_drafter(tmp_path / "native", target)
    assert isinstance(loaded, Eagle3Drafter)
    for name, tensor in head.state_dict().items():
        assert torch.equal(loaded.head.state_dict()[name], tensor), name
    with pytest.raises(ValueError, match="needs a folder"):
        load_runtime_drafter(None, target)


def test_commit_tree_of_any_accepted_path_keeps_state_in_step() -> None:
    """Accept an arbitrary root-to-node path (as sampling might) and compare with scratch."""
    target = tiny_llama(num_layers=4)
    head = _head(target)
    drafter = Eagle3Drafter(head, target)
    committed = prefill_prompts(drafter, target, [11, 12])
    generator = torch.Generator().manual_seed(5)
    for round_ in range(4):
        tree = drafter.propose_tree(TreeSpec(top_k=2, total_tokens=6), depth=3)
        verify = tree_pass(target, committed, tree)
        ends = [tree.num_nodes - 1 - round_ % 2, round_ % tree.num_nodes]  # deep and shallow
        result = path_verification(tree, ends, torch.randint(3, 64, (2,), generator=generator))
        assert result.num_accepted.min() >= 1
        drafter.commit_tree(result, verify)
        extend_committed(committed, result.accepted_tokens, result.num_accepted, result.next_tokens)
        for row in range(2):
            expected = _scratch_draft_logits(head, target, committed[row], [0])[0]
            torch.testing.assert_close(drafter._read_state().logits[row], expected)
    chain = drafter.propose(3, SamplingConfig(temperature=1.0), generator)
    for row in range(2):
        expected = _scratch_draft_logits(head, target, committed[row], chain.tokens[row].tolist())
        torch.testing.assert_close(chain.probs[row], torch.softmax(expected, -1).float())


def _kind_drafter(kind: str, target: torch.nn.Module):
    if kind == "eagle3":
        return tiny_eagle_drafter(target)
    return tiny_peagle_drafter(target, num_depths=3)


@pytest.mark.parametrize("kind", ["eagle3", "peagle"])
def test_rounds_without_drafts_are_read_in_one_later_pass_that_equals_reading_each(
    kind: str,
) -> None:
    """A commit is read by the head's next pass: a run of rounds that draft nothing (plain
    steps, rounds the hybrid gives to lookup) costs one pass over all their entries, and the
    drafts that follow are those of a drafter that read every commit at once (holes too)."""
    target = tiny_llama(num_layers=4).double()
    lazy = _kind_drafter(kind, target)
    eager = lazy.spawn()
    committed = prefill_prompts(lazy, target, [11, 12])
    prefill_prompts(eager, target, [11, 12])
    passes = []
    counted = lazy._committed_pass
    lazy._committed_pass = lambda *args: (passes.append(args[0].shape[1]), counted(*args))[1]
    sampling = SamplingConfig(temperature=1.0)
    coins = torch.Generator().manual_seed(4)
    schedule = [(3, [0, 2]), (0, [0, 0]), (0, [0, 0]), (3, [3, 0]), (0, [0, 0]), (2, [1, 0])]
    schedule += [(0, [0, 0])] * 3 + [(3, [0, 3]), (3, [2, 1])]
    for num_tokens, accepted in schedule:
        seed = int(torch.randint(1 << 30, (1,), generator=coins))
        proposal = lazy.propose(num_tokens, sampling, torch.Generator().manual_seed(seed))
        reference = eager.propose(num_tokens, sampling, torch.Generator().manual_seed(seed))
        assert torch.equal(proposal.tokens, reference.tokens)
        if num_tokens:
            torch.testing.assert_close(proposal.probs, reference.probs)
        next_tokens = torch.randint(3, 64, (2,), generator=coins)
        rows = [committed[r] + proposal.tokens[r].tolist() for r in range(2)]
        verify = scratch_pass(target, rows, num_tokens + 1)
        lazy.commit(torch.tensor(accepted), next_tokens, verify)
        eager.commit(torch.tensor(accepted), next_tokens, verify)
        eager._read_state()
        extend_committed(committed, proposal.tokens, accepted, next_tokens)
    drafted_rounds = sum(1 for num_tokens, _ in schedule[1:] if num_tokens)
    assert len(passes) == drafted_rounds  # one pass per drafted round, none for the others
    assert passes[0] == 3 + 1 + 1  # a round that kept up to 3 entries, two plain steps: one pass
    torch.testing.assert_close(lazy._read_state().logits, eager._read_state().logits)


def test_unread_entries_are_read_once_they_reach_the_bound() -> None:
    from draftsmith.decode.drafters.eagle.drafter import MAX_UNREAD_ENTRIES

    target = tiny_llama(num_layers=4).double()
    drafter = tiny_eagle_drafter(target)
    committed = prefill_prompts(drafter, target, [11, 12])
    for _ in range(MAX_UNREAD_ENTRIES + 3):  # plain steps only
        drafter.propose(0, SamplingConfig(), None)
        next_tokens = torch.tensor([5, 6])
        drafter.commit(torch.tensor([0, 0]), next_tokens, scratch_pass(target, committed, 1))
        extend_committed(committed, torch.zeros(2, 0, dtype=torch.long), [0, 0], next_tokens)
        assert sum(block.tokens.shape[1] for block in drafter._state.unread) < MAX_UNREAD_ENTRIES
    for row in range(2):
        expected = _scratch_draft_logits(drafter.head, target, committed[row], [0])[0]
        torch.testing.assert_close(drafter._read_state().logits[row], expected)
