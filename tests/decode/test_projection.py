"""Every layout of ``draftsmith.decode.forward.projection`` computes ``x W^T + b``; the choice follows the dtype."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from draftsmith.decode.forward import projection
from draftsmith.decode.forward.projection import Projection

LAYOUTS = [projection.TRANSPOSED, projection.WEIGHT_FIRST, projection.PACKED, projection.LINEAR]
# bfloat16 products round their output to 8 bits of mantissa; float32 to 24.
TOLERANCE = {torch.float32: 1e-4, torch.bfloat16: 3e-2}
# Weight-only int8 rounds each weight by at most half its row's scale (max |w| / 254).
INT8_TOLERANCE = 3e-2
# Int4 with groups of 32 moves an output by a few percent of the largest one.
INT4_TOLERANCE = 0.15
needs_int8_kernel = pytest.mark.skipif(
    not projection.int8_weight_kernel(), reason="this torch has no weight-only int8 kernel"
)
needs_int4_kernel = pytest.mark.skipif(
    not projection.int4_weight_kernel(), reason="this torch has no weight-only int4 kernel"
)
needs_quantized_kernel = pytest.mark.skipif(
    projection.draft_quantized_layout() is None, reason="this torch has no weight-only kernel"
)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("layout", LAYOUTS)
@pytest.mark.parametrize("with_bias", [False, True])
@pytest.mark.parametrize("rows", [1, 5, 70])
def test_every_layout_computes_the_linear_map(
    dtype: torch.dtype, layout: str, with_bias: bool, rows: int
) -> None:
    if layout == projection.PACKED and not projection.onednn_packs(dtype):
        pytest.skip(f"this torch's oneDNN does not pack {dtype}")
    generator = torch.Generator().manual_seed(rows)
    weight = torch.randn(48, 32, generator=generator).to(dtype)  # [out, in]
    bias = torch.randn(48, generator=generator).to(dtype) if with_bias else None
    x = torch.randn(2, rows, 32, generator=generator).to(dtype)  # [B, T, in]
    reference = F.linear(x.double(), weight.double(), None if bias is None else bias.double())
    out = Projection(weight, bias, lambda _dtype, _rows: layout)(x)
    assert out.shape == (2, rows, 48) and out.dtype == dtype
    error = (out.double() - reference).abs().max() / reference.abs().max()
    assert error < TOLERANCE[dtype]


def test_layouts_follow_in_place_weight_updates() -> None:
    weight = torch.randn(16, 8)
    x = torch.randn(3, 8)
    for layout in LAYOUTS:
        if layout == projection.PACKED and not projection.onednn_packs(torch.float32):
            continue
        project = Projection(weight, None, lambda _dtype, _rows, chosen=layout: chosen)
        project(x)  # prepares the layout
        with torch.no_grad():
            weight.mul_(2.0)
        assert torch.allclose(project(x), F.linear(x, weight), atol=1e-5), layout


def test_the_layout_rules_keep_float32_and_pack_bfloat16(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(projection, "onednn_packs", lambda dtype: True)
    monkeypatch.setattr(projection, "packs_few_float32_rows", lambda: False)
    assert projection.layer_layout(torch.float32, 5) == projection.TRANSPOSED
    assert [projection.vocab_layout(torch.float32, r) for r in (1, 3, 5, 13)] == [
        projection.TRANSPOSED,
        projection.TRANSPOSED,
        projection.WEIGHT_FIRST,
        projection.PACKED,
    ]
    monkeypatch.setattr(projection, "packs_few_float32_rows", lambda: True)  # AMX, or AVX2
    assert [projection.vocab_layout(torch.float32, r) for r in (1, 2, 5, 13)] == [
        projection.TRANSPOSED,
        projection.PACKED,
        projection.PACKED,
        projection.PACKED,
    ]
    assert [projection.layer_layout(torch.float32, r) for r in (1, 2, 17)] == [
        projection.TRANSPOSED,
        projection.PACKED,
        projection.PACKED,
    ]
    assert projection.layer_layout(torch.bfloat16, 1) == projection.PACKED
    assert projection.vocab_layout(torch.bfloat16, 64) == projection.PACKED
    assert projection.vocab_layout(torch.bfloat16, 65) == projection.WEIGHT_FIRST
    monkeypatch.setattr(projection, "onednn_packs", lambda dtype: False)
    assert projection.layer_layout(torch.bfloat16, 1) == projection.LINEAR
    assert projection.layer_layout(torch.float64, 1) == projection.LINEAR


def test_a_compute_dtype_keeps_the_precision_an_argmax_needs() -> None:
    """Two logits 1/512 apart round to one bfloat16 value; in float32 they stay apart."""
    weight = torch.zeros(2, 4, dtype=torch.bfloat16)
    weight[0, 0], weight[1, 0] = 1.0, 1.0
    weight[1, 1] = 2.0**-9
    x = torch.tensor([[8.0, 1.0, 0.0, 0.0]], dtype=torch.bfloat16)
    rounded = Projection(weight)(x)  # 8 and 8 + 2^-9 -> the same bfloat16 value
    kept = Projection(weight, compute_dtype=torch.float32)(x)
    assert rounded[0, 0] == rounded[0, 1]
    assert kept.dtype == torch.float32 and int(kept.argmax()) == 1


def test_int8_quantization_rounds_each_weight_to_its_row_scale() -> None:
    weight = torch.randn(24, 32, generator=torch.Generator().manual_seed(0))
    weight[3] = 0.0  # an all-zero row stays zero
    int8, scales = projection.quantize_int8(weight)
    assert int8.dtype == torch.int8 and int8.abs().max() <= 127 and scales.shape == (24,)
    error = (int8.float() * scales[:, None] - weight).abs()
    assert (error <= scales[:, None] / 2 + 1e-7).all()
    assert (int8[3] == 0).all() and int(int8.abs().amax(1)[0]) == 127


@needs_int8_kernel
@pytest.mark.parametrize("with_bias", [False, True])
@pytest.mark.parametrize("rows", [1, 5])
@pytest.mark.parametrize("width", [32, 33])
def test_int8_weights_compute_the_linear_map(with_bias: bool, rows: int, width: int) -> None:
    """Within quantization error; a width the kernel cannot read (33) keeps the layer layout."""
    generator = torch.Generator().manual_seed(rows + width)
    weight = torch.randn(48, width, generator=generator).bfloat16()  # [out, in]
    bias = torch.randn(48, generator=generator).bfloat16() if with_bias else None
    x = torch.randn(2, rows, width, generator=generator).bfloat16()  # [B, T, in]
    reference = F.linear(x.double(), weight.double(), None if bias is None else bias.double())
    project = Projection(weight, bias, lambda _dtype, _rows: projection.INT8_WEIGHTS)
    out = project(x)
    assert out.shape == (2, rows, 48) and out.dtype == torch.bfloat16
    error = (out.double() - reference).abs().max() / reference.abs().max()
    assert error < INT8_TOLERANCE
    assert (projection.INT8_WEIGHTS in project._prepared) == (width % 16 == 0)


def test_int4_quantization_rounds_each_weight_within_its_group() -> None:
    """Each weight lies within half a step of its group's grid; a constant group is exact."""
    weight = torch.randn(16, 64, generator=torch.Generator().manual_seed(0))
    weight[2, :32] = 0.25  # a constant group
    levels, scales, low = projection.quantize_int4(weight, group=32)
    assert levels.dtype == torch.int32 and int(levels.min()) >= 0 and int(levels.max()) <= 15
    assert scales.shape == low.shape == (16, 2)
    step = scales.repeat_interleave(32, dim=1)  # [out, in]
    approx = low.repeat_interleave(32, dim=1) + step * levels.float()
    assert ((approx - weight).abs() <= step / 2 + 1e-6).all()
    assert torch.equal(approx[2, :32], weight[2, :32])
    assert (levels.reshape(16, 2, 32).amax(-1)[torch.arange(16) != 2] == 15).all()


