"""``x W^T + b`` on CPU in the layout that is fastest for the dtype and the row count.

Decoding multiplies a few rows (1 for a plain step, N + 1 for a verify pass, a tree's nodes)
by weights that no longer sit in cache, so the layout of the weight decides the cost, and the
best layout differs between dtypes. Measured on this project's CPUs (one thread, ms per Llama
layer of width 512 (q/k/v, o, gate/up, down), min of 7 runs; an Intel Xeon with AMX and
AVX512-BF16):

| rows | float32 ``x @ W^T`` copy | float32 ``F.linear`` | bfloat16 ``F.linear`` | bfloat16 oneDNN packed |
|---|---|---|---|---|
| 1 / 5 / 9 | 0.71 / 0.95 / 1.45 | 0.81 / 1.37 / 1.92 | 0.77 / 0.69 / 0.75 | 0.49 / 0.46 / 0.47 |
| 17 / 64 | 1.60 / 4.08 | 2.63 / 6.24 | 0.79 / 1.10 | 0.51 / 0.72 |

So float32 layers multiply by a contiguous transposed copy (MKL), and bfloat16 by oneDNN's
prepacked weight, whose cost on AMX tiles is flat in the row count: a verify pass over 5-17
tokens costs about one step, the regime in which drafting pays (docs/theory.md §1). With
AVX512-BF16 alone (AMX absent or hidden by a hypervisor) the packed weight is still the
fastest bfloat16 layout measured, but its cost grows with the rows (warm q/k/v 1536 x 1024, 2
threads: about six times the one-row cost at 17 rows; docs/guides/results-other-cpus.md, "The
demo target on the Intel Xeon without AMX"). An AMD EPYC (Zen 5) with AVX512-BF16 and no AMX
behaves like the AMX machine: warm, 2 threads, the target's q/k/v 1536 x 512 cost 54 / 49 / 52 /
85 microseconds for 1 / 4 / 9 / 17 rows (same guide, "The demo target on the AMD EPYC (Zen
5)"). Vocabulary-sized
outputs follow their own float32 table (``draftsmith.decode.forward.output_head``); in bfloat16 (V = 8192, H =
512) the packed weight wins up to 64 rows (0.44 ms at 1-5 rows against 0.73 for ``F.linear``)
and ``(W x^T)^T`` beyond (2.4 ms at 256 rows against 4.3 packed).

Drafters may go further. Rejection sampling is exact for whatever ``q`` the draft computes
(docs/theory.md §2), so a drafter's products over a few rows can multiply a weight-only int8 copy
(symmetric, one scale per output row: ``W ~ s * W8``, ``|W8| <= 127``) with ATen's
``_weight_int8pack_mm``, which streams half the bytes of bfloat16 and skips oneDNN's fixed
cost of ~50 microseconds a call. Measured on the same CPU (2 threads, one row, weights warm in
cache, median microseconds; the EAGLE-3 head's products on the 8 x 512 demo target):

| weight [out, in] | bfloat16 oneDNN packed | int8 weights |
|---|---|---|
| q/k/v 1536 x 1024 / gate-up 2816 x 512 | 143 / 123 | 88 / 91 |
| o 512 x 512 / down 512 x 1408 | 55 / 80 | 22 / 43 |

A drafter's weights are cold when its commit pass runs: the target's verify pass has just
streamed ~60 MB through the caches. Measured with the caches flushed before each call (2
threads, median microseconds, packed bfloat16 / int8), and warm for comparison:

| weight | 1 row | 2 rows | 3 rows | 4 rows | 5 rows | 4 rows, warm |
|---|---|---|---|---|---|---|
| q/k/v 1536 x 1024 | 629 / 250 | 584 / 316 | 680 / 350 | 622 / 401 | 582 / 570 | 150 / 195 |
| gate-up 2816 x 512 | 565 / 249 | 557 / 270 | 646 / 320 | 646 / 342 | 557 / 506 | 155 / 152 |
| vocabulary 2048 x 512 | | 487 / 231 | 575 / 253 | 579 / 285 | 506 / 439 | 101 / 137 |

Cold, int8 costs half up to 4 rows and draws level at 5; warm, it ties up to 3 rows and loses
from 4 on (its cost grows with the rows, oneDNN's does not; 13 rows warm: 642 against 148).
So ``draft_layer_layout`` uses it for bfloat16 products of up to 4 rows
(``QUANTIZED_DRAFT_ROWS``): every chain step, a commit of up to 3 accepted drafts plus the
pending token, a P-EAGLE pass of 4 depths. The
kernel has no fast float32 path (about 10x slower). A target never uses it: its output must
follow its own weights. In the speculative decoder the one-row rule cut the EAGLE-3 chain's
drafting cost per round by a fifth to a quarter with the same measured acceptance (4 seeds x 6
held-out prompts at T = 1, tau 2.72 against 2.70); widening it to 4 rows took a further
0.6-1.6 ms off a round of 9.8-11.4 ms (A/B, main job's head, 12 prompts x 128 tokens).

Int4 goes one step further (``DRAFT_WEIGHT_BITS = 4``, the default where ATen's
``_weight_int4pack_mm_for_cpu`` runs): asymmetric round-to-nearest levels 0..15 with a scale
and a zero per group of 32 inputs (``quantize_int4``), a quarter of bfloat16's bytes. Measured
on the Intel Xeon with AMX (2 threads, median microseconds, 64 MB streamed between calls for
"cold"; packed bfloat16 / int8 / int4):

| weight | 1 row cold | 4 rows cold | 5 rows cold | 1 row warm | 4 rows warm |
|---|---|---|---|---|---|
| q/k/v 1536 x 1024 | 218 / 136 / 129 | 201 / 165 / 164 | 212 / 238 / 237 | 63 / 50 / 53 | 69 / 85 / 89 |
| gate-up 2816 x 512 | 207 / 134 / 126 | 200 / 173 / 159 | 204 / 240 / 227 | 58 / 47 / 48 | 61 / 87 / 81 |
| vocabulary 2048 x 512 | 185 / 120 / 115 | 183 / 153 / 127 | 185 / 191 / 193 | 43 / 37 / 40 | 44 / 64 / 63 |

Per product int4 saves little over int8 (both kernels cost more per call than their bytes
explain), and both lose to the packed weight from 5 rows on, so the row rule is the same for
both. Over a decoding round it adds up: in an interleaved A/B on the main job's EAGLE-3 head
(6 held-out prompts x 128 tokens, N = 4, two runs of two passes each) the chain's drafting per
round fell from 3.75-3.93 to 3.32-3.41 ms at T = 0 and its speed over plain decoding rose from
2.22-2.25 to 2.31-2.38 times, with greedy tau 3.90 against 3.94; a P-EAGLE round's drafting fell
from 2.04-2.08 to 1.90-1.92 ms (2.30-2.34 to 2.36-2.44 times, tau 3.31 against 3.32). Greedy
acceptance falls a little: over 12 held-out prompts the int4 head's tau was 3.87 against 3.98
at T = 0. Sampled acceptance did not fall: 2.83 against 2.61 over 16 held-out prompts x 2
seeds at T = 1, 2.61 against 2.67 over 16 ood prompts (sampled tau moves that much between
samples). A weight the kernel cannot take (outputs not a multiple of 16, inputs not whole
groups) uses the int8 copy.

The layouts are built on first use and rebuilt when the weight changes in place (tensor
versions), so a model being trained can still be decoded.
"""

