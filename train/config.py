"""Typed configuration of ``train/distill.py``: one default per field, YAML recipes, flags.

Eight sections, one dataclass each: target, drafter, data, loss, optim, logging, output,
speed_eval. Field names are unique across sections, so every field is also a command-line
flag of the same name (``--learning_rate 3e-4``). A recipe YAML groups them by section::

    inherit: base/tiny.yaml   # optional: start from this recipe (relative to this file)
    target:
      target: demo
    loss:
      loss: tv
      loss_temperature: 1.0

``inherit`` names another recipe, resolved against the folder of the file that names it; that
recipe is read first (it may inherit in turn) and every value this file gives overrides it.
A chain that comes back to a file it already read is an error naming the chain.

``--config recipe.yaml`` (given once) sets values, flags override them, and an unknown section
or key is an error that lists the valid ones (parsed with ``transformers.HfArgumentParser``).
Types are strict: a recipe value must have its field's type (``max_steps: 2.5``, ``null`` or
``[1, 2]`` is an error naming the key and the expected type; an integer is accepted where a
float is expected), a flag that does not parse is an error (a flag given twice keeps the
last value, as argparse does; ``--config`` given twice is an error), and every float must be
finite. Errors are ``ValueError``s, never an argparse exit. The
defaults are the demo recipe (``configs/demo.yaml``): ``python train/distill.py`` with no
argument distils an EAGLE-3 head (pruned 2048-token vocabulary) from the demo target on the
target's own continuations of the embedded corpus's prompts, greedy and sampled.
"""

from __future__ import annotations

import dataclasses
import math
import typing
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, NoReturn

from draftsmith.decode.cpu_threads import check_thread_count
from draftsmith.decode.defaults import (
    ADAPTIVE_DRAFT_TOKENS,
    DEMO_PROMPT_CHARS,
    MAX_SEED,
    NUM_DRAFT_TOKENS,
    TREE_TOP_K,
)
from draftsmith.decode.drafters.eagle.config import VARIANT_FLAGS as HEAD_VARIANT_FLAGS
from draftsmith.decode.precision import DtypeChoice, choose_training_dtype
from draftsmith.decode.yaml_values import (
    describe_type,
    describe_value,
    load_plain_yaml,
    typed_value,
)

DEMO_TARGET_PRESETS = ("demo", "bench", "tiny")
TARGET_OUTPUTS = ("online", "cache", "cache_only")
TARGET_SHARDINGS = ("none", "fsdp")
CACHE_DTYPES = ("float16", "bfloat16", "float32")
DATA_FORMATS = ("auto", "text", "conversations", "prompt_response")
EVAL_SOURCES = ("target_samples", "data")
TRAIN_PROMPT_FORMS = ("blocks", "definitions")
DRAFTER_INITS = ("random", "embeddings", "target_layers")
REPORTERS = ("wandb", "tensorboard", "none")
MIXED_PRECISION = ("auto", "no", "bf16", "fp16")
DTYPES = ("auto", "float32", "bfloat16", "float16")
LR_SCHEDULERS = ("cosine", "linear", "constant")  # draftsmith.train.loop.SCHEDULES
HIDDEN_STATE_NOISE_SHAPES = ("uniform", "gaussian")  # draftsmith.train.objectives.heads
EXPORT_FORMATS_BY_KIND = {  # drafter kind -> the --export_format layouts it writes
    "eagle3": ("vllm", "sglang", "speculators"),
    "medusa": ("vllm",),
    "peagle": ("speculators",),
    "dflash": ("vllm", "speculators"),
}
# Every engine layout some kind writes.
EXPORT_FORMATS = tuple(dict.fromkeys(f for fs in EXPORT_FORMATS_BY_KIND.values() for f in fs))


@dataclass(frozen=True)
class RunPrecision:
    """What a distillation run computes in (``DistillConfig.precision``)."""

    choice: DtypeChoice
    target_dtype: str  # the frozen target's weights
    mixed_precision: str  # accelerate's setting for the drafter: no | bf16 | fp16

    def record(self) -> dict[str, str]:
        """The fields of summary.json, provenance and the model card."""
        return {
            **self.choice.record(),
            "target_dtype": self.target_dtype,
            "mixed_precision": self.mixed_precision,
        }


def _f(default: Any, help: str, **kwargs: Any) -> Any:
    return field(default=default, metadata={"help": help, **kwargs})


@dataclass
class TargetConfig:
    """The frozen model the drafter imitates."""

    target: str = _f(
        "demo",
        "a demo-target preset (demo, bench, tiny: taken from the user cache, built if missing), "
        "a local model folder, or a hub id; write ./demo for a local folder named demo",
    )
    dtype: str = _f(
        "auto",
        "dtype of the run (draftsmith.decode.precision): the frozen target's weights and the drafter's "
        "autocast; auto: bfloat16 where the CPU has AVX512-BF16/AMX kernels or the GPU "
        f"supports it, float32 elsewhere; {', '.join(DTYPES)}",
    )
    target_dtype: str = _f(
        "auto", f"dtype the frozen target runs in (auto: --dtype); {', '.join(DTYPES)}"
    )
    trust_remote_code: bool = _f(False, "allow custom modelling code of a hub target")
    target_sharding: str = _f(
        "none",
        "none: every process holds the whole frozen target; fsdp: FSDP2 fully_shard splits it "
        "over the processes (each holds ~1/N, a layer gathered only while it runs; needs >= 2 "
        "processes; docs/guides/large-targets.md)",
    )


