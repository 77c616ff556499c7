"""Medusa heads: K extra LM heads on the target's last hidden state (Cai et al., 2024).

Head i maps the target's final (post-norm) hidden state at position t, the one whose LM head
predicts x_{t+1}, to a guess of x_{t+2+i}:

    z_i = x + SiLU(W_{i,L} ... (x + SiLU(W_{i,1} x + b_{i,1})) ...)   # residual blocks
    logits_i = U_i z_i

With the blocks zero-initialised and ``U_i`` copied from the target's LM head, every head starts
as the target's own next-token head, and training moves head i towards its offset.

Weights follow vLLM's ``MedusaModel`` (``vllm/model_executor/models/medusa.py``):
``blocks.{i}.layers.{j}.weight`` / ``.bias`` [H, H] / [H] and ``lm_heads.{i}.weight`` [V, H];
vLLM reads the block bias only when ``medusa_fc_bias`` is set in config.json.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any, ClassVar

import torch
import torch.nn.functional as F
from draftsmith.decode.drafters.base import (
    Drafter,
    DraftProposal,
    TargetPass,
    TreeSpec,
    require_left_padded,
)
from draftsmith.decode.drafters.folder import config_from_fields, read_folder, save_native_folder
from draftsmith.decode.sampling import SamplingConfig, greedy_tokens, logits_to_probs, sample
from draftsmith.decode.trees.layout import StaticTree, TreeProposal
from draftsmith.decode.trees.verify import TreeVerification
from torch import nn

MEDUSA_ARCHITECTURE = "MedusaModel"


@dataclass
class MedusaConfig:
    """Shape of a set of Medusa heads."""

    hidden_size: int
    vocab_size: int
    num_heads: int = 4
    num_layers: int = 1  # residual blocks per head
    bias: bool = True  # residual-block bias, as in the Medusa paper

    def __post_init__(self) -> None:
        for name in ("hidden_size", "vocab_size", "num_heads", "num_layers"):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise ValueError(f"MedusaConfig.{name} must be a positive integer, got {value!r}")

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)

    @classmethod
    def from_dict(cls, values: dict[str, Any]) -> MedusaConfig:
        return config_from_fields(cls, values)


class _ResidualBlock(nn.Module):
    """``x <- x + SiLU(W x + b)``, ``num_layers`` times; W, b start at zero (identity)."""

    def __init__(self, hidden: int, num_layers: int, bias: bool) -> None:
        super().__init__()
        self.layers = nn.ModuleList(nn.Linear(hidden, hidden, bias=bias) for _ in range(num_layers))
        for layer in self.layers:
            nn.init.zeros_(layer.weight)
            if layer.bias is not None:
                nn.init.zeros_(layer.bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # [..., H] -> [..., H]
        for layer in self.layers:
            x = x + F.silu(layer(x))
        return x


class MedusaHeads(nn.Module):
    """K Medusa heads; ``forward`` returns every head's logits at once."""

    def __init__(self, config: MedusaConfig) -> None:
        super().__init__()
        self.config = config
        self.blocks = nn.ModuleList(
            _ResidualBlock(config.hidden_size, config.num_layers, config.bias)
            for _ in range(config.num_heads)
        )
        self.lm_heads = nn.ModuleList(
            nn.Linear(config.hidden_size, config.vocab_size, bias=False)
            for _ in range(config.num_heads)
        )

    @classmethod
    def from_target(
        cls, target: nn.Module, num_heads: int = 4, num_layers: int = 1, bias: bool = True
    ) -> MedusaHeads:
        """Heads shaped for ``target``, each starting as a copy of the target's LM head."""
        head = target.get_output_embeddings()
        if getattr(head, "bias", None) is not None:
            raise ValueError(
                "the target's LM head has a bias, which Medusa heads (and vLLM's MedusaModel) "
                "do not carry: use a target with a bias-free LM head"
            )
        vocab, hidden = head.weight.shape
        heads = cls(MedusaConfig(hidden, vocab, num_heads, num_layers, bias))
        heads.to(device=head.weight.device, dtype=head.weight.dtype)
        with torch.no_grad():
            for lm_head in heads.lm_heads:
                lm_head.weight.copy_(head.weight)
        return heads

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:  # [..., H] -> [..., K, V]
        """Logits of every head; head i at position t predicts token t+2+i."""
        return torch.stack(
            [
                lm_head(block(hidden))
                for block, lm_head in zip(self.blocks, self.lm_heads, strict=True)
            ],
            dim=-2,
        )

    # -- folders --------------------------------------------------------------------------
    def save_pretrained(self, path: str | Path) -> None:
        """Write the native drafter folder: drafter.json, config.json, model.safetensors."""
        save_native_folder(path, "medusa", self.config.to_dict(), self)

    @classmethod
    def from_pretrained(cls, path: str | Path) -> MedusaHeads:
        """Load a native folder or a vLLM ``MedusaModel`` export."""
        folder = Path(path)
        raw, native, weights = read_folder(folder, "medusa", MEDUSA_ARCHITECTURE)
        config = MedusaConfig.from_dict(raw) if native else config_from_vllm_dict(raw)
        state = {k.removeprefix("medusa_heads."): v for k, v in weights.items()}
        heads = cls(config)
        expected = heads.state_dict()
        missing = sorted(set(expected) - set(state))
        unexpected = sorted(set(state) - set(expected))
        if missing or unexpected:
            raise ValueError(
                f"medusa weights do not match the config: missing {missing}, unexpected {unexpected}"
            )
        for name, tensor in state.items():
            if tensor.shape != expected[name].shape:
                raise ValueError(
                    f"weight {name} has shape {tuple(tensor.shape)}, the config implies "
                    f"{tuple(expected[name].shape)}"
                )
        heads.to(state["lm_heads.0.weight"].dtype)
        heads.load_state_dict(state)
        return heads


