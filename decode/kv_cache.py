"""A causal LM's KV cache over a batch whose rows advance by different amounts.

Speculative rounds accept a different number of tokens in each row. Rather than moving cache
memory per row, rejected slots stay in the cache as *holes*: the attention mask marks them
invalid and positions are counted over valid slots only, so each row sees exactly its own
committed sequence. Slots past the longest kept row are cropped off for real, so the cache
never grows by more than what some row accepted.

With ``transformers`` 5.x, ``DynamicCache.crop`` takes a negative count of tokens to drop, and
the forward argument is ``cache`` (``past_key_values`` is deprecated).
"""

from __future__ import annotations

import torch
from transformers import DynamicCache
from transformers.modeling_outputs import CausalLMOutputWithPast


class CachedSequence:
    """Incremental forward passes of one model over a batch, with a rollback."""

    def __init__(self, model: torch.nn.Module, batch_size: int, device: torch.device) -> None:
        self.model = model
        self.cache = DynamicCache(config=model.config)
        self.valid = torch.zeros(batch_size, 0, dtype=torch.bool, device=device)  # [B, S]
        self.lengths = torch.zeros(batch_size, dtype=torch.long, device=device)  # [B]

    @property
    def num_slots(self) -> int:
        """Cache slots held, holes included."""
        return self.valid.shape[1]

    def extend(
        self,
        tokens: torch.Tensor,  # [B, W]
        valid: torch.Tensor | None = None,  # [B, W] bool; None means all valid
        *,
        tree_mask: torch.Tensor | None = None,  # [W, W] or [B, W, W] bool: i sees j
        positions: torch.Tensor | None = None,  # [B, W] explicit positions (trees)
        logits_to_keep: int = 0,
        output_hidden_states: bool = False,
    ) -> CausalLMOutputWithPast:
        """Run the model on ``tokens`` appended after the cache and keep their keys/values."""
        batch, width = tokens.shape
        if valid is None:
            valid = torch.ones(batch, width, dtype=torch.bool, device=tokens.device)
        if positions is None:
            positions = self.lengths[:, None] + valid.long().cumsum(-1) - 1
            positions = positions.clamp(min=0)
        full_valid = torch.cat([self.valid, valid], dim=1)  # [B, S + W]
        if tree_mask is None:
            attention_mask = full_valid.long()
        else:
            attention_mask = _four_d_mask(self.valid, valid, tree_mask)
        output = self.model(
            input_ids=tokens,
            attention_mask=attention_mask,
            position_ids=positions,
            cache=self.cache,
            use_cache=True,
            logits_to_keep=logits_to_keep,
            output_hidden_states=output_hidden_states,
        )
        self.valid = full_valid
        self.lengths = self.lengths + valid.sum(-1)
        return output

    def rollback(
        self,
        num_recent: int,
        keep: torch.Tensor,  # [B] how many of the last num_recent slots each row keeps
    ) -> None:
        """Keep, per row, only the first ``keep[b]`` of the last ``num_recent`` slots.

        The recent slots must all have been valid. Dropped slots become holes; slots past the
        largest ``keep`` are removed from the cache.
        """
        if num_recent == 0:
            return
        start = self.num_slots - num_recent
        max_keep = int(keep.max())
        drop = num_recent - max_keep
        if drop > 0:
            self.cache.crop(-drop)
        recent = torch.arange(max_keep, device=keep.device)[None, :] < keep[:, None]  # [B, k]
        self.valid = torch.cat([self.valid[:, :start], recent], dim=1)
        self.lengths = self.lengths - (num_recent - keep)

    def keep_path(
        self,
        num_recent: int,
        path: torch.Tensor,  # [B, P] slot offsets (within the recent block) to keep, in order
        path_valid: torch.Tensor,  # [B, P] bool
    ) -> None:
        """Keep, per row, the recent slots listed in ``path`` (a tree's accepted branch).

        The kept slots are moved to the front of the recent block in path order; the rest of
        the block is removed. Used after tree verification, where the accepted nodes are not a
        prefix of the flattened tree.
        """
        start = self.num_slots - num_recent
        index = (start + path.clamp(min=0)).to(torch.long)  # [B, P]
        for layer in self.cache.layers:
            for name in ("keys", "values"):
                tensor = getattr(layer, name)  # [B, heads, S, d]
                gathered = tensor.gather(
                    2, index[:, None, :, None].expand(-1, tensor.shape[1], -1, tensor.shape[3])
                )
                setattr(layer, name, torch.cat([tensor[:, :, :start], gathered], dim=2))
        self.valid = torch.cat([self.valid[:, :start], path_valid], dim=1)
        self.lengths = self.lengths - num_recent + path_valid.sum(-1)


def _four_d_mask(
    cached_valid: torch.Tensor,  # [B, S]
    new_valid: torch.Tensor,  # [B, W]
    tree_mask: torch.Tensor,  # [W, W] or [B, W, W] bool
) -> torch.Tensor:  # [B, 1, W, S + W] bool, True where attention is allowed
    batch, width = new_valid.shape
    past = cached_valid[:, None, None, :].expand(batch, 1, width, cached_valid.shape[1])
    tree_mask = tree_mask.expand(batch, width, width)[:, None]
    new = tree_mask & new_valid[:, None, None, :]
    return torch.cat([past, new], dim=-1)
