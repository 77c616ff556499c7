"""Exactness beyond the Llama-style families: targets from other Hugging Face architectures.

``test_exactness_configs`` and ``test_exactness_kinds`` sweep the families the lean forward
serves (and Gemma). Here the decoder runs the target's own forward on absolute and learned
positions (GPT-2, OPT, GPT-BigCode), partial rotary (GPT-NeoX, Phi), ALiBi (BLOOM, Falcon with
``alibi``, MPT), mixtures of experts (Mixtral, DeepSeek-V3 with multi-head latent attention)
and other Llama relatives (Phi-3, OLMo-2, Granite's multipliers, Cohere). Weights are drawn
wide (``initializer_range`` 0.3) so greedy text varies and random drafters are accepted only
sometimes: ragged batches then leave holes in the cache, the case positions must survive.
Greedy output must equal ``generate(do_sample=False)`` token for token, in float32.
"""

from __future__ import annotations

import pytest
import torch
import transformers
from decode_helpers import hf_greedy, noisy_copy, tiny_eagle_drafter, tiny_medusa_drafter
from draftsmith.decode import DraftModelDrafter, SpeculativeDecoder
from draftsmith.decode.drafters.base import TreeSpec
from draftsmith.decode.drafters.ngram import NgramDrafter
from draftsmith.decode.forward.attention_layout import learned_position_limit

VOCAB = 96
NEW_TOKENS = 16
ATTENTION = dict(hidden_size=32, num_hidden_layers=2, num_attention_heads=4)
LLAMA_LIKE = dict(**ATTENTION, num_key_value_heads=2, intermediate_size=64)
# model_type -> its config's own keyword arguments (each family names its sizes its own way).
FAMILIES = {
    "gpt2": dict(n_embd=32, n_layer=2, n_head=4, n_positions=128),
    "opt": dict(**ATTENTION, ffn_dim=64, max_position_embeddings=128, word_embed_proj_dim=32),
    "gpt_bigcode": dict(n_embd=32, n_layer=2, n_head=4, n_positions=128, multi_query=True),
    "gpt_neox": dict(**ATTENTION, intermediate_size=64, rotary_pct=0.25),
    "phi": dict(**ATTENTION, intermediate_size=64, partial_rotary_factor=0.5),
    "phi3": dict(**LLAMA_LIKE, max_position_embeddings=128, original_max_position_embeddings=128),
    "olmo2": dict(**LLAMA_LIKE),
    "granite": dict(
        **LLAMA_LIKE, embedding_multiplier=2.0, attention_multiplier=0.3,
        residual_multiplier=0.5, logits_scaling=2.0,
    ),
    "cohere": dict(**LLAMA_LIKE),
    "mixtral": dict(**LLAMA_LIKE, num_local_experts=4, num_experts_per_tok=2),
    "deepseek_v3": dict(
        **ATTENTION, num_key_value_heads=4, intermediate_size=64, moe_intermediate_size=32,
        n_routed_experts=4, num_experts_per_tok=2, n_shared_experts=1, first_k_dense_replace=1,
        kv_lora_rank=16, q_lora_rank=16, qk_rope_head_dim=8, qk_nope_head_dim=8,
        v_head_dim=8, n_group=1, topk_group=1,
    ),
    "bloom": dict(hidden_size=32, n_layer=2, n_head=4),
    "falcon": dict(**ATTENTION, alibi=True, multi_query=True, bias=False),  # ALiBi Falcon
    "mpt": dict(d_model=32, n_layers=2, n_heads=4, max_seq_len=128, expansion_ratio=2),
}  # fmt: skip
ALIBI = {"bloom", "falcon", "mpt"}
SLOT_ORDER_ALIBI = {"mpt"}  # one row at a time (attention_layout.single_row_problem)


def _target(family: str) -> torch.nn.Module:
    config = transformers.AutoConfig.for_model(
        family, vocab_size=VOCAB, bos_token_id=1, eos_token_id=2, pad_token_id=0,
        initializer_range=0.3, **FAMILIES[family],
    )  # fmt: skip
    torch.manual_seed(0)
    return transformers.AutoModelForCausalLM.from_config(config).float().eval()


def _prompts(batch: int) -> tuple[torch.Tensor, torch.Tensor]:  # left-padded [B, 10] each
    ids = torch.randint(3, VOCAB, (3, 10), generator=torch.Generator().manual_seed(0))
    ids[:, -4:] = ids[:, -8:-4].clone()  # a repeated tail: prompt lookup finds matches
    mask = torch.ones_like(ids)
    mask[1, :3] = 0
    mask[2, :6] = 0
    return ids.masked_fill(mask == 0, 0)[-batch:], mask[-batch:]


def _drafters(target: torch.nn.Module) -> dict[str, object]:
    kinds = {
        "draft_lm": lambda: DraftModelDrafter(noisy_copy(target, 0.3)),
        "ngram": lambda: NgramDrafter(VOCAB),
        "eagle3": lambda: tiny_eagle_drafter(target),
    }
    if target.get_output_embeddings().bias is None:  # Medusa heads carry no bias
        kinds["medusa"] = lambda: tiny_medusa_drafter(target)
    return kinds


