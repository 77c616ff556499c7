"""Distil a speculative-decoding drafter from a frozen target.

    python train/distill.py                                   # the demo recipe (configs/demo.yaml)
    python train/distill.py --config configs/tiny.yaml --max_steps 20
    accelerate launch train/distill.py --config configs/qwen2.5-0.5b-draft.yaml
    ACCELERATE_USE_CPU=true accelerate launch --multi_gpu --num_processes 2 \\
        train/distill.py --config configs/tiny.yaml           # two CPU ranks over gloo

Tests call ``draftsmith.train.distill.main(argv)``. The run folder (``--output_dir``) receives
``checkpoints/`` (every ``--checkpoint_every`` steps and at the end, the last
``--keep_checkpoints`` kept), ``logs/metrics.jsonl``, the tracker runs, ``summary.json`` and the
exported ``drafter/`` that ``draftsmith.decode.drafters.load_drafter`` reads. Everything that can be
checked without training (target path, loss name, drafter kind, vocabularies, data) is checked
before the first step.

Runs as a script with ``train/`` first on ``sys.path``, so this file imports the project as
``train.*`` only, and module-level imports stay in the standard library.
"""

from __future__ import annotations

import os
import shutil
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from accelerate import Accelerator
    from draftsmith.train.config import DistillConfig
    from draftsmith.train.loop import LoopConfig


def main(argv: list[str] | None = None) -> dict[str, Any]:
    """Parse ``argv`` (default: ``sys.argv[1:]``), train, export; return the run summary."""
    from draftsmith.train.config import parse_config

    config = parse_config(sys.argv[1:] if argv is None else argv)
    return distill(config)


@dataclass
class _Plan:
    """What the checks that need no model settle: they fail before anything loads or trains."""

    loss: Any  # draftsmith.train.losses.Loss
    objective_cls: type
    target_ref: Any  # draftsmith.train.target.model.resolve_target's answer
    output_dir: Path
    checkpoints: Any  # draftsmith.train.checkpoint.CheckpointManager
    resume: Path | None


@dataclass
class _Run:
    """The started run: its processes, the target, the objective and the rows it trains on."""

    accelerator: Accelerator
    reporters: list[str]
    location: Any  # the target's folder
    target_name: str
    tokenizer: Any
    objective: Any  # draftsmith.train.objectives.Objective
    description: str  # the training data, for the model card
    train_rows: Any
    eval_rows: list[dict[str, Any]]
    cache_stats: Any = None  # draftsmith.train.target.cache's statistics with target_outputs: cache
    target_memory: Any = None  # draftsmith.train.target.sharding.target_memory_report's answer


def distill(config: DistillConfig) -> dict[str, Any]:
    """Run one distillation described by a resolved config: check, start, load, train, export."""
    plan = _plan(config)
    accelerator, reporters, location, target_name = _start(config, plan)
    run = _load(config, plan, accelerator, reporters, location, target_name)
    if config.data.cache_build_only:
        return _cache_built(config, plan, run)
    tracker = _tracker(config, plan, run)
    result = _train(config, plan, run, tracker)
    return _finish(config, plan, run, tracker, result)


def _plan(config: DistillConfig) -> _Plan:
    """Check the loss, the kind, the target reference and the run folder; find the resume point."""
    from draftsmith.train.checkpoint import CheckpointManager
    from draftsmith.train.losses import build_loss
    from draftsmith.train.objectives import get_objective_class
    from draftsmith.train.target.model import resolve_target

    loss = build_loss(config.loss.loss)
    objective_cls = get_objective_class(config.drafter.drafter_kind)
    target_ref = resolve_target(config.target.target)
    output_dir = Path(config.output.output_dir).expanduser()
    _check_output_dir(output_dir)
    checkpoints = CheckpointManager(
        output_dir / "checkpoints", config.output.keep_checkpoints, config.to_dict()
    )
    resume = _resume_point(config, checkpoints)
    return _Plan(loss, objective_cls, target_ref, output_dir, checkpoints, resume)