@dataclass
class DrafterConfig:
    """The drafter: its kind (registry key) and architecture."""

    drafter_kind: str = _f("eagle3", "registry key of the drafter/objective kind")
    drafter_path: str | None = _f(
        None, "initialise from this causal-LM folder instead of building from the target config"
    )
    drafter_num_layers: int = _f(
        1,
        "decoder layers of a draft LM built from the target's config, or of an EAGLE-3/P-EAGLE head",
    )
    drafter_hidden_size: int | None = _f(None, "hidden size (default: the target's)")
    drafter_intermediate_size: int | None = _f(
        None, "MLP size of a draft LM or an EAGLE-3/P-EAGLE head's layer (default: the target's)"
    )
    drafter_num_heads: int | None = _f(None, "attention heads (default: the target's)")
    drafter_init: str = _f(
        "embeddings",
        "random; embeddings (copy the target's embeddings, final norm and LM head); "
        "target_layers (also copy its first drafter_num_layers layers)",
    )
    freeze_embeddings: bool = _f(False, "keep copied input embeddings and LM head frozen")
    lora_rank: int = _f(0, "LoRA rank through peft (0 = train every parameter); merged on export")
    lora_alpha: float = _f(16.0, "LoRA scaling numerator")
    lora_dropout: float = _f(0.0, "LoRA dropout")
    lora_target_modules: str = _f("all-linear", "peft target_modules (comma list or all-linear)")
    draft_vocab_size: int | None = _f(
        2048,
        "eagle3 and draft_lm: keep the N most frequent training tokens in the output layer "
        "(a pruned draft vocabulary; null: all)",
    )
    aux_hidden_state_layer_ids: list[int] | None = field(
        default=None,
        metadata={"help": "eagle3: target hidden-state ids fused by the head (default 2,L//2,L-3)"},
    )
    fc_norm: bool = _f(
        False,
        "eagle3, peagle: EAGLE-3.1's RMSNorm on each captured target state before fc "
        "(fc_norm.{i}, as vLLM reads it)",
    )
    norm_output: bool = _f(
        False,
        "eagle3, peagle: EAGLE-3.1's normed head output fed to the next step (vLLM's norm_output)",
    )
    norm_before_residual: bool = _f(
        False,
        "eagle3, peagle: the residual stream starts from hidden_norm(fused features) "
        "(speculators' norm_before_residual)",
    )
    medusa_num_heads: int = _f(4, "medusa: heads, head i guessing the token i+2 ahead")
    medusa_num_layers: int = _f(1, "medusa: residual blocks per head")
    mask_token_id: int | None = _f(
        None,
        "peagle, dflash: the placeholder token of the mask rows (null: the data's rarest token)",
    )
    dflash_block_size: int = _f(
        16, "dflash: rows of a block pass, B - 1 of them drafted (DFlash: 16)"
    )
    markov_rank: int = _f(
        0,
        "dflash: rank of DSpark's Markov head biasing each position by the draft before it (0: off)",
    )
    confidence_head: bool = _f(
        False, "dflash: DSpark's confidence head, which decides how much of a block is verified"
    )


@dataclass
class DataConfig:
    """What the drafter trains on, and where the target's distributions come from."""

    dataset: str = _f(
        "stdlib",
        "stdlib (the embedded corpus), a .jsonl/.json file (e.g. from "
        "scripts/regenerate_data.py), a text file or folder of them, or a datasets name",
    )
    data_format: str = _f("auto", f"how rows are read: {', '.join(DATA_FORMATS)}")
    text_field: str = _f("text", "JSONL field holding text")
    messages_field: str = _f("messages", "JSONL field holding a conversation")
    system_prompt: str | None = _f(
        None,
        "system turn of every training conversation that opens without one, recorded in the "
        "drafter's provenance.json for draftsmith-evaluate and draftsmith-benchmark to send "
        "with their chat prompts (draftsmith.data.chat_context)",
    )
    block_size: int = _f(256, "tokens per training sequence")
    max_files: int | None = _f(None, "stdlib only: cap on corpus files (tests, quick runs)")
    max_train_sequences: int | None = _f(None, "cap on training sequences after packing")
    validation_fraction: float = _f(0.02, "held-out share of user data (stdlib: fixed split)")
    target_outputs: str = _f(
        "online",
        "online: the target scores every batch; cache: score once into a top-k cache first; "
        "cache_only: train and evaluate from a complete cache without the target's layers",
    )
    cache_dir: str | None = _f(None, "offline cache folder (default: <output_dir>/target_cache)")
    cache_top_k: int = _f(
        256,
        "log-probs kept per token in the offline cache (the rest mass is spread evenly over the "
        "other tokens: too small a k teaches a flat tail and costs acceptance when sampling)",
    )
    cache_dtype: str = _f(
        "float16", f"dtype of the cached log-probs and hidden states: {', '.join(CACHE_DTYPES)}"
    )
    cache_build_only: bool = _f(
        False,
        "with --target_outputs cache: stop once the cache (training and held-out rows) is "
        "written; train later with --target_outputs cache_only",
    )
    on_policy_fraction: float = _f(
        0.0, "share of batches continued by the drafter itself, then scored by the target"
    )
    on_policy_prompt_tokens: int = _f(32, "tokens of each sequence kept as the prompt")
    on_policy_temperature: float = _f(1.0, "temperature the drafter samples at on-policy")
    eval_source: str = _f(
        "target_samples",
        "held-out sequences: target_samples (held-out prompts continued by the target, where "
        "acceptance is measured) or data (held-out text as is)",
    )
    train_source: str = _f(
        "target_samples",
        "training sequences: data (the dataset as is) or target_samples (prompts cut from the "
        "dataset's training sequences continued by the target at each of "
        "--train_temperatures: the target's own text, greedy and sampled, where acceptance "
        "is measured)",
    )
    train_sequences: int = _f(
        1200, "target_samples: sequences regenerated (split over temperatures)"
    )
    train_prompts: str = _f(
        "definitions",
        "target_samples: blocks (the first --train_prompt_tokens tokens of training sequences) "
        "or definitions (the --train_prompt_chars characters of code up to a def/class line "
        "in them, the form of the prompts evaluated and served)",
    )
    train_prompt_tokens: int = _f(32, "target_samples, blocks: prompt tokens kept")
    train_prompt_chars: int = _f(
        DEMO_PROMPT_CHARS, "target_samples, definitions: characters of code kept as the prompt"
    )
    train_prompt_loss: bool = _f(
        True, "target_samples: train on the prompt's tokens too, not only the continuation"
    )
    train_samples_seed: int | None = _f(
        None,
        "target_samples: seed of the target's continuations (null: --seed); fixing it lets runs "
        "of different seeds share one regeneration (the ablation's --samples-seed)",
    )
    train_temperatures: list[float] = field(
        default_factory=lambda: [0.0, 1.0],
        metadata={"help": "target_samples: temperatures the target continues at (0: greedy)"},
    )
    eval_sequences: int = _f(32, "held-out sequences")
    eval_prompt_tokens: int = _f(32, "prompt tokens of each held-out sequence")
    eval_new_tokens: int = _f(96, "tokens the target samples after each held-out prompt")


