"""The shape of an EAGLE-3 head (:class:`Eagle3Config`) and how engine folders state it.

Hidden-state indexing convention (stored as ``aux_hidden_state_layer_ids``): an id ``i`` selects
``output_hidden_states[i]`` of the Hugging Face target, whose tuple holds the embeddings at index
0 and the output of decoder layer ``i - 1`` at index ``i`` (the last entry, index L, is after the
final norm and is never used). This equals vLLM's ``eagle_aux_hidden_state_layer_ids`` (the input
of layer i, 0 being the embedding output); SGLang/SpecForge's
``eagle_config.eagle_aux_hidden_state_layer_ids`` count layer outputs and are ours minus one.
Both engines keep each captured layer once and concatenate in ascending layer order, so ids
must be strictly increasing: a repeated id would feed ``fc`` fewer features than it was
trained on. The default, EAGLE-3's ``(2, L//2, L-3)``, is :func:`default_aux_layer_ids`.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, replace
from typing import Any

import torch
from draftsmith.decode.drafters.eagle.rope import checked_rope_scaling, rope_scaling_from_layer
from draftsmith.decode.drafters.folder import config_from_fields
from draftsmith.decode.loading import LoadError
from draftsmith.decode.yaml_values import describe_value


def default_aux_layer_ids(num_target_layers: int) -> tuple[int, ...]:
    """EAGLE-3's low/mid/high feature layers as hidden-state tuple indices, always distinct.

    The reference rule is ``(2, L//2, L-3)`` (vLLM's default; SpecForge's ``(1, L//2-1, L-4)``
    counted as layer outputs). Targets shallower than 7 layers spread the ids as
    ``(1, L//2, L-1)`` (4 to 6 layers), take the embedding output too at 3 layers
    (``(0, 1, 2)``), and fuse the only two distinct states of a 2-layer target (``(0, 1)``):
    engines capture each layer once, so a repeated id could not be served.
    """
    if num_target_layers < 2:
        raise ValueError(
            f"EAGLE-3 needs a target with at least 2 decoder layers, got {num_target_layers}: "
            "use a draft LM or Medusa heads for single-layer targets"
        )
    ids = (2, num_target_layers // 2, num_target_layers - 3)
    if 1 <= ids[0] < ids[1] < ids[2] <= num_target_layers - 1:
        return ids
    if num_target_layers >= 4:
        return (1, num_target_layers // 2, num_target_layers - 1)
    return tuple(range(num_target_layers))


@dataclass
class Eagle3Config:
    """Shape of an EAGLE-3 head; ``aux_hidden_state_layer_ids`` follow the module docstring."""

    hidden_size: int
    num_attention_heads: int
    num_key_value_heads: int
    intermediate_size: int
    target_vocab_size: int
    target_num_hidden_layers: int
    draft_vocab_size: int | None = None  # None: the full target vocabulary
    aux_hidden_state_layer_ids: tuple[int, ...] | None = None  # None: default_aux_layer_ids
    head_dim: int | None = None  # None: hidden_size // num_attention_heads
    rms_norm_eps: float = 1e-6
    rope_theta: float = 10000.0
    max_position_embeddings: int = 4096
    num_hidden_layers: int = 1  # the head's decoder layers (the first reads 2H inputs)
    # rope_type linear / llama3 / yarn and their keys (decode/drafters/eagle/rope.py); None: plain
    rope_scaling: dict[str, Any] | None = None
    # speculators' variant: the first layer's residual is hidden_norm(g) instead of g
    norm_before_residual: bool = False
    # EAGLE-3.1 (arXiv 2605.09992): an RMSNorm per captured state before fc (weights
    # fc_norm.{i}.weight), and the normalised output norm(h) fed to the next step
    fc_norm: bool = False
    norm_output: bool = False

    def __post_init__(self) -> None:
        layers = self.num_hidden_layers
        if isinstance(layers, bool) or not isinstance(layers, int) or layers < 1:
            raise ValueError(f"num_hidden_layers must be an integer >= 1, got {layers!r}")
        if self.draft_vocab_size is None:
            self.draft_vocab_size = self.target_vocab_size
        if self.rope_scaling is not None:
            self.rope_scaling = checked_rope_scaling(self.rope_scaling)
        if self.aux_hidden_state_layer_ids is None:
            self.aux_hidden_state_layer_ids = default_aux_layer_ids(self.target_num_hidden_layers)
        self.aux_hidden_state_layer_ids = tuple(int(i) for i in self.aux_hidden_state_layer_ids)
        if self.head_dim is None:
            self.head_dim = self.hidden_size // self.num_attention_heads
        if self.num_attention_heads % self.num_key_value_heads:
            raise ValueError(
                f"num_attention_heads ({self.num_attention_heads}) must be a multiple of "
                f"num_key_value_heads ({self.num_key_value_heads}) for grouped-query attention"
            )
        if self.head_dim % 2:
            raise ValueError(f"head_dim must be even for rotary embeddings, got {self.head_dim}")
        if not 1 <= self.draft_vocab_size <= self.target_vocab_size:
            raise ValueError(
                f"draft_vocab_size must lie in [1, target_vocab_size={self.target_vocab_size}], "
                f"got {self.draft_vocab_size}"
            )
        top = self.target_num_hidden_layers - 1
        bad = [i for i in self.aux_hidden_state_layer_ids if not 0 <= i <= top]
        if bad or not self.aux_hidden_state_layer_ids:
            raise ValueError(
                f"aux_hidden_state_layer_ids {self.aux_hidden_state_layer_ids} must be non-empty "
                f"hidden-state indices in [0, {top}] for a {self.target_num_hidden_layers}-layer "
                "target (index i = output of layer i-1; the post-norm last state is excluded)"
            )
        ids = self.aux_hidden_state_layer_ids
        if list(ids) != sorted(set(ids)):
            raise ValueError(
                f"aux_hidden_state_layer_ids {ids} must be strictly increasing: vLLM and SGLang "
                "capture each target layer once, in layer order, so repeated or unordered ids "
                f"cannot be served; use e.g. {default_aux_layer_ids(self.target_num_hidden_layers)}"
            )

    @classmethod
    def for_target(cls, target_config: Any, **overrides: Any) -> Eagle3Config:
        """Defaults copied from a Hugging Face target config (same width, heads, rope).

        Rope and context are our choice, not a published convention: plain rope with the
        target's theta and no scaling over the target's whole context, so the engines' cos/sin
        caches cover every position the target serves; a head with a shorter
        ``max_position_embeddings`` is refused (an engine would index past its cache, or clamp
        the positions, beyond it). Published heads differ (the EAGLE authors' Llama-3.1-8B
        head: theta 10000 and a 2048-token context; SpecForge's Llama-3.3-70B head: the
        target's llama3 scaling); pass ``rope_scaling`` and ``rope_theta`` to follow one.
        """
        rope = getattr(target_config, "rope_parameters", None) or {}
        values: dict[str, Any] = {
            "hidden_size": target_config.hidden_size,
            "num_attention_heads": target_config.num_attention_heads,
            "num_key_value_heads": getattr(
                target_config, "num_key_value_heads", target_config.num_attention_heads
            ),
            "intermediate_size": target_mlp_width(target_config),
            "target_vocab_size": target_config.vocab_size,
            "target_num_hidden_layers": target_config.num_hidden_layers,
            "head_dim": getattr(target_config, "head_dim", None),
            "rms_norm_eps": getattr(target_config, "rms_norm_eps", 1e-6),
            "rope_theta": rope.get("rope_theta", getattr(target_config, "rope_theta", 10000.0)),
            "max_position_embeddings": getattr(target_config, "max_position_embeddings", 4096),
        }
        context = values["max_position_embeddings"]
        values.update(overrides)
        if values["max_position_embeddings"] < context:
            raise ValueError(
                f"max_position_embeddings {values['max_position_embeddings']} is below the "
                f"target's {context}: engines build the head's rope cache that long and would "
                "clamp or overrun past it; leave it at the target's context"
            )
        return cls(**values)

    def to_dict(self) -> dict[str, Any]:
        out = asdict(self)
        out["aux_hidden_state_layer_ids"] = list(self.aux_hidden_state_layer_ids)
        return out

    @classmethod
    def from_dict(cls, values: dict[str, Any]) -> Eagle3Config:
        """A config read from a folder: every field type-checked (``config_from_fields``),
        ``rope_scaling`` by :func:`~draftsmith.decode.drafters.eagle.rope.checked_rope_scaling`."""
        values = dict(values)
        scaling = values.pop("rope_scaling", None)
        if scaling is not None and not isinstance(scaling, dict):
            raise LoadError(
                f"config.json: rope_scaling must be an object or null, got "
                f"{describe_value(scaling)}; export the head again"
            )
        config = config_from_fields(cls, values)
        return config if scaling is None else replace(config, rope_scaling=scaling)


def target_mlp_width(target_config: Any) -> int:
    """The target's MLP width, which a head copies, under the names Hugging Face's families
    give it: ``intermediate_size`` (Llama and most), ``n_inner`` (GPT-2, GPT-BigCode),
    ``ffn_dim`` (OPT), ``ffn_hidden_size`` (Falcon); else four times the width (GPT-2's
    ``n_inner=None``, BLOOM)."""
    for name in ("intermediate_size", "n_inner", "ffn_dim", "ffn_hidden_size"):
        value = getattr(target_config, name, None)
        if isinstance(value, int) and not isinstance(value, bool) and value > 0:
            return value
    return 4 * target_config.hidden_size


def check_layer_count(config: Eagle3Config, state: dict[str, torch.Tensor]) -> None:
    """Refuse a config whose layer count the weights do not hold, before building the head (a
    hostile ``num_hidden_layers`` would otherwise allocate that many layers first)."""
    later = {
        parts[1]
        for parts in (name.removeprefix("model.").split(".") for name in state)
        if len(parts) > 2 and parts[0] == "layers" and parts[1] != "0"
    }
    count = config.num_hidden_layers
    # Compare counts first: the expected set is then built no larger than the weights' own.
    if len(later) != count - 1 or later != {str(i) for i in range(1, count)}:
        raise ValueError(
            f"the config declares {count} decoder layer(s) but the weights hold later layers "
            f"{sorted(later)} (expected 1 .. {count - 1}): the folder's config.json and "
            "model.safetensors do not belong together"
        )


def unused_engine_norm(name: str) -> bool:
    """vLLM builds a ``hidden_norm`` in every layer of a multi-layer head but uses only the
    first layer's, so exports carry ``layers.{i}.hidden_norm.weight`` (i >= 1) for its loader."""
    parts = name.split(".")
    return (
        len(parts) == 4 and parts[0] == "layers" and parts[1] != "0" and parts[2] == "hidden_norm"
    )


def config_from_engine_dict(
    raw: dict[str, Any], target_num_hidden_layers: int | None
) -> Eagle3Config:
    """Read a vLLM/SGLang ``LlamaForCausalLMEagle3`` config.json.

    vLLM's top-level ``eagle_aux_hidden_state_layer_ids`` are hidden-state indices (ours);
    SGLang's ``eagle_config.eagle_aux_hidden_state_layer_ids`` count layer outputs (ours - 1).
    """
    check_layer_kinds(raw)
    missing = [key for key in _ENGINE_REQUIRED if key not in raw]
    if missing:
        raise LoadError(
            f"config.json: this EAGLE-3 export lacks {', '.join(missing)}; export the head again "
            "(draftsmith-distill --export_format vllm or sglang)"
        )
    eagle_config = raw.get("eagle_config") or {}
    if not isinstance(eagle_config, dict):
        raise LoadError(
            f"config.json: eagle_config must be an object, got {describe_value(eagle_config)}; "
            "export the head again"
        )
    nested = eagle_config.get("eagle_aux_hidden_state_layer_ids")
    ids = _layer_ids(
        raw.get("eagle_aux_hidden_state_layer_ids"), "eagle_aux_hidden_state_layer_ids"
    )
    if ids is None and nested:
        nested_ids = _layer_ids(nested, "eagle_config.eagle_aux_hidden_state_layer_ids")
        ids = [i + 1 for i in nested_ids]
    depth = raw.get("target_num_hidden_layers", target_num_hidden_layers)
    if depth is None:
        if ids is None:
            raise ValueError(
                "this EAGLE-3 export names no aux layer ids and not the target's depth: pass "
                "target_num_hidden_layers=<target config.num_hidden_layers>"
            )
        depth = max(ids) + 1
    draft_vocab = raw.get("draft_vocab_size") or raw["vocab_size"]
    values = eagle3_values_from_layer(raw, depth, ids, draft_vocab)
    values.update(eagle3_variant_flags(raw, norm_before_residual=False))
    # The same checks as our own folders' config.json: types, positive sizes.
    return Eagle3Config.from_dict(values)


# Variants of the EAGLE-3 layer a folder may name, each applied by the head (vLLM reads the
# same keys); a speculators config defaults norm_before_residual to true (vLLM's
# ``update_eagle3``), an engine-layout one to false (vLLM's Llama layer).
VARIANT_FLAGS = ("norm_before_residual", "fc_norm", "norm_output")


def eagle3_variant_flags(raw: dict[str, Any], *, norm_before_residual: bool) -> dict[str, Any]:
    """The head's variant flags as vLLM reads them from ``raw`` (missing: vLLM's default),
    refusing ``norm_before_fc`` (one RMSNorm over the concatenated states), which this head
    does not implement."""
    if raw.get("norm_before_fc") or (raw.get("eagle_config") or {}).get("norm_before_fc"):
        raise ValueError(
            "this head uses norm_before_fc (one RMSNorm over the concatenated target states "
            "before fc, weight input_norm.weight), which draftsmith's EAGLE-3 head does not "
            "implement; serve it in vLLM, or use a head without it (fc_norm, one norm per "
            "state, is supported)"
        )
    defaults = {
        "norm_before_residual": norm_before_residual,
        "fc_norm": False,
        "norm_output": False,
    }
    return {key: raw.get(key, default) for key, default in defaults.items()}


def check_layer_kinds(layer: dict[str, Any]) -> None:
    """Refuse a layer config whose attention this head does not compute: a sliding window
    (the head attends over every committed entry) or a non-Llama layer (Qwen3's q/k norms)."""
    kinds = layer.get("layer_types") or []
    if layer.get("use_sliding_window") or any(k == "sliding_attention" for k in kinds):
        raise ValueError(
            f"this head's layer attends through a sliding window of {layer.get('sliding_window')} "
            "tokens, which draftsmith's EAGLE-3 head does not implement (it attends over every "
            "committed entry, so its drafts would differ from the engine's); serve it in vLLM "
            "or use a full-attention head"
        )
    model_type = layer.get("model_type", "llama")
    if model_type != "llama":
        raise ValueError(
            f"this head's layer is a {model_type!r} layer; draftsmith's EAGLE-3 head computes "
            "a Llama layer (no q/k norms, no biases): serve it in vLLM, or use a head whose "
            "transformer_layer_config has model_type 'llama'"
        )


def eagle3_values_from_layer(
    layer: dict[str, Any], depth: Any, ids: Any, draft_vocab_size: Any
) -> dict[str, Any]:
    """``Eagle3Config`` field values from an engine's Llama-style layer config (vLLM, SGLang,
    speculators' ``transformer_layer_config``), unchecked: pass them to ``config_from_fields``.
    ``depth`` is the target's layer count, ``ids`` the aux hidden-state ids (ours)."""
    rope_parameters = layer.get("rope_parameters")
    theta = rope_parameters.get("rope_theta") if isinstance(rope_parameters, dict) else None
    scaling = rope_scaling_from_layer(layer)
    values: dict[str, Any] = {} if scaling is None else {"rope_scaling": scaling}
    return values | {
        "hidden_size": layer["hidden_size"],
        "num_attention_heads": layer["num_attention_heads"],
        "num_key_value_heads": layer.get("num_key_value_heads", layer["num_attention_heads"]),
        "intermediate_size": layer["intermediate_size"],
        "target_vocab_size": layer["vocab_size"],
        "target_num_hidden_layers": depth,
        "draft_vocab_size": draft_vocab_size,
        "aux_hidden_state_layer_ids": ids,
        "head_dim": layer.get("head_dim"),
        "rms_norm_eps": layer.get("rms_norm_eps", 1e-6),
        # no rope_theta anywhere (the EAGLE authors' heads): transformers' and vLLM's 10000
        "rope_theta": layer.get("rope_theta", theta if theta is not None else 10000.0),
        "max_position_embeddings": layer.get("max_position_embeddings", 4096),
        "num_hidden_layers": layer.get("num_hidden_layers", 1),
    }


# Keys an engine export's config.json must hold (the rest have defaults).
_ENGINE_REQUIRED = ("hidden_size", "num_attention_heads", "intermediate_size", "vocab_size")


def _layer_ids(value: Any, key: str) -> list[int] | None:
    """An export's aux layer ids (None when absent or empty), or ``LoadError`` naming ``key``."""
    if value is None or value == []:
        return None
    if not isinstance(value, list) or not all(
        isinstance(i, int) and not isinstance(i, bool) for i in value
    ):
        raise LoadError(
            f"config.json: {key} must be a list of integers, got {describe_value(value)}; "
            "export the head again"
        )
    return value
