"""How a causal LM's decoder attends, as far as the speculative decoder needs to know it.

Which attention each layer runs and the boolean mask each kind gets (``AttentionLayout``);
the models whose positions a cache with holes or a draft tree cannot reproduce (ALiBi over a
2-D padding mask or over cache slots: ``tree_verification_problem``, ``single_row_problem``);
and the end of a learned table of absolute positions (``learned_position_limit``).

Sliding-window layers (Mistral, Qwen2/Qwen3 with ``use_sliding_window``, Gemma2/Gemma3's local
layers) are windowed by *token position*, not by cache slot: a query at position ``p`` sees the
valid keys at positions ``p - W < p' <= p``, the window Hugging Face applies to a sequence
without holes. Counting slots instead would let a row's holes (``draftsmith.decode.forward.cached_sequence``) eat
its window. Every layer keeps all its slots (nothing is truncated, so a rollback works at any
length) and the model gets one 4-D mask per layer kind built from positions; full-attention
models keep the plain 2-D mask and pay nothing for this.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from transformers.cache_utils import get_layer_types_and_kwargs

# Hugging Face's names of the two attention kinds the decoder serves (``config.layer_types``).
FULL_ATTENTION = "full_attention"
SLIDING_ATTENTION = "sliding_attention"


def tree_verification_problem(model: torch.nn.Module) -> str | None:
    """Why ``model``'s forward cannot score a draft tree exactly, or ``None`` if it can.

    A tree's nodes sit side by side in the cache but at their depths' positions, so the
    forward must take explicit positions and a tree-shaped 4-D mask. ALiBi models derive their
    position biases otherwise: BLOOM and Falcon with ``alibi`` from a 2-D padding mask (their
    forward refuses a 4-D one), MPT from the slot order (``single_row_problem``). Chains are
    exact on all of them."""
    if _alibi(model) is None:
        return None
    return (
        f"{type(model).__name__} places tokens with ALiBi biases, which follow cache slots or "
        "a 2-D padding mask, not a draft tree's node depths: draft chains on it (drop the "
        "tree settings)"
    )


def single_row_problem(model: torch.nn.Module) -> str | None:
    """Why ``model`` must decode one row at a time, or ``None``.

    MPT's ALiBi biases a key by its cache slot, whatever the attention mask says. The rows of
    a batch accept different numbers of drafts, so rejected slots stay behind as masked holes
    (and rows that join a running batch bring their own front padding); a hole shifts every
    later key's bias, where Hugging Face's own forward, which never leaves one, does not.
    (BLOOM and Falcon count positions from the 2-D mask, holes excluded: exact.)"""
    if _alibi(model) != "slots":
        return None
    return (
        f"{type(model).__name__} biases attention by cache slot (ALiBi over slot order), which "
        "the holes a batch leaves behind would shift: decode one row at a time (batch size 1)"
    )


def learned_position_limit(model: torch.nn.Module) -> int | None:
    """The positions a model with a learned table of absolute positions can embed (GPT-2's
    ``n_positions``, OPT's and GPT-BigCode's ``max_position_embeddings``), or ``None`` for
    relative schemes (rope, ALiBi), which have no hard end. Past the table its forward fails
    with an index error deep inside torch, as Hugging Face's ``generate`` does."""
    config = model.config.get_text_config(decoder=True)
    size = getattr(config, "max_position_embeddings", None)
    if isinstance(size, bool) or not isinstance(size, int):
        return None
    tokens = model.get_input_embeddings()
    # OPT's table holds two offset rows in front of its max_position_embeddings.
    tables = (
        module
        for module in model.modules()
        if isinstance(module, torch.nn.Embedding) and module is not tokens
    )
    return size if any(table.num_embeddings in (size, size + 2) for table in tables) else None


def _alibi(model: torch.nn.Module) -> str | None:
    """How the model's ALiBi biases count positions: "mask" (BLOOM, Falcon with ``alibi``),
    "slots" (MPT), or ``None`` for a model without ALiBi."""
    config = model.config.get_text_config(decoder=True)
    if getattr(getattr(config, "attn_config", None), "alibi", False) is True:
        return "slots"
    if config.model_type == "bloom" or getattr(config, "alibi", False) is True:
        return "mask"
    return None


@dataclass(frozen=True)
class AttentionLayout:
    """Which attention each decoder layer runs, as the model's config defines it.

    ``layer_types[i]`` is layer ``i``'s kind (``"full_attention"`` or ``"sliding_attention"``,
    Hugging Face's names, inferred from ``sliding_window`` for configs without
    ``layer_types``) and ``windows[kind]`` its window ``W`` (None: full causal attention).
    """

    layer_types: tuple[str, ...]
    windows: dict[str, int | None]

    @classmethod
    def for_model(cls, model: torch.nn.Module) -> AttentionLayout:
        """Read the layout the model's ``DynamicCache`` would be built from; raise
        ``ValueError`` for layer kinds this cache cannot serve exactly."""
        config = model.config.get_text_config(decoder=True)
        kinds, per_layer = get_layer_types_and_kwargs(config)
        windows: dict[str, int | None] = {}
        for kind, kwargs in zip(kinds, per_layer, strict=True):
            if kind not in (FULL_ATTENTION, SLIDING_ATTENTION):
                raise ValueError(
                    f"{type(model).__name__} has {kind!r} layers; the speculative decoder's cache "
                    "serves full and sliding-window attention only"
                )
            window = kwargs.get("sliding_window") if kind == SLIDING_ATTENTION else None
            if windows.setdefault(kind, window) != window:
                raise ValueError(
                    f"{type(model).__name__} has {kind!r} layers with different windows "
                    f"({windows[kind]} and {window}); one window per layer kind is supported"
                )
        return cls(tuple(kinds), windows)

    @property
    def sliding(self) -> bool:
        """Whether some layer attends through a window."""
        return any(window is not None for window in self.windows.values())

    def masks(
        self,
        allowed: torch.Tensor,  # [B, 1, W, S + W] bool: causal (or tree) and valid
        key_positions: torch.Tensor,  # [B, S + W] every slot's token position
        query_positions: torch.Tensor,  # [B, W]
    ) -> torch.Tensor | dict[str, torch.Tensor]:  # [B, 1, W, S + W] bool, or one per kind
        """The boolean mask of each layer kind; a bare tensor when all layers share a kind.

        A window keeps the keys with ``query_position - key_position < W``. Every query also
        sees its own slot, so a padding or hole query never attends to nothing (a fully
        masked row gives NaN, which a zero attention weight later would still spread).
        Hugging Face's models take either form: a 4-D tensor is used as given, and the models
        with mixed layer kinds accept a dict keyed by kind.
        """
        width, total = allowed.shape[-2], allowed.shape[-1]
        own_slot = torch.eye(width, dtype=torch.bool, device=allowed.device)  # [W, W]
        own_slot = torch.nn.functional.pad(own_slot, (total - width, 0))  # [W, S + W]
        allowed = allowed | own_slot
        distance = query_positions[:, None, :, None] - key_positions[:, None, None, :]
        masks = {
            kind: allowed if window is None else allowed & ((distance < window) | own_slot)
            for kind, window in self.windows.items()
        }
        return next(iter(masks.values())) if len(masks) == 1 else masks
