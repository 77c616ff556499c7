"""Prompts cut from training rows and continued by the target (``train_source:
target_samples``): each row filled to its length, exact against the prompt decoded alone."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import pytest
import torch
from draftsmith.decode.sampling import SamplingConfig
from draftsmith.train.distill_data import block_prompts, continued_rows, definition_prompts_of_rows
from draftsmith.train.generation import sample_continuations
from tiny_models import tiny_llama, tiny_tokenizer

CODE = (
    "import os\n\nVALUE = 3\n\n\n"
    "def add(a, b):\n    return a + b\n\n\n"
    "class Point:\n    def __init__(self, x, y):\n        self.x = x\n"
)


def _continue(prompts: list[list[int]], length: int, **kwargs: object) -> list[dict]:
    return continued_rows(
        tiny_llama(seed=7),
        prompts,
        length=length,
        temperature=0.0,
        seed=0,
        eos_token_id=None,
        pad_token_id=0,
        device=torch.device("cpu"),
        batch_size=3,
        **kwargs,
    )


def test_prompts_of_any_length_are_filled_to_the_length_as_if_decoded_alone() -> None:
    prompts = [[5, 9, 12], [3, 3, 8, 41, 2, 17, 6], [11], [4, 4, 4, 4, 4]]
    rows = _continue(prompts, length=12)
    model = tiny_llama(seed=7)
    for prompt, row in zip(prompts, rows, strict=True):
        assert len(row["input_ids"]) == 12 and row["input_ids"][: len(prompt)] == prompt
        assert row["loss_mask"] == [0] * len(prompt) + [1] * (12 - len(prompt))
        alone = torch.tensor([prompt])
        greedy = sample_continuations(
            model, alone, torch.ones_like(alone), 12 - len(prompt), SamplingConfig(0.0), None
        )
        assert row["input_ids"][len(prompt) :] == greedy.tokens[0].tolist()


def test_the_prompt_is_trained_when_asked() -> None:
    rows = _continue([[5, 9, 12], [1, 2]], length=6, train_prompt=True)
    assert [row["loss_mask"] for row in rows] == [[1] * 6, [1] * 6]


def test_a_prompt_that_leaves_no_room_is_refused() -> None:
    with pytest.raises(ValueError, match="every prompt needs 1 to 5 tokens"):
        _continue([[1, 2, 3], [1, 2, 3, 4, 5, 6]], length=6)
    with pytest.raises(ValueError, match="every prompt needs 1 to 5 tokens"):
        _continue([[]], length=6)


def test_block_prompts_are_the_first_tokens_of_long_enough_rows() -> None:
    rows = [{"input_ids": [1, 2, 3, 4]}, {"input_ids": [5, 6]}, {"input_ids": [7, 8, 9]}]
    assert block_prompts(rows, 3, count=5) == [[1, 2, 3], [7, 8, 9]]
    assert block_prompts(rows, 2, count=2) == [[1, 2], [5, 6]]
    with pytest.raises(ValueError, match="no sequence has 5 tokens"):
        block_prompts(rows, 5, count=2)


def test_definition_prompts_end_on_a_def_line_and_spread_over_the_rows() -> None:
    tokenizer = tiny_tokenizer()
    code_row = {"input_ids": tokenizer(CODE, add_special_tokens=False)["input_ids"]}
    plain_row = {"input_ids": tokenizer("x = 1\n" * 20, add_special_tokens=False)["input_ids"]}
    rows = [plain_row, code_row] * 4
    prompts = definition_prompts_of_rows(rows, tokenizer, count=3, chars=30, max_tokens=200)
    assert len(prompts) == 3
    texts = [tokenizer.decode(ids) for ids in prompts]
    end = CODE.index("def add(a, b):") + len("def add(a, b):")
    assert texts == [CODE[end - 30 : end]] * 3  # the first definition past 30 characters
    # A prompt longer than max_tokens is dropped; no prompt at all is an error naming the fix.
    with pytest.raises(ValueError, match="--train_prompts blocks"):
        definition_prompts_of_rows(rows, tokenizer, count=3, chars=30, max_tokens=2)
    with pytest.raises(ValueError, match="no training sequence has a def/class line past"):
        definition_prompts_of_rows([plain_row], tokenizer, count=1, chars=5, max_tokens=200)


def test_a_run_trains_on_definition_prompts_continued_by_the_target(
    tmp_path: Path, tiny_argv: Callable[..., list[str]], capsys: pytest.CaptureFixture[str]
) -> None:
    from draftsmith.train.distill import main

    flags = ["--train_source", "target_samples", "--train_prompts", "definitions"]
    flags += ["--train_prompt_chars", "120", "--block_size", "96", "--train_sequences", "8"]
    flags += ["--train_temperatures", "1.0", "--train_prompt_loss", "true", "--max_steps", "2"]
    summary = main(tiny_argv(tmp_path, *flags))
    assert summary["steps"] == 2
    out = capsys.readouterr().out
    assert "regenerated 8 training sequences" in out and "warning" not in out
    card = (tmp_path / "drafter" / "README.md").read_text()
    assert "8 definitions prompts cut from the embedded corpus" in card
    # More sequences than the data has prompts of that form: said, not silent.
    main(tiny_argv(tmp_path / "many", *flags, "--train_sequences", "100000"))
    assert "definitions prompts of the 100000 asked" in capsys.readouterr().out


def test_a_fixed_samples_seed_shares_one_regeneration_between_training_seeds(
    tmp_path: Path,
    tiny_argv: Callable[..., list[str]],
    capsys: pytest.CaptureFixture[str],
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    from draftsmith.train.distill import main

    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "cache"))
    flags = ["--train_source", "target_samples", "--train_prompts", "blocks"]
    flags += ["--block_size", "64", "--train_sequences", "4", "--train_temperatures", "1.0"]
    flags += ["--max_steps", "1", "--train_samples_seed", "5"]
    main(tiny_argv(tmp_path / "a", *flags, "--seed", "0"))
    assert "reusing the target's continuations" not in capsys.readouterr().out
    main(tiny_argv(tmp_path / "b", *flags, "--seed", "1"))  # another training seed: same rows
    assert "reusing the target's continuations" in capsys.readouterr().out
    main(tiny_argv(tmp_path / "c", *flags[:-1], "6", "--seed", "1"))  # another samples seed
    assert "reusing the target's continuations" not in capsys.readouterr().out


def test_regenerated_rows_are_keyed_by_target_weights_dtype_and_settings(
    tiny_target: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    import shutil

    from draftsmith.train.distill_data import regenerated_rows_file
    from transformers import AutoModelForCausalLM

    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "cache"))
    copy = tmp_path / "target"
    shutil.copytree(tiny_target, copy)
    target = AutoModelForCausalLM.from_pretrained(copy)
    settings = {"prompts": [[1, 2, 3]], "temperatures": [0.0, 1.0], "seed": 0}
    path = regenerated_rows_file(target, settings)
    assert path is not None and path.parent == tmp_path / "cache" / "draftsmith" / "regenerated"
    assert regenerated_rows_file(target, dict(settings)) == path
    assert regenerated_rows_file(target, {**settings, "seed": 1}) != path
    assert regenerated_rows_file(target.to(torch.bfloat16), settings) != path
    target.to(torch.float32)
    weights = next(copy.glob("*.safetensors"))
    weights.write_bytes(weights.read_bytes())  # rewritten in place: a new modification time
    assert regenerated_rows_file(target, settings) != path
    target.name_or_path = ""  # no local folder: nothing to key on, nothing cached
    assert regenerated_rows_file(target, settings) is None