from __future__ import annotations

import contextlib
import functools
from collections.abc import Callable, Iterator

import torch
import torch.nn.functional as F

# A layout's name -> how it multiplies (rows [R, in]) by the prepared weight.
Layout = str
TRANSPOSED: Layout = "transposed"  # rows @ W^T, W^T a contiguous [in, out] copy
WEIGHT_FIRST: Layout = "weight_first"  # (W @ rows^T)^T, W as stored [out, in]
PACKED: Layout = "packed"  # oneDNN's inner product on a weight reordered for it
LINEAR: Layout = "linear"  # F.linear on W as stored
INT8_WEIGHTS: Layout = "int8_weights"  # rows @ (s * W8)^T, W8 int8 [out, in], s [out]
INT4_WEIGHTS: Layout = "int4_weights"  # rows @ W4^T, W4 groups of 4-bit levels (quantize_int4)
QUANTIZED: tuple[Layout, ...] = (INT8_WEIGHTS, INT4_WEIGHTS)

# Up to this many rows a bfloat16 drafter's products use quantized weights (see the tables).
QUANTIZED_DRAFT_ROWS = 4
# The bits of a drafter's quantized weights: 4 where ATen's int4 kernel takes the weight, else 8.
DRAFT_WEIGHT_BITS = 4
# Weights per (scale, zero) pair of the int4 copies (``quantize_int4``).
INT4_GROUP_SIZE = 32
# ``_weight_int4pack_mm_for_cpu`` (torch 2.13) packs output rows in blocks of 16.
INT4_KERNEL_OUTPUT_MULTIPLE = 16
# A drafter's quantized logits in a wider compute dtype: this many largest ones per row are
# recomputed exactly, so its argmax and top-k are the exact product's (``Projection._rescored``).
RESCORED_OUTPUTS = 8
# ``_weight_int8pack_mm`` (torch 2.13, CPU) reads input widths in blocks of 16: at other widths
# it returns wrong numbers or crashes, so such weights keep ``layer_layout``'s product.
INT8_KERNEL_WIDTH_MULTIPLE = 16

