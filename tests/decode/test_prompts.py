"""Evaluation prompts and the corpus prompts cut in their form for regenerating data."""

from __future__ import annotations

import pytest
from draftsmith.data.corpus import load_stdlib_corpus
from draftsmith.decode.measure.prompts import DEMO_PROMPT_CHARS, definition_prompts, demo_prompts
from draftsmith.train.regeneration.in_process import corpus_definition_prompts

CODE = (
    "import os\n"
    "\n"
    "def first():\n"
    "    return 1\n"
    "\n"
    "class Second:\n"
    "    def method(self):\n"
    "        return 2\n"
)


def _ends_with_definition(prompt: str) -> bool:
    last = prompt.splitlines()[-1].lstrip()
    return prompt == prompt.rstrip() and last.startswith(("def ", "class "))


def test_definition_prompts_end_at_each_def_or_class_line_with_a_fixed_length() -> None:
    prompts = list(definition_prompts(CODE, chars=20))
    assert [p.splitlines()[-1].strip() for p in prompts] == [
        "def first():",
        "class Second:",
        "def method(self):",
    ]
    assert all(len(p) == 20 and CODE.find(p) >= 0 for p in prompts)
    assert all(p.endswith(":") for p in prompts)  # the line break is the next token's


def test_a_prompt_ends_where_the_tokenizer_ends_a_token_in_the_full_text() -> None:
    """Cut from real code, a prompt's tokens are a prefix of the full text's tokens: the
    model sees the boundary it saw in training (a lone line-break token it never did)."""
    from tiny_models import tiny_tokenizer

    tokenizer = tiny_tokenizer()
    code = "x = 1\n\n\ndef add(a, b):\n    return a + b\n"
    (prompt,) = definition_prompts(code, chars=len("\n\n\ndef add(a, b):"))
    full = tokenizer(code[code.index(prompt) :], add_special_tokens=False)["input_ids"]
    cut = tokenizer(prompt, add_special_tokens=False)["input_ids"]
    assert full[: len(cut)] == cut
    with_break = tokenizer(prompt + "\n", add_special_tokens=False)["input_ids"]
    assert full[: len(with_break)] != with_break  # what the old cut gave the model


def test_definitions_too_close_to_the_start_give_no_prompt() -> None:
    first_end = CODE.index("def first():") + len("def first():")
    prompts = list(definition_prompts(CODE, chars=first_end))
    assert [p.splitlines()[-1].strip() for p in prompts] == ["class Second:", "def method(self):"]


def test_corpus_definition_prompts_have_the_demo_form_and_come_from_training_files() -> None:
    prompts = corpus_definition_prompts(60, max_files=40)
    assert len(prompts) == 60
    assert all(len(p) == DEMO_PROMPT_CHARS and _ends_with_definition(p) for p in prompts)
    assert all(_ends_with_definition(p) for p in demo_prompts(16))
    training = load_stdlib_corpus(max_files=40)["train"]["text"]
    assert all(any(p in text for text in training) for p in prompts)


def test_corpus_definition_prompts_take_each_file_in_turn() -> None:
    """The first definition of every file comes before any file's second, so a small count
    still spreads over the corpus."""
    few = corpus_definition_prompts(10, max_files=40)
    many = corpus_definition_prompts(10_000, max_files=40)
    assert few == many[:10]
    assert len(set(few)) == 10
    assert len(many) > 40  # files hold several definitions each


@pytest.mark.parametrize("chars", [0, -5, 2.5, True])
def test_corpus_definition_prompts_refuse_a_bad_length(chars: object) -> None:
    with pytest.raises(ValueError, match="--prompt-chars"):
        corpus_definition_prompts(4, max_files=5, chars=chars)  # type: ignore[arg-type]


def test_hostile_prompt_files_are_clear_errors(tmp_path) -> None:
    """A folder, JSON nested past the parser's depth, counts below 1, a byte-order mark."""
    from draftsmith.decode.measure.prompts import file_prompts, load_eval_prompts

    with pytest.raises(ValueError, match="is a folder; pass a file in it"):
        load_eval_prompts(str(tmp_path), 2)
    for name in ("deep.json", "deep.jsonl"):
        deep = tmp_path / name
        deep.write_text("[" * 100_000 + "]" * 100_000 + "\n")
        with pytest.raises(ValueError, match="nests JSON too deeply"):
            load_eval_prompts(str(deep), 2)
    text = tmp_path / "p.txt"
    text.write_bytes(b"\xef\xbb\xbffirst\nsecond\n")
    assert file_prompts(str(text), 5) == ["first", "second"]
    for spec in ("demo", "ood", str(text)):
        for count in (0, -1):
            with pytest.raises(
                ValueError, match=rf"--num-prompts must be an integer >= 1, got {count}"
            ):
                load_eval_prompts(spec, count)


def test_unreadable_prompt_file_is_a_clear_error(tmp_path, monkeypatch) -> None:
    """An OSError while reading (permissions, a device) names the file, no traceback."""
    from pathlib import Path

    from draftsmith.decode.measure.prompts import file_prompts

    text = tmp_path / "p.txt"
    text.write_text("a\n")

    def refuse(*_args, **_kwargs):
        raise PermissionError(13, "Permission denied")

    monkeypatch.setattr(Path, "read_text", refuse)
    with pytest.raises(ValueError, match=r"p\.txt cannot be read \(Permission denied\)"):
        file_prompts(str(text), 1)
