"""Rollback keeps exactly the committed sequence: crop + step equals a fresh prefill."""

from __future__ import annotations

import pytest
import torch
from draftsmith.decode.forward.cached_sequence import CachedSequence
from draftsmith.decode.forward.kv_cache import PreallocatedLayer
from draftsmith.decode.forward.output_head import OutputHead
from tiny_models import tiny_llama, tiny_qwen2


def test_rollback_then_step_equals_fresh_prefill() -> None:
    model = tiny_llama(seed=0)
    generator = torch.Generator().manual_seed(0)
    prompt = torch.randint(3, 64, (2, 6), generator=generator)
    block = torch.randint(3, 64, (2, 4), generator=generator)
    follow = torch.randint(3, 64, (2, 1), generator=generator)
    keep = torch.tensor([1, 3])  # row 0 keeps 1 of the 4 block tokens, row 1 keeps 3

    with torch.no_grad():
        sequence = CachedSequence(model, 2, torch.device("cpu"))
        sequence.extend(prompt)
        sequence.extend(block)
        sequence.rollback(4, keep)
        assert sequence.num_slots == 6 + 3  # slots past the longest kept row are cropped
        assert sequence.lengths.tolist() == [7, 9]
        stepped = sequence.extend(follow).logits[:, -1]

        for row in range(2):
            committed = torch.cat([prompt[row], block[row, : keep[row]], follow[row]])
            fresh = model(committed[None]).logits[0, -1]
            assert torch.allclose(stepped[row], fresh, atol=1e-10)


def test_keep_path_keeps_a_tree_branch() -> None:
    model = tiny_llama(seed=0)
    prompt = torch.tensor([[5, 6, 7]])
    # Flattened "tree": nodes 0..3; keep the branch 0 -> 2 (nodes 1 and 3 are discarded).
    nodes = torch.tensor([[10, 11, 12, 13]])
    tree_mask = torch.tensor(
        [[1, 0, 0, 0], [1, 1, 0, 0], [1, 0, 1, 0], [1, 1, 0, 1]], dtype=torch.bool
    )
    positions = torch.tensor([[3, 4, 4, 5]])
    with torch.no_grad():
        sequence = CachedSequence(model, 1, torch.device("cpu"))
        sequence.extend(prompt)
        sequence.extend(nodes, tree_mask=tree_mask, positions=positions)
        sequence.keep_path(4, torch.tensor([[0, 2]]), torch.tensor([[True, True]]))
        stepped = sequence.extend(torch.tensor([[20]])).logits[0, -1]
        fresh = model(torch.tensor([[5, 6, 7, 10, 12, 20]])).logits[0, -1]
    assert torch.allclose(stepped, fresh, atol=1e-10)


def test_cache_growth_past_capacity_matches_fresh_prefill() -> None:
    """A block that crosses the capacity the prefill allocated (at least 256 slots) grows it."""
    model = tiny_llama(seed=1)
    generator = torch.Generator().manual_seed(1)
    prompt = torch.randint(3, 64, (1, 250), generator=generator)
    block = torch.randint(3, 64, (1, 12), generator=generator)
    with torch.no_grad():
        sequence = CachedSequence(model, 1, torch.device("cpu"), OutputHead.for_model(model))
        sequence.extend(prompt[:, :10])  # capacity 256
        sequence.extend(prompt[:, 10:])  # 250 slots: fits
        stepped = sequence.extend(block).logits[0]  # 262 slots: grows
        assert isinstance(sequence.cache.layers[0], PreallocatedLayer)
        assert sequence.cache.layers[0]._key_buffer.shape[2] >= 262
        assert sequence.cache.get_seq_length() == 262
        fresh = model(torch.cat([prompt, block], dim=1)).logits[0, -12:]
    assert torch.allclose(stepped, fresh, atol=1e-10)


def test_output_head_equals_the_model_head_and_follows_weight_updates() -> None:
    model = tiny_qwen2(seed=2)
    head = OutputHead.for_model(model)
    assert head is not None
    hidden = torch.randn(2, 3, model.config.hidden_size, dtype=model.dtype)
    with torch.no_grad():
        assert torch.allclose(head(hidden), model.lm_head(hidden), atol=1e-12)
        model.lm_head.weight.mul_(2.0)  # an in-place update must not leave a stale copy
        assert torch.allclose(head(hidden), model.lm_head(hidden), atol=1e-12)