# Up to this many rows a bfloat16 vocabulary projection uses the packed weight.
PACKED_VOCAB_ROWS = 64


def layer_layout(dtype: torch.dtype, rows: int) -> Layout:
    """The layout of a decoder layer's products (see the module table): in float32 the
    transposed copy, or from 2 rows oneDNN's packed weight where ``packs_few_float32_rows``."""
    if dtype == torch.float32:
        if rows >= 2 and packs_few_float32_rows() and onednn_packs(dtype):
            return PACKED
        return TRANSPOSED
    if dtype == torch.bfloat16 and onednn_packs(dtype):
        return PACKED
    return LINEAR


def draft_layer_layout(dtype: torch.dtype, rows: int) -> Layout:
    """The layout of a drafter's layer products: quantized weights (``draft_quantized_layout``)
    for up to ``QUANTIZED_DRAFT_ROWS`` bfloat16 rows where ATen has the kernel, else a
    target's ``layer_layout`` (see the module docstring)."""
    return _draft_quantized(dtype, rows) or layer_layout(dtype, rows)


def draft_vocab_layout(dtype: torch.dtype, rows: int) -> Layout:
    """The layout of a drafter's output projection: quantized weights for up to
    ``QUANTIZED_DRAFT_ROWS`` bfloat16 rows (each row's top outputs then rescored in the compute
    dtype, ``Projection._rescored``), else ``vocab_layout``."""
    return _draft_quantized(dtype, rows) or vocab_layout(dtype, rows)


def draft_quantized_layout() -> Layout | None:
    """int4 weights when ``DRAFT_WEIGHT_BITS`` is 4 and ATen's int4 kernel runs, int8 when
    its int8 kernel does, None without either. A weight a kernel cannot take falls back
    (``Projection._layout``)."""
    if DRAFT_WEIGHT_BITS == 4 and int4_weight_kernel():
        return INT4_WEIGHTS
    return INT8_WEIGHTS if int8_weight_kernel() else None


def _draft_quantized(dtype: torch.dtype, rows: int) -> Layout | None:
    if dtype != torch.bfloat16 or rows > QUANTIZED_DRAFT_ROWS:
        return None
    return draft_quantized_layout()