@needs_int4_kernel
@pytest.mark.parametrize("with_bias", [False, True])
@pytest.mark.parametrize("rows", [1, 4])
@pytest.mark.parametrize("shape", [(48, 64), (40, 64), (48, 48)])
def test_int4_weights_compute_the_linear_map(
    with_bias: bool, rows: int, shape: tuple[int, int]
) -> None:
    """Within quantization error; a weight the kernel cannot take (40 outputs: not a multiple
    of 16; 48 inputs: not whole groups of 32) multiplies the int8 copy instead."""
    out_features, in_features = shape
    generator = torch.Generator().manual_seed(rows + out_features + in_features)
    weight = torch.randn(out_features, in_features, generator=generator).bfloat16()
    bias = torch.randn(out_features, generator=generator).bfloat16() if with_bias else None
    x = torch.randn(2, rows, in_features, generator=generator).bfloat16()  # [B, T, in]
    reference = F.linear(x.double(), weight.double(), None if bias is None else bias.double())
    project = Projection(weight, bias, lambda _dtype, _rows: projection.INT4_WEIGHTS)
    out = project(x)
    assert out.shape == (2, rows, out_features) and out.dtype == torch.bfloat16
    error = (out.double() - reference).abs().max() / reference.abs().max()
    assert error < INT4_TOLERANCE
    takes = out_features % 16 == 0 and in_features % 32 == 0
    assert (projection.INT4_WEIGHTS in project._prepared) == takes
    if not takes and projection.int8_weight_kernel():
        assert projection.INT8_WEIGHTS in project._prepared


