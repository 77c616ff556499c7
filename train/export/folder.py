"""Export a trained drafter as the folder ``decode`` loads, with a model card and provenance.

Layout (docs/interfaces.md, "The drafter folder"): the kind-specific files written by the
objective (for ``draft_lm`` a normal Hugging Face causal-LM folder with its tokenizer, LoRA
merged) and ``drafter.json``, plus ``README.md`` (target, data, loss, held-out acceptance per
position) and ``provenance.json`` (resolved config, git revision, package versions). The folder
is assembled under a temporary name and renamed into place (``draftsmith.data.atomic_io.atomic_folder``:
the temporary folder of an export that was killed is removed by the next export). Weights that
are NaN or infinite are never exported (``NonFiniteWeightsError``).

``push_to_hub`` uploads an exported folder with ``huggingface_hub``; it is called only after the
local export, and fails fast with a message naming the saved folder when the hub is offline or
unreachable.
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

from draftsmith.data.atomic_io import atomic_folder
from draftsmith.decode.drafters.folder import PROVENANCE_FILE
from draftsmith.decode.measure.machine import describe_machine
from draftsmith.train.provenance import build_provenance


class HubUploadError(RuntimeError):
    """The drafter was saved locally but could not be uploaded."""


class NonFiniteWeightsError(ValueError):
    """The trained weights hold NaN or infinite values: nothing is exported."""


def export_drafter(
    objective: Any,
    folder: Path,
    tokenizer: Any,
    resolved_config: dict[str, Any],
    summary: dict[str, Any],
    state_dict: dict[str, Any] | None = None,
) -> Path:
    """Write the drafter folder atomically and return it.

    ``summary`` carries the facts for the card: ``target``, ``data``, ``loss``, ``steps``,
    ``tokens_seen``, ``held_out`` (metric -> value, e.g. ``overlap@1``), ``eval_temperature``,
    and optionally ``cache`` (offline cache statistics). ``state_dict`` is the gathered
    trainable state (see ``Objective.save_drafter``).
    """
    folder = Path(folder)
    check_finite_weights(state_dict if state_dict is not None else objective.unwrapped_module)
    with atomic_folder(folder) as temp:
        objective.save_drafter(temp, tokenizer, state_dict)
        provenance = build_provenance(resolved_config)
        provenance["distributed"] = summary.get("distributed")  # type, world size, shards
        provenance["target_memory"] = summary.get("target_memory")  # the frozen target per rank
        (temp / PROVENANCE_FILE).write_text(json.dumps(provenance, indent=2) + "\n")
        # Machine-readable held-out metrics (overlap@j ...) for benchmarks and dashboards.
        held_out = summary.get("held_out", {})
        (temp / "eval_results.json").write_text(json.dumps(held_out, indent=2) + "\n")
        card = model_card(objective.kind, summary, describe(objective), provenance)
        (temp / "README.md").write_text(card + "\n".join(engine_exports_section(temp)))
    return folder


def check_finite_weights(weights: Any) -> None:
    """Raise ``NonFiniteWeightsError`` if a floating tensor of a state dict or module is not finite."""
    import torch

    tensors = weights.state_dict() if isinstance(weights, torch.nn.Module) else weights
    bad = [
        name
        for name, tensor in tensors.items()
        if isinstance(tensor, torch.Tensor)
        and tensor.is_floating_point()
        and not bool(torch.isfinite(tensor).all())
    ]
    if bad:
        raise NonFiniteWeightsError(
            f"refusing to export: {len(bad)} weight tensor(s) hold NaN or infinite values "
            f"({', '.join(bad[:4])}{', ...' if len(bad) > 4 else ''}); the run diverged: lower "
            "--learning_rate (or raise --warmup_steps) and train again"
        )


def describe(objective: Any) -> dict[str, Any]:
    return objective.describe()


def model_card(
    kind: str, summary: dict[str, Any], architecture: dict[str, Any], provenance: dict[str, Any]
) -> str:
    """The README.md of a drafter folder."""
    held_out = summary.get("held_out", {})
    positions = sorted(
        (key for key in held_out if key.startswith("overlap@")), key=lambda k: int(k.split("@")[1])
    )
    rows = "\n".join(
        f"| {key.split('@')[1]} | {held_out[key]:.4f} | "
        f"{held_out.get(key.replace('overlap', 'greedy_match'), float('nan')):.4f} |"
        for key in positions
    )
    other = {k: v for k, v in held_out.items() if "@" not in k}
    git = provenance.get("git") or {}
    lines = [
        "---",
        "library_name: transformers" if kind == "draft_lm" else "library_name: draftsmith",
        "tags:",
        "  - speculative-decoding",
        f"  - {kind}",
        "  - draftsmith",
        "---",
        "",
        f"# {kind} drafter for `{summary.get('target', '?')}`",
        "",
        "A speculative-decoding drafter trained with draftsmith against a frozen target. "
        "Speculative sampling keeps the output distribution exactly the target's; the drafter "
        "only decides the speed.",
        "",
        "## Training",
        "",
        f"- target: `{summary.get('target', '?')}`",
        f"- data: {summary.get('data', '?')}",
        f"- target outputs: {summary.get('target_outputs', 'online')}",
        f"- on-policy fraction: {summary.get('on_policy_fraction', 0.0)}",
        f"- loss: `{summary.get('loss', '?')}` at temperature {summary.get('loss_temperature', 1.0)}",
        f"- steps: {summary.get('steps', '?')}, tokens seen: {summary.get('tokens_seen', '?')}",
        f"- dtype: {summary.get('dtype', 'float32')} (target in "
        f"{summary.get('target_dtype', summary.get('dtype', 'float32'))}, mixed precision "
        f"{summary.get('mixed_precision', 'no')}; weights saved in float32)",
        f"- architecture: {json.dumps(architecture)}",
        *_rope_line(architecture.get("rope")),
    ]
    if summary.get("machine"):
        lines.append(f"- machine: {describe_machine(summary['machine'])}")
    cache = summary.get("cache")
    if cache:
        lines.append(
            f"- offline cache: top-{cache['k']}, {cache['bytes_per_token']:.1f} bytes/token "
            f"vs {cache['full_fp16_bytes_per_token']} for full fp16 logits"
        )
    lines += [
        "",
        "## Held-out acceptance",
        "",
        f"Measured on {summary.get('eval_description', 'held-out sequences')}. `overlap` is the "
        "mean of sum_x min(p(x), q(x)) at decoding temperature "
        f"{summary.get('eval_temperature', 1.0)}: the probability that speculative sampling "
        "accepts the draft token at that position (Leviathan et al. 2023). `greedy match` is "
        "the same at temperature 0 (argmax agreement).",
        "",
        "| draft position | overlap | greedy match |",
        "|---|---|---|",
        rows or "| - | - | - |",
        "",
    ]
    if other:
        lines += ["Other held-out metrics: " + ", ".join(f"{k} {v:.4f}" for k, v in other.items())]
        lines.append("")
    lines += [
        "## Use",
        "",
        "```python",
        "from draftsmith.decode.drafters.registry import load_drafter",
        "drafter = load_drafter(path, target)  # target: the frozen model named above",
        "```",
        "",
        f"or measure it: `python -m draftsmith.decode.measure.evaluate --target {summary.get('target_path', '<target>')}"
        " --drafter <this folder>`",
        "",
        *_pruned_vocab_note(kind, architecture),
        "## Provenance",
        "",
        f"- git commit: `{git.get('commit', 'unknown')}`"
        + (" (uncommitted changes)" if git.get("dirty") else ""),
        "- packages: "
        + ", ".join(f"{k} {v}" for k, v in provenance.get("packages", {}).items() if v),
        "- the resolved training config is in `provenance.json`.",
        "",
    ]
    return "\n".join(lines)


def engine_exports_section(folder: Path) -> list[str]:
    """The model card's account of the engine folders written beside the drafter (``vllm/``,
    ``sglang/``, ``speculators/``): where their launch lines are, and why a multi-layer EAGLE-3
    head's ``vllm/`` folder names no SGLang ids."""
    from draftsmith.decode.drafters.eagle.head import EAGLE3_ARCHITECTURE
    from draftsmith.train.config import EXPORT_FORMATS
    from draftsmith.train.export.formats import NO_SGLANG_IDS_REASON

    written = [fmt for fmt in EXPORT_FORMATS if (folder / fmt / "config.json").is_file()]
    if not written:
        return []
    lines = [
        "## Engine exports",
        "",
        "Each folder's README.md gives the exact vLLM or SGLang launch line, with the draft "
        "length this drafter was trained for (`draftsmith-export` prints them with the paths "
        "filled in).",
        "",
    ]
    for fmt in written:
        config = json.loads((folder / fmt / "config.json").read_text())
        lines.append(f"- `{fmt}/`")
        eagle3 = EAGLE3_ARCHITECTURE in config.get("architectures", [])
        if eagle3 and config.get("num_hidden_layers", 1) > 1 and "eagle_config" not in config:
            lines.append(f"  {NO_SGLANG_IDS_REASON}")
    return [*lines, ""]