@contextlib.contextmanager
def drafts_in_their_own_dtype() -> Iterator[None]:
    """Inside the block drafters multiply their weights as stored (no quantized copies), as an
    engine that runs the head in the model's dtype does: for comparing acceptance with one."""
    global QUANTIZED_DRAFT_ROWS
    saved, QUANTIZED_DRAFT_ROWS = QUANTIZED_DRAFT_ROWS, 0
    try:
        yield
    finally:
        QUANTIZED_DRAFT_ROWS = saved


def vocab_layout(dtype: torch.dtype, rows: int) -> Layout:
    """The layout of an output projection onto a vocabulary (see ``draftsmith.decode.forward.output_head``).

    In float32 one row multiplies the transposed copy everywhere. For 2+ rows the best layout
    depends on the CPU: on CPUs with AMX tiles (Intel Sapphire Rapids and later) oneDNN's
    packed float32 weight beat both MKL layouts from 2 rows on (one thread, matrix evicted,
    median ms for V = 2048 / 8192, H = 512: 1.12 / 2.41 at 4 rows against 1.33 / 4.70 for
    ``(W x^T)^T`` and 1.44 / 4.90 for the transposed copy; 1.24 / 3.26 at 8 rows against 1.40 /
    4.53); elsewhere the table of ``draftsmith.decode.forward.output_head`` holds (the transposed copy up to 3
    rows, ``(W x^T)^T`` up to 8, packed beyond).
    """
    if dtype == torch.float32:
        if rows <= 1:
            return TRANSPOSED
        packs = onednn_packs(dtype)
        if packs and packs_few_float32_rows():
            return PACKED
        if rows <= 3:
            return TRANSPOSED
        if rows <= 8:
            return WEIGHT_FIRST
        return PACKED if packs else TRANSPOSED
    if dtype == torch.bfloat16 and onednn_packs(dtype):
        return PACKED if rows <= PACKED_VOCAB_ROWS else WEIGHT_FIRST
    return LINEAR