@dataclass
class LossConfig:
    """The distillation objective (draftsmith.train.losses)."""

    loss: str = _f(
        "0.5*fkl+0.5*tv",
        "loss spec: tv, fkl, rkl, jsd:0.5, lk, nla, ce, or a mix like 0.5*fkl+0.5*tv",
    )
    loss_temperature: float = _f(1.0, "temperature both distributions are taken at in the loss")
    eval_temperature: float = _f(1.0, "decoding temperature the held-out overlap is measured at")
    unroll_steps: int = _f(
        4, "eagle3: training-time-test steps; peagle: depths drafted per pass (positions trained)"
    )
    cod_ratio: float = _f(
        0.7,
        "peagle: conditional drop-token sampling keeps about max(r^(k-1), cod_min_ratio) of the "
        "anchors at depth k >= 2 (1: all)",
    )
    cod_min_ratio: float = _f(0.2, "peagle: the floor of that share at deep depths")
    dflash_num_anchors: int = _f(16, "dflash: blocks trained per sequence (random anchors)")
    dflash_loss_decay: float = _f(
        7.0, "dflash: position j of a block weighs exp(-(j-1)/gamma) in the loss (gamma)"
    )
    confidence_weight: float = _f(
        1.0, "dflash: weight of the confidence head's binary cross-entropy (DSpark: 1.0)"
    )
    position_weights: list[float] | None = field(
        default=None,
        metadata={"help": "eagle3/medusa: loss weight per draft position (default decay^(j-1))"},
    )
    position_weight_decay: float = _f(0.8, "eagle3/medusa: geometric per-position weight")
    align_topk: int = _f(
        0,
        "eagle3/medusa: train draft position j>1 only where the drafter's top-K held the chain's "
        "token at every earlier position (GRIFFIN's loss masking; 0: off)",
    )
    loss_chunk_size: int = _f(
        0,
        "draft_lm: positions per chunk of the loss, the draft and target heads applied per chunk "
        "and recomputed in the backward pass, so no [B, T, V] float32 tensor exists (0: off)",
    )
    hidden_state_noise: float = _f(
        0.0,
        "eagle3/peagle/medusa/dflash: scale s of the noise added to the target's hidden states "
        "the drafter reads, in training only (speculators' recipe: 0.05; 0: off)",
    )
    hidden_state_noise_shape: str = _f(
        "uniform",
        "uniform: U(-s, s) per value (speculators' train.py, AddUniformNoise); gaussian: N(0, s^2) "
        "(its AddGaussianNoise)",
    )


@dataclass
class OptimConfig:
    """Optimisation (draftsmith.train.loop.LoopConfig)."""

    learning_rate: float = _f(2e-3, "peak AdamW learning rate")
    weight_decay: float = _f(0.0, "AdamW weight decay on matrices")
    adam_beta1: float = _f(0.9, "AdamW beta1")
    adam_beta2: float = _f(0.95, "AdamW beta2")
    warmup_steps: int = _f(20, "linear warmup steps")
    lr_scheduler: str = _f("cosine", "cosine, linear or constant after warmup")
    min_lr_ratio: float = _f(0.1, "final learning rate / peak")
    max_grad_norm: float = _f(1.0, "gradient clipping norm (0 disables)")
    max_steps: int = _f(450, "optimizer steps")
    max_minutes: float | None = _f(
        8.0, "wall-clock budget of the training loop; stops cleanly and checkpoints (null: none)"
    )
    schedule_by_time: bool = _f(
        False,
        "with max_minutes set, decay by the larger of the share of max_steps done and of the "
        "budget spent, so a run the time box stops has annealed by then (false: by steps alone, "
        "which a resumed time-boxed run replays bit for bit)",
    )
    per_device_batch_size: int = _f(8, "sequences per process per micro-batch")
    gradient_accumulation_steps: int = _f(1, "micro-batches per optimizer step")
    mixed_precision: str = _f(
        "auto",
        "accelerate mixed precision of the drafter (float32 master weights and optimizer "
        f"state); auto: bf16 when --dtype is bfloat16, else no; {', '.join(MIXED_PRECISION)}",
    )
    threads: int | None = _f(
        None, "torch CPU threads per process (null: the process's share of the machine's cores)"
    )
    seed: int = _f(0, "seed of initialisation, data order and sampling")