def test_output_head_layouts_agree_for_every_row_count_in_float32() -> None:
    """1-3 rows, 4-8 rows and longer blocks take different products (oneDNN for the last)."""
    model = tiny_llama(seed=5, dtype=torch.float32)
    head = OutputHead.for_model(model)
    with torch.no_grad():
        for rows in (1, 2, 3, 5, 8, 9, 13, 40):
            hidden = torch.randn(1, rows, model.config.hidden_size)
            assert torch.allclose(head(hidden), model.lm_head(hidden), atol=1e-4), rows


def test_output_head_falls_back_for_heads_it_does_not_know() -> None:
    model = tiny_llama(seed=0)
    model.config.model_type = "gemma2"  # logits soft-capped after the projection
    assert OutputHead.for_model(model) is None


def _windowed(model_type: str, **overrides: object) -> torch.nn.Module:
    """A tiny model with 4-token sliding windows (float64)."""
    from transformers import AutoConfig, AutoModelForCausalLM

    config = AutoConfig.for_model(
        model_type,
        vocab_size=64,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=8,
        max_position_embeddings=128,
        sliding_window=4,
        **overrides,
    )
    torch.manual_seed(0)
    return AutoModelForCausalLM.from_config(config).double().eval()


WINDOWED = [
    ("mistral", {}),  # every layer windowed
    ("qwen2", {"use_sliding_window": True, "max_window_layers": 1}),  # full, then windowed
    ("gemma2", {}),  # windowed, then full; eager attention
    ("gemma3_text", {"layer_types": ["sliding_attention", "full_attention"]}),
]


@pytest.mark.parametrize(
    ("model_type", "overrides", "lean"),
    [(*case, False) for case in WINDOWED] + [(*case, True) for case in WINDOWED[:2]],
)
def test_sliding_windows_count_tokens_not_slots_and_roll_back_at_any_length(
    model_type: str, overrides: dict, lean: bool
) -> None:
    """Holes must not eat a row's window, and rollbacks work long after the window filled up
    (Hugging Face's own sliding layer cannot be cropped once full). ``lean`` runs the lean
    forward (Mistral and Qwen2 have one)."""
    from draftsmith.decode.forward.lean_decoder import LeanDecoder

    model = _windowed(model_type, **overrides)
    head = OutputHead.for_model(model)
    decoder = LeanDecoder.for_model(model) if lean else None
    assert (decoder is not None) == lean
    generator = torch.Generator().manual_seed(0)
    prompt = torch.randint(3, 64, (2, 6), generator=generator)
    prompt_valid = torch.ones_like(prompt, dtype=torch.bool)
    prompt_valid[1, :2] = False
    committed = [prompt[row][prompt_valid[row]].tolist() for row in range(2)]
    tolerance = 1e-6 if model_type == "gemma2" else 1e-10  # Gemma2's softmax runs in float32
    with torch.no_grad():
        sequence = CachedSequence(model, 2, torch.device("cpu"), head, decoder)
        sequence.extend(prompt, prompt_valid)
        for round_index in range(6):
            block = torch.randint(3, 64, (2, 4), generator=generator)
            sequence.extend(block)
            keep = torch.randint(0, 5, (2,), generator=generator)
            sequence.rollback(4, keep)
            for row in range(2):
                committed[row] += block[row, : keep[row]].tolist()
            if round_index == 3:  # a tree step: keep the branch 0 -> 2 in both rows
                nodes = torch.randint(3, 64, (2, 3), generator=generator)
                sequence.extend(
                    nodes,
                    tree_mask=torch.tensor([[1, 0, 0], [1, 1, 0], [1, 0, 1]], dtype=torch.bool),
                    positions=sequence.lengths[:, None] + torch.tensor([[0, 1, 1]]),
                )
                sequence.keep_path(3, torch.tensor([[0, 2], [0, 2]]), torch.ones(2, 2).bool())
                for row in range(2):
                    committed[row] += [int(nodes[row, 0]), int(nodes[row, 2])]
            follow = torch.randint(3, 64, (2, 1), generator=generator)
            stepped = sequence.extend(follow).logits[:, -1]
            for row in range(2):
                committed[row].append(int(follow[row, 0]))
                fresh = model(torch.tensor([committed[row]])).logits[0, -1]
                assert torch.allclose(stepped[row], fresh, atol=tolerance), (round_index, row)
        assert sequence.num_slots > 4 * model.config.sliding_window  # far past the window


