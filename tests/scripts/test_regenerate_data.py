"""scripts/regenerate_data.py: target responses as datasets-loadable JSONL that distill reads."""

from __future__ import annotations

import importlib.util
import json
from pathlib import Path
from types import ModuleType

import datasets
import pytest

from train.demo_target import build_demo_target

REPO = Path(__file__).resolve().parents[2]


def _script() -> ModuleType:
    spec = importlib.util.spec_from_file_location(
        "regenerate_data", REPO / "scripts" / "regenerate_data.py"
    )
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.fixture(scope="module")
def target(tmp_path_factory: pytest.TempPathFactory) -> Path:
    folder = tmp_path_factory.mktemp("t") / "tiny"
    return build_demo_target(folder, preset="tiny", max_steps=20, progress_bar=False, verbose=False)


def test_plain_prompts_become_prompt_response_records(tmp_path: Path, target: Path) -> None:
    prompts = tmp_path / "prompts.jsonl"
    prompts.write_text(
        "".join(json.dumps({"prompt": f"def f{i}(x):\n    "}) + "\n" for i in range(5))
    )
    out = tmp_path / "regen.jsonl"
    argv = ["--target", str(target), "--prompts", str(prompts), "--output", str(out),
            "--max-new-tokens", "12", "--batch-size", "2", "--seed", "3"]  # fmt: skip
    result = _script().main(argv)
    assert result["records"] == 5
    table = datasets.load_dataset("json", data_files=str(out), split="train")
    assert table.column_names == ["prompt", "response", "text"]
    assert table[0]["text"] == table[0]["prompt"] + table[0]["response"]
    first = out.read_text()
    _script().main(argv)
    assert out.read_text() == first  # seeded: the same responses again
    assert not list(tmp_path.glob(".regen.jsonl.tmp-*"))

    from train.distill import main

    summary = main(["--config", str(REPO / "configs" / "tiny.yaml"), "--target", str(target),
                    "--output_dir", str(tmp_path / "run"), "--dataset", str(out),
                    "--validation_fraction", "0.4", "--eval_source", "data", "--max_steps", "2",
                    "--per_device_batch_size", "2"])  # fmt: skip
    assert "prompt_response" in summary["data"]


def test_chat_prompts_become_conversations(tmp_path: Path, target: Path) -> None:
    prompts = tmp_path / "chat.jsonl"
    record = {"messages": [{"role": "user", "content": "write a loop"}]}
    prompts.write_text(json.dumps(record) + "\n" + json.dumps(record) + "\n")
    out = tmp_path / "chat-out.jsonl"
    _script().main(["--target", str(target), "--prompts", str(prompts), "--output", str(out),
                    "--max-new-tokens", "6"])  # fmt: skip
    rows = [json.loads(line) for line in out.read_text().splitlines()]
    assert [m["role"] for m in rows[0]["messages"]] == ["user", "assistant"]


def test_corpus_prompts(tmp_path: Path, target: Path) -> None:
    out = tmp_path / "corpus.jsonl"
    result = _script().main(["--target", str(target), "--prompts", "stdlib", "--num-prompts", "4",
                             "--max-files", "20", "--prompt-tokens", "8", "--output", str(out),
                             "--max-new-tokens", "5"])  # fmt: skip
    assert result["records"] == 4
