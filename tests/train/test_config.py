"""Recipe YAML + flags through HfArgumentParser; every recipe in configs/ parses."""

from __future__ import annotations

from pathlib import Path

import pytest
from draftsmith.train.config import DistillConfig, parse_config, read_recipe

CONFIGS = Path(__file__).resolve().parents[2] / "configs"


def test_no_argument_is_the_demo_recipe() -> None:
    demo = parse_config(["--config", str(CONFIGS / "demo.yaml")])
    default = parse_config([])
    assert {**demo.to_dict(), "config_file": None} == default.to_dict()
    assert default.to_dict() == DistillConfig().to_dict()


@pytest.mark.parametrize("recipe", sorted(CONFIGS.glob("*.yaml")), ids=lambda p: p.name)
def test_every_recipe_parses(recipe: Path) -> None:
    config = parse_config(["--config", str(recipe)])
    assert config.config_file == str(recipe)
    assert config.drafter.drafter_kind


def test_flags_override_the_recipe(tmp_path: Path) -> None:
    recipe = tmp_path / "r.yaml"
    recipe.write_text("optim:\n  learning_rate: 0.01\n  max_steps: 7\nloss:\n  loss: jsd:0.5\n")
    config = parse_config(["--config", str(recipe), "--max_steps", "9", "--report_to", "none"])
    assert config.optim.learning_rate == 0.01
    assert config.optim.max_steps == 9
    assert config.loss.loss == "jsd:0.5"
    assert config.logging.report_to == "none"
    assert parse_config([f"--config={recipe}"]).optim.max_steps == 7


def test_unknown_yaml_key_lists_the_valid_ones(tmp_path: Path) -> None:
    recipe = tmp_path / "r.yaml"
    recipe.write_text("optim:\n  learnin_rate: 0.01\n")
    with pytest.raises(ValueError, match=r"unknown key 'learnin_rate'.*valid keys: learning_rate"):
        parse_config(["--config", str(recipe)])
    recipe.write_text("optim:\n  loss: tv\n")
    with pytest.raises(ValueError, match="belongs in section 'loss'"):
        read_recipe(recipe)
    recipe.write_text("optimizer:\n  max_steps: 3\n")
    with pytest.raises(ValueError, match="unknown section 'optimizer'; valid sections: target"):
        read_recipe(recipe)


def test_unknown_flag_lists_the_valid_ones() -> None:
    with pytest.raises(ValueError, match=r"--bogus.*valid flags: .*--learning_rate"):
        parse_config(["--bogus", "1"])


def test_bad_values_are_rejected_with_the_choices() -> None:
    with pytest.raises(ValueError, match="--target_outputs 'disk' is not valid; choose one of"):
        parse_config(["--target_outputs", "disk"])
    with pytest.raises(ValueError, match="unknown tracker 'mlflow'"):
        parse_config(["--report_to", "wandb,mlflow"])
    with pytest.raises(ValueError, match="on_policy_fraction must lie in"):
        parse_config(["--on_policy_fraction", "1.5"])
    with pytest.raises(FileNotFoundError, match="no such file"):
        parse_config(["--config", "does/not/exist.yaml"])


@pytest.mark.parametrize(
    ("line", "expected"),
    [
        ("max_steps: 2.5", r"optim\.max_steps must be an integer, got 2\.5 \(a float\)"),
        ("max_steps: null", r"optim\.max_steps must be an integer, got null"),
        ("max_steps: [1, 2]", r"optim\.max_steps must be an integer, got \[1, 2\] \(a list\)"),
        ("max_minutes: fast", r"optim\.max_minutes must be a finite number or null"),
        ("learning_rate: .nan", r"optim\.learning_rate must be a finite number"),
        ("mixed_precision: 16", r"optim\.mixed_precision must be a string, got 16"),
    ],
)
def test_recipe_values_must_have_their_field_type(tmp_path: Path, line: str, expected: str) -> None:
    recipe = tmp_path / "r.yaml"
    recipe.write_text(f"optim:\n  {line}\n")
    with pytest.raises(ValueError, match=expected):
        parse_config(["--config", str(recipe)])


def test_recipe_numbers_widen_to_float_and_yaml_exponents_read_as_numbers(tmp_path: Path) -> None:
    recipe = tmp_path / "r.yaml"
    recipe.write_text("optim:\n  learning_rate: 1e-3\n  max_grad_norm: 2\n")
    config = parse_config(["--config", str(recipe)])
    assert config.optim.learning_rate == 0.001
    assert config.optim.max_grad_norm == 2.0 and isinstance(config.optim.max_grad_norm, float)
    recipe.write_text("drafter:\n  aux_hidden_state_layer_ids: [1, 2.5]\n")
    with pytest.raises(ValueError, match="must be a list of integers or null"):
        parse_config(["--config", str(recipe)])


