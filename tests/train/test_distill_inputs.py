"""Bad input fails before training starts, with a message that says what to change."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import pytest
import torch
from draftsmith.train.distill import main
from draftsmith.train.loop import NonFiniteLossError
from safetensors.torch import load_file
from tiny_models import tiny_llama

Argv = Callable[..., list[str]]


def _nothing_trained(output_dir: Path) -> bool:
    return not (output_dir / "checkpoints").exists() and not (output_dir / "logs").exists()


def test_missing_target_path(tmp_path: Path, tiny_argv: Argv) -> None:
    argv = [*tiny_argv(tmp_path), "--target", str(tmp_path / "no-such-model")]
    with pytest.raises(FileNotFoundError, match="no such folder; pass an existing model folder"):
        main(argv)
    not_a_model = tmp_path / "empty"
    not_a_model.mkdir()
    with pytest.raises(FileNotFoundError, match=r"no config\.json"):
        main([*tiny_argv(tmp_path / "out"), "--target", str(not_a_model)])
    assert _nothing_trained(tmp_path / "out")


def test_unknown_loss_name(tmp_path: Path, tiny_argv: Argv) -> None:
    with pytest.raises(ValueError, match=r"unknown loss .kl.*valid names: fkl, rkl, jsd, tv"):
        main(tiny_argv(tmp_path, "--loss", "kl"))
    assert _nothing_trained(tmp_path)


def test_unknown_drafter_kind(tmp_path: Path, tiny_argv: Argv) -> None:
    with pytest.raises(ValueError, match="unknown objective/drafter kind 'ngram'; known kinds"):
        main(tiny_argv(tmp_path, "--drafter_kind", "ngram"))


def test_drafter_vocab_differs_from_target(tmp_path: Path, tiny_argv: Argv) -> None:
    other = tmp_path / "other-vocab"
    tiny_llama(vocab_size=64).save_pretrained(other)
    with pytest.raises(ValueError, match="predicts over 64 tokens but the target over 512"):
        main(tiny_argv(tmp_path / "out", "--drafter_path", str(other)))
    assert _nothing_trained(tmp_path / "out")


def test_empty_dataset(tmp_path: Path, tiny_argv: Argv) -> None:
    data = tmp_path / "short.jsonl"
    data.write_text('{"text": "x = 1"}\n{"text": "y = 2"}\n{"text": "z"}\n')
    with pytest.raises(ValueError, match=r"yields no training sequence.*lower --block_size"):
        main(tiny_argv(tmp_path / "out", "--dataset", str(data)))
    assert _nothing_trained(tmp_path / "out")
    empty = tmp_path / "empty.jsonl"
    empty.write_text("")
    with pytest.raises(ValueError, match="holds no records"):
        main(tiny_argv(tmp_path / "out", "--dataset", str(empty)))
    with pytest.raises(ValueError, match=r"none of 'messages'.*set --messages_field"):
        wrong = tmp_path / "wrong.jsonl"
        wrong.write_text('{"body": "a"}\n{"body": "b"}\n')
        main(tiny_argv(tmp_path / "out", "--dataset", str(wrong)))


def test_existing_run_needs_resume_or_overwrite(tmp_path: Path, tiny_argv: Argv) -> None:
    (tmp_path / "checkpoints" / "checkpoint-0000002").mkdir(parents=True)
    (tmp_path / "checkpoints" / "checkpoint-0000002" / "trainer_state.json").write_text("{}")
    with pytest.raises(FileExistsError, match="--resume_from_checkpoint latest"):
        main(tiny_argv(tmp_path))
    with pytest.raises(FileNotFoundError, match="not a complete checkpoint"):
        main(tiny_argv(tmp_path, "--resume_from_checkpoint", str(tmp_path / "nope")))


def test_a_launch_without_a_process_group_builds_no_demo_target(
    tmp_path: Path, tiny_argv: Argv, monkeypatch: pytest.MonkeyPatch
) -> None:
    # Launched ranks build a missing demo target on the main one (tests/train/test_distill_fsdp.py);
    # a process that was told it is one of two but formed no group is refused before any build.
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "cache"))
    monkeypatch.setenv("WORLD_SIZE", "2")
    recipe = Path(__file__).resolve().parents[2] / "configs" / "tiny.yaml"
    argv = ["--config", str(recipe), "--target", "tiny"]
    with pytest.raises(RuntimeError, match="formed no process group"):
        main([*argv, "--output_dir", str(tmp_path / "out")])
    assert not (tmp_path / "cache").exists()


def test_a_diverging_run_stops_with_the_step_and_exports_nothing(
    tmp_path: Path, tiny_argv: Argv
) -> None:
    argv = tiny_argv(tmp_path, "--learning_rate", "1e20", "--warmup_steps", "0", "--max_steps", "4")
    with pytest.raises(NonFiniteLossError, match=r"at step \d+.*Lower the learning rate") as error:
        main([*argv, "--checkpoint_every", "1"])
    assert "nothing is exported" in str(error.value)
    assert not (tmp_path / "drafter").exists()
    assert not (tmp_path / "summary.json").exists()
    # Every checkpoint that was written holds finite weights only.
    for checkpoint in (tmp_path / "checkpoints").glob("checkpoint-*"):
        for tensor in load_file(str(checkpoint / "model.safetensors")).values():
            assert torch.isfinite(tensor).all(), checkpoint


def test_output_dir_that_is_a_file(tmp_path: Path, tiny_argv: Argv) -> None:
    taken = tmp_path / "taken"
    taken.write_text("not a folder")
    for output in (taken, taken / "run"):
        with pytest.raises(FileExistsError, match=r"is a file, not a folder; pass a folder"):
            main(tiny_argv(output))


def test_fp16_on_the_cpu_names_the_fix(tmp_path: Path, tiny_argv: Argv) -> None:
    if torch.cuda.is_available():
        pytest.skip("fp16 is valid with a GPU")
    with pytest.raises(ValueError, match=r"fp16 needs a GPU.*use --mixed_precision bf16 or no"):
        main(tiny_argv(tmp_path, "--mixed_precision", "fp16"))
    assert _nothing_trained(tmp_path)


@pytest.mark.parametrize(
    ("text", "problem"),
    [('[{"input_ids": [1, 2]', "Expecting"), ('{"rows": []}', "not hold a list of rows")],
)
def test_a_corrupt_continuations_cache_is_named_and_regenerated(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], text: str, problem: str
) -> None:
    from draftsmith.train.distill_data import read_regenerated_cache

    cache = tmp_path / "rows.json"
    assert read_regenerated_cache(cache) is None  # absent: generate
    cache.write_text(text)
    assert read_regenerated_cache(cache) is None
    warning = capsys.readouterr().out
    assert str(cache) in warning and problem in warning and "generating them again" in warning
    cache.write_text('[{"input_ids": [1, 2]}]')
    assert read_regenerated_cache(cache) == [{"input_ids": [1, 2]}]