def push_to_hub(folder: Path, repo_id: str, private: bool = True) -> str:
    """Upload ``folder`` to ``repo_id``; raise ``HubUploadError`` fast when offline."""
    from huggingface_hub import HfApi

    folder = Path(folder)
    hint = f"the drafter is saved at {folder}; upload it later with `hf upload {repo_id} {folder}`"
    if os.environ.get("HF_HUB_OFFLINE", "").lower() in ("1", "true", "yes", "on"):
        raise HubUploadError(
            f"--push_to_hub {repo_id}: HF_HUB_OFFLINE is set, so nothing was uploaded; {hint} "
            "(unset HF_HUB_OFFLINE and log in with `hf auth login` first)"
        )
    api = HfApi()
    try:
        # create_repo fails in well under a second without network, while upload_folder
        # would retry for tens of seconds (measured without network): probe with it first.
        api.create_repo(repo_id, exist_ok=True, private=private)
        info = api.upload_folder(repo_id=repo_id, folder_path=str(folder))
    except Exception as error:  # httpx, requests and hub errors share no base class
        raise HubUploadError(
            f"--push_to_hub {repo_id} failed ({type(error).__name__}: {error}); {hint}"
        ) from error
    return str(getattr(info, "commit_url", repo_id))


def _rope_line(rope: dict[str, Any] | None) -> list[str]:
    """The head's rope and context next to the target's (EAGLE-3 family heads)."""
    if not rope:
        return []
    target = rope.get("target_rope") or {}
    return [
        f"- rope and context: plain rope, theta {rope['rope_theta']:g}, no scaling, "
        f"max_position_embeddings {rope['max_position_embeddings']} (target: "
        f"{target.get('rope_type', 'default')} rope, theta {target.get('rope_theta', '?')}, "
        f"context {rope.get('target_max_position_embeddings')}); the same in every export"
    ]