def test_bad_flags_and_a_second_config_are_errors_not_exits(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match=r"--max_steps.*invalid int value: '2\.5'"):
        parse_config(["--max_steps", "2.5"])
    with pytest.raises(ValueError, match="expected one argument"):
        parse_config(["--max_steps"])
    recipe = tmp_path / "r.yaml"
    recipe.write_text("optim:\n  max_steps: 3\n")
    with pytest.raises(ValueError, match=r"--config is given 2 times"):
        parse_config(["--config", str(recipe), f"--config={recipe}"])


@pytest.mark.parametrize(
    ("argv", "expected"),
    [
        (["--max_grad_norm", "-1"], "--max_grad_norm must be >= 0"),
        (["--weight_decay", "-0.1"], "--weight_decay must be >= 0"),
        (["--learning_rate", "nan"], "--learning_rate must be a finite number"),
        (["--learning_rate", "0"], "--learning_rate must be > 0"),
        (["--adam_beta2", "1.0"], r"--adam_beta2 must lie in \[0, 1\)"),
        (["--max_steps", "0"], "--max_steps must be >= 1"),
        (["--train_prompts", "lines"], "--train_prompts 'lines' is not valid; choose one of"),
        (["--train_prompt_chars", "0"], "--train_prompt_chars must be >= 1"),
        (["--threads", "0"], "--threads 0: give a thread count from 1 to"),
        (["--threads", "1000000"], "--threads 1000000: give a thread count from 1 to"),
    ],
)
def test_out_of_range_optimisation_values(argv: list[str], expected: str) -> None:
    with pytest.raises(ValueError, match=expected):
        parse_config(argv)


@pytest.mark.parametrize(
    ("content", "expected"),
    [
        (b"optim:\n  max_steps: !!python/object/apply:os.system ['echo hi']\n", "python/object"),
        (b"!!python/name:os.system\n", "python/name"),
        (b"optim:\n  max_steps: [1,\n", "not a valid plain YAML file"),
        (b"optim:\n\tmax_steps: 1\n", "not a valid plain YAML file"),
        (b"optim:\n  max_steps: 1\x00\n", "not a valid plain YAML file"),
        (b"? [a]\n: b\n", "unhashable key"),
        (bytes(range(256)), "is not UTF-8 text"),
        ("optim:\n  max_steps: 1\n".encode("utf-16"), "is not UTF-8 text"),
    ],
    ids=["python-object", "python-name", "unclosed", "tab", "nul", "unhashable", "binary", "utf16"],
)
def test_a_recipe_that_is_not_plain_yaml_is_a_value_error_naming_it(
    tmp_path: Path, content: bytes, expected: str
) -> None:
    """Python tags are refused (never run), and unreadable YAML is a ValueError naming the file
    (what train/distill.py prints as a one-line error), not a yaml or codec exception."""
    recipe = tmp_path / "r.yaml"
    recipe.write_bytes(content)
    with pytest.raises(ValueError, match=expected) as raised:
        parse_config(["--config", str(recipe)])
    assert str(recipe) in str(raised.value)
    assert "\n" not in str(raised.value)
    inheriting = tmp_path / "child.yaml"
    inheriting.write_text("inherit: r.yaml\n")
    with pytest.raises(ValueError, match=expected):
        parse_config(["--config", str(inheriting)])


@pytest.mark.parametrize(
    ("flags", "expected"),
    [
        (["--log_every", "0"], r"--log_every must be >= 1, got 0"),
        (["--speed_eval_new_tokens", "0"], r"--speed_eval_new_tokens must be >= 1"),
        (["--speed_eval_draft_tokens", "-1"], r"--speed_eval_draft_tokens must be >= 1"),
        (["--speed_eval_tree_top_k", "0"], r"--speed_eval_tree_top_k must be >= 1"),
        (["--speed_eval_repeats", "0"], r"--speed_eval_repeats must be >= 1, got 0"),
        (["--speed_eval_prompts", "-1"], r"--speed_eval_prompts must be >= 0 \(0: skips it\)"),
        (["--speed_eval_tree_total_tokens", "-4"], r"--speed_eval_tree_total_tokens must be >= 0"),
        (["--speed_eval_tree_frontier", "5"], r"--speed_eval_tree_frontier must lie in \[0, "),
        (["--speed_eval_tree_frontier", "-1"], r"--speed_eval_tree_frontier must lie in \[0, "),
        (["--drafter_num_heads", "0"], r"--drafter_num_heads must be >= 1, got 0"),
        (["--drafter_hidden_size", "-8"], r"--drafter_hidden_size must be >= 1"),
        (["--max_train_sequences", "0"], r"--max_train_sequences must be >= 1"),
        (["--lora_dropout", "5"], r"--lora_dropout must lie in \[0, 1\), got 5"),
        (["--lora_alpha", "0"], r"--lora_alpha must be > 0"),
    ],
)
def test_counts_and_rates_out_of_range_are_refused_by_name(flags: list[str], expected: str) -> None:
    with pytest.raises(ValueError, match=expected):
        parse_config(flags)


