"""Recipe YAML + flags through HfArgumentParser; every recipe in configs/ parses."""

from __future__ import annotations

from pathlib import Path

import pytest

from train.config import DistillConfig, parse_config, read_recipe

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