def _start(config: DistillConfig, plan: _Plan) -> tuple[Accelerator, list[str], Any, str]:
    """The accelerator and the target's folder (a missing demo target built on one process)."""
    from draftsmith.decode.cpu_threads import set_cpu_threads
    from draftsmith.decode.precision import announce
    from draftsmith.train.loop import make_accelerator
    from draftsmith.train.target.model import target_location, target_on_main_first

    # Threads first: `accelerate launch` starts a single process with OMP_NUM_THREADS=1, and a
    # missing demo target built before this point would train on one core of many.
    set_cpu_threads(config.optim.threads)
    # One process builds a missing demo target before its Accelerator exists (the build trains
    # through its own); under a launcher the main process builds it while the others wait.
    launched = int(os.environ.get("WORLD_SIZE", "1"))
    if launched == 1:
        location, target_name = target_location(plan.target_ref)

    reporters = [name for name in config.logging_reporters() if name != "none"]
    precision = config.precision(_device_type())
    if int(os.environ.get("RANK", "0")) == 0:
        announce(precision.choice)
    accelerator = make_accelerator(
        gradient_accumulation_steps=config.optim.gradient_accumulation_steps,
        mixed_precision=precision.mixed_precision,
        log_with=reporters,
        project_dir=plan.output_dir,
    )
    if launched > 1:
        location, target_name = target_on_main_first(plan.target_ref, accelerator)
    if plan.resume is None and config.output.overwrite_output_dir and accelerator.is_main_process:
        shutil.rmtree(plan.output_dir / "checkpoints", ignore_errors=True)
        (plan.output_dir / "logs" / "metrics.jsonl").unlink(missing_ok=True)
    accelerator.wait_for_everyone()
    return accelerator, reporters, location, target_name


def _load(
    config: DistillConfig,
    plan: _Plan,
    accelerator: Accelerator,
    reporters: list[str],
    location: Any,
    target_name: str,
) -> _Run:
    """Tokenizer, data (its errors before the model loads), target, objective and the rows."""
    from draftsmith.train.distill_cache import cached_eval_rows, cached_training_rows
    from draftsmith.train.distill_data import evaluation_rows, load_sequences, regenerated_rows
    from draftsmith.train.target.model import load_tokenizer

    remote = config.target.trust_remote_code
    tokenizer = load_tokenizer(location, remote)
    sets = load_sequences(config.data, tokenizer, config.optim.seed)  # data errors before the model
    target = _load_target(config, location, accelerator)
    objective = plan.objective_cls.from_config(config, target, tokenizer, plan.loss)
    if config.loss.hidden_state_noise:  # head kinds only (DistillConfig.validate)
        objective.set_hidden_state_noise(
            config.loss.hidden_state_noise, config.loss.hidden_state_noise_shape, config.optim.seed
        )
    train_rows = sets.train
    description = sets.description
    if config.data.train_source == "target_samples":
        started = time.perf_counter()
        train_rows = regenerated_rows(config, target, tokenizer, sets.train, accelerator)
        description = (
            f"{len(train_rows)} {config.data.train_prompts} prompts cut from {description}, "
            f"continued by the target at temperatures {config.data.train_temperatures}"
        )
        if accelerator.is_main_process:
            print(
                f"regenerated {len(train_rows)} training sequences with the target at "
                f"temperatures {config.data.train_temperatures} in "
                f"{time.perf_counter() - started:.0f} s"
            )
    objective.prepare(train_rows)
    target, target_memory = _place_target(config, objective, target, location, accelerator)
    cache_stats = None
    if config.data.target_outputs != "online":
        train_rows, cache_stats = cached_training_rows(
            config,
            accelerator,
            objective,
            target,
            target_name,
            train_rows,
            tokenizer,
            plan.output_dir,
        )
    eval_rows = evaluation_rows(config, target, tokenizer, sets.held_out, accelerator)
    if config.data.target_outputs != "online":
        eval_rows = cached_eval_rows(
            config,
            accelerator,
            target,
            target_name,
            eval_rows,
            objective,
            tokenizer,
            plan.output_dir,
        )
    return _Run(
        accelerator,
        reporters,
        location,
        target_name,
        tokenizer,
        objective,
        description,
        train_rows,
        eval_rows,
        cache_stats,
        target_memory,
    )


def _device_type() -> str:
    """Where the run will compute, known before the Accelerator exists (it chooses the dtype)."""
    import torch

    use_cpu = os.environ.get("ACCELERATE_USE_CPU", "").lower() in ("1", "true", "yes")
    return "cuda" if torch.cuda.is_available() and not use_cpu else "cpu"