# Rows kept after a merge (lengths 9, 11, 3, 4, 2 over 11 slots) and the slots left: the
# holes are dropped only when they exceed a quarter of the slots (``COMPACT_ABOVE``).
SELECTIONS = [
    ([3, 0, 2], 11),  # a new order, few holes: rows move, every slot stays
    ([0, 2, 4], 11),  # rows leaving a batch: the rest move up in place
    ([4, 3], 4),  # many holes: each row's valid slots gathered into the last 4
]


@pytest.mark.parametrize(("kept", "slots_after"), SELECTIONS)
@pytest.mark.parametrize(
    ("model_type", "overrides", "lean"),
    [("llama", None, False), ("llama", None, True), (*WINDOWED[0], False), (*WINDOWED[1], True)],
)
def test_rows_merged_in_and_selected_out_keep_their_own_sequences(
    model_type: str, overrides: dict | None, lean: bool, kept: list[int], slots_after: int
) -> None:
    """A batch with holes merged with a fresh prefill of other lengths, then rows selected (in
    a new order, or some leaving, holes kept or dropped): every row's next step equals a fresh
    forward over its own committed tokens."""
    from draftsmith.decode.forward.lean_decoder import LeanDecoder

    model = tiny_llama(seed=3) if overrides is None else _windowed(model_type, **overrides)
    head = OutputHead.for_model(model) if lean else None
    decoder = LeanDecoder.for_model(model) if lean else None
    vocab = model.config.vocab_size
    generator = torch.Generator().manual_seed(3)
    first = torch.randint(3, vocab, (2, 7), generator=generator)
    block = torch.randint(3, vocab, (2, 4), generator=generator)
    second = torch.randint(3, vocab, (3, 3), generator=generator)
    second_mask = torch.tensor([[0, 1, 1], [1, 1, 1], [0, 0, 1]], dtype=torch.bool)
    follow = torch.randint(3, vocab, (5, 2), generator=generator)
    with torch.no_grad():
        running = CachedSequence(model, 2, torch.device("cpu"), head, decoder)
        running.extend(first)
        running.extend(block)
        running.rollback(4, torch.tensor([1, 3]))  # holes in row 0
        joining = CachedSequence(model, 3, torch.device("cpu"), head, decoder)
        joining.extend(second, second_mask)
        running.merge(joining)
        assert running.lengths.tolist() == [8, 10, 2, 3, 1]
        committed = [
            torch.cat([first[0], block[0, :1]]),
            torch.cat([first[1], block[1, :3]]),
            *(second[row][second_mask[row]] for row in range(3)),
        ]
        running.extend(follow[:, :1])
        assert running.lengths.tolist() == [9, 11, 3, 4, 2] and running.num_slots == 11
        order = torch.tensor(kept)
        running.select_rows(order)
        assert running.num_slots == slots_after
        assert bool(running.valid.sum(1).eq(running.lengths).all())
        stepped = running.extend(follow[order, 1:]).logits[:, -1]
        for index, row in enumerate(order.tolist()):
            tokens = torch.cat([committed[row], follow[row]])
            fresh = model(tokens[None]).logits[0, -1]
            assert torch.allclose(stepped[index], fresh, atol=1e-9), (index, row)


def test_a_layer_keeps_its_slots_in_the_storage_dtype_through_growth_and_merges() -> None:
    """``storage_dtype`` float32 (a drafter's cache on CPU) holds bfloat16 keys exactly, also
    after the buffer grows past its capacity and after rows are merged and selected."""
    generator = torch.Generator().manual_seed(3)
    keys = torch.randn(1, 2, 300, 8, generator=generator).to(torch.bfloat16)
    layer, other = PreallocatedLayer(torch.float32), PreallocatedLayer(torch.float32)
    layer.update(keys[:, :, :5], -keys[:, :, :5])
    for start in range(5, 300, 7):  # past the initial capacity of 256 slots
        stored_keys, stored_values = layer.update(
            keys[:, :, start : start + 7], -keys[:, :, start : start + 7]
        )
    assert stored_keys.dtype == torch.float32 and stored_keys.shape[2] == 300
    assert torch.equal(stored_keys, keys.float())
    assert torch.equal(stored_values, -keys.float())
    other.update(keys[:, :, :4], keys[:, :, :4])
    layer.merge_rows(other, 300)
    layer.select_slots(torch.tensor([1]), torch.arange(296, 300)[None])
    assert layer.keys.dtype == torch.float32
    assert torch.equal(layer.keys, keys[:, :, :4].float())