@pytest.mark.parametrize("family", sorted(FAMILIES))
def test_chains_equal_generate(family: str) -> None:
    target = _target(family)
    for batch in (1,) if family in SLOT_ORDER_ALIBI else (1, 3):
        ids, mask = _prompts(batch)
        reference = hf_greedy(target, ids, NEW_TOKENS, mask)
        for kind, make in _drafters(target).items():
            out = SpeculativeDecoder(target, make(), 3).generate(
                ids, mask, max_new_tokens=NEW_TOKENS, eos_token_id=[], pad_token_id=0
            )
            assert torch.equal(out.sequences, reference), (batch, kind)


@pytest.mark.parametrize("family", sorted(set(FAMILIES) - ALIBI))
def test_trees_equal_generate(family: str) -> None:
    target = _target(family)
    ids, mask = _prompts(3)
    reference = hf_greedy(target, ids, NEW_TOKENS, mask)
    drafters = _drafters(target)
    for kind in ("eagle3", "medusa"):
        if kind in drafters:
            decoder = SpeculativeDecoder(target, drafters[kind](), 3, tree=TreeSpec(3, 8))
            out = decoder.generate(ids, mask, max_new_tokens=NEW_TOKENS, eos_token_id=[])
            assert torch.equal(out.sequences, reference), kind


@pytest.mark.parametrize("family", sorted(ALIBI))
def test_alibi_targets_refuse_trees_by_name(family: str) -> None:
    """Their forward biases by slot order or a 2-D mask, never by a tree node's depth."""
    target = _target(family)
    with pytest.raises(ValueError, match=r"ALiBi biases.*draft chains on it"):
        SpeculativeDecoder(target, tiny_eagle_drafter(target), 3, tree=TreeSpec(3, 8))


def test_slot_order_alibi_decodes_one_row_at_a_time() -> None:
    """MPT biases a key by its cache slot, so the holes a batch leaves would shift it."""
    target = _target("mpt")
    decoder = SpeculativeDecoder(target, NgramDrafter(VOCAB), 3)
    ids, mask = _prompts(3)
    with pytest.raises(ValueError, match=r"biases attention by cache slot.*batch size 1"):
        decoder.generate(ids, mask, max_new_tokens=4)
    session = decoder.session(eos_token_id=[])
    session.add_rows(ids[:1], mask[:1], 4)
    with pytest.raises(ValueError, match="biases attention by cache slot"):
        session.add_rows(ids[1:2], mask[1:2], 4)


@pytest.mark.parametrize("family", sorted(FAMILIES))
def test_learned_position_tables_bound_the_request(family: str) -> None:
    """GPT-2, OPT and GPT-BigCode embed absolute positions from a table: a request past it is
    refused by name (their forward would fail with an index error); the others have no end."""
    target = _target(family)
    learned = family in {"gpt2", "opt", "gpt_bigcode"}
    assert (learned_position_limit(target) == 128) is learned
    decoder = SpeculativeDecoder(target, NgramDrafter(VOCAB), 3)
    ids, _ = _prompts(1)
    if learned:
        with pytest.raises(ValueError, match=r"need 137 positions, past the 128 .* <= 119"):
            decoder.generate(ids, max_new_tokens=128)
    out = decoder.generate(ids, max_new_tokens=119, eos_token_id=[], pad_token_id=0)
    assert out.sequences.shape == (1, 10 + 119)


def test_rows_past_their_limit_stay_inside_a_learned_position_table() -> None:
    """A row that finished keeps riding along in its batch's verify passes, and may accept
    more per round than a row still decoding: its positions ran past GPT-2's table (an index
    error) while the long rows' stayed inside. They are clamped; no emitted token changes."""
    target = _target("gpt2")
    ids = torch.randint(3, VOCAB, (3, 10), generator=torch.Generator().manual_seed(1))
    limits = [119, 3, 119]  # rows 0 and 2 end at the table's last position
    session = SpeculativeDecoder(target, DraftModelDrafter(target), 4).session(
        eos_token_id=[], pad_token_id=0, record=True
    )
    session.add_rows(ids, None, limits)
    while session.room() > 0:
        session.step()
    sequences = session.sequences(ids)
    for row, limit in enumerate(limits):
        reference = hf_greedy(target, ids[row : row + 1], limit)
        assert torch.equal(sequences[row, : 10 + limit], reference[0]), row


def test_a_ragged_batch_needs_only_each_rows_own_positions() -> None:
    """Padding takes no position: a long prompt with few new tokens beside a short prompt with
    many fits the table when each row does, however wide the padded batch."""
    target = _target("gpt2")
    ids = torch.randint(3, VOCAB, (2, 100), generator=torch.Generator().manual_seed(2))
    mask = torch.ones_like(ids)
    mask[1, :90] = 0  # row 1: 10 real tokens
    limits = [20, 119]  # row 0: 100 + 20 - 1 <= 128; row 1: 10 + 119 - 1 = 128
    session = SpeculativeDecoder(target, NgramDrafter(VOCAB), 3).session(
        eos_token_id=[], pad_token_id=0, record=True
    )
    session.add_rows(ids.masked_fill(mask == 0, 0), mask, limits)
    while session.room() > 0:
        session.step()
    assert session.count.tolist() == limits
    with pytest.raises(ValueError, match=r"prompt \(10 tokens\) and max_new_tokens=120 need 129"):
        session.add_rows(ids[1:, 90:], None, 120)
