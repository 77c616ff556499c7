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

So one row uses the transposed copy, 2-8 rows multiply ``W`` by ``h^T``, and more rows use the
copy again. The model itself is untouched: its decoder runs through the public API
(``get_decoder()``) and only the final matrix product is done here, for architectures whose
logits are exactly ``lm_head(h)`` (no soft-capping or scaling).
"""

from __future__ import annotations

import torch

# Model types whose logits are exactly ``lm_head(decoder(x).last_hidden_state)``.
PLAIN_HEAD_MODEL_TYPES = frozenset({"llama", "mistral", "qwen2", "qwen3"})


class OutputHead:
    """``h @ W^T`` with a transposed copy of ``W``, refreshed if the weight changes in place."""

    def __init__(self, weight: torch.Tensor) -> None:  # [V, H]
        self.weight = weight
        self._version = -1
        self._transposed = weight  # replaced on first use

    @classmethod
    def for_model(cls, model: torch.nn.Module) -> OutputHead | None:
        """The head of ``model`` when it runs on CPU with a plain linear output, else ``None``."""
        head = model.get_output_embeddings()
        config = getattr(model, "config", None)
        if (
            getattr(config, "model_type", None) not in PLAIN_HEAD_MODEL_TYPES
            or type(head) is not torch.nn.Linear
            or head.bias is not None
            or head.weight.device.type != "cpu"
        ):
            return None
        return cls(head.weight)

    def __call__(self, hidden: torch.Tensor) -> torch.Tensor:  # [B, T, H] -> [B, T, V]
        if self._version != self.weight._version:
            self._transposed = self.weight.detach().t().contiguous()  # [H, V]
            self._version = self.weight._version
        rows = hidden.reshape(-1, hidden.shape[-1]).to(self._transposed.dtype)  # [R, H]
        if 2 <= rows.shape[0] <= 8:
            logits = (self.weight.detach() @ rows.T).T  # [R, V]
        else:
            logits = rows @ self._transposed  # [R, V]
        return logits.reshape(*hidden.shape[:-1], logits.shape[-1])