class Projection:
    """``x W^T + b`` with the layout ``choose(dtype, rows)`` picks, prepared once per layout."""

    def __init__(
        self,
        weight: torch.Tensor,  # [out, in]
        bias: torch.Tensor | None = None,  # [out]
        choose: Callable[[torch.dtype, int], Layout] = layer_layout,
        compute_dtype: torch.dtype | None = None,
    ) -> None:
        """``compute_dtype`` (e.g. float32 for a bfloat16 drafter's logits) multiplies a copy of
        the weight in that dtype when the weight's own is narrower, so the output keeps the
        precision its argmax needs (a float64 weight stays float64)."""
        self.weight = weight
        self.bias = bias
        self._choose = choose
        self._compute_dtype = compute_dtype
        self._converted: Projection | None = None
        self._version = None if weight.is_inference() else weight._version
        self._prepared: dict[Layout, object] = {}

    def __call__(self, x: torch.Tensor) -> torch.Tensor:  # [..., in] -> [..., out]
        if self._version is not None and self._version != self.weight._version:
            self._prepared.clear()
            self._converted = None
            self._version = self.weight._version
        rows = x.reshape(-1, x.shape[-1])  # [R, in]
        layout = self._layout(rows.shape[0])
        widened = self._compute_dtype is not None and _narrower(
            self.weight.dtype, self._compute_dtype
        )
        if widened and layout in QUANTIZED:
            out = self._rescored(layout, rows)  # [R, out]
        elif widened:
            out = self._in_compute_dtype()(rows)  # [R, out]
        else:
            out = self._multiply(layout, rows.to(self.weight.dtype))  # [R, out]
        return out.view(*x.shape[:-1], out.shape[-1])

    def _layout(self, rows: int) -> Layout:
        """``choose``'s layout on CPU, unless it is quantized and the kernel cannot take this
        weight (int4 then falls back to int8, int8 to the layer layout); ``F.linear`` elsewhere
        (the tables are CPU measurements, and oneDNN's packed weight and the quantized kernels
        are CPU code: on a GPU ``F.linear`` is cuBLAS's product)."""
        if self.weight.device.type != "cpu":
            return LINEAR
        layout = self._choose(self.weight.dtype, rows)
        if layout == INT4_WEIGHTS and not _int4_kernel_takes(self.weight):
            layout = INT8_WEIGHTS if int8_weight_kernel() else layer_layout(self.weight.dtype, rows)
        if layout == INT8_WEIGHTS and not _int8_kernel_takes(self.weight):
            return layer_layout(self.weight.dtype, rows)
        return layout

    def _rescored(self, layout: Layout, rows: torch.Tensor) -> torch.Tensor:  # [R, in] -> [R, out]
        """The quantized product in the weight's dtype, with each row's ``RESCORED_OUTPUTS``
        largest outputs recomputed in the compute dtype from the exact weight.

        So the argmax and the order of the top outputs are the compute dtype's whenever the
        exact top outputs lie among the approximate ones (int8 moves a logit by a fraction of
        a percent, int4 by a few); the rest of the row keeps the quantized values. Drafts may
        use any ``q``."""
        approx = self._multiply(layout, rows.to(self.weight.dtype))
        approx = approx.to(self._compute_dtype)  # [R, out]
        exact = self._in_compute_dtype()
        top = approx.topk(min(RESCORED_OUTPUTS, approx.shape[-1]), dim=-1).indices  # [R, k]
        candidates = exact.weight.detach()[top]  # [R, k, in]
        rescored = torch.bmm(candidates, rows.to(self._compute_dtype)[:, :, None])[..., 0]
        if exact.bias is not None:
            rescored = rescored + exact.bias[top]  # [R, k]
        return approx.scatter_(-1, top, rescored)

    def _in_compute_dtype(self) -> Projection:
        if self._converted is None:
            with torch.no_grad():
                weight = self.weight.detach().to(self._compute_dtype)
                bias = None if self.bias is None else self.bias.detach().to(self._compute_dtype)
            self._converted = Projection(weight, bias, self._choose)
        return self._converted

    def _multiply(self, layout: Layout, rows: torch.Tensor) -> torch.Tensor:  # [R, out]
        weight, bias = self.weight.detach(), self.bias
        if layout == PACKED:
            packed = self._prepare(PACKED, lambda: _pack(weight))
            return torch.ops.mkldnn._linear_pointwise(rows, packed, bias, "none", [], "")
        if layout == TRANSPOSED:
            transposed = self._prepare(TRANSPOSED, lambda: weight.t().contiguous())  # [in, out]
            return rows @ transposed if bias is None else torch.addmm(bias, rows, transposed)
        if layout == INT8_WEIGHTS:
            int8, scales = self._prepare(INT8_WEIGHTS, lambda: _int8_copy(weight))
            out = torch._weight_int8pack_mm(rows.contiguous(), int8, scales)
            return out if bias is None else out + bias
        if layout == INT4_WEIGHTS:
            packed, scales_and_zeros = self._prepare(INT4_WEIGHTS, lambda: _int4_copy(weight))
            out = torch.ops.aten._weight_int4pack_mm_for_cpu(
                rows.contiguous(), packed, INT4_GROUP_SIZE, scales_and_zeros
            )
            return out if bias is None else out + bias
        if layout == WEIGHT_FIRST:
            out = (weight @ rows.T).T
            return out if bias is None else out + bias
        return F.linear(rows, weight, bias)

    def _prepare(self, layout: Layout, build: Callable[[], object]) -> object:
        if layout not in self._prepared:
            with torch.no_grad():
                self._prepared[layout] = build()
        return self._prepared[layout]


