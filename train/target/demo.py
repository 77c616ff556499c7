"""The demo target: a small Llama pretrained on CPU on the embedded stdlib corpus.

Drafters need a frozen target to imitate, and no model hub is reachable, so the project grows
its own: a byte-level BPE tokenizer (``draftsmith.data.tokenizer``) and a ``LlamaForCausalLM`` (Touvron et
al. 2023) trained with next-token cross-entropy (``draftsmith.train.objectives.causal_lm``) through the one
training loop (``draftsmith.train.loop``), within a wall-clock budget. The learning rate warms up, then
follows a cosine that reaches its floor exactly at the deadline (``schedule_by_time``), so a
time-boxed run ends annealed whatever the machine's speed.

The result is a normal Hugging Face folder (config.json, model.safetensors, generation_config.json,
tokenizer files) plus ``metrics.json``; it is written into a temporary sibling folder and renamed
into place, with the marker file ``BUILD_COMPLETE`` written last, so a folder that carries the
marker is complete and a second call reuses it instead of retraining.
"""

from __future__ import annotations

import hashlib
import json
import os
import time
from dataclasses import asdict, dataclass, replace
from pathlib import Path
from typing import Any

import torch
from draftsmith.data.atomic_io import atomic_folder
from draftsmith.decode.command_line import check_positive_finite
from draftsmith.decode.measure.machine import machine_record
from draftsmith.decode.precision import DtypeChoice, announce, choose_training_dtype
from draftsmith.train.batches import ShardedBatches
from draftsmith.train.loop import LoopConfig, evaluate, make_accelerator, run_training
from draftsmith.train.objectives.causal_lm import CausalLMObjective

MARKER = "BUILD_COMPLETE"
METRICS_FILE = "metrics.json"


@dataclass(frozen=True)
class DemoPreset:
    """Model shape, data and optimisation of one demo-target preset."""

    name: str
    num_layers: int
    hidden_size: int
    intermediate_size: int
    num_heads: int
    vocab_size: int = 8192
    block_size: int = 256
    batch_size: int = 8
    learning_rate: float = 1e-3
    warmup_steps: int = 30
    min_lr_ratio: float = 0.05
    weight_decay: float = 0.1
    max_minutes: float | None = 9.5
    max_steps: int = 100_000
    max_files: int | None = None
    validation_fraction: float = 0.01
    test_fraction: float = 0.01
    max_eval_blocks: int = 256
    tie_word_embeddings: bool = True

    def __post_init__(self) -> None:
        if self.max_minutes is not None:
            unset = " (or left out for the preset's budget)"
            check_positive_finite(self.max_minutes, "--max-minutes", "minutes", unset)
        if self.max_steps < 1:
            raise ValueError(f"--max-steps must be >= 1, got {self.max_steps}")

    @property
    def context_length(self) -> int:
        """The target's ``max_position_embeddings``: the longest sequence it is built for."""
        return max(2048, self.block_size)

    def with_budget(self, max_minutes: float | None, max_steps: int | None) -> DemoPreset:
        """This preset with its training budget replaced where given (checked at once)."""
        spec = self if max_minutes is None else replace(self, max_minutes=max_minutes)
        return spec if max_steps is None else replace(spec, max_steps=max_steps)


PRESETS: dict[str, DemoPreset] = {
    # About 30 M parameters, 8 x 512 with heads of 64: the shape at which, in bfloat16, a
    # verify pass over 5 tokens costs about one target step and a one-layer drafter a small
    # fraction of one (decode/forward/projection.py), as for the targets deployed on GPUs. Trained
    # under bfloat16 autocast where the CPU has the kernels, 18 minutes on 2 cores.
    "demo": DemoPreset(
        "demo",
        num_layers=8,
        hidden_size=512,
        intermediate_size=1408,
        num_heads=8,
        learning_rate=1.5e-3,
        max_minutes=18.0,
    ),
    # About 13.8 M parameters, 6 x 384: a forward pass ~3.4x the demo's layer work, for
    # benchmarks where a drafted token is cheaper relative to the target. Trained for an hour
    # (one build, ~60 min on 2 cores) so that its greedy output is code, not a run of newlines.
    "bench": DemoPreset(
        "bench",
        num_layers=6,
        hidden_size=384,
        intermediate_size=1024,
        num_heads=6,
        max_minutes=60.0,
    ),
    # Seconds: a few files, a small vocabulary, a few dozen steps. For tests.
    "tiny": DemoPreset(
        "tiny",
        num_layers=2,
        hidden_size=64,
        intermediate_size=128,
        num_heads=4,
        vocab_size=512,
        block_size=64,
        batch_size=8,
        learning_rate=3e-3,
        warmup_steps=5,
        max_minutes=None,
        max_steps=120,
        max_files=40,
        validation_fraction=0.1,
        test_fraction=0.1,
        max_eval_blocks=32,
    ),
}