@dataclass
class LoggingConfig:
    """Tracking, progress and evaluation cadence."""

    report_to: str = _f(
        "wandb",
        "wandb (offline by itself without API key or network), tensorboard, none, or a comma list",
    )
    project: str = _f("draftsmith", "tracker project name")
    run_name: str | None = _f(None, "run name (default: the output folder's name)")
    log_every: int = _f(10, "steps between logged training metrics")
    eval_every: int = _f(50, "steps between held-out evaluations (0: only at the end)")
    progress_bar: bool = _f(True, "tqdm progress bar on the main process")


@dataclass
class OutputConfig:
    """Checkpoints and the exported drafter."""

    output_dir: str = _f("outputs/distill-demo", "run folder: checkpoints, logs, drafter/")
    checkpoint_every: int = _f(50, "steps between checkpoints (0: only at the end)")
    keep_checkpoints: int = _f(2, "checkpoints kept (the newest)")
    resume_from_checkpoint: str | None = _f(None, "latest or a checkpoint-<step> folder")
    overwrite_output_dir: bool = _f(False, "start afresh in an output_dir that has checkpoints")
    push_to_hub: str | None = _f(None, "hub repo id to upload the exported drafter to")
    export_format: str | None = _f(
        None, "eagle3/medusa: also write vllm and/or sglang layouts (comma list) in drafter/<fmt>/"
    )


@dataclass
class SpeedEvalConfig:
    """After export: decode held-out prompts with the drafter, side by side with plain decoding."""

    speed_eval_prompts: int = _f(6, "held-out prompts decoded after training (0 skips the step)")
    speed_eval_prompt_source: str = _f("demo", "'demo' (held-out stdlib code) or a prompt file")
    speed_eval_new_tokens: int = _f(128, "tokens generated per prompt")
    speed_eval_repeats: int = _f(
        1,
        "interleaved passes over the prompts, each prompt timed by its fastest pass of the same "
        "tokens (draftsmith.decode.measure.side_by_side): 2 on a shared machine",
    )
    speed_eval_temperatures: list[float] = field(
        default_factory=lambda: [0.0, 1.0],
        metadata={"help": "decoding temperatures measured"},
    )
    speed_eval_ood_prompts: str = _f(
        "ood",
        "a second prompt set the target never saw, decoded at each temperature too: 'ood' "
        "(installed third-party code), a prompt file, or '' to skip",
    )
    speed_eval_adaptive: bool = _f(
        False,
        "choose each chain round's draft length in 0..speed_eval_adaptive_draft_tokens from "
        "measured acceptance and round times (false: every round drafts speed_eval_draft_tokens)",
    )
    speed_eval_adaptive_draft_tokens: int = _f(
        ADAPTIVE_DRAFT_TOKENS, "the most drafts an adaptive round may take"
    )
    speed_eval_draft_tokens: int = _f(
        NUM_DRAFT_TOKENS, "num_draft_tokens of fixed chains (chain length) and trees (depth)"
    )
    speed_eval_tree_top_k: int = _f(TREE_TOP_K, "eagle3/medusa trees: children per expanded node")
    speed_eval_tree_total_tokens: int = _f(
        0, "eagle3/medusa trees at T = 0: nodes per tree (0: chains)"
    )
    speed_eval_tree_frontier: int = _f(
        0,
        "eagle3 trees: nodes per level that grow children (0: all top_k, EAGLE-2; 1: chain "
        "and runners-up)",
    )


SECTIONS: dict[str, type] = {
    "target": TargetConfig,
    "drafter": DrafterConfig,
    "data": DataConfig,
    "loss": LossConfig,
    "optim": OptimConfig,
    "logging": LoggingConfig,
    "output": OutputConfig,
    "speed_eval": SpeedEvalConfig,
}


