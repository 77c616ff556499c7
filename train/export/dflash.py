"""Write a DFlash block drafter in the folder layout vLLM's ``qwen3_dflash`` model reads, and
``DFlashHead.from_pretrained`` reads it back (docs/theory.md §9, docs/guides/block-drafters.md).

The layout, from vLLM's ``vllm/model_executor/models/qwen3_dflash.py`` (0.32):

- ``config.json``: a Qwen3 layer config (``model_type: qwen3``, per-head ``q_norm``/``k_norm``)
  under ``architectures: ["DFlashDraftModel"]`` (z-lab's name), with ``block_size``,
  ``draft_vocab_size``, an explicit ``rope_theta`` (vLLM's DFlash layer defaults a missing one to
  1e6, not the target's), ``eagle_aux_hidden_state_layer_ids`` (the target hidden-state indices
  of ``draftsmith.decode.drafters.eagle.config``'s convention, which vLLM reads first) and
  ``dflash_config: {mask_token_id, target_layer_ids}`` (z-lab's convention: layer outputs, ours
  minus one, which vLLM reads when the first key is absent). The attention is non-causal: no
  ``is_causal``, ``layer_types`` or ``dflash_config.causal`` key says otherwise.
- ``model.safetensors``: ``fc``, ``hidden_norm``, ``layers.{i}.*`` (q/k/v/o, q/k norms, MLP,
  the two layer norms), ``norm``, ``lm_head`` and ``d2t`` (vLLM's ``draft_id_to_target_id``);
  no ``embed_tokens``: vLLM then shares the target's embedding, as the head was trained with
  it, and the mask token is its ``embed_tokens`` row.

DSpark's Markov and confidence heads have no place in this layout (vLLM's ``qwen3_dspark`` is
another model whose layout is not written here), so a head with either is refused by name.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch
from draftsmith.decode.drafters.dflash.head import DFLASH_ARCHITECTURE, DFlashHead
from draftsmith.train.export.formats import _llama_layer_config, _write_folder, launch_block

DFLASH_FORMATS = ("vllm",)


def dflash_vllm_config(head: DFlashHead, dtype: torch.dtype) -> dict[str, Any]:
    """The ``config.json`` of a ``vllm`` DFlash folder (module docstring)."""
    config = head.config
    ids = list(config.aux_hidden_state_layer_ids)
    return {
        "architectures": [DFLASH_ARCHITECTURE],
        **_llama_layer_config(config, dtype),
        "model_type": "qwen3",  # per-head q_norm/k_norm
        "draft_vocab_size": config.draft_vocab_size,
        "block_size": config.block_size,
        "target_hidden_size": config.hidden_size,
        "target_num_hidden_layers": config.target_num_hidden_layers,  # ours; vLLM ignores it
        "eagle_aux_hidden_state_layer_ids": ids,
        "dflash_config": {
            "mask_token_id": config.mask_token_id,
            "target_layer_ids": [i - 1 for i in ids],
            "block_size": config.block_size,
        },
    }


def export_dflash(
    head: DFlashHead,
    out_dir: str | Path,
    fmt: str = "vllm",
    *,
    dtype: torch.dtype | None = None,
    overwrite: bool = False,
) -> Path:
    """Write ``head`` in the ``fmt`` layout (``vllm``); returns the folder."""
    if fmt not in DFLASH_FORMATS:
        raise ValueError(
            f"a dflash drafter exports as {', '.join(DFLASH_FORMATS)}, not {fmt!r}: SGLang and the "
            "speculators format have no DFlash layout this code writes"
        )
    config = head.config
    if config.markov_rank or config.confidence_head:
        raise ValueError(
            "vLLM's qwen3_dflash layout has no DSpark Markov or confidence head: export a plain "
            "DFlash head (markov_rank 0, confidence_head false) or serve this one with "
            "draftsmith-serve"
        )
    if any(i < 1 for i in config.aux_hidden_state_layer_ids):
        raise ValueError(
            f"aux_hidden_state_layer_ids {list(config.aux_hidden_state_layer_ids)} include the "
            "embeddings (index 0), which DFlash's target_layer_ids cannot name: train with ids >= 1"
        )
    dtype = dtype or head.fc.weight.dtype
    tensors = {
        name: tensor.to(dtype) if tensor.is_floating_point() else tensor
        for name, tensor in head.state_dict().items()
        if name != "t2d"
    }
    config = dflash_vllm_config(head, dtype)
    return _write_folder(Path(out_dir), config, tensors, overwrite, dflash_card(head, config))


def dflash_card(head: DFlashHead, config: dict[str, Any]) -> str:
    """The folder's README: what was trained and how vLLM serves it."""
    c = head.config
    return "\n".join(
        [
            "# DFlash block drafter (vLLM qwen3_dflash layout)",
            "",
            f"- {c.num_hidden_layers} layer(s) of width {c.hidden_size}, block of {c.block_size} "
            f"rows ({c.draft_tokens} drafted tokens per pass), mask token {c.mask_token_id}.",
            f"- Reads the target's hidden states {list(c.aux_hidden_state_layer_ids)} "
            "(vLLM's eagle_aux_hidden_state_layer_ids; dflash_config.target_layer_ids are "
            f"{config['dflash_config']['target_layer_ids']}).",
            f"- Output head over {c.draft_vocab_size} of {c.target_vocab_size} tokens; the "
            "input embedding (and the mask token's row) is the target's.",
            f"- Plain rope, theta {c.rope_theta}, written explicitly (vLLM's DFlash layers "
            "default a missing theta to 1e6).",
            "",
            *launch_block("dflash", "vllm", c.draft_tokens),
            "",
            "Not yet checked here against a running vLLM (draftsmith-check-engine does not run "
            "DFlash folders yet): the layout follows vLLM's reader, and tests/train/"
            "test_export_dflash.py checks it field by field.",
            "",
        ]
    )