def user_cache_dir() -> Path:
    """``$XDG_CACHE_HOME/draftsmith`` (``~/.cache/draftsmith`` by default)."""
    cache = os.environ.get("XDG_CACHE_HOME") or str(Path.home() / ".cache")
    return Path(cache).expanduser() / "draftsmith"


def default_targets_dir() -> Path:
    """``$XDG_CACHE_HOME/draftsmith/targets`` (``~/.cache/draftsmith/targets`` by default)."""
    return user_cache_dir() / "targets"


def default_target_path(preset: str = "demo", dtype: str = "auto") -> Path:
    """Where ``build_demo_target`` puts a preset when no output_dir is given:
    ``<preset>-<training dtype>-<key>``, the key a hash of the preset's settings, so a changed
    preset or another training dtype is a new build, never a stale folder reused."""
    spec = _preset(preset)
    trained_in = choose_training_dtype(dtype).name
    settings = json.dumps({**asdict(spec), "train_dtype": trained_in}, sort_keys=True)
    key = hashlib.sha256(settings.encode()).hexdigest()[:10]
    return default_targets_dir() / f"{preset}-{trained_in}-{key}"


def is_complete(folder: Path) -> bool:
    """Whether ``folder`` holds a finished demo-target build (its marker file exists)."""
    return (Path(folder) / MARKER).is_file()


def load_metrics(folder: Path) -> dict[str, Any]:
    """The ``metrics.json`` of a finished build (``LoadError`` naming it when it is damaged)."""
    from draftsmith.decode.loading import read_json_object

    fix = f"rebuild the target with force=True (--force), or remove {folder}"
    return read_json_object(Path(folder) / METRICS_FILE, fix)


def build_demo_target(
    output_dir: Path | None = None,
    preset: str = "demo",
    max_minutes: float | None = None,
    force: bool = False,
    max_steps: int | None = None,
    seed: int = 0,
    progress_bar: bool = True,
    verbose: bool = True,
    dtype: str = "auto",
) -> Path:
    """Train (or reuse) the demo target and return its folder.

    ``output_dir`` defaults to ``default_target_path(preset)``. A complete folder there is
    reused unless ``force``; an existing folder that is not a finished build is an error (it
    is never deleted unless ``force``). ``max_minutes`` / ``max_steps`` override the preset's
    training budget. ``dtype`` (``draftsmith.decode.precision.choose_training_dtype``) chooses the training
    precision: bfloat16 autocast with float32 master weights and optimizer state, or float32
    (``auto`` measures which is faster here); the saved weights
    are float32 either way, and ``metrics.json`` records the dtype. Metrics go to
    ``metrics.json`` and, with ``verbose``, to stdout.
    """
    spec = _preset(preset).with_budget(max_minutes, max_steps)
    choice = choose_training_dtype(dtype)
    folder = (
        Path(output_dir).expanduser()
        if output_dir is not None
        else default_target_path(preset, dtype)
    )
    if is_complete(folder) and not force:
        if verbose:
            print(f"reusing the demo target at {folder} (pass force=True / --force to rebuild)")
            print(format_metrics(load_metrics(folder)))
        return folder
    if folder.exists() and not force and any(folder.iterdir()):
        raise FileExistsError(
            f"{folder} exists but is not a finished demo-target build (no {MARKER} file): pass "
            "force=True (--force) to replace it, or choose another output_dir"
        )
    with atomic_folder(folder) as temp:  # renamed into place only once complete
        if verbose:
            announce(choice)
        metrics = _train_into(temp, spec, seed, progress_bar, choice)
    if verbose:
        print(f"demo target saved to {folder}")
        print(format_metrics(metrics))
    return folder


def format_metrics(metrics: dict[str, Any]) -> str:
    """One line per headline figure, for stdout."""
    keys = (
        "preset",
        "params",
        "test_loss",
        "test_top1_accuracy",
        "validation_loss",
        "tokens_seen",
        "tokens_per_s",
        "train_minutes",
        "dtype",
        "total_minutes",
    )
    lines = []
    for key in keys:
        if key in metrics:
            value = metrics[key]
            if isinstance(value, float):
                text = f"{value:,.4f}"
            elif isinstance(value, int):
                text = f"{value:,}"
            else:
                text = str(value)
            lines.append(f"  {key:<20} {text}")
    return "\n".join(lines)


def _preset(name: str) -> DemoPreset:
    if name not in PRESETS:
        raise ValueError(f"unknown demo-target preset {name!r}; choose one of {', '.join(PRESETS)}")
    return PRESETS[name]