def _load_target(config: DistillConfig, location: Any, accelerator: Accelerator) -> Any:
    """The frozen target: whole on the device, whole on the host until it is sharded, or
    (``cache_only``) without its decoder layers."""
    from draftsmith.train.target.model import load_model, load_model_without_layers

    remote = config.target.trust_remote_code
    dtype = config.precision(accelerator.device.type).target_dtype
    if config.data.target_outputs == "cache_only":
        return load_model_without_layers(location, dtype, remote).to(accelerator.device)
    if config.target.target_sharding == "fsdp" and config.drafter.drafter_init != "target_layers":
        # The objective is built on the embeddings and head alone; _place_target then reads
        # each process's share of the layers (no process ever holds the whole target).
        return load_model_without_layers(location, dtype, remote)
    target = load_model(location, dtype, remote)
    if config.target.target_sharding == "none":
        target = target.to(accelerator.device)
    return target


def _place_target(
    config: DistillConfig, objective: Any, target: Any, location: Any, accelerator: Accelerator
) -> tuple[Any, dict[str, Any]]:
    """Shard the target when asked (the objective gets the sharded one), then report what each
    process holds (a collective)."""
    from draftsmith.train.target.model import checkpoint_bytes, has_decoder_layers
    from draftsmith.train.target.sharding import (
        format_target_memory,
        load_sharded_target,
        shard_target,
        target_memory_report,
    )

    sharding = config.target.target_sharding
    if sharding == "fsdp" and has_decoder_layers(target):  # read whole: shard it in place
        shard_target(target, accelerator)
    elif sharding == "fsdp":  # each process reads its share of the layers
        dtype = next(target.parameters()).dtype
        remote = config.target.trust_remote_code
        target = load_sharded_target(str(location), dtype, accelerator, remote)
        objective.target = target
    report = target_memory_report(target, accelerator, sharding)
    if config.data.target_outputs == "cache_only":  # only the embeddings and head are loaded
        report["layers_loaded"] = False
        report["full_bytes"] = max(report["full_bytes"], checkpoint_bytes(str(location)))
        report["ratio"] = max(report["bytes_per_rank"]) / report["full_bytes"]
    if accelerator.is_main_process:
        print(format_target_memory(report), flush=True)
    return target, report


def _tracker(config: DistillConfig, plan: _Plan, run: _Run) -> Any:
    """The run's trackers (metrics.jsonl plus the configured reporters), resumed in step."""
    from draftsmith.train.tracking import RunTracker

    tracker = RunTracker(
        run.accelerator,
        run.reporters,
        config.logging.project,
        config.logging.run_name or plan.output_dir.name,
        config.to_dict(),
        plan.output_dir,
        resume_step=None if plan.resume is None else plan.checkpoints.step_of(plan.resume),
    )
    if run.cache_stats is not None and plan.resume is None:  # logged at step 0 by the first run
        tracker.log({"cache/bytes_per_token": run.cache_stats.bytes_per_token}, 0)
    return tracker


def _train(config: DistillConfig, plan: _Plan, run: _Run, tracker: Any) -> Any:
    """Batch the rows (each process its shard) and run the training loop."""
    from draftsmith.data.cache import collate_cached
    from draftsmith.data.sequences import collate_rows
    from draftsmith.train.batches import ShardedBatches, shard_list
    from draftsmith.train.loop import run_training

    accelerator, pad_id = run.accelerator, run.tokenizer.pad_token_id

    def collate(rows: list[dict[str, Any]]) -> dict[str, Any]:
        batch = collate_rows(rows, pad_id)
        if "hidden_states" in rows[0] and "hidden_states" not in batch:  # eagle3/medusa caches
            batch["hidden_states"] = collate_cached(rows, pad_id)["hidden_states"]
        return batch

    batch_size = config.optim.per_device_batch_size
    local_eval = shard_list(run.eval_rows, accelerator.process_index, accelerator.num_processes)
    eval_batches = [
        collate(local_eval[i : i + batch_size]) for i in range(0, len(local_eval), batch_size)
    ]
    train_batches = ShardedBatches(
        run.train_rows,
        batch_size,
        collate,
        seed=config.optim.seed,
        process_index=accelerator.process_index,
        num_processes=accelerator.num_processes,
    )
    return run_training(
        run.objective,
        train_batches,
        loop_config(config),
        accelerator,
        eval_batches=eval_batches,
        log=tracker.log,
        checkpoints=plan.checkpoints,
        resume_from=plan.resume,
    )