def config_from_vllm_dict(raw: dict[str, Any]) -> MedusaConfig:
    """Read vLLM's ``MedusaConfig`` fields (any ``*num*heads*`` / ``*num*layers*`` key, as vLLM)."""
    values = dict(raw)
    for key in list(values):
        if "num" in key and "heads" in key:
            values["num_heads"] = values.pop(key)
        elif "num" in key and "layers" in key:
            values["num_hidden_layers"] = values.pop(key)
    truncated = values.get("truncated_vocab_size")
    if truncated not in (None, values["vocab_size"]):
        raise ValueError(
            f"Medusa exports with a truncated vocabulary ({truncated} of {values['vocab_size']} "
            "tokens, token_map) are not supported: export the full vocabulary"
        )
    return MedusaConfig(
        hidden_size=values["hidden_size"],
        vocab_size=values["vocab_size"],
        num_heads=values["num_heads"],
        num_layers=values.get("num_hidden_layers", 1),
        bias=bool(values.get("medusa_fc_bias", False)),
    )


def default_medusa_choices(num_heads: int) -> list[tuple[int, ...]]:
    """A sparse static tree sized for small targets: 3 guesses at depth 1, fewer deeper.

    Medusa (Cai et al. 2024) tunes its trees per model (63 nodes for Vicuna-7B on a GPU); on a
    CPU, where the verify pass's cost grows with every node, a narrow tree of about 12-16 nodes
    pays best. Paths are child ranks, e.g. ``(0, 1)`` = the top-1 token of head 0 followed by
    the top-2 token of head 1.
    """
    widths = [3, 2, 2, 1, 1, 1, 1, 1][:num_heads]
    choices: list[tuple[int, ...]] = []
    frontier: list[tuple[int, ...]] = [()]
    for depth, width in enumerate(widths):
        # Expand only the best path and the first alternative below depth 1.
        parents = frontier if depth == 0 else frontier[:2]
        frontier = [(*parent, rank) for parent in parents for rank in range(width)]
        choices.extend(frontier)
    return choices