@dataclass
class DistillConfig:
    """All sections of one run."""

    target: TargetConfig = field(default_factory=TargetConfig)
    drafter: DrafterConfig = field(default_factory=DrafterConfig)
    data: DataConfig = field(default_factory=DataConfig)
    loss: LossConfig = field(default_factory=LossConfig)
    optim: OptimConfig = field(default_factory=OptimConfig)
    logging: LoggingConfig = field(default_factory=LoggingConfig)
    output: OutputConfig = field(default_factory=OutputConfig)
    speed_eval: SpeedEvalConfig = field(default_factory=SpeedEvalConfig)
    config_file: str | None = None

    def to_dict(self) -> dict[str, Any]:
        """Section -> field -> value (what provenance.json and the trackers record)."""
        out: dict[str, Any] = {name: dataclasses.asdict(getattr(self, name)) for name in SECTIONS}
        out["config_file"] = self.config_file
        return out

    def flat(self) -> dict[str, Any]:
        """Field -> value over all sections."""
        return {
            k: v for name in SECTIONS for k, v in dataclasses.asdict(getattr(self, name)).items()
        }

    def precision(self, device: str) -> RunPrecision:
        """The run's training dtypes on ``device``: ``dtype``'s choice for training
        (``choose_training_dtype``), unless a field names its own."""
        choice = choose_training_dtype(self.target.dtype, device)
        target = self.target.target_dtype
        mixed = self.optim.mixed_precision
        return RunPrecision(
            choice,
            target_dtype=choice.name if target == "auto" else target,
            mixed_precision=choice.mixed_precision if mixed == "auto" else mixed,
        )

    def validate(self) -> None:
        """Check values that do not need any file or model; raise naming the fix."""
        checks = [
            (self.target.dtype, DTYPES, "dtype"),
            (self.target.target_dtype, DTYPES, "target_dtype"),
            (self.drafter.drafter_init, DRAFTER_INITS, "drafter_init"),
            (self.data.data_format, DATA_FORMATS, "data_format"),
            (self.data.target_outputs, TARGET_OUTPUTS, "target_outputs"),
            (self.target.target_sharding, TARGET_SHARDINGS, "target_sharding"),
            (self.data.cache_dtype, CACHE_DTYPES, "cache_dtype"),
            (self.data.eval_source, EVAL_SOURCES, "eval_source"),
            (self.data.train_prompts, TRAIN_PROMPT_FORMS, "train_prompts"),
            (self.optim.mixed_precision, MIXED_PRECISION, "mixed_precision"),
            (self.optim.lr_scheduler, LR_SCHEDULERS, "lr_scheduler"),
        ]
        for value, allowed, name in checks:
            if value not in allowed:
                raise ValueError(
                    f"--{name} {value!r} is not valid; choose one of {', '.join(allowed)}"
                )
        for reporter in self.logging_reporters():
            if reporter not in REPORTERS:
                raise ValueError(
                    f"--report_to {self.logging.report_to!r}: unknown tracker {reporter!r}; use "
                    f"{', '.join(REPORTERS)} or a comma list of them"
                )
        if not 0.0 <= self.data.on_policy_fraction <= 1.0:
            raise ValueError(
                f"--on_policy_fraction must lie in [0, 1], got {self.data.on_policy_fraction}"
            )
        if self.data.on_policy_fraction > 0 and (
            self.data.on_policy_prompt_tokens < 1
            or self.data.on_policy_prompt_tokens >= self.data.block_size
        ):
            raise ValueError(
                f"--on_policy_prompt_tokens must lie in [1, block_size={self.data.block_size}), "
                f"got {self.data.on_policy_prompt_tokens}"
            )
        if self.data.system_prompt is not None and not self.data.system_prompt.strip():
            raise ValueError(
                "--system_prompt is blank; write the system turn's text, or drop it (null) for "
                "conversations without one"
            )
        if not 0.0 < self.data.validation_fraction < 1.0:
            raise ValueError(
                f"--validation_fraction must lie in (0, 1), got {self.data.validation_fraction}"
            )
        positive = {
            "block_size": self.data.block_size,
            "cache_top_k": self.data.cache_top_k,
            "eval_sequences": self.data.eval_sequences,
            "eval_prompt_tokens": self.data.eval_prompt_tokens,
            "eval_new_tokens": self.data.eval_new_tokens,
            "per_device_batch_size": self.optim.per_device_batch_size,
            "gradient_accumulation_steps": self.optim.gradient_accumulation_steps,
            "keep_checkpoints": self.output.keep_checkpoints,
            "drafter_num_layers": self.drafter.drafter_num_layers,
            "unroll_steps": self.loss.unroll_steps,
            "medusa_num_heads": self.drafter.medusa_num_heads,
            "medusa_num_layers": self.drafter.medusa_num_layers,
            "dflash_num_anchors": self.loss.dflash_num_anchors,
        }
        positive["max_steps"] = self.optim.max_steps
        positive["log_every"] = self.logging.log_every
        for name in (
            "speed_eval_new_tokens",
            "speed_eval_draft_tokens",
            "speed_eval_adaptive_draft_tokens",
            "speed_eval_tree_top_k",
            "speed_eval_repeats",
        ):
            positive[name] = getattr(self.speed_eval, name)
        for name in ("drafter_intermediate_size", "drafter_hidden_size", "drafter_num_heads"):
            if getattr(self.drafter, name) is not None:  # None: the target's
                positive[name] = getattr(self.drafter, name)
        if self.data.max_train_sequences is not None:
            positive["max_train_sequences"] = self.data.max_train_sequences
        for name, value in positive.items():
            if value < 1:
                raise ValueError(f"--{name} must be >= 1, got {value}")
        if self.optim.threads is not None:
            check_thread_count(self.optim.threads)
        for name, zero in (
            ("speed_eval_prompts", "skips it"),
            ("speed_eval_tree_total_tokens", "chains"),
        ):
            if getattr(self.speed_eval, name) < 0:
                raise ValueError(
                    f"--{name} must be >= 0 (0: {zero}), got {getattr(self.speed_eval, name)}"
                )
        speed = self.speed_eval
        if not 0 <= speed.speed_eval_tree_frontier <= speed.speed_eval_tree_top_k:
            raise ValueError(
                f"--speed_eval_tree_frontier must lie in [0, --speed_eval_tree_top_k="
                f"{speed.speed_eval_tree_top_k}] (0: every node of a level grows children), got "
                f"{speed.speed_eval_tree_frontier}"
            )
        if not 0.0 <= self.drafter.lora_dropout < 1.0:
            raise ValueError(f"--lora_dropout must lie in [0, 1), got {self.drafter.lora_dropout}")
        if self.drafter.lora_alpha <= 0:
            raise ValueError(f"--lora_alpha must be > 0, got {self.drafter.lora_alpha}")
        for name, value in self.flat().items():
            floats = value if isinstance(value, list) else [value]
            if any(isinstance(v, float) and not math.isfinite(v) for v in floats):
                raise ValueError(f"--{name} must be a finite number, got {value}")
        if self.optim.learning_rate <= 0:
            raise ValueError(f"--learning_rate must be > 0, got {self.optim.learning_rate}")
        for name in ("max_grad_norm", "weight_decay", "warmup_steps"):
            if getattr(self.optim, name) < 0:
                raise ValueError(
                    f"--{name} must be >= 0 (0 disables it), got {getattr(self.optim, name)}"
                )
        for name in ("adam_beta1", "adam_beta2"):
            if not 0.0 <= getattr(self.optim, name) < 1.0:
                raise ValueError(f"--{name} must lie in [0, 1), got {getattr(self.optim, name)}")
        if self.optim.max_minutes is not None and self.optim.max_minutes <= 0:
            raise ValueError(
                f"--max_minutes must be > 0 (or unset for no budget), got {self.optim.max_minutes}"
            )
        if self.data.train_source not in ("data", "target_samples"):
            raise ValueError(
                f"--train_source must be data or target_samples, got {self.data.train_source!r}"
            )
        if self.data.train_source == "target_samples" and not (
            1 <= self.data.train_prompt_tokens < self.data.block_size
            and self.data.train_sequences >= len(self.data.train_temperatures) >= 1
            and all(t >= 0 for t in self.data.train_temperatures)
        ):
            raise ValueError(
                "--train_source target_samples needs 1 <= --train_prompt_tokens < --block_size, "
                "at least one --train_temperatures value >= 0 and --train_sequences >= their "
                f"count; got {self.data.train_prompt_tokens}, {self.data.train_temperatures}, "
                f"{self.data.train_sequences}"
            )
        if self.data.train_prompt_chars < 1:
            raise ValueError(
                f"--train_prompt_chars must be >= 1, got {self.data.train_prompt_chars}"
            )
        if self.loss.loss_temperature <= 0:
            raise ValueError(f"--loss_temperature must be > 0, got {self.loss.loss_temperature}")
        if self.loss.eval_temperature < 0:
            raise ValueError(f"--eval_temperature must be >= 0, got {self.loss.eval_temperature}")
        if self.loss.align_topk < 0:
            raise ValueError(f"--align_topk must be >= 0 (0: off), got {self.loss.align_topk}")
        if self.loss.align_topk and self.drafter.drafter_kind not in ("eagle3", "medusa"):
            raise ValueError(
                f"--align_topk masks the draft positions of head drafters (eagle3, medusa); "
                f"--drafter_kind {self.drafter.drafter_kind} trains one position per token, "
                "so leave it at 0"
            )
        if self.drafter.lora_rank < 0:
            raise ValueError(
                f"--lora_rank must be >= 0 (0 disables LoRA), got {self.drafter.lora_rank}"
            )
        self._validate_hidden_state_noise()
        self._validate_head_variants()
        if self.loss.loss_chunk_size < 0:
            raise ValueError(
                f"--loss_chunk_size must be >= 0 (0: off), got {self.loss.loss_chunk_size}"
            )
        self._validate_schedule()
        self._validate_run_folder()
        self._validate_export_format()
        self._validate_large_target()

    def _validate_hidden_state_noise(self) -> None:
        """Noise on the target's hidden states: a scale >= 0, a known shape, a kind that reads
        hidden states."""
        loss = self.loss
        if loss.hidden_state_noise < 0:
            raise ValueError(
                f"--hidden_state_noise must be >= 0 (0: off), got {loss.hidden_state_noise}"
            )
        if loss.hidden_state_noise_shape not in HIDDEN_STATE_NOISE_SHAPES:
            raise ValueError(
                f"--hidden_state_noise_shape must be one of {', '.join(HIDDEN_STATE_NOISE_SHAPES)}, "
                f"got {loss.hidden_state_noise_shape!r}"
            )
        if loss.hidden_state_noise and self.drafter.drafter_kind not in EXPORT_FORMATS_BY_KIND:
            raise ValueError(
                f"--hidden_state_noise perturbs the target's hidden states a head reads "
                f"({', '.join(EXPORT_FORMATS_BY_KIND)}); --drafter_kind "
                f"{self.drafter.drafter_kind} reads none, so leave it at 0"
            )

    def _validate_head_variants(self) -> None:
        """EAGLE-3.1's and speculators' layer variants belong to the EAGLE-3 head (eagle3,
        peagle), and SGLang's layout has no place for them."""
        drafter = self.drafter
        chosen = [f"--{flag}" for flag in HEAD_VARIANT_FLAGS if getattr(drafter, flag)]
        if not chosen:
            return
        if drafter.drafter_kind not in ("eagle3", "peagle"):
            raise ValueError(
                f"{', '.join(chosen)}: these change the EAGLE-3 head's layer (eagle3, peagle); "
                f"--drafter_kind {drafter.drafter_kind} has no such layer, so leave them off"
            )
        if "sglang" in parse_export_formats(self.output.export_format):
            raise ValueError(
                f"--export_format sglang with {', '.join(chosen)}: vLLM's llama_eagle3.py reads "
                "these, SGLang's EAGLE-3 layer is not known to (it would serve a different "
                "head); export with --export_format vllm (or speculators)"
            )

    def _validate_schedule(self) -> None:
        """The loop's settings (``draftsmith.train.loop.LoopConfig``), checked before any model loads."""
        if not 0.0 <= self.optim.min_lr_ratio <= 1.0:
            raise ValueError(
                f"--min_lr_ratio must lie in [0, 1] (final learning rate / peak), got "
                f"{self.optim.min_lr_ratio}"
            )
        for name, value in (
            ("checkpoint_every", self.output.checkpoint_every),
            ("eval_every", self.logging.eval_every),
        ):
            if value < 0:
                raise ValueError(f"--{name} must be >= 0 (0: only at the end), got {value}")
        for name, seed in (
            ("seed", self.optim.seed),
            ("train_samples_seed", self.data.train_samples_seed),
        ):
            if seed is not None and not 0 <= seed <= MAX_SEED:
                raise ValueError(f"--{name} must lie in [0, 2**32 - 1], got {seed}")

    def _validate_run_folder(self) -> None:
        """An empty ``--output_dir`` (an unset shell variable, say) would write into the
        working folder: refuse it."""
        if not self.output.output_dir.strip():
            raise ValueError(
                "--output_dir is empty; pass the run folder (e.g. outputs/distill-demo), or "
                "--output_dir . to write into the working folder"
            )

    def _validate_export_format(self) -> None:
        """``--export_format`` names layouts the drafter kind writes, checked before training
        (an unknown one would otherwise fail, or be ignored, only at export)."""
        value = self.output.export_format
        formats = parse_export_formats(value)
        if not formats:
            return
        kind = self.drafter.drafter_kind
        allowed = EXPORT_FORMATS_BY_KIND.get(kind, ())
        bad = [fmt for fmt in formats if fmt not in allowed]
        if bad:
            offer = f"use {', '.join(allowed)}" if allowed else "leave --export_format unset"
            raise ValueError(
                f"--export_format {value!r}: --drafter_kind {kind} writes no {', '.join(bad)} "
                f"layout; {offer} (its native drafter/ folder is always written)"
            )
        if "sglang" in formats and self.drafter.drafter_num_layers != 1:
            raise ValueError(
                f"--export_format sglang: SGLang serves single-layer EAGLE-3 heads only, got "
                f"--drafter_num_layers {self.drafter.drafter_num_layers}; export with "
                "--export_format vllm (or speculators), or train with --drafter_num_layers 1"
            )

    def _validate_large_target(self) -> None:
        """A sharded target and cache-only runs read their rows from data, never generate them
        (generation runs the whole target on one process; docs/guides/large-targets.md)."""
        data = self.data
        if data.cache_build_only and data.target_outputs != "cache":
            raise ValueError(
                "--cache_build_only builds the offline cache: pass --target_outputs cache too "
                f"(got {data.target_outputs})"
            )
        for setting, asked in (
            ("--target_sharding fsdp", self.target.target_sharding != "none"),
            ("--target_outputs cache_only", data.target_outputs == "cache_only"),
        ):
            generated = [
                f"--{name} target_samples"
                for name in ("train_source", "eval_source")
                if getattr(data, name) == "target_samples"
            ]
            if asked and (generated or data.on_policy_fraction > 0):
                raise ValueError(
                    f"{setting} cannot continue prompts with the target "
                    f"({', '.join(generated) or '--on_policy_fraction > 0'}): pass "
                    "--train_source data --eval_source data --on_policy_fraction 0 (regenerate "
                    "the data beforehand with scripts/regenerate_data.py and pass it as --dataset)"
                )

    def logging_reporters(self) -> list[str]:
        return [part.strip() for part in self.logging.report_to.split(",") if part.strip()]


