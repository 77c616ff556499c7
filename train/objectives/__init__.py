"""Training objectives: what a drafter kind is fed, what it predicts and how it is scored.

The one training loop (``draftsmith.train.loop``) knows nothing about drafter kinds. It asks an
``Objective`` for the module whose parameters it optimises, calls ``compute_loss`` on each
micro-batch and ``evaluate`` on held-out batches, and checkpoints the objective's own state
(its sampling generator, for example) alongside the model.

Kinds are chosen through an explicit registry (``OBJECTIVES``) of import paths, resolved lazily
so that importing this package imports no model code:

- ``causal_lm``: next-token cross-entropy on packed text (the demo target's pretraining);
- ``draft_lm``: a small causal LM distilled from a frozen target (``draftsmith.train.objectives.draft_lm``);
- ``eagle3`` and ``medusa``: heads on the target's hidden states (``draftsmith.train.objectives.eagle3``,
  ``draftsmith.train.objectives.medusa``), added by their own modules;
- ``peagle``: EAGLE-3's head drafting all depths in one pass (``draftsmith.train.objectives.peagle``).
"""

from __future__ import annotations

import importlib
from abc import ABC, abstractmethod
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any, ClassVar

import torch

if TYPE_CHECKING:
    from pathlib import Path

    from accelerate import Accelerator
    from draftsmith.train.config import DistillConfig
    from draftsmith.train.losses import Loss

Batch = dict[str, torch.Tensor]
"""A collated micro-batch: at least ``input_ids`` [B, T]; objectives document the rest."""

MetricSums = dict[str, tuple[float, float]]
"""Evaluation results as ``name -> (sum, weight)``.

The loop adds sums and weights over batches and processes before dividing, so a mean over
tokens stays exact however the held-out set is split.
"""


