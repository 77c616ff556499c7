"""Scratch computations shared by the runtime tests of the head drafters (EAGLE-3, Medusa).

Both drafters read the target's hidden states; their tests drive them by hand over a ragged,
left-padded batch and compare each step with the target recomputed from scratch. These helpers
are that scaffolding: the target's pass over chains and trees, the padded prefill, the
verification of an arbitrary accepted path, and the folder errors both kinds must name.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from draftsmith.decode.drafters.base import TargetPass
from draftsmith.decode.forward.cached_sequence import CachedSequence
from draftsmith.decode.sampling import SamplingConfig
from draftsmith.decode.trees.layout import tree_attention_mask, tree_positions
from draftsmith.decode.trees.verify import TreeVerification

PROMPTS = [[5, 17, 9, 33, 2, 40], [7, 21, 8]]
"""A ragged batch of two prompts, left-padded with 0 by :func:`padded_prefill`."""


def _stacked(
    logits: list[torch.Tensor], hidden: list[list[torch.Tensor]], last_layer_only: bool
) -> TargetPass:
    """Rows' logits [W, V] and per-layer hidden states [W, H] stacked into a batch pass."""
    layers = [len(hidden[0]) - 1] if last_layer_only else range(len(hidden[0]))
    return TargetPass(
        torch.stack(logits), tuple(torch.stack([h[i] for h in hidden]) for i in layers)
    )


def scratch_pass(
    target: torch.nn.Module,
    sequences: list[list[int]],
    width: int,
    *,
    last_layer_only: bool = False,
) -> TargetPass:  # logits [B, width, V], hidden states [B, width, H] per layer
    """The target's logits and hidden states over the last ``width`` tokens of each row, each
    row run alone from scratch; ``last_layer_only`` keeps only the final hidden state."""
    logits, hidden = [], []
    with torch.no_grad():
        for sequence in sequences:
            out = target(torch.tensor([sequence]), output_hidden_states=True)
            logits.append(out.logits[0, -width:])
            hidden.append([h[0, -width:] for h in out.hidden_states])
    return _stacked(logits, hidden, last_layer_only)


def tree_pass(
    target: torch.nn.Module,
    committed: list[list[int]],
    tree,
    *,
    last_layer_only: bool = False,
) -> TargetPass:  # logits [B, 1 + nodes, V], hidden states [B, 1 + nodes, H] per layer
    """The target over [pending, tree nodes] after each row's cached prefix (one row at a time);
    each row's last committed token is its pending one."""
    logits, hidden = [], []
    with torch.no_grad():
        for row, sequence in enumerate(committed):
            cached = CachedSequence(target, batch_size=1, device=torch.device("cpu"))
            cached.extend(torch.tensor([sequence[:-1]]))
            out = cached.extend(
                torch.cat((torch.tensor([sequence[-1]]), tree.tokens[row]))[None],
                tree_mask=tree_attention_mask(tree.parents[row]),
                positions=tree_positions(tree.depths[row], cached.lengths),
                output_hidden_states=True,
            )
            logits.append(out.logits[0])
            hidden.append([h[0] for h in out.hidden_states])
    return _stacked(logits, hidden, last_layer_only)


def padded_prefill(
    target: torch.nn.Module, *, last_layer_only: bool = False
) -> tuple[torch.Tensor, torch.Tensor, TargetPass]:
    """:data:`PROMPTS` left-padded: ``(input_ids [2, W], attention_mask [2, W], pass)``.

    The pass holds each prompt's own scratch logits and hidden states; padding columns hold
    zeros, as junk the drafter must ignore.
    """
    width = max(map(len, PROMPTS))
    input_ids = torch.tensor([[0] * (width - len(p)) + p for p in PROMPTS])
    attention = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in PROMPTS])
    rows = [scratch_pass(target, [p], len(p), last_layer_only=last_layer_only) for p in PROMPTS]
    logits = torch.zeros(len(PROMPTS), width, rows[0].logits.shape[-1], dtype=rows[0].logits.dtype)
    hidden = tuple(torch.zeros(len(PROMPTS), width, *h.shape[2:], dtype=h.dtype)
                   for h in rows[0].hidden_states)  # fmt: skip
    for row, (prompt, row_pass) in enumerate(zip(PROMPTS, rows, strict=True)):
        logits[row, width - len(prompt) :] = row_pass.logits[0]
        for h, full in zip(hidden, row_pass.hidden_states, strict=True):
            h[row, width - len(prompt) :] = full[0]
    return input_ids, attention, TargetPass(logits, hidden)


