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

So up to 3 rows use the transposed copy, 4-8 rows multiply ``W`` by ``h^T``, and more rows (long
chains, trees, prefills) use the packed weight where oneDNN serves the dtype (float32), the
copy otherwise. The model itself is untouched: its decoder runs (through ``get_decoder()`` or
``LeanDecoder``) and only the final matrix product is done here, for architectures whose logits
are exactly ``lm_head(h)`` (no soft-capping or scaling).
"""

from __future__ import annotations

import torch

# The Llama family this package runs by hand: logits are exactly
# ``lm_head(decoder(x).last_hidden_state)`` (no soft-capping or scaling), and the decoder
# layers are the plain Llama block (optionally with q/k/v biases, per-head q/k norms for Qwen3,
# and grouped key/value heads), which ``decode.lean_decoder`` reproduces. The one definition:
# this module is a leaf, so the lean decoder imports it from here.
LLAMA_FAMILY_MODEL_TYPES = frozenset({"llama", "mistral", "qwen2", "qwen3"})


class OutputHead:
    """``h @ W^T`` in the fastest layout for the row count; copies follow in-place updates."""

    def __init__(self, weight: torch.Tensor) -> None:  # [V, H]
        self.weight = weight
        self._version = -1
        self._transposed = weight  # [H, V], replaced on first use
        self._packed: torch.Tensor | None = None  # oneDNN layout, built on first long call

    @classmethod
    def for_model(cls, model: torch.nn.Module) -> OutputHead | None:
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
        return cls(head.weight)

    def __call__(self, hidden: torch.Tensor) -> torch.Tensor:  # [B, T, H] -> [B, T, V]
        if self._version != self.weight._version:
            self._transposed = self.weight.detach().t().contiguous()  # [H, V]
            self._packed = None
            self._version = self.weight._version
        rows = hidden.reshape(-1, hidden.shape[-1]).to(self._transposed.dtype)  # [R, H]
        if rows.shape[0] <= 3:
            logits = rows @ self._transposed  # [R, V]
        elif rows.shape[0] <= 8:
            logits = (self.weight.detach() @ rows.T).T  # [R, V]
        elif _onednn_serves(self.weight):
            if self._packed is None:
                self._packed = torch.ops.mkldnn._reorder_linear_weight(self.weight.detach(), 16)
            logits = torch.ops.mkldnn._linear_pointwise(rows, self._packed, None, "none", [], "")
        else:
            logits = rows @ self._transposed  # [R, V]
        return logits.reshape(*hidden.shape[:-1], logits.shape[-1])


def _onednn_serves(weight: torch.Tensor) -> bool:
    """oneDNN's prepacked float32 inner product is built into this torch and usable here."""
    return (
        weight.dtype == torch.float32
        and torch.backends.mkldnn.is_available()
        and hasattr(torch.ops.mkldnn, "_reorder_linear_weight")
    )