def _train_into(
    folder: Path, spec: DemoPreset, seed: int, progress_bar: bool, choice: DtypeChoice
) -> dict[str, Any]:
    from draftsmith.data.corpus import load_stdlib_corpus
    from draftsmith.data.packing import collate, tokenize_and_pack
    from draftsmith.data.tokenizer import train_byte_level_bpe

    start = time.perf_counter()
    corpus = load_stdlib_corpus(
        include_tests=False,
        validation_fraction=spec.validation_fraction,
        test_fraction=spec.test_fraction,
        max_files=spec.max_files,
    )
    tokenizer = train_byte_level_bpe(corpus["train"]["text"], vocab_size=spec.vocab_size)
    blocks = {
        split: tokenize_and_pack(corpus[split], tokenizer, spec.block_size) for split in corpus
    }
    for split in ("train", "validation", "test"):
        if len(blocks[split]) == 0:
            raise ValueError(
                f"the {split} split of the corpus holds less than one block of "
                f"{spec.block_size} tokens; raise max_files or lower block_size"
            )
    model = _new_model(spec, tokenizer, seed)
    objective = CausalLMObjective(model)

    def collate_fn(rows: list[dict[str, Any]]) -> dict[str, torch.Tensor]:
        return collate(rows, pad_token_id=tokenizer.pad_token_id)

    def eval_batches(split: str) -> list[dict[str, torch.Tensor]]:
        rows = [blocks[split][i] for i in range(min(len(blocks[split]), spec.max_eval_blocks))]
        size = spec.batch_size
        return [collate_fn(rows[i : i + size]) for i in range(0, len(rows), size)]

    accelerator = make_accelerator(mixed_precision=choice.mixed_precision)
    train_batches = ShardedBatches(
        blocks["train"],
        spec.batch_size,
        collate_fn,
        seed=seed,
        process_index=accelerator.process_index,
        num_processes=accelerator.num_processes,
    )
    config = LoopConfig(
        max_steps=spec.max_steps,
        learning_rate=spec.learning_rate,
        weight_decay=spec.weight_decay,
        warmup_steps=spec.warmup_steps,
        lr_scheduler="cosine",
        min_lr_ratio=spec.min_lr_ratio,
        max_minutes=spec.max_minutes,
        schedule_by_time=spec.max_minutes is not None,
        progress_bar=progress_bar,
        log_every=25,
        description=f"demo target ({spec.name})",
    )
    prepare_s = time.perf_counter() - start
    result = run_training(objective, train_batches, config, accelerator, eval_batches("validation"))
    test_batches = eval_batches("test")
    test = evaluate(objective, test_batches, accelerator)

    folder.mkdir(parents=True, exist_ok=True)
    trained = accelerator.unwrap_model(objective.module)
    trained.save_pretrained(folder, safe_serialization=True)
    tokenizer.save_pretrained(folder)
    metrics = {
        "preset": spec.name,
        "params": sum(p.numel() for p in trained.parameters()),
        "test_loss": test["loss"],
        "test_top1_accuracy": test["top1_accuracy"],
        "validation_loss": result.final_eval.get("loss"),
        "validation_top1_accuracy": result.final_eval.get("top1_accuracy"),
        "test_tokens_scored": sum(int(b["attention_mask"].sum()) for b in test_batches),
        "steps": result.steps,
        "stop_reason": result.stop_reason,
        "tokens_seen": result.tokens_seen,
        "tokens_per_s": result.tokens_per_second,
        "train_minutes": result.minutes,
        "prepare_minutes": prepare_s / 60,
        "total_minutes": (time.perf_counter() - start) / 60,
        "train_blocks": len(blocks["train"]),
        "torch_threads": torch.get_num_threads(),
        **choice.record(),
        "machine": machine_record(),
        "loss_unit": "nats/token",
        "preset_config": asdict(spec),
        "seed": seed,
    }
    (folder / METRICS_FILE).write_text(json.dumps(metrics, indent=2))
    (folder / MARKER).write_text(f"{spec.name}\n")
    return metrics


def _new_model(spec: DemoPreset, tokenizer: Any, seed: int) -> torch.nn.Module:
    """A freshly initialised Llama; initialised under a forked, seeded global RNG."""
    from transformers import GenerationConfig, LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(
        vocab_size=len(tokenizer),
        hidden_size=spec.hidden_size,
        intermediate_size=spec.intermediate_size,
        num_hidden_layers=spec.num_layers,
        num_attention_heads=spec.num_heads,
        num_key_value_heads=spec.num_heads,
        max_position_embeddings=spec.context_length,
        bos_token_id=tokenizer.bos_token_id,
        eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id,
        tie_word_embeddings=spec.tie_word_embeddings,
    )
    # transformers initialises weights from the global RNG; fork it so that callers' global
    # state is left untouched and the initialisation depends on ``seed`` only.
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        model = LlamaForCausalLM(config)
    model.generation_config = GenerationConfig(
        bos_token_id=tokenizer.bos_token_id,
        eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id,
    )
    return model
