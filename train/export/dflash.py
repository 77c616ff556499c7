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
  the two layer norms), ``norm``, ``lm_head``, ``d2t`` (vLLM's ``draft_id_to_target_id``) and
  ``t2d`` (which vLLM skips; it keeps the folder's target vocabulary readable); no
  ``embed_tokens``: vLLM then shares the target's embedding, as the head was trained with
  it, and the mask token is its ``embed_tokens`` row.

The ``speculators`` layout (speculators 0.9's ``DFlashSpeculatorConfig``, which vLLM 0.32
converts in ``transformers_utils/configs/speculators/algos.py::update_dflash``) holds the same
weights under a config of ``speculators_model_type: dflash``: the Qwen3 layer config as
``transformer_layer_config``, ``aux_hidden_state_layer_ids`` (our indices; vLLM derives both of
its own from them), ``mask_token_id``, ``block_size``, ``sample_from_anchor: false`` (the anchor
row drafts nothing: B - 1 tokens a block), ``sliding_window_non_causal: true`` (vLLM writes
``dflash_config.causal`` as its negation) and ``speculators_config`` naming the verifier, with
``speculative_tokens`` = B - 1, the block the head was trained to fill.

DSpark's Markov and confidence heads have no place in either layout, so a head with either is
refused by name. vLLM 0.32 reads DSpark checkpoints (``qwen3_dspark``) only on its GPU model
runner (``v1/worker/gpu/spec_decode/dspark``), with DeepSpec's conventions: every block row
drafts (``sample_from_anchor``, ``num_speculative_tokens == block_size``) and the Markov bias
``markov_w2(markov_w1[x_prev])`` does not read the row's state; our DSpark heads follow the
DFlash row convention and a state-gated bias (docs/theory.md §9), so that layout is not written.
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path
from typing import Any

import torch
from draftsmith.decode.drafters.dflash.head import (
    DFLASH_ARCHITECTURE,
    SPECULATORS_DFLASH_ARCHITECTURE,
    DFlashHead,
)
from draftsmith.train.export.formats import _llama_layer_config, _write_folder, launch_block

DFLASH_FORMATS = ("vllm", "speculators")


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


def dflash_speculators_config(
    head: DFlashHead,
    dtype: torch.dtype,
    verifier: str,
    verifier_architectures: Sequence[str] = ("LlamaForCausalLM",),
) -> dict[str, Any]:
    """The ``config.json`` of a ``speculators`` DFlash folder (module docstring)."""
    if not verifier:
        raise ValueError(
            "the speculators format names its verifier: pass the target's path or hub id"
        )
    config = head.config
    return {
        "architectures": [SPECULATORS_DFLASH_ARCHITECTURE],
        "speculators_model_type": "dflash",
        "transformer_layer_config": {**_llama_layer_config(config, dtype), "model_type": "qwen3"},
        "draft_vocab_size": config.draft_vocab_size,
        "block_size": config.block_size,
        "target_hidden_size": config.hidden_size,
        "target_num_hidden_layers": config.target_num_hidden_layers,  # ours; vLLM ignores it
        "aux_hidden_state_layer_ids": list(config.aux_hidden_state_layer_ids),
        "mask_token_id": config.mask_token_id,
        "sample_from_anchor": False,
        "sliding_window_non_causal": True,
        "projector_type": "dflash",
        "shift_label": False,
        "speculators_config": {
            "algorithm": "dflash",
            "proposal_methods": [
                {
                    "proposal_type": "greedy",
                    "speculative_tokens": config.draft_tokens,
                    "verifier_accept_k": 1,
                    "accept_tolerance": 0.0,
                }
            ],
            "default_proposal_method": "greedy",
            "verifier": {"name_or_path": verifier, "architectures": list(verifier_architectures)},
        },
        "torch_dtype": str(dtype).removeprefix("torch."),
    }


def export_dflash(
    head: DFlashHead,
    out_dir: str | Path,
    fmt: str = "vllm",
    *,
    dtype: torch.dtype | None = None,
    overwrite: bool = False,
    verifier: str = "",
    verifier_architectures: Sequence[str] = ("LlamaForCausalLM",),
) -> Path:
    """Write ``head`` in the ``fmt`` layout (``vllm`` or ``speculators``, which names
    ``verifier``); returns the folder."""
    if fmt not in DFLASH_FORMATS:
        raise ValueError(
            f"a dflash drafter exports as {', '.join(DFLASH_FORMATS)}, not {fmt!r}: SGLang has "
            "no DFlash layout this code writes"
        )
    config = head.config
    if config.markov_rank or config.confidence_head:
        raise ValueError(
            "vLLM's and speculators' DFlash layouts have no DSpark Markov or confidence head "
            "(vLLM's qwen3_dspark runs on its GPU runner only, with other conventions: "
            "train/export/dflash.py): export a plain DFlash head (markov_rank 0, "
            "confidence_head false) or serve this one with draftsmith-serve"
        )
    if any(i < 1 for i in config.aux_hidden_state_layer_ids):
        raise ValueError(
            f"aux_hidden_state_layer_ids {list(config.aux_hidden_state_layer_ids)} include the "
            "embeddings (index 0), which DFlash's target_layer_ids cannot name: train with ids >= 1"
        )
    dtype = dtype or head.fc.weight.dtype
    tensors = {  # t2d too: vLLM skips it, and it carries the target's vocabulary size
        name: tensor.to(dtype) if tensor.is_floating_point() else tensor
        for name, tensor in head.state_dict().items()
    }
    if fmt == "speculators":
        config = dflash_speculators_config(head, dtype, verifier, verifier_architectures)
    else:
        config = dflash_vllm_config(head, dtype)
    return _write_folder(Path(out_dir), config, tensors, overwrite, dflash_card(head, fmt))


def dflash_card(head: DFlashHead, fmt: str) -> str:
    """The folder's README: what was trained and how vLLM serves it."""
    c = head.config
    ids = list(c.aux_hidden_state_layer_ids)
    layout = "vLLM qwen3_dflash" if fmt == "vllm" else "speculators dflash"
    return "\n".join(
        [
            f"# DFlash block drafter ({layout} layout)",
            "",
            f"- {c.num_hidden_layers} layer(s) of width {c.hidden_size}, block of {c.block_size} "
            f"rows ({c.draft_tokens} drafted tokens per pass), mask token {c.mask_token_id}.",
            f"- Reads the target's hidden states {ids} (vLLM's "
            "eagle_aux_hidden_state_layer_ids; its dflash_config.target_layer_ids are "
            f"{[i - 1 for i in ids]}).",
            f"- Output head over {c.draft_vocab_size} of {c.target_vocab_size} tokens; the "
            "input embedding (and the mask token's row) is the target's.",
            f"- Plain rope, theta {c.rope_theta}, written explicitly (vLLM's DFlash layers "
            "default a missing theta to 1e6).",
            "",
            *launch_block("dflash", fmt, c.draft_tokens),
            "",
            "draftsmith-check-engine runs this folder in vLLM beside draftsmith's decoder "
            "(outputs and acceptance per position).",
            "",
        ]
    )