def test_merged_and_selected_slots_are_the_listed_ones_with_zero_holes() -> None:
    """A merge right-aligns both parts in one buffer (zeros in front of the shorter: finite
    holes), and a selection keeps each listed row's listed slots in order."""
    torch.manual_seed(0)
    old, new = PreallocatedLayer(), PreallocatedLayer()
    old.update(torch.randn(3, 2, 5, 4), torch.randn(3, 2, 5, 4))
    new.update(torch.randn(2, 2, 3, 4), torch.randn(2, 2, 3, 4))
    old_keys, new_keys = old.keys.clone(), new.keys.clone()
    old.merge_rows(new, 5)
    assert old.keys.shape == (5, 2, 5, 4)
    assert torch.equal(old.keys[:3], old_keys)
    assert torch.equal(old.keys[3:, :, 2:], new_keys)
    assert torch.equal(old.keys[3:, :, :2], torch.zeros(2, 2, 2, 4))
    merged = old.keys.clone()
    rows, order = torch.tensor([4, 0]), torch.tensor([[2, 4, 3], [0, 1, 4]])
    old.select_slots(rows, order)
    assert torch.equal(old.keys[0], merged[4][:, [2, 4, 3]])
    assert torch.equal(old.keys[1], merged[0][:, [0, 1, 4]])
    old.update(torch.ones(2, 2, 1, 4), torch.ones(2, 2, 1, 4))  # spare capacity takes writes
    assert torch.equal(old.keys[:, :, 3], torch.ones(2, 2, 4))


def test_rows_join_in_place_when_they_fit_and_a_longer_join_regrows() -> None:
    """A merge of rows no longer than the cache writes them into its spare rows (the running
    rows are not copied; holes in front are zeros even over stale values), a selection writes
    back into the same buffer, and a join longer than the cache moves both into a new one."""
    torch.manual_seed(0)
    layer = PreallocatedLayer()
    layer.update(torch.randn(3, 2, 6, 4), torch.randn(3, 2, 6, 4))
    first = PreallocatedLayer()
    first.update(torch.randn(1, 2, 6, 4), torch.randn(1, 2, 6, 4))
    layer.merge_rows(first, 6)  # a new buffer with spare rows: 4 rows of 8
    buffer = layer._key_buffer
    assert buffer.shape[0] == 8
    buffer[4:].fill_(float("nan"))  # stale values where the next rows go
    running = layer.keys.clone()
    layer.select_slots(torch.tensor([3, 1]), torch.tensor([[1, 2, 3, 4, 5], [0, 2, 3, 4, 5]]))
    assert layer._key_buffer is buffer and layer.keys.shape == (2, 2, 5, 4)
    assert torch.equal(layer.keys[0], running[3][:, 1:])
    kept = layer.keys.clone()
    short = PreallocatedLayer()
    short.update(torch.randn(3, 2, 2, 4), torch.randn(3, 2, 2, 4))
    layer.merge_rows(short, 5)
    assert layer._key_buffer is buffer and layer.keys.shape == (5, 2, 5, 4)
    assert torch.equal(layer.keys[:2], kept)
    assert torch.equal(layer.keys[2:, :, 3:], short.keys)
    assert torch.equal(layer.keys[2:, :, :3], torch.zeros(3, 2, 3, 4))
    long = PreallocatedLayer()
    long.update(torch.randn(4, 2, 7, 4), torch.randn(4, 2, 7, 4))
    before = layer.keys.clone()
    layer.merge_rows(long, 7)  # 9 rows of 8, and more slots: a new buffer
    assert layer._key_buffer is not buffer and layer.keys.shape == (9, 2, 7, 4)
    assert torch.equal(layer.keys[:5, :, 2:], before)
    assert torch.equal(layer.keys[:5, :, :2], torch.zeros(5, 2, 2, 4))
    assert torch.equal(layer.keys[5:], long.keys)
    step = torch.randn(9, 2, 1, 4)
    keys, _ = layer.update(step, step)
    assert torch.equal(keys[:, :, 7], step[:, :, 0])
