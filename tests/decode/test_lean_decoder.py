"""The lean CPU forward computes what the model's own forward computes, step after step."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from draftsmith.decode.forward.cached_sequence import CachedSequence
from draftsmith.decode.forward.lean_decoder import LeanDecoder
from draftsmith.decode.forward.llama_math import attention, draft_cache_dtype
from draftsmith.decode.forward.output_head import OutputHead
from tiny_models import tiny_causal_lm, tiny_llama

# Mistral with full attention; Qwen2 has q/k/v biases, Qwen3 per-head q/k norms.
ARCHITECTURES = ["llama", "mistral", "qwen2", "qwen3"]


def _pair(model: torch.nn.Module, batch: int) -> tuple[CachedSequence, CachedSequence]:
    head = OutputHead.for_model(model)
    lean = LeanDecoder.for_model(model)
    assert head is not None and lean is not None
    cpu = torch.device("cpu")
    return CachedSequence(model, batch, cpu, head), CachedSequence(model, batch, cpu, head, lean)


def _assert_same(reference, lean, valid: torch.Tensor | None = None) -> None:
    """Equal outputs at the valid positions (padding and hole outputs are never read)."""
    keep = slice(None) if valid is None else valid  # [B, W] bool
    assert torch.allclose(lean.logits[keep], reference.logits[keep], atol=1e-9)
    if reference.hidden_states is not None:
        assert len(lean.hidden_states) == len(reference.hidden_states)
        for mine, theirs in zip(lean.hidden_states, reference.hidden_states, strict=True):
            assert torch.allclose(mine[keep], theirs[keep], atol=1e-9)


@pytest.mark.parametrize("architecture", ARCHITECTURES)
def test_lean_forward_matches_the_model_through_holes_rollbacks_and_trees(
    architecture: str,
) -> None:
    model = tiny_causal_lm(architecture, seed=3, sliding_window=None)
    generator = torch.Generator().manual_seed(3)
    prompt = torch.randint(3, 64, (2, 7), generator=generator)
    prompt_mask = torch.ones_like(prompt, dtype=torch.bool)
    prompt_mask[1, :3] = False  # left padding in row 1
    reference, lean = _pair(model, 2)
    with torch.no_grad():
        steps = [
            dict(tokens=prompt, valid=prompt_mask, output_hidden_states=True),
            dict(tokens=torch.randint(3, 64, (2, 1), generator=generator)),
            dict(
                tokens=torch.randint(3, 64, (2, 2), generator=generator),
                valid=torch.tensor([[True, True], [False, True]]),  # a hole in row 1
            ),
            dict(tokens=torch.randint(3, 64, (2, 4), generator=generator)),
        ]
        for step in steps:
            _assert_same(reference.extend(**step), lean.extend(**step), step.get("valid"))
        keep = torch.tensor([1, 3])
        reference.rollback(4, keep)
        lean.rollback(4, keep)
        tree = dict(
            tokens=torch.randint(3, 64, (2, 3), generator=generator),
            tree_mask=torch.tensor([[1, 0, 0], [1, 1, 0], [1, 0, 1]], dtype=torch.bool),
            positions=lean.lengths[:, None] + torch.tensor([[0, 1, 1]]),
            output_hidden_states=True,
        )
        _assert_same(reference.extend(**tree), lean.extend(**tree))
        path, path_valid = torch.tensor([[0, 2], [0, 1]]), torch.ones(2, 2, dtype=torch.bool)
        reference.keep_path(3, path, path_valid)
        lean.keep_path(3, path, path_valid)
        last = dict(tokens=torch.randint(3, 64, (2, 1), generator=generator))
        _assert_same(reference.extend(**last), lean.extend(**last))


def test_lean_forward_follows_in_place_weight_updates() -> None:
    model = tiny_llama(seed=4)
    head, lean = OutputHead.for_model(model), LeanDecoder.for_model(model)
    tokens = torch.tensor([[5, 6, 7, 8]])
    cpu = torch.device("cpu")
    with torch.no_grad():
        for _ in range(2):
            _assert_same(
                CachedSequence(model, 1, cpu, head).extend(tokens),
                CachedSequence(model, 1, cpu, head, lean).extend(tokens),
            )
            model.model.layers[0].mlp.down_proj.weight.mul_(3.0)  # e.g. an optimizer step


def test_lean_forward_declines_what_it_does_not_implement() -> None:
    unknown = tiny_llama()
    unknown.config.model_type = "gemma2"
    assert LeanDecoder.for_model(unknown) is None
    gelu = tiny_llama()
    gelu.config.hidden_act = "gelu"
    assert LeanDecoder.for_model(gelu) is None
    chunked = tiny_llama()
    chunked.config.layer_types = ["chunked_attention", "full_attention"]
    chunked.config.attention_chunk_size = 4
    assert LeanDecoder.for_model(chunked) is None
    for change in ({"rope_type": "mystery"}, {"partial_rotary_factor": 0.5}):
        model = tiny_llama()
        model.config.rope_parameters = {**model.config.rope_parameters, **change}
        assert LeanDecoder.for_model(model) is None, change


def test_lean_forward_serves_windows_and_call_dependent_ropes() -> None:
    """Sliding windows and dynamic/longrope are matched now (tests/decode/test_exactness_configs.py
    compares their logits); only what it cannot reproduce is declined."""
    assert LeanDecoder.for_model(tiny_causal_lm("mistral", sliding_window=16)) is not None
    dynamic = tiny_llama(rope_parameters={"rope_type": "dynamic", "factor": 2.0})
    assert LeanDecoder.for_model(dynamic) is not None


@pytest.mark.parametrize("architecture", ARCHITECTURES)
def test_lean_forward_in_bfloat16_is_as_close_to_float64_as_the_models_own(
    architecture: str,
) -> None:
    """In bfloat16 the two forwards round differently; the lean one must not round worse."""
    exact = tiny_causal_lm(architecture, seed=5, sliding_window=None)
    model = tiny_causal_lm(architecture, seed=5, sliding_window=None, dtype=torch.bfloat16)
    generator = torch.Generator().manual_seed(5)
    prompt = torch.randint(3, 64, (2, 9), generator=generator)
    (exact_seq, _), (reference, lean) = _pair(exact, 2), _pair(model, 2)
    errors = {"model": 0.0, "lean": 0.0}
    with torch.no_grad():
        steps = [torch.randint(3, 64, (2, width), generator=generator) for width in (5, 1, 1)]
        for tokens in (prompt, *steps):  # widths 1 take the single-query attention path
            truth = exact_seq.extend(tokens=tokens).logits
            scale = truth.abs().max()
            for name, sequence in (("model", reference), ("lean", lean)):
                logits = sequence.extend(tokens=tokens).logits
                assert logits.dtype == torch.bfloat16
                error = float((logits.double() - truth).abs().max() / scale)
                errors[name] = max(errors[name], error)
    assert errors["lean"] <= 2 * errors["model"] + 1e-3, errors


@pytest.mark.parametrize("kv_heads", [4, 2])
@pytest.mark.parametrize("masked", [False, True])
def test_single_query_attention_in_bfloat16_rounds_no_worse_than_the_kernel(
    kv_heads: int, masked: bool
) -> None:
    """One bfloat16 query attends over float32 copies: within bfloat16 rounding of the float64
    attention, no further from it than ATen's bfloat16 kernel; other widths are the kernel."""
    generator = torch.Generator().manual_seed(11)
    q64 = torch.randn(2, 4, 1, 16, generator=generator, dtype=torch.float64)
    k64, v64 = torch.randn(2, 2, kv_heads, 37, 16, generator=generator, dtype=torch.float64)
    mask = torch.rand(2, 1, 1, 37, generator=generator) < 0.7 if masked else None
    if mask is not None:
        mask[..., -1] = True  # a query always sees its own slot
    grouped = kv_heads != 4
    truth = F.scaled_dot_product_attention(q64, k64, v64, attn_mask=mask, enable_gqa=grouped)
    q, k, v = (t.to(torch.bfloat16) for t in (q64, k64, v64))
    ours = attention(q, k, v, mask)
    kernel = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, enable_gqa=grouped)
    assert ours.dtype == torch.bfloat16 and ours.shape == truth.shape
    ours_error = float((ours.double() - truth).abs().max())
    kernel_error = float((kernel.double() - truth).abs().max())
    assert ours_error <= max(kernel_error, 2**-7 * float(truth.abs().max())), (
        ours_error,
        kernel_error,
    )
    wide_q = torch.cat((q, q), dim=2)  # [2, 4, 2, 16]: two queries keep the kernel
    wide_mask = None if mask is None else mask.expand(2, 1, 2, 37)
    assert torch.equal(
        attention(wide_q, k, v, wide_mask),
        F.scaled_dot_product_attention(wide_q, k, v, attn_mask=wide_mask, enable_gqa=grouped),
    )