def fused_projection(
    linears: tuple[torch.nn.Linear, ...],
    choose: Callable[[torch.dtype, int], Layout] = layer_layout,
) -> Projection:
    """The linears' outputs side by side (q/k/v, gate/up): one product of their stacked
    weights, a copy that no later update of the modules reaches (callers rebuild on change),
    in the layouts ``choose`` picks (``draft_layer_layout`` for a drafter's layers)."""
    weight = torch.cat([m.weight.detach() for m in linears])  # [sum out, in]
    if all(m.bias is None for m in linears):
        return Projection(weight, None, choose)
    bias = torch.cat(
        [
            m.bias.detach() if m.bias is not None else m.weight.new_zeros(m.out_features)
            for m in linears
        ]
    )
    return Projection(weight, bias, choose)


@functools.cache
def onednn_packs(dtype: torch.dtype) -> bool:
    """oneDNN's prepacked inner product is built into this torch and serves ``dtype``.

    A property of the torch build and the CPU, asked before every product: answered once."""
    if not (
        torch.backends.mkldnn.is_available()
        and hasattr(torch.ops.mkldnn, "_reorder_linear_weight")
        and hasattr(torch.ops.mkldnn, "_linear_pointwise")
    ):
        return False
    if dtype == torch.float32:
        return True
    if dtype == torch.bfloat16:
        return bool(torch.ops.mkldnn._is_mkldnn_bf16_supported())
    return False


def quantize_int8(
    weight: torch.Tensor,  # [out, in]
) -> tuple[torch.Tensor, torch.Tensor]:  # int8 [out, in], scales [out] float32
    """Symmetric weight-only int8 with one scale per output row: ``W ~ s[:, None] * W8``,
    ``s = max_j |W_ij| / 127`` (an all-zero row gets a scale that keeps it zero)."""
    weight = weight.detach().float()
    scales = weight.abs().amax(dim=1).clamp_min(torch.finfo(torch.float32).tiny) / 127.0
    int8 = torch.round(weight / scales[:, None]).clamp(-127, 127).to(torch.int8)
    return int8, scales


@functools.cache
def int8_weight_kernel() -> bool:
    """ATen's weight-only int8 product (``_weight_int8pack_mm``) is in this torch and runs.

    A property of the build, asked before every drafter product: answered once, by trying it."""
    kernel = getattr(torch, "_weight_int8pack_mm", None)
    if kernel is None:
        return False
    try:
        rows = torch.ones(1, 64, dtype=torch.bfloat16)
        out = kernel(rows, torch.ones(16, 64, dtype=torch.int8), torch.ones(16, dtype=rows.dtype))
    except RuntimeError:
        return False
    return bool(out.shape == (1, 16) and (out == 64).all())