def parse_export_formats(value: str | Sequence[str] | None) -> tuple[str, ...]:
    """``--export_format`` (``vllm``, ``sglang``, ``speculators``, a comma list or sequence of
    them, or unset)."""
    if value is not None and not isinstance(value, str):
        value = ",".join(value)
    if value is None or not value.strip() or value.strip() == "none":
        return ()
    formats = tuple(part.strip() for part in value.split(",") if part.strip())
    bad = [fmt for fmt in formats if fmt not in EXPORT_FORMATS]
    if bad:
        raise ValueError(
            f"--export_format {value!r}: unknown format(s) {bad}; use "
            f"{', '.join(EXPORT_FORMATS)} or a comma list of them"
        )
    return tuple(dict.fromkeys(formats))


def make_parser() -> Any:
    """The ``HfArgumentParser`` over all sections, plus ``--config``."""
    from transformers import HfArgumentParser

    parser = HfArgumentParser(
        tuple(SECTIONS.values()),
        epilog="example: draftsmith-distill --config configs/tiny.yaml --max_steps 20 "
        "(or: accelerate launch train/distill.py --config configs/demo.yaml)",
    )
    parser.add_argument("--config", default=None, help="recipe YAML; flags override its values")
    parser.error = _flag_error  # a ValueError naming the flag, not argparse's exit
    return parser


