"""draftsmith.data.chat_context: one system prompt for data, training and benchmarks, and the
seeded choice of prompts answered with thinking off."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from draftsmith.data.chat_context import (
    prompts_with_system_prompt,
    system_prompt_argument,
    thinking_off_indices,
    with_system_prompt,
)
from draftsmith.decode.drafters.folder import PROVENANCE_FILE
from draftsmith.decode.measure.prompts import drafters_system_prompt, load_eval_prompts

USER = {"role": "user", "content": "hi"}
TINY_RECIPE = Path(__file__).resolve().parents[2] / "configs" / "tiny.yaml"


def test_the_system_turn_opens_a_conversation_without_one_and_never_replaces_one() -> None:
    own = [{"role": "system", "content": "own"}, USER]
    assert with_system_prompt([USER], "sys") == [{"role": "system", "content": "sys"}, USER]
    assert with_system_prompt(own, "sys") == own
    assert with_system_prompt([USER], None) == [USER] == with_system_prompt([USER], "")
    # Plain text prompts are continued as they are.
    assert prompts_with_system_prompt(["def f():", [USER]], "sys") == [
        "def f():",
        [{"role": "system", "content": "sys"}, USER],
    ]


def test_the_flags_value_is_text_a_file_or_none(tmp_path: Path) -> None:
    (tmp_path / "system.txt").write_text("From a file.\n", encoding="utf-8")
    (tmp_path / "blank.txt").write_text("  \n", encoding="utf-8")
    (tmp_path / "binary.txt").write_bytes(b"\xff\xfe\x00")
    assert system_prompt_argument("Be brief.") == "Be brief."
    assert system_prompt_argument("none") == "" == system_prompt_argument("None")
    assert system_prompt_argument(f"@{tmp_path / 'system.txt'}") == "From a file.\n"
    for value, message in (
        ("  ", "--system-prompt is empty"),
        (f"@{tmp_path / 'absent.txt'}", "no such file"),
        (f"@{tmp_path / 'blank.txt'}", "the file is empty"),
        (f"@{tmp_path / 'binary.txt'}", "cannot be read as UTF-8 text"),
        (f"@{tmp_path}", "no such file"),
    ):
        with pytest.raises(ValueError, match=message):
            system_prompt_argument(value)


def test_the_thinking_off_share_is_an_exact_seeded_choice() -> None:
    chosen = thinking_off_indices(10, 0.3, seed=1)
    assert len(chosen) == 3 and chosen <= set(range(10))
    assert chosen == thinking_off_indices(10, 0.3, seed=1)
    assert thinking_off_indices(10, 0.0, seed=1) == frozenset()
    assert thinking_off_indices(10, 1.0, seed=1) == frozenset(range(10))
    assert len({thinking_off_indices(10, 0.5, seed=s) for s in range(8)}) > 1
    with pytest.raises(ValueError, match=r"must be in \[0, 1\]"):
        thinking_off_indices(10, 1.5, seed=1)


def _trained_with(folder: Path, system_prompt: str | None) -> Path:
    folder.mkdir()
    record = {"config": {"data": {"system_prompt": system_prompt}}}
    (folder / PROVENANCE_FILE).write_text(json.dumps(record), encoding="utf-8")
    return folder


def test_an_evaluation_uses_the_system_prompt_the_drafter_was_trained_with(
    tmp_path: Path,
) -> None:
    a = _trained_with(tmp_path / "a", "Be brief.")
    b = _trained_with(tmp_path / "b", "Be brief.")
    other = _trained_with(tmp_path / "other", "Be long.")
    plain = _trained_with(tmp_path / "plain", None)
    assert drafters_system_prompt(None, [a, b]) == "Be brief."
    assert drafters_system_prompt(None, [plain]) is None
    assert drafters_system_prompt(None, [tmp_path / "absent"]) is None
    assert drafters_system_prompt(None, []) is None
    # The flag wins; "" (none) drops it.
    assert drafters_system_prompt("Other.", [a]) == "Other."
    assert drafters_system_prompt("", [a]) is None
    with pytest.raises(ValueError, match=r"different system prompts.*pass --system-prompt"):
        drafters_system_prompt(None, [a, other])
    # Chat prompts of a file get it; code prompts and own system turns keep what they are.
    prompts = tmp_path / "chat.jsonl"
    prompts.write_text(
        json.dumps({"messages": [USER]})
        + "\n"
        + json.dumps({"messages": [{"role": "system", "content": "own"}, USER]})
        + "\n",
        encoding="utf-8",
    )
    first, second = load_eval_prompts(str(prompts), 2, "Be brief.")
    assert first[0] == {"role": "system", "content": "Be brief."}
    assert second[0]["content"] == "own"
    assert all(isinstance(p, str) for p in load_eval_prompts("demo", 2, "Be brief."))


def test_the_recipes_system_prompt_is_recorded_where_the_evaluation_reads_it(
    tmp_path: Path,
) -> None:
    from draftsmith.train.config import parse_config
    from draftsmith.train.provenance import build_provenance

    config = parse_config(["--config", str(TINY_RECIPE), "--system_prompt", "Be brief."])
    folder = tmp_path / "drafter"
    folder.mkdir()
    record = build_provenance(config.to_dict())
    (folder / PROVENANCE_FILE).write_text(json.dumps(record), encoding="utf-8")
    assert drafters_system_prompt(None, [folder]) == "Be brief."
    with pytest.raises(ValueError, match="--system_prompt is blank"):
        parse_config(["--config", str(TINY_RECIPE), "--system_prompt", " "]).validate()
