"""Every recipe for a real target runs without hub or GPU: the family's real config facts
(vocabulary, rope, context, chat template) on a scaled-down model, a few CPU steps on a chat
file in the regenerated shape, the recipe's exports written and read back.

What is kept from each recipe: the drafter kind and its settings, the loss, the data path
(conversations, assistant-only masks), the draft vocabulary, the exports. What is overridden:
the target (a 4 x 64 model with the family's config.json facts), the dataset, the sizes and the
budget, the dtype (float32 on CPU) and the tracker.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from draftsmith.decode.drafters.registry import load_drafter
from real_targets import LLAMA32_1B, save_scaled_target

CONFIGS = Path(__file__).resolve().parents[2] / "configs"
# recipe -> (target fixture, exports it writes)
RECIPES = {
    "llama3.1-8b-eagle3.yaml": ("llama31_target", ("vllm", "sglang", "speculators")),
    "qwen3-8b-eagle3.yaml": ("qwen3_target", ("vllm", "sglang", "speculators")),
    "llama3.1-8b-medusa.yaml": ("llama31_target", ("vllm",)),
    "llama3.1-8b-draft.yaml": ("llama31_target", ()),
    "llama3.1-8b-peagle.yaml": ("llama31_target", ("speculators",)),
    "qwen3-8b-dflash.yaml": ("qwen3_target", ("vllm", "speculators")),
}
TOPICS = ["primes", "rivers", "sorting", "tea", "orbits", "verbs", "chess", "bread"]


def chat_file(path: Path, reasoning: bool) -> Path:
    """Conversations as draftsmith-regenerate writes them (the target's answers last)."""
    records = []
    for i in range(16):
        topic = TOPICS[i % len(TOPICS)]
        answer = f"Here is a short note on {topic}: item {i} is listed and explained."
        if reasoning:
            answer = f"<think>\nThe user wants {topic}.\n</think>\n\n{answer}"
        messages = [{"role": "user", "content": f"Tell me about {topic}, number {i}."}]
        if i % 3 == 0:  # some multi-turn conversations
            messages = [
                {"role": "system", "content": "Answer briefly."},
                *messages,
                {"role": "assistant", "content": f"{topic} {i}."},
                {"role": "user", "content": "More, please."},
            ]
        records.append(
            {"index": i, "messages": [*messages, {"role": "assistant", "content": answer}]}
        )
    path.write_text("".join(json.dumps(r) + "\n" for r in records))
    return path


@pytest.fixture(scope="module")
def draft_folder(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """Llama-3.2-1B-Instruct's facts (tied embeddings, its own llama3 rope) on 2 x 64."""
    return save_scaled_target(
        LLAMA32_1B, tmp_path_factory.mktemp("draft") / "llama32", num_layers=2
    )


# 8-18 s each on an idle 2-core machine (vocabularies of 128,256 and 151,936): in CI, since
# every recipe must run, export and reload there.
@pytest.mark.parametrize("recipe", sorted(RECIPES))
def test_recipe_runs_exports_and_reloads(
    recipe: str, request: pytest.FixtureRequest, draft_folder: Path, tmp_path: Path
) -> None:
    from draftsmith.train.distill import main

    fixture, exports = RECIPES[recipe]
    target_folder: Path = request.getfixturevalue(fixture)
    data = chat_file(tmp_path / "chat.jsonl", reasoning=fixture == "qwen3_target")
    argv = [
        "--config", str(CONFIGS / recipe), "--target", str(target_folder),
        "--dataset", str(data), "--output_dir", str(tmp_path / "run"),
        "--block_size", "128", "--validation_fraction", "0.25", "--eval_sequences", "2",
        "--max_steps", "3", "--warmup_steps", "1", "--per_device_batch_size", "2",
        "--gradient_accumulation_steps", "1", "--eval_every", "0", "--checkpoint_every", "0",
        "--log_every", "1", "--report_to", "none", "--progress_bar", "false",
        "--target_dtype", "float32", "--mixed_precision", "no",
    ]  # fmt: skip
    if "draft.yaml" in recipe:
        argv += ["--drafter_path", str(draft_folder)]
    if "dflash" in recipe:  # the scaled target has 4 layers, a 128-token block few anchors
        argv += ["--aux_hidden_state_layer_ids", "1", "2", "3", "--dflash_num_anchors", "4"]
    summary = main(argv)
    assert summary["steps"] == 3
    assert all(torch.isfinite(torch.tensor(v)) for v in summary["held_out"].values())
    folder = Path(summary["drafter_dir"])
    card = (folder / "README.md").read_text()

    from transformers import AutoModelForCausalLM

    target = AutoModelForCausalLM.from_pretrained(target_folder).eval()
    drafter = load_drafter(folder, target)  # the native folder, as the decoder loads it
    assert drafter is not None
    context = json.loads((target_folder / "config.json").read_text())["max_position_embeddings"]
    if "eagle3" in recipe or "peagle" in recipe:
        # The head's rope and context, stated in the model card, are the target's theta and
        # context with no scaling.
        assert "rope and context: plain rope" in card and f"{context}" in card
    for fmt in exports:
        exported = folder / fmt
        config = json.loads((exported / "config.json").read_text())
        layer = config.get("transformer_layer_config", config)
        assert config.get("vocab_size", layer.get("vocab_size")) == target.config.vocab_size
        if "medusa" in recipe:
            from draftsmith.decode.drafters.medusa import MedusaHeads

            assert MedusaHeads.from_pretrained(exported).config.num_heads == 4
            continue
        if "dflash" in recipe:
            from draftsmith.decode.drafters.dflash.head import DFlashHead

            head = DFlashHead.from_pretrained(exported)  # the full vocabulary, 5 layers, B = 16
            assert head.config.num_hidden_layers == 5 and head.config.block_size == 16
            assert head.config.draft_vocab_size == target.config.vocab_size
            assert layer["max_position_embeddings"] >= context
            continue
        assert layer["max_position_embeddings"] >= context and layer["rope_scaling"] is None
        assert config["draft_vocab_size"] == 32000
        if fmt != "speculators":
            from draftsmith.decode.drafters.eagle.head import Eagle3Head

            assert Eagle3Head.from_pretrained(exported).config.draft_vocab_size == 32000
        elif "peagle" in recipe:
            from draftsmith.train.export.formats import read_speculators_peagle

            assert read_speculators_peagle(exported).config.max_position_embeddings >= context
        else:
            from draftsmith.train.export.formats import read_speculators_eagle3

            assert read_speculators_eagle3(exported).config.max_position_embeddings >= context
    if "draft.yaml" in recipe:
        drafted = AutoModelForCausalLM.from_pretrained(folder)
        assert drafted.config.vocab_size == target.config.vocab_size
        assert drafted.config.rope_parameters["rope_type"] == "llama3"


@pytest.mark.slow  # two CPU ranks through accelerate launch
def test_the_70b_recipe_shards_its_target_over_two_ranks_exports_and_reloads(
    tmp_path: Path,
) -> None:
    """configs/llama3.3-70b-eagle3.yaml: Llama-3.3-70B's facts (80 layers and 8192 wide in
    truth, 4 x 64 here) sharded over 2 CPU ranks (--target_sharding fsdp from the recipe)."""
    import os
    import subprocess
    import sys

    from draftsmith.decode.drafters.eagle.head import Eagle3Head
    from real_targets import LLAMA33_70B

    target_folder = save_scaled_target(LLAMA33_70B, tmp_path / "target")
    data = chat_file(tmp_path / "chat.jsonl", reasoning=False)
    repo = CONFIGS.parent
    env = {**os.environ, "ACCELERATE_USE_CPU": "true", "HF_HUB_OFFLINE": "1"}
    command = [
        sys.executable, "-m", "accelerate.commands.launch", "--multi_gpu", "--num_processes", "2",
        "--num_machines", "1", "--mixed_precision", "no", "--dynamo_backend", "no",
        str(repo / "train" / "distill.py"), "--config", str(CONFIGS / "llama3.3-70b-eagle3.yaml"),
        "--target", str(target_folder), "--dataset", str(data),
        "--output_dir", str(tmp_path / "run"), "--block_size", "128",
        "--validation_fraction", "0.25", "--eval_sequences", "2", "--max_steps", "2",
        "--warmup_steps", "1", "--per_device_batch_size", "1", "--gradient_accumulation_steps", "1",
        "--eval_every", "0", "--checkpoint_every", "0", "--report_to", "none",
        "--progress_bar", "false", "--target_dtype", "float32", "--mixed_precision", "no",
    ]  # fmt: skip
    done = subprocess.run(command, cwd=repo, env=env, capture_output=True, text=True, timeout=1500)
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-4000:]
    assert "frozen target (fsdp)" in done.stdout + done.stderr
    folder = tmp_path / "run" / "drafter"
    context = json.loads((target_folder / "config.json").read_text())["max_position_embeddings"]
    for fmt in ("vllm", "sglang"):
        head = Eagle3Head.from_pretrained(folder / fmt)
        assert head.config.draft_vocab_size == 32000
        assert head.config.max_position_embeddings == context == 131072
    from draftsmith.train.export.formats import read_speculators_eagle3

    assert read_speculators_eagle3(folder / "speculators").config.rope_theta == 500000.0