def test_a_time_box_drives_the_decay_when_asked() -> None:
    from draftsmith.train.distill import loop_config

    assert not loop_config(parse_config([])).schedule_by_time  # steps alone by default
    assert loop_config(parse_config(["--schedule_by_time"])).schedule_by_time  # 8 minutes
    assert not loop_config(parse_config(["--schedule_by_time", "false"])).schedule_by_time
    # Without a time box the flag has nothing to follow: steps alone, and no error.
    untimed = loop_config(
        parse_config(["--config", str(CONFIGS / "tiny.yaml"), "--schedule_by_time"])
    )
    assert untimed.max_minutes is None and not untimed.schedule_by_time


# ---- hostile recipes and flags (the audit of the training side's inputs)


def test_a_key_given_twice_in_a_recipe_is_an_error(tmp_path: Path) -> None:
    recipe = tmp_path / "r.yaml"
    recipe.write_text("optim:\n  max_steps: 1\n  max_steps: 2\n")
    with pytest.raises(ValueError, match=r"found the key 'max_steps' twice \(keep one\)"):
        read_recipe(recipe)
    recipe.write_text("optim: {max_steps: 1}\noptim: {seed: 2}\n")
    with pytest.raises(ValueError, match=r"found the key 'optim' twice"):
        read_recipe(recipe)


def test_a_merge_key_may_still_be_overridden(tmp_path: Path) -> None:
    recipe = tmp_path / "r.yaml"
    recipe.write_text("optim:\n  <<: {max_steps: 3, seed: 4}\n  max_steps: 5\n")
    assert read_recipe(recipe) == {"max_steps": 5, "seed": 4}


def test_an_alias_bomb_costs_a_short_message(tmp_path: Path) -> None:
    """Billion laughs: nine levels of nine aliases would print ~10**9 items in the message."""
    levels = ["&a0 [x, x, x, x, x, x, x, x, x]"]
    levels += [f"&a{i} [{', '.join([f'*a{i - 1}'] * 9)}]" for i in range(1, 9)]
    recipe = tmp_path / "r.yaml"
    recipe.write_text(f"optim:\n  max_steps: [{', '.join(levels)}]\n")
    with pytest.raises(ValueError, match=r"optim\.max_steps must be an integer") as error:
        read_recipe(recipe)
    assert len(str(error.value)) < 1000
    recipe.write_text(f"inherit: [{', '.join(levels)}]\n")
    with pytest.raises(ValueError, match=r"inherit must be the path") as error:
        read_recipe(recipe)
    assert len(str(error.value)) < 1000


@pytest.mark.parametrize(
    ("flags", "expected"),
    [
        (["--lr_scheduler", "cosin"], r"--lr_scheduler 'cosin' is not valid; choose one of"),
        (["--min_lr_ratio", "-2"], r"--min_lr_ratio must lie in \[0, 1\]"),
        (["--checkpoint_every", "-1"], r"--checkpoint_every must be >= 0"),
        (["--eval_every", "-5"], r"--eval_every must be >= 0"),
        (["--seed", str(2**70)], r"--seed must lie in \[0, 2\*\*32 - 1\]"),
        (["--seed", "-1"], r"--seed must lie in"),
        (["--train_samples_seed", "-3"], r"--train_samples_seed must lie in"),
        (["--output_dir", " "], r"--output_dir is empty"),
        (["--export_format", "onnx"], r"unknown format\(s\) \[.onnx.\]; use vllm, sglang"),
        (
            ["--drafter_kind", "draft_lm", "--export_format", "vllm"],
            r"--drafter_kind draft_lm writes no vllm layout; leave --export_format unset",
        ),
        (
            ["--drafter_kind", "medusa", "--export_format", "vllm,sglang"],
            r"--drafter_kind medusa writes no sglang layout; use vllm",
        ),
        (
            ["--export_format", "sglang", "--drafter_num_layers", "2"],
            r"SGLang serves single-layer EAGLE-3 heads only",
        ),
    ],
)
def test_loop_and_export_settings_are_checked_before_anything_loads(
    flags: list[str], expected: str
) -> None:
    """These used to fail only after the target loaded (or, for --export_format, after
    training, at export; draft_lm ignored it)."""
    with pytest.raises(ValueError, match=expected):
        parse_config(flags)


def test_valid_export_formats_and_seeds_still_parse() -> None:
    config = parse_config(["--export_format", "vllm,sglang", "--seed", str(2**32 - 1)])
    assert config.output.export_format == "vllm,sglang"
    assert parse_config(["--drafter_kind", "draft_lm", "--export_format", "none"])