def loop_config(config: DistillConfig) -> LoopConfig:
    """The training loop's settings from the recipe's optim and logging sections."""
    from draftsmith.train.loop import LoopConfig

    return LoopConfig(
        max_steps=config.optim.max_steps,
        learning_rate=config.optim.learning_rate,
        weight_decay=config.optim.weight_decay,
        adam_beta1=config.optim.adam_beta1,
        adam_beta2=config.optim.adam_beta2,
        warmup_steps=config.optim.warmup_steps,
        lr_scheduler=config.optim.lr_scheduler,
        min_lr_ratio=config.optim.min_lr_ratio,
        max_grad_norm=config.optim.max_grad_norm,
        max_minutes=config.optim.max_minutes,
        schedule_by_time=config.optim.schedule_by_time and config.optim.max_minutes is not None,
        eval_every=config.logging.eval_every,
        checkpoint_every=config.output.checkpoint_every,
        log_every=config.logging.log_every,
        progress_bar=config.logging.progress_bar,
        description=f"distil {config.drafter.drafter_kind}",
    )


def _finish(
    config: DistillConfig, plan: _Plan, run: _Run, tracker: Any, result: Any
) -> dict[str, Any]:
    """Report the parallel layout, export the drafter, write the summary, measure, push."""
    from draftsmith.data.atomic_io import write_json_atomic
    from draftsmith.train.distributed import format_report, parallel_report
    from draftsmith.train.export.folder import export_drafter, push_to_hub
    from draftsmith.train.speed_report import measure_recipe_speed

    accelerator, output_dir = run.accelerator, plan.output_dir
    parallel = parallel_report(run.objective.module, accelerator)  # a collective
    if accelerator.is_main_process:
        print(format_report(parallel))
    summary = _summary(config, plan, run, result, parallel, tracker.wandb_mode)
    state_dict = accelerator.get_state_dict(run.objective.module)  # a collective under FSDP
    if accelerator.is_main_process:
        export_drafter(
            run.objective,
            output_dir / "drafter",
            run.tokenizer,
            config.to_dict(),
            summary,
            state_dict,
        )
        write_json_atomic(output_dir / "summary.json", summary)
        _print_summary(summary)
        if config.speed_eval.speed_eval_prompts > 0:
            summary["speed"] = measure_recipe_speed(
                config, run.location, output_dir, result.final_eval
            )
            write_json_atomic(output_dir / "summary.json", summary)
    accelerator.wait_for_everyone()
    tracker.finish()
    if config.output.push_to_hub and accelerator.is_main_process:
        summary["hub_url"] = push_to_hub(output_dir / "drafter", config.output.push_to_hub)
    return summary


def _summary(
    config: DistillConfig,
    plan: _Plan,
    run: _Run,
    result: Any,
    parallel: dict[str, Any],
    wandb_mode: Any,
) -> dict[str, Any]:
    """What ``summary.json`` and the model card report about the run."""
    from draftsmith.decode.measure.machine import machine_record
    from draftsmith.train.distill_cache import cache_summary
    from draftsmith.train.distill_data import evaluation_description

    return {
        "target": run.target_name,
        "target_path": run.location,
        "drafter_kind": config.drafter.drafter_kind,
        **config.precision(run.accelerator.device.type).record(),
        "machine": machine_record(run.accelerator.device),
        "data": run.description,
        "target_outputs": config.data.target_outputs,
        "on_policy_fraction": config.data.on_policy_fraction,
        "loss": config.loss.loss,
        "loss_temperature": config.loss.loss_temperature,
        "eval_temperature": config.loss.eval_temperature,
        "eval_description": evaluation_description(config, len(run.eval_rows)),
        "held_out": result.final_eval,
        "steps": result.steps,
        "stop_reason": result.stop_reason,
        "tokens_seen": result.tokens_seen,
        "minutes": result.minutes,
        "tokens_per_s": result.tokens_per_second,
        "world_size": result.world_size,
        "params_in_sync": result.params_in_sync,
        "distributed": parallel,
        "train_sequences": len(run.train_rows),
        "last_checkpoint": str(result.last_checkpoint) if result.last_checkpoint else None,
        "cache": None if run.cache_stats is None else cache_summary(run.cache_stats),
        "target_memory": run.target_memory,
        "peak_rss_bytes": _peak_rss_bytes(),
        "drafter_dir": str(plan.output_dir / "drafter"),
        "wandb_mode": wandb_mode,
    }