def quantize_int4(
    weight: torch.Tensor,  # [out, in], in a multiple of group
    group: int = INT4_GROUP_SIZE,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:  # levels, scales, lows
    """Asymmetric weight-only int4 over groups of ``group`` inputs of one output row:
    ``W[i, j] ~ low[i, g] + s[i, g] * L[i, j]`` with ``L`` in 0..15, ``g = j // group``,
    ``low`` the group's minimum and ``s = (max - min) / 15`` (a constant group gets a scale that
    keeps it exact). Returns levels int32 [out, in], scales and lows float32 [out, in / group].
    Round-to-nearest, the layout of GPTQ's and AWQ's groups (Frantar et al. 2023; Lin et al.
    2024) without their calibration."""
    out_features, in_features = weight.shape
    grouped = weight.detach().float().reshape(out_features, in_features // group, group)
    low = grouped.amin(-1)  # [out, G]
    scales = ((grouped.amax(-1) - low) / 15.0).clamp_min(torch.finfo(torch.float32).tiny)
    levels = torch.round((grouped - low[..., None]) / scales[..., None]).clamp(0, 15)
    return levels.to(torch.int32).reshape(out_features, in_features), scales, low


@functools.cache
def int4_weight_kernel() -> bool:
    """ATen's weight-only int4 product for CPU (``_weight_int4pack_mm_for_cpu``) is in this
    torch and computes ``quantize_int4``'s weights: answered once, by trying it."""
    ops = torch.ops.aten
    if not (
        hasattr(ops, "_weight_int4pack_mm_for_cpu")
        and hasattr(ops, "_convert_weight_to_int4pack_for_cpu")
    ):
        return False
    weight = torch.arange(16 * 64, dtype=torch.float32).reshape(16, 64).remainder(16)  # exact
    try:
        packed, scales_and_zeros = _int4_copy(weight.bfloat16())
        out = ops._weight_int4pack_mm_for_cpu(
            torch.ones(1, 64, dtype=torch.bfloat16), packed, INT4_GROUP_SIZE, scales_and_zeros
        )
    except RuntimeError:
        return False
    return bool(out.shape == (1, 16) and torch.allclose(out.float(), weight.sum(1)[None]))


@functools.cache
def packs_few_float32_rows() -> bool:
    """Whether oneDNN's packed float32 product beats MKL's layouts from 2 rows on: measured on
    CPUs with AMX tiles (``vocab_layout``) and on the AVX2-only AMD EPYC, which is what this
    detects (AMX, or no AVX512). There, 2 threads, weights evicted between calls, median
    microseconds of MKL's transposed copy against the packed weight:

    | weight [out, in] | 1 row | 2 rows | 4 rows | 8 rows | 16 rows |
    |---|---|---|---|---|---|
    | q/k/v 1536 x 512 | 189 / 336 | 393 / 324 | 610 / 384 | 557 / 380 | 771 / 602 |
    | gate-up 2816 x 512 | 313 / 399 | 524 / 433 | 1116 / 496 | 1379 / 546 | 1014 / 680 |
    | down 512 x 1408 | 249 / 323 | 466 / 338 | 535 / 398 | 365 / 321 | 414 / 387 |
    | vocabulary 8192 x 512 | 538 / 765 | 1164 / 821 | 3846 / 976 | 3143 / 1133 | 3409 / 1613 |

    MKL ran its small products on one of the two cores (1.00 cores busy at 1-4 rows, warm),
    oneDNN on both. The CPUs with AVX512 and no AMX keep the ``vocab_layout`` table."""
    is_amx = getattr(torch.cpu, "_is_amx_tile_supported", None)
    if is_amx is not None and is_amx():
        return True
    return torch.backends.cpu.get_cpu_capability() == "AVX2"


def _int8_copy(weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``quantize_int8`` with the scales in the weight's dtype, as the kernel takes them."""
    int8, scales = quantize_int8(weight)
    return int8, scales.to(weight.dtype)


def _int4_copy(weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``quantize_int4`` in the kernel's layout: levels packed two to a byte, and per group the
    scale and ``low + 8 * scale`` (the kernel computes ``(L - 8) * s + zero``) as
    [in / group, out, 2] in the weight's dtype."""
    levels, scales, low = quantize_int4(weight)
    packed = torch.ops.aten._convert_weight_to_int4pack_for_cpu(levels, 2)
    zeros = low + 8.0 * scales
    scales_and_zeros = torch.stack((scales, zeros), dim=-1).transpose(0, 1).contiguous()
    return packed, scales_and_zeros.to(weight.dtype)


def _int4_kernel_takes(weight: torch.Tensor) -> bool:  # [out, in] on CPU
    """The int4 kernel's limits: outputs in blocks of 16, inputs in whole groups."""
    return (
        weight.shape[0] % INT4_KERNEL_OUTPUT_MULTIPLE == 0
        and weight.shape[1] % INT4_GROUP_SIZE == 0
    )


def _int8_kernel_takes(weight: torch.Tensor) -> bool:  # [out, in] on CPU
    """The int8 kernel's limit: an input width that is a multiple of 16."""
    return weight.shape[1] % INT8_KERNEL_WIDTH_MULTIPLE == 0


def _narrower(dtype: torch.dtype, than: torch.dtype) -> bool:
    return dtype.is_floating_point and torch.finfo(dtype).bits < torch.finfo(than).bits


def _pack(weight: torch.Tensor) -> torch.Tensor:  # [out, in] -> oneDNN's blocked layout
    return torch.ops.mkldnn._reorder_linear_weight(weight, 16)