@pytest.mark.parametrize("rule", ["draft_layer_layout", "draft_vocab_layout"])
@pytest.mark.parametrize("bits", [4, 8])
def test_drafters_use_quantized_weights_for_a_few_bfloat16_rows_only(
    monkeypatch: pytest.MonkeyPatch, rule: str, bits: int
) -> None:
    """Layer products and logits alike, up to ``QUANTIZED_DRAFT_ROWS`` rows (a chain step, a
    commit, a P-EAGLE pass), int4 where asked for and its kernel runs, else int8; more rows,
    float32 and targets keep their layouts."""
    monkeypatch.setattr(projection, "onednn_packs", lambda dtype: True)
    monkeypatch.setattr(projection, "int8_weight_kernel", lambda: True)
    monkeypatch.setattr(projection, "int4_weight_kernel", lambda: True)
    monkeypatch.setattr(projection, "DRAFT_WEIGHT_BITS", bits)
    quantized = projection.INT4_WEIGHTS if bits == 4 else projection.INT8_WEIGHTS
    choose = getattr(projection, rule)
    most = projection.QUANTIZED_DRAFT_ROWS
    assert most >= 1
    for rows in range(1, most + 1):
        assert choose(torch.bfloat16, rows) == quantized
    assert choose(torch.bfloat16, most + 1) == projection.PACKED
    assert choose(torch.float32, 1) == projection.TRANSPOSED
    monkeypatch.setattr(projection, "int4_weight_kernel", lambda: False)
    assert choose(torch.bfloat16, 1) == projection.INT8_WEIGHTS
    monkeypatch.setattr(projection, "int8_weight_kernel", lambda: False)
    assert choose(torch.bfloat16, 1) == projection.PACKED
    assert projection.layer_layout(torch.bfloat16, 1) == projection.PACKED  # targets never


@needs_quantized_kernel
def test_a_bfloat16_eagle_head_drafts_through_quantized_weights() -> None:
    from decode_helpers import tiny_eagle_drafter
    from tiny_models import tiny_llama

    target = tiny_llama(num_layers=2, seed=0, dtype=torch.bfloat16)
    lean = tiny_eagle_drafter(target).lean
    first = lean.weights().first
    hidden = torch.randn(1, 1, lean.head.config.hidden_size).bfloat16()
    first.qkv(hidden.repeat(1, 1, 2))  # one row: the quantized copy is built and used
    assert projection.draft_quantized_layout() in first.qkv._prepared