def prefill_prompts(drafter, target: torch.nn.Module, pending: list[int]) -> list[list[int]]:
    """Prefill a head drafter with the left-padded :data:`PROMPTS` batch and ``pending``
    tokens; returns each row's committed tokens (its pending one last)."""
    input_ids, attention, target_pass = padded_prefill(target)
    drafter.prefill(input_ids, attention, target_pass, torch.tensor(pending))
    return [[*p, t] for p, t in zip(PROMPTS, pending, strict=True)]


def path_verification(tree, end_nodes: list[int], next_tokens: torch.Tensor) -> TreeVerification:
    """A verification that accepts, in row ``r``, the root-to-node path ending at
    ``end_nodes[r]`` (as sampling might), then emits ``next_tokens[r]``."""
    nodes = torch.full((len(end_nodes), int(tree.depths.max())), -1)
    for row, end in enumerate(end_nodes):
        path, walk = [], end
        while walk >= 0:
            path.insert(0, walk)
            walk = int(tree.parents[row, walk])
        nodes[row, : len(path)] = torch.tensor(path)
    tokens = torch.where(nodes >= 0, tree.tokens.gather(1, nodes.clamp(min=0)), 0)
    return TreeVerification(nodes, (nodes >= 0).sum(1), tokens, next_tokens)


def extend_committed(
    committed: list[list[int]],
    tokens: torch.Tensor,  # [B, N] drafted or accepted tokens
    num_accepted: torch.Tensor | list[int],  # [B]
    next_tokens: torch.Tensor,  # [B]
) -> None:
    """Append each row's accepted tokens and its next (recovered or bonus) token in place."""
    for row in range(len(committed)):
        n = int(num_accepted[row])
        committed[row] += [*tokens[row, :n].tolist(), int(next_tokens[row])]


def check_from_pretrained_names_the_problem(
    cls, folder: Path, *, architecture: str, kind: str, other_kind: str
) -> None:
    """``cls.from_pretrained`` names what is wrong with a folder: no ``config.json``, a config of
    another architecture, a ``drafter.json`` of another kind."""
    with pytest.raises(FileNotFoundError, match=r"config\.json"):
        cls.from_pretrained(folder)
    # GPT-2 is no head (an EAGLE-3 reader accepts LlamaForCausalLM: the EAGLE authors name it)
    (folder / "config.json").write_text(json.dumps({"architectures": ["GPT2LMHeadModel"]}))
    with pytest.raises(ValueError, match=architecture):
        cls.from_pretrained(folder)
    (folder / "drafter.json").write_text(json.dumps({"kind": other_kind}))
    with pytest.raises(ValueError, match=f"not '{kind}'"):
        cls.from_pretrained(folder)


def check_needs_prefill_and_hidden_states(drafter, vocab_size: int = 64) -> None:
    """A head drafter refuses to propose before its prefill and to prefill from a target pass
    without hidden states, naming the fix (``output_hidden_states=True``)."""
    with pytest.raises(RuntimeError, match="prefill"):
        drafter.propose(1, SamplingConfig(), None)
    with pytest.raises(ValueError, match="output_hidden_states=True"):
        drafter.prefill(
            torch.ones(1, 3, dtype=torch.long),
            torch.ones(1, 3),
            TargetPass(torch.zeros(1, 3, vocab_size)),
            torch.ones(1, dtype=torch.long),
        )


def saved_and_loaded(module: torch.nn.Module, folder: Path, kind: str) -> torch.nn.Module:
    """``module`` saved to ``folder`` and read back by its class's ``from_pretrained``, after
    checking ``drafter.json`` names ``kind`` and that config, tensors and dtypes come back equal."""
    module.save_pretrained(folder)
    assert json.loads((folder / "drafter.json").read_text())["kind"] == kind
    loaded = type(module).from_pretrained(folder)
    assert loaded.config == module.config
    for name, tensor in module.state_dict().items():
        assert torch.equal(loaded.state_dict()[name], tensor), name
        assert loaded.state_dict()[name].dtype == tensor.dtype, name
    return loaded