class Objective(ABC):
    """What one drafter kind trains on; the loop drives it.

    Life cycle: the loop calls ``trainable_module()`` once, prepares it with accelerate
    (DDP/FSDP/DeepSpeed wrapping), hands the prepared module back through ``bind`` and then calls
    ``compute_loss`` per micro-batch. Subclasses run the forward pass through ``self.module``
    (the prepared one, so gradient synchronisation hooks fire) and use
    ``self.unwrapped_module`` for anything that is not differentiated (sampling, export).

    The distillation protocol (``draftsmith.train.distill``) is declared here too, with defaults for
    objectives that train no drafter: :meth:`from_config` builds the objective from a resolved
    recipe and the already parsed loss, :meth:`target_cache_hidden_layers` names the hidden
    states the offline cache must keep, :meth:`save_drafter` writes the drafter folder and
    :meth:`describe` gives the model card's architecture facts. A kind with
    ``trains_drafter = True`` implements all four, and its key in :data:`OBJECTIVES` is a
    drafter kind that ``draftsmith.decode.drafters.registry`` loads.
    """

    kind: ClassVar[str]
    trains_drafter: ClassVar[bool] = True

    def __init__(self) -> None:
        self._module: torch.nn.Module | None = None
        self._accelerator: Accelerator | None = None

    @abstractmethod
    def trainable_module(self) -> torch.nn.Module:
        """The module whose parameters with ``requires_grad`` the optimizer updates."""

    @abstractmethod
    def compute_loss(self, batch: Batch) -> tuple[torch.Tensor, dict[str, float]]:
        """The scalar loss of one micro-batch (graph attached) and scalar metrics to log."""

    @abstractmethod
    def evaluate(self, batch: Batch) -> MetricSums:
        """Held-out metrics of one batch as ``name -> (sum, weight)``, without gradients."""

    def bind(self, module: torch.nn.Module, accelerator: Accelerator) -> None:
        """Receive the prepared module; move frozen parts (a target, say) to the device."""
        self._module = module
        self._accelerator = accelerator

    @property
    def module(self) -> torch.nn.Module:
        """The prepared (possibly wrapped) trainable module; forward passes go through it."""
        if self._module is None:
            raise RuntimeError(
                f"{type(self).__name__} is not bound to a prepared module yet: call bind() "
                "(draftsmith.train.loop.run_training does) before compute_loss or evaluate"
            )
        return self._module

    @property
    def unwrapped_module(self) -> torch.nn.Module:
        """The trainable module without DDP/compile wrappers."""
        if self._accelerator is None:
            return self.trainable_module()
        return self._accelerator.unwrap_model(self.module)

    @property
    def device(self) -> torch.device:
        if self._accelerator is None:
            return torch.device("cpu")
        return self._accelerator.device

    def prepare(self, train_rows: Sequence[dict[str, Any]]) -> None:
        """Look at the training rows once before the first step; does nothing by default.

        ``draftsmith.train.distill`` calls it after building the objective (EAGLE-3 chooses its pruned
        draft vocabulary from the label frequencies here).
        """
        del train_rows  # nothing to learn from the data before training by default

    def state_dict(self) -> dict[str, Any]:
        """Objective-owned state to checkpoint besides the model (e.g. generator states)."""
        return {}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Restore what ``state_dict`` returned."""
        if state:
            raise ValueError(
                f"{type(self).__name__} keeps no state but the checkpoint holds keys "
                f"{sorted(state)}: resume with the objective that wrote the checkpoint"
            )

    @classmethod
    def from_config(
        cls,
        config: DistillConfig,
        target: torch.nn.Module,
        tokenizer: Any,
        loss: Loss,
    ) -> Objective:
        """Build the objective for a distillation recipe, on a loaded frozen target.

        ``loss`` is the recipe's loss spec as ``draftsmith.train.distill`` parsed it (``build_loss``),
        never re-parsed here.
        """
        raise ValueError(
            f"objective kind {cls.kind!r} trains no drafter and cannot be built from a "
            "distillation recipe; pick a drafter kind for --drafter_kind "
            f"({', '.join(kind for kind in sorted(OBJECTIVES) if kind != cls.kind)})"
        )

    def target_cache_hidden_layers(self) -> list[int] | None:
        """Hidden-state indices the offline target cache keeps per token (None: none)."""
        return None

    def describe(self) -> dict[str, Any]:
        """Architecture facts for the model card (none by default)."""
        return {}

    def save_drafter(
        self,
        folder: Path,
        tokenizer: Any = None,
        state_dict: dict[str, torch.Tensor] | None = None,
    ) -> None:
        """Write the drafter folder's kind-specific files (weights, config, ``drafter.json``).

        ``state_dict`` is the full trainable state gathered on every process with
        ``accelerator.get_state_dict`` (a collective under FSDP/DeepSpeed); ``save_drafter``
        itself runs on the main process only. Drafter objectives override this; the export step
        (``draftsmith.train.export.folder``) adds the model card and provenance.
        """
        raise NotImplementedError(f"objective kind {self.kind!r} does not export a drafter")


OBJECTIVES: dict[str, str] = {
    "causal_lm": "draftsmith.train.objectives.causal_lm:CausalLMObjective",
    "draft_lm": "draftsmith.train.objectives.draft_lm:DraftLMObjective",
    "eagle3": "draftsmith.train.objectives.eagle3:Eagle3Objective",
    "medusa": "draftsmith.train.objectives.medusa:MedusaObjective",
    "peagle": "draftsmith.train.objectives.peagle:PEagleObjective",
    "dflash": "draftsmith.train.objectives.dflash:DFlashObjective",
}
"""Objective kind -> ``"module:Class"``; the key is the drafter kind written to drafter.json."""


def register_objective(kind: str, import_path: str) -> None:
    """Add (or replace) an objective kind, given as ``"package.module:ClassName"``."""
    if ":" not in import_path:
        raise ValueError(
            f"objective import path {import_path!r} must look like 'package.module:ClassName'"
        )
    OBJECTIVES[kind] = import_path


def get_objective_class(kind: str) -> type[Objective]:
    """Resolve a registered objective kind to its class, importing its module on demand."""
    if kind not in OBJECTIVES:
        raise ValueError(
            f"unknown objective/drafter kind {kind!r}; known kinds: {', '.join(sorted(OBJECTIVES))}"
        )
    module_name, class_name = OBJECTIVES[kind].split(":")
    try:
        module = importlib.import_module(module_name)
    except ModuleNotFoundError as error:
        if error.name != module_name:
            raise
        raise ValueError(
            f"objective kind {kind!r} is registered as {OBJECTIVES[kind]} but module "
            f"{module_name} does not exist in this installation; pick another kind"
        ) from error
    cls = getattr(module, class_name, None)
    if not (isinstance(cls, type) and issubclass(cls, Objective)):
        raise TypeError(f"{OBJECTIVES[kind]} is not an Objective subclass")
    return cls


__all__ = [
    "OBJECTIVES",
    "Batch",
    "MetricSums",
    "Objective",
    "get_objective_class",
    "register_objective",
]