@pytest.mark.parametrize("rows", [1, 3])
@pytest.mark.parametrize(
    ("layout", "tolerance", "kernel"),
    [
        (projection.INT8_WEIGHTS, INT8_TOLERANCE, projection.int8_weight_kernel),
        (projection.INT4_WEIGHTS, INT4_TOLERANCE, projection.int4_weight_kernel),
    ],
)
def test_quantized_logits_keep_the_exact_argmax_and_top_outputs(
    rows: int, layout: str, tolerance: float, kernel
) -> None:
    """A drafter's logits from quantized weights: each row's largest outputs are the float32
    product's values wherever they lie among the ``RESCORED_OUTPUTS`` largest approximate ones
    (here the top 4, a tree's widest level: int4 can push the 8th out of that set), so argmax
    and top-k are float32's; the rest are close."""
    if not kernel():
        pytest.skip(f"this torch has no {layout} kernel")
    generator = torch.Generator().manual_seed(rows)
    weight = torch.randn(304, 64, generator=generator).bfloat16()  # [V, H]
    hidden = torch.randn(2, rows, 64, generator=generator).bfloat16()  # [B, T, H]
    exact = F.linear(hidden.float(), weight.float())  # [B, T, V]
    head = Projection(weight, None, lambda _d, _r: layout, torch.float32)
    logits = head(hidden)
    assert logits.dtype == torch.float32 and logits.shape == exact.shape
    assert torch.equal(logits.argmax(-1), exact.argmax(-1))
    top = exact.topk(4, dim=-1)
    assert torch.allclose(logits.gather(-1, top.indices), top.values, atol=1e-5)
    assert torch.equal(logits.topk(4, dim=-1).indices, top.indices)
    assert ((logits - exact).abs().max() / exact.abs().max()) < tolerance
    with torch.no_grad():
        weight.mul_(-1.0)  # an in-place update reaches the quantized copy and the exact rows
    assert torch.equal(head(hidden).argmax(-1), (-exact).argmax(-1))


def test_engine_comparisons_can_turn_quantized_drafting_off(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setattr(projection, "onednn_packs", lambda dtype: True)
    monkeypatch.setattr(projection, "int8_weight_kernel", lambda: True)
    monkeypatch.setattr(projection, "int4_weight_kernel", lambda: True)
    with projection.drafts_in_their_own_dtype():
        for rows in range(1, projection.QUANTIZED_DRAFT_ROWS + 1):
            assert projection.draft_layer_layout(torch.bfloat16, rows) == projection.PACKED
            assert projection.draft_vocab_layout(torch.bfloat16, rows) == projection.PACKED
    assert projection.draft_layer_layout(torch.bfloat16, 1) == projection.draft_quantized_layout()


@pytest.mark.parametrize(
    "choose",
    [
        projection.layer_layout,
        projection.draft_layer_layout,
        projection.vocab_layout,
        projection.draft_vocab_layout,
    ],
)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_weights_off_the_cpu_multiply_with_f_linear(choose, dtype: torch.dtype) -> None:
    """The layout tables are CPU measurements: oneDNN's packed weight and the int8 kernel are
    CPU code, so a weight on another device (a GPU; here ``meta``, which runs no kernel at
    all) multiplies with ``F.linear``, whatever ``choose`` would pick on a CPU."""
    weight = torch.empty(48, 32, dtype=dtype, device="meta")
    for rows in (1, 4, 13):
        product = Projection(weight, choose=choose)
        out = product(torch.empty(rows, 32, dtype=dtype, device="meta"))
        assert out.shape == (rows, 48) and out.device.type == "meta"
        assert product._prepared == {}  # no CPU layout was built