@pytest.mark.parametrize("width", [1, 3])
def test_keys_kept_in_float32_are_attended_without_rounding_the_cache(width: int) -> None:
    """A drafter's float32 cache (``draft_cache_dtype``) is attended in float32 at every width:
    exactly the float32 attention of the bfloat16 queries, rounded back to bfloat16."""
    generator = torch.Generator().manual_seed(12)
    q = torch.randn(2, 4, width, 16, generator=generator).to(torch.bfloat16)
    k, v = torch.randn(2, 2, 2, 29, 16, generator=generator)  # [B, KV, S, D] float32 each
    mask = torch.rand(2, 1, width, 29, generator=generator) < 0.7
    mask[..., -1] = True
    expected = F.scaled_dot_product_attention(q.float(), k, v, attn_mask=mask, enable_gqa=True)
    ours = attention(q, k, v, mask)
    assert ours.dtype == torch.bfloat16
    assert torch.equal(ours, expected.to(torch.bfloat16))


def test_drafters_keep_float32_caches_on_cpu_in_narrow_dtypes_only() -> None:
    cpu, cuda = torch.device("cpu"), torch.device("cuda")
    assert draft_cache_dtype(torch.bfloat16, cpu) == torch.float32
    assert draft_cache_dtype(torch.float16, cpu) == torch.float32
    assert draft_cache_dtype(torch.float32, cpu) == torch.float32
    assert draft_cache_dtype(torch.float64, cpu) == torch.float64
    assert draft_cache_dtype(torch.bfloat16, cuda) == torch.bfloat16  # the GPU keeps its kernels