def _pruned_vocab_note(kind: str, architecture: dict[str, Any]) -> list[str]:
    """The model card's account of a draft LM folder with a pruned draft vocabulary."""
    draft_vocab = architecture.get("draft_vocab_size")
    target_vocab = architecture.get("target_vocab_size")
    if kind != "draft_lm" or not draft_vocab or draft_vocab == target_vocab:
        return []
    coverage = architecture.get("draft_vocab_coverage")
    covered = f" (they cover {coverage:.1%} of the training labels)" if coverage else ""
    return [
        "## Pruned draft vocabulary",
        "",
        f"The output layer predicts over the {draft_vocab} most frequent training tokens of the "
        f"target's {target_vocab}{covered}, as EAGLE-3's head does; the input embedding still "
        "reads every target token. `config.json` keeps the target's `vocab_size` (for the "
        "embedding) and `model.safetensors` every weight except `lm_head.weight`, which is in "
        f"`draft_vocab.safetensors` ([{draft_vocab}, hidden]) with the maps `d2t` "
        f"([{draft_vocab}] int64: target id = draft id + d2t[draft id]) and `t2d` "
        f"([{target_vocab}] bool: the kept target ids). `load_drafter` reads both; a plain "
        "`AutoModelForCausalLM.from_pretrained` loads the folder but leaves `lm_head` freshly "
        "initialised: replace it with a bias-free `Linear(hidden, "
        f"{draft_vocab})` holding that weight and map its argmax or samples through `d2t`. "
        "Draft tokens outside this vocabulary have probability 0; speculative sampling stays "
        "exact because the verifier is given exactly that distribution.",
        "",
    ]
