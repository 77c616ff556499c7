"""Recipes inherit from a base recipe (``inherit:``), and the recipes in configs/ still resolve
to exactly the configs they resolved to when each was a full copy.

``recipes_before_inherit.json`` holds every recipe of configs/ as it was written before the
bases existed (section -> field -> value, what the YAML set). A recipe resolves to the defaults
overridden by its values, so comparing the resolved configs of the old and the new text proves
the rewrite changed no value and stays true when a default changes. A deliberate change to a
recipe's values changes its entry in that file too.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import yaml
from draftsmith.train.config import parse_config, read_recipe

CONFIGS = Path(__file__).resolve().parents[2] / "configs"
BEFORE = json.loads((Path(__file__).with_name("recipes_before_inherit.json")).read_text())


def _resolved(path: Path) -> dict:
    config = parse_config(["--config", str(path)]).to_dict()
    config.pop("config_file")
    return config


def test_every_recipe_is_in_the_snapshot() -> None:
    assert sorted(BEFORE) == sorted(p.name for p in CONFIGS.glob("*.yaml"))


@pytest.mark.parametrize("name", sorted(BEFORE))
def test_recipe_resolves_as_its_full_copy_did(name: str, tmp_path: Path) -> None:
    old = tmp_path / name
    old.write_text(yaml.safe_dump(BEFORE[name]))
    assert _resolved(CONFIGS / name) == _resolved(old)


@pytest.mark.parametrize("base", sorted((CONFIGS / "base").glob("*.yaml")), ids=lambda p: p.name)
def test_every_base_parses_on_its_own(base: Path) -> None:
    assert read_recipe(base)


def test_inherited_values_are_overridden_field_by_field(tmp_path: Path) -> None:
    (tmp_path / "presets").mkdir()
    (tmp_path / "presets" / "root.yaml").write_text(
        "optim:\n  max_steps: 7\n  learning_rate: 0.01\nloss:\n  loss: tv\n"
    )
    # Relative to the file that names it, not to the working directory.
    (tmp_path / "presets" / "mid.yaml").write_text("inherit: root.yaml\noptim:\n  max_steps: 9\n")
    leaf = tmp_path / "leaf.yaml"
    leaf.write_text("loss:\n  loss: fkl\ninherit: presets/mid.yaml\n")
    assert read_recipe(leaf) == {"max_steps": 9, "learning_rate": 0.01, "loss": "fkl"}
    config = parse_config(["--config", str(leaf), "--max_steps", "3"])
    assert config.optim.max_steps == 3  # flags still override the whole chain
    assert config.optim.learning_rate == 0.01 and config.loss.loss == "fkl"
    assert config.config_file == str(leaf)


def test_a_cycle_is_refused_with_the_chain(tmp_path: Path) -> None:
    (tmp_path / "a.yaml").write_text("inherit: b.yaml\n")
    (tmp_path / "b.yaml").write_text("inherit: ./a.yaml\n")
    with pytest.raises(
        ValueError, match=r"inherit in a cycle \(.*a\.yaml -> .*b\.yaml -> .*a\.yaml"
    ):
        read_recipe(tmp_path / "a.yaml")
    (tmp_path / "self.yaml").write_text("inherit: self.yaml\n")
    with pytest.raises(ValueError, match="inherit in a cycle"):
        read_recipe(tmp_path / "self.yaml")


def test_bad_bases_are_errors_naming_the_file(tmp_path: Path) -> None:
    leaf = tmp_path / "leaf.yaml"
    leaf.write_text("inherit: missing.yaml\n")
    with pytest.raises(FileNotFoundError, match=r"missing\.yaml \(inherited by .*leaf\.yaml\)"):
        read_recipe(leaf)
    for value in ("null", "3", "''", "[a.yaml]"):
        leaf.write_text(f"inherit: {value}\n")
        with pytest.raises(ValueError, match="inherit must be the path of a recipe YAML"):
            read_recipe(leaf)
    # Unknown keys are refused in a base as in any recipe, naming the base.
    (tmp_path / "base.yaml").write_text("optim:\n  learnin_rate: 0.1\n")
    leaf.write_text("inherit: base.yaml\n")
    with pytest.raises(ValueError, match=r"base\.yaml: unknown key 'learnin_rate'"):
        read_recipe(leaf)
    (tmp_path / "base.yaml").write_text("inherits: other.yaml\n")
    with pytest.raises(ValueError, match=r"unknown section 'inherits'.*\(and 'inherit'\)"):
        read_recipe(leaf)
    # Only data: a YAML tag that would build a Python object is refused, never run.
    (tmp_path / "base.yaml").write_text("optim: !!python/object/apply:os.system ['true']\n")
    with pytest.raises(ValueError, match=r"base\.yaml is not a valid plain YAML file"):
        read_recipe(leaf)