class _FlagError(ValueError):
    """A flag argparse could not read (a bad value, a missing argument)."""


def _flag_error(message: str) -> NoReturn:
    raise _FlagError(f"{message}; see --help for each flag and its type")


INHERIT_KEY = "inherit"
"""The recipe key naming the recipe this one starts from (a path relative to its folder)."""


def read_recipe(path: str | Path) -> dict[str, Any]:
    """Flatten a sectioned recipe YAML into field -> value, checking every key.

    With ``inherit: other.yaml`` the other recipe's values come first and this file's override
    them, field by field.
    """
    return _read_recipe(Path(path), ())


def _read_recipe(path: Path, chain: tuple[Path, ...]) -> dict[str, Any]:
    """``read_recipe`` for ``path``, reached through the recipes in ``chain`` (outermost first)."""
    if not path.is_file():
        named_by = f" (inherited by {chain[-1]})" if chain else ""
        raise FileNotFoundError(
            f"--config {path}{named_by}: no such file; pass a recipe YAML such as configs/demo.yaml"
        )
    here = path.resolve()
    if here in chain:
        names = " -> ".join(str(p) for p in (*chain, here))
        raise ValueError(f"{path}: recipes inherit in a cycle ({names}); remove one inherit")
    data = load_plain_yaml(path, "a recipe YAML such as configs/demo.yaml")
    if not isinstance(data, dict):
        raise ValueError(
            f"{path}: a recipe is a mapping of sections ({', '.join(SECTIONS)}) and an optional "
            f"{INHERIT_KEY!r}"
        )
    flat: dict[str, Any] = {}
    if INHERIT_KEY in data:
        base = data.pop(INHERIT_KEY)
        if not isinstance(base, str) or not base.strip():
            raise ValueError(
                f"{path}: {INHERIT_KEY} must be the path of a recipe YAML relative to "
                f"{path.parent}, got {describe_value(base)}"
            )
        flat.update(_read_recipe(path.parent / base, (*chain, here)))
    for section, values in data.items():
        if section not in SECTIONS:
            raise ValueError(
                f"{path}: unknown section {section!r}; valid sections: {', '.join(SECTIONS)} "
                f"(and {INHERIT_KEY!r})"
            )
        if values is None:
            continue
        if not isinstance(values, dict):
            raise ValueError(f"{path}: section {section!r} must be a mapping of field: value")
        valid = [f.name for f in dataclasses.fields(SECTIONS[section])]
        for key, value in values.items():
            if key not in valid:
                home = _section_of(key)
                hint = f" (it belongs in section {home!r})" if home else ""
                raise ValueError(
                    f"{path}: unknown key {key!r} in section {section!r}{hint}; valid keys: "
                    f"{', '.join(valid)}"
                )
            flat[key] = _checked_value(path, section, key, value)
    return flat


