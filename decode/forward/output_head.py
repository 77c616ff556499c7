"""The last projection of a causal LM (hidden state -> logits), run with a faster CPU layout.

On CPU a small model's output projection dominates a decoding step: the vocabulary matrix
([V, H], 8 MB for V = 8192, H = 256 in float32) no longer sits in cache after the layers ran,
so the product is bound by memory, and ``F.linear`` (``h @ W^T`` with ``W`` read transposed)
is the BLAS's slowest layout for the few rows a decoding step has. Measured on 2 CPU cores
with the matrix evicted from cache (median microseconds):

| rows | ``F.linear`` | ``h @ Wt`` (contiguous [H, V] copy) | ``(W @ h^T)^T`` |
|---|---|---|---|
| 1 | 1,700 | 700 | 1,500 |
| 5 | 4,000 | 3,900 | 1,800-2,000 |
| 13 | 5,200 | 4,300 | 4,600-5,400 |

With another model's pass in between (a 20 MB read, as in a speculative round), later
measurements of the three layouts and of oneDNN's prepacked inner product (median microseconds):

| rows | ``h @ Wt`` | ``(W @ h^T)^T`` | oneDNN, packed for 16 rows |
|---|---|---|---|
| 1 / 2 / 3 | 455 / 787 / 1,400 | 1,711 / 1,168 / 1,273 | 1,556 / 1,457 / 1,595 |
| 5 / 8 | 4,046 / 4,189 | 1,379 / 2,503 | 1,693 / 1,880 |
| 11 / 13 / 17 | 5,107 / 4,144 / 4,334 | 3,671 / 5,376 / 5,045 | 2,887 / 2,675 / 2,368 |
| 64 / 128 | 9,613 / 15,755 | 7,462 / 13,765 | 5,551 / 8,952 |

So in float32 up to 3 rows use the transposed copy, 4-8 rows multiply ``W`` by ``h^T``, and
more rows (long chains, trees, prefills) use the packed weight. On CPUs with AMX tiles the
packed weight wins from 2 rows on and one row keeps the transposed copy; bfloat16 has its own
rule (both in ``draftsmith.decode.forward.projection.vocab_layout``, measured there). The model itself is untouched: its
decoder runs (through ``get_decoder()`` or ``LeanDecoder``) and only the final matrix product
is done here, for architectures whose logits are exactly ``lm_head(h)`` (no soft-capping or
scaling).
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from draftsmith.decode.forward.projection import Layout, Projection, vocab_layout

# The Llama family this package runs by hand: logits are exactly
# ``lm_head(decoder(x).last_hidden_state)`` (no soft-capping or scaling), and the decoder
# layers are the plain Llama block (optionally with q/k/v biases, per-head q/k norms for Qwen3,
# and grouped key/value heads), which ``draftsmith.decode.forward.lean_decoder`` reproduces. The one definition:
# this module is a leaf, so the lean decoder imports it from here.
LLAMA_FAMILY_MODEL_TYPES = frozenset({"llama", "mistral", "qwen2", "qwen3"})

# Drafters compute their logits in at least float32: in bfloat16 (8 significant bits) a draft's
# top two logits often round to one value and argmax then proposes the lower token id rather
# than the drafter's real first choice (docs/theory.md §7). A bfloat16 drafter's logits over a
# few rows may come from int4 or int8 weights with their largest few recomputed in float32
# (``draft_vocab_layout``, ``Projection._rescored``): the argmax stays the float32 one. The
# target's logits stay in its own dtype: they are the distribution the output follows.
DRAFT_LOGITS_DTYPE: torch.dtype | None = torch.float32


class OutputHead(Projection):
    """``h @ W^T`` in the fastest layout for the dtype and row count (``vocab_layout``, or a
    drafter's ``draft_vocab_layout``)."""

    def __init__(
        self,
        weight: torch.Tensor,  # [V, H]
        logits_dtype: torch.dtype | None = None,
        choose: Callable[[torch.dtype, int], Layout] = vocab_layout,
    ) -> None:
        super().__init__(weight, None, choose, logits_dtype)

    @classmethod
    def for_model(
        cls,
        model: torch.nn.Module,
        logits_dtype: torch.dtype | None = None,
        choose: Callable[[torch.dtype, int], Layout] = vocab_layout,
    ) -> OutputHead | None:
        """The head of ``model`` when it runs on CPU with a plain linear output, else ``None``."""
        head = model.get_output_embeddings()
        config = getattr(model, "config", None)
        if (
            getattr(config, "model_type", None) not in LLAMA_FAMILY_MODEL_TYPES
            or type(head) is not torch.nn.Linear
            or head.bias is not None
            or head.weight.device.type != "cpu"
        ):
            return None
        return cls(head.weight, logits_dtype, choose)