def _check_output_dir(output_dir: Path) -> None:
    """The run folder and every existing parent must be folders (created when missing)."""
    for path in (output_dir, *output_dir.parents):
        if path.exists():
            if not path.is_dir():
                raise FileExistsError(
                    f"--output_dir {output_dir}: {path} is a file, not a folder; pass a folder "
                    "path (it is created when missing) or move the file away"
                )
            return


def _resume_point(config: DistillConfig, checkpoints: Any) -> Path | None:
    spec = config.output.resume_from_checkpoint
    if spec:
        return checkpoints.resolve(spec)
    if checkpoints.checkpoints() and not config.output.overwrite_output_dir:
        raise FileExistsError(
            f"{checkpoints.root} already holds checkpoints of an earlier run: pass "
            "--resume_from_checkpoint latest to continue it, --overwrite_output_dir to start "
            "afresh, or another --output_dir"
        )
    return None


def _cache_built(config: DistillConfig, plan: _Plan, run: _Run) -> dict[str, Any]:
    """``--cache_build_only``: the cache is written; report it and the target, train nothing."""
    from draftsmith.data.atomic_io import write_json_atomic
    from draftsmith.train.distill_cache import cache_summary

    summary = {
        "target": run.target_name,
        "cache": None if run.cache_stats is None else cache_summary(run.cache_stats),
        "train_sequences": len(run.train_rows),
        "target_memory": run.target_memory,
        "world_size": run.accelerator.num_processes,
        "peak_rss_bytes": _peak_rss_bytes(),
        "steps": 0,
    }
    if run.accelerator.is_main_process:
        write_json_atomic(plan.output_dir / "summary.json", summary)
        cache = summary["cache"]
        print(
            f"target cache written: {cache['num_sequences']} sequences, "
            f"{cache['bytes_per_token']:.1f} bytes/token in {cache['folder']}; train from it "
            "with --target_outputs cache_only"
        )
    run.accelerator.wait_for_everyone()
    return summary


def _peak_rss_bytes() -> int:
    """This process's peak resident memory so far (Linux reports KiB, macOS bytes)."""
    import resource

    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return int(peak if sys.platform == "darwin" else peak * 1024)


def _print_summary(summary: dict[str, Any]) -> None:
    held = ", ".join(f"{k} {v:.4f}" for k, v in summary["held_out"].items())
    print(f"distilled {summary['drafter_kind']} from {summary['target']}")
    print(
        f"  steps {summary['steps']} ({summary['stop_reason']}), tokens {summary['tokens_seen']:,}"
    )
    print(f"  held-out: {held}")
    if summary["cache"]:
        cache = summary["cache"]
        print(
            f"  target cache: top-{cache['k']}, {cache['bytes_per_token']:.1f} bytes/token vs "
            f"{cache['full_fp16_bytes_per_token']} for fp16 logits ({cache['compression']:.0f}x)"
        )
    print(f"  drafter: {summary['drafter_dir']}")


def _run_as_script() -> None:
    """``main`` for the command line: a user's mistake (draftsmith.train.checkpoint.CheckpointError is a
    ValueError), a failed Hub upload or a diverged loss is one line and exit status 2."""
    from draftsmith.decode.command_line import run_command
    from draftsmith.train.export.folder import HubUploadError
    from draftsmith.train.loop import NonFiniteLossError

    run_command(main, (HubUploadError, NonFiniteLossError))


if __name__ == "__main__":
    # Before torch loads OpenMP: idle threads sleep at once only where ranks share the cores.
    from draftsmith.decode.cpu_threads import default_openmp_wait_policy

    default_openmp_wait_policy()
    _run_as_script()