def _checked_value(path: Path, section: str, key: str, value: Any) -> Any:
    """``value`` if it has the field's type (an int widened to float), else ``ValueError``."""
    hint = typing.get_type_hints(SECTIONS[section])[key]
    ok, converted = typed_value(value, hint)
    if not ok:
        raise ValueError(
            f"{path}: {section}.{key} must be {describe_type(hint)}, got "
            f"{describe_value(value)}; fix the value in the recipe or pass --{key}"
        )
    return converted


def parse_config(argv: list[str] | None = None) -> DistillConfig:
    """``--config recipe.yaml`` then flags; unknown keys or flags raise ``ValueError``."""
    parser = make_parser()
    args = list(argv) if argv is not None else []
    config_file = _pop_config_flag(args)
    if config_file is not None:
        parser.set_defaults(**read_recipe(config_file))
    try:
        parsed = parser.parse_args_into_dataclasses(args=args, look_for_args_file=False)
    except _FlagError:
        raise
    except ValueError as error:
        valid = sorted(f.name for cls in SECTIONS.values() for f in dataclasses.fields(cls))
        raise ValueError(f"{error}; valid flags: --{', --'.join(valid)}") from error
    sections = dict(zip(SECTIONS, parsed[: len(SECTIONS)], strict=True))
    config = DistillConfig(**sections, config_file=config_file)
    config.validate()
    return config


def _pop_config_flag(args: list[str]) -> str | None:
    """Remove ``--config PATH`` (or ``--config=PATH``) from ``args``; given twice is an error."""
    found: list[str] = []
    i = 0
    while i < len(args):
        if args[i] == "--config":
            if i + 1 >= len(args):
                raise ValueError("--config needs a path to a recipe YAML")
            found.append(args[i + 1])
            del args[i : i + 2]
        elif args[i].startswith("--config="):
            found.append(args[i].split("=", 1)[1])
            del args[i]
        else:
            i += 1
    if len(found) > 1:
        raise ValueError(
            f"--config is given {len(found)} times ({', '.join(found)}); pass one recipe and "
            "override its values with flags"
        )
    return found[0] if found else None


def _section_of(key: str) -> str | None:
    for name, cls in SECTIONS.items():
        if key in {f.name for f in dataclasses.fields(cls)}:
            return name
    return None