class MedusaDrafter(Drafter):
    """Runs :class:`MedusaHeads` on the target's last hidden state (chain or static tree).

    State per row: the target's final hidden state at the last committed position, the one
    whose logits produced the pending token; head i then guesses the token i+1 places after
    the pending one. A chain of N <= K tokens is head-wise: argmax (greedy, one-hot q) or one
    independent sample from each head's distribution (q = that head's law), both exact under
    verification. The heads are moved to the target's LM-head device and dtype.
    """

    kind: ClassVar[str] = "medusa"
    supports_trees: ClassVar[bool] = True
    needs_hidden_states: ClassVar[bool] = True

    def __init__(self, heads: MedusaHeads, target: nn.Module) -> None:
        weight = target.get_output_embeddings().weight
        if weight.shape[1] != heads.config.hidden_size:
            raise ValueError(
                f"the heads read hidden states of width {heads.config.hidden_size}, the target's "
                f"LM head reads {weight.shape[1]}: Medusa heads are built for one target"
            )
        self.heads = heads.to(device=weight.device, dtype=weight.dtype).eval()
        self._hidden: torch.Tensor | None = None  # [B, H]
        self._trees: dict[tuple[object, int], StaticTree] = {}
        self.check_compatible(target)

    @classmethod
    def from_pretrained(cls, path: str | Path, target: nn.Module) -> MedusaDrafter:
        return cls(MedusaHeads.from_pretrained(path), target)

    @property
    def vocab_size(self) -> int:
        return self.heads.config.vocab_size

    @property
    def max_draft_tokens(self) -> int:
        """Head i guesses the token i + 1 places after the pending one: K heads, K drafts."""
        return self.heads.config.num_heads

    @torch.no_grad()
    def prefill(
        self,
        input_ids: torch.Tensor,  # [B, T] left-padded prompt
        attention_mask: torch.Tensor,  # [B, T]
        target_pass: TargetPass,
        pending: torch.Tensor,  # [B]
    ) -> None:
        require_left_padded(attention_mask)
        self._hidden = _last_hidden(target_pass)[:, -1]

    @torch.no_grad()
    def propose(
        self, num_tokens: int, sampling: SamplingConfig, generator: torch.Generator | None
    ) -> DraftProposal:
        hidden = self._require_hidden()
        if not 0 <= num_tokens <= self.heads.config.num_heads:
            raise ValueError(
                f"Medusa drafts at most one token per head: num_tokens must lie in "
                f"[0, {self.heads.config.num_heads}], got {num_tokens}"
            )
        if num_tokens == 0:  # a round without drafts
            empty = hidden.new_empty(hidden.shape[0], 0, dtype=torch.long)  # [B, 0]
            return DraftProposal(tokens=empty, probs=None)
        logits = self.heads(hidden)[:, :num_tokens]  # [B, N, V]
        if sampling.greedy:
            return DraftProposal(tokens=greedy_tokens(logits), probs=None)
        probs = logits_to_probs(logits, sampling)
        return DraftProposal(tokens=sample(probs, generator), probs=probs)

    @torch.no_grad()
    def commit(
        self,
        num_accepted: torch.Tensor,  # [B]
        next_tokens: torch.Tensor,  # [B]
        target_pass: TargetPass,  # verify pass over [pending, d_1 .. d_N]
    ) -> None:
        self._require_hidden()
        last = _last_hidden(target_pass)
        rows = torch.arange(last.shape[0], device=last.device)
        self._hidden = last[rows, num_accepted]

    @torch.no_grad()
    def propose_tree(self, spec: TreeSpec, depth: int) -> TreeProposal:
        """Fill a static tree (Medusa choices, cut to ``depth``) with each head's top tokens."""
        return self._static_tree(spec, depth).propose(self.heads(self._require_hidden()))

    def _static_tree(self, spec: TreeSpec, depth: int) -> StaticTree:
        depth = min(depth, self.heads.config.num_heads)
        key = (spec.choices, depth)
        if key not in self._trees:
            choices = spec.choices or default_medusa_choices(self.heads.config.num_heads)
            self._trees[key] = StaticTree.from_choices([c for c in choices if len(c) <= depth])
        return self._trees[key]

    @torch.no_grad()
    def commit_tree(
        self,
        verification: TreeVerification,
        target_pass: TargetPass,  # the target's pass over [pending, tree nodes]
    ) -> None:
        self._require_hidden()
        last = _last_hidden(target_pass)
        rows = torch.arange(last.shape[0], device=last.device)
        end = verification.path_indices()[rows, verification.num_accepted]
        self._hidden = last[rows, end]

    def select_rows(self, rows: torch.Tensor) -> None:
        self._hidden = self._require_hidden()[rows.to(self._hidden.device, torch.long)]

    def merge(self, other: Drafter) -> None:
        if not isinstance(other, MedusaDrafter) or other.heads is not self.heads:
            raise TypeError("only a spawn of this Medusa drafter can be merged into it")
        self._hidden = torch.cat([self._require_hidden(), other._require_hidden()])

    def _require_hidden(self) -> torch.Tensor:
        if self._hidden is None:
            raise RuntimeError("the drafter has no batch: call prefill() first")
        return self._hidden


def _last_hidden(target_pass: TargetPass) -> torch.Tensor:  # [B, T, H]
    if target_pass.hidden_states is None:
        raise ValueError(
            "Medusa heads read the target's last hidden state: run the target with "
            "output_hidden_states=True on prefill and verify passes"
        )
    return target_pass.hidden_states[-1]


def load_runtime_drafter(path: str | Path | None, target: nn.Module) -> MedusaDrafter:
    """Registry entry (``draftsmith.decode.drafters.registry``): a Medusa folder as a runtime drafter."""
    if path is None:
        raise ValueError("the medusa drafter needs a folder: pass --drafter PATH")
    return MedusaDrafter.from_pretrained(path, target)
