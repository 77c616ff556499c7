"""scripts/check_engine.py: folder detection, the verdict, draftsmith's side, and (marked
``engines``) the real check in vLLM where it is importable or ``DRAFTSMITH_ENGINE_PYTHON`` names
a Python that has it."""

from __future__ import annotations

import importlib.util
import json
import os
import sys
from pathlib import Path

import pytest
import torch
from draftsmith.decode.drafters.dflash.head import DFLASH_ARCHITECTURE, DFlashConfig, DFlashHead
from draftsmith.decode.drafters.eagle.head import Eagle3Config, Eagle3Head
from draftsmith.decode.drafters.eagle.peagle import PEagleConfig, PEagleHead
from draftsmith.train.export.dflash import export_dflash
from draftsmith.train.export.formats import export_eagle3, export_medusa, export_peagle
from engine_models import (
    engine_llama,
    fit_dflash,
    fit_eagle3,
    fit_medusa,
    fit_peagle,
    greedy_corpus,
    save_target,
)

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "scripts"))
import check_engine

ENGINE_PYTHON = os.environ.get("DRAFTSMITH_ENGINE_PYTHON")
HAVE_VLLM = importlib.util.find_spec("vllm") is not None or bool(ENGINE_PYTHON)


def _job(target: Path, drafter: Path, *extra: str) -> dict:
    args = check_engine.build_parser().parse_args(
        ["--target", str(target), "--drafter", str(drafter), *extra]
    )
    return check_engine.build_job(args)


def assert_draftsmith_side_is_plain_greedy(target: torch.nn.Module, job: dict) -> None:
    """The script's draftsmith side decodes the job's prompts exactly as greedy ``generate``,
    drafting 3 tokens a round."""
    ours = check_engine.run_draftsmith(job)
    with torch.no_grad():
        for ids, out in zip(job["prompts"], ours["speculative"], strict=True):
            ref = target.generate(
                torch.tensor([ids]), max_new_tokens=job["max_tokens"], do_sample=False,
                eos_token_id=None,
            )  # fmt: skip
            assert out == ref[0, len(ids) :].tolist()
    assert ours["drafts"] > 0 and len(ours["accepted_per_position"]) == 3


def test_folders_are_recognised_by_what_they_declare(tmp_path) -> None:
    target = engine_llama(2)
    head = Eagle3Head(Eagle3Config.for_target(target.config))
    assert check_engine.drafter_method(export_eagle3(head, tmp_path / "v", "vllm")) == "eagle3"
    folder = export_eagle3(head, tmp_path / "s", "speculators", verifier="t")
    assert check_engine.drafter_method(folder) == "speculators"
    target4 = engine_llama(4)
    parallel = PEagleHead(PEagleConfig.for_target(target4.config))
    embed = target4.get_input_embeddings().weight
    folder = export_peagle(parallel, embed, tmp_path / "p", verifier="t")
    assert check_engine.drafter_method(folder) == "peagle"
    block = DFlashHead(DFlashConfig.for_target(target4.config, block_size=4))
    assert check_engine.drafter_method(export_dflash(block, tmp_path / "d")) == "dflash"
    # The engine side runs without draftsmith, so the script spells the name out: keep it equal.
    assert check_engine.DFLASH_ARCHITECTURE == DFLASH_ARCHITECTURE
    (tmp_path / "x").mkdir()
    (tmp_path / "x" / "config.json").write_text(json.dumps({"architectures": ["LlamaForCausalLM"]}))
    with pytest.raises(SystemExit, match="not an engine export"):
        check_engine.drafter_method(tmp_path / "x")
    with pytest.raises(SystemExit, match=r"no config\.json"):
        check_engine.drafter_method(tmp_path / "missing")


def test_prompts_are_seeded_and_avoid_special_ids() -> None:
    a = check_engine.make_prompts(256, 4, 16, seed=3)
    assert (
        a
        == check_engine.make_prompts(256, 4, 16, seed=3)
        != check_engine.make_prompts(256, 4, 16, seed=4)
    )
    assert len(a) == 4 and all(len(p) == 16 and min(p) >= 3 and max(p) < 256 for p in a)


def _engine(spec, per_pos):
    plain = [[1, 2, 3], [4, 5, 6]]
    return {"plain": plain, "speculative": spec, "drafts": 4, "accepted": sum(per_pos),
            "accepted_per_position": per_pos}  # fmt: skip


def test_verdict_passes_only_on_equal_outputs_and_agreeing_acceptance() -> None:
    same = [[1, 2, 3], [4, 5, 6]]
    ours = {"speculative": same, "drafts": 4, "accepted": 5, "accepted_per_position": [3, 2]}
    assert check_engine.compare(_engine(same, [3, 2]), ours, 0.0)["ok"]
    verdict = check_engine.compare(_engine(same, [3, 1, 0]), ours, 0.0)
    assert not verdict["ok"] and "per position differ" in verdict["problems"][0]
    assert check_engine.compare(_engine(same, [100, 50]), {**ours, "accepted_per_position": [99, 50]}, 0.02)["ok"]  # fmt: skip
    cut = {**ours, "accepted_per_position": [3, 1]}  # one request's last round cut short
    assert check_engine.compare(_engine(same, [3, 2]), cut, 0.02, last_rounds=2)["ok"]
    assert not check_engine.compare(_engine(same, [3, 2]), cut, 0.0, last_rounds=2)["ok"]
    misread = {**ours, "accepted_per_position": [9, 2]}
    assert not check_engine.compare(_engine(same, [3, 2]), misread, 0.02, last_rounds=2)["ok"]
    wrong = [[1, 2, 3], [4, 5, 7]]
    verdict = check_engine.compare(_engine(wrong, [3, 2]), ours, 0.0)
    assert verdict["engine_equal_plain"] == [True, False] and not verdict["ok"]
    verdict = check_engine.compare(_engine(same, [3, 2]), {**ours, "speculative": wrong}, 0.0)
    assert "draftsmith's output differs" in verdict["problems"][0]
    nothing = {**ours, "accepted_per_position": [0, 0]}
    verdict = check_engine.compare(_engine(same, [0, 0]), nothing, 0.0)
    assert not verdict["ok"] and "nothing was checked" in verdict["problems"][0]


def test_bad_arguments_are_named(tmp_path) -> None:
    target = save_target(engine_llama(2), tmp_path / "t")
    heads = fit_medusa(engine_llama(2), torch.randint(3, 256, (2, 8)), num_heads=2, steps=1)
    folder = export_medusa(heads, tmp_path / "m")
    with pytest.raises(SystemExit, match="draft at most 2"):
        _job(target, folder, "--k", "3")
    with pytest.raises(SystemExit, match=r"no config\.json"):
        _job(tmp_path / "nowhere", folder)
    with pytest.raises(SystemExit, match="--max-tokens must be >= 1"):
        _job(target, folder, "--max-tokens", "0")


def test_draftsmith_side_equals_plain_greedy(tmp_path) -> None:
    """The script's own half: draftsmith decodes the exported folder exactly like greedy."""
    target = engine_llama(4)
    target_dir = save_target(target, tmp_path / "t")
    head = Eagle3Head(Eagle3Config.for_target(target.config, draft_vocab_size=128))
    folder = export_eagle3(head, tmp_path / "e", "speculators", verifier=str(target_dir))
    job = _job(target_dir, folder, "--num-prompts", "2", "--max-tokens", "12")
    assert_draftsmith_side_is_plain_greedy(target, job)


def test_draftsmith_side_of_a_peagle_folder_equals_plain_greedy(tmp_path) -> None:
    target = engine_llama(4)
    target_dir = save_target(target, tmp_path / "t")
    corpus = greedy_corpus(target, rows=8, length=24)
    head = fit_peagle(target, corpus, draft_vocab_size=128, steps=10)
    embed = target.get_input_embeddings().weight
    folder = export_peagle(head, embed, tmp_path / "p", verifier=str(target_dir))
    job = _job(target_dir, folder, "--num-prompts", "2", "--max-tokens", "12")
    assert job["method"] == "peagle"
    assert_draftsmith_side_is_plain_greedy(target, job)


def test_draftsmith_side_of_a_dflash_folder_equals_plain_greedy(tmp_path) -> None:
    target = engine_llama(4)
    target_dir = save_target(target, tmp_path / "t")
    corpus = greedy_corpus(target, rows=8, length=24)
    head = fit_dflash(target, corpus, block_size=4, steps=20, draft_vocab_size=128)
    folder = export_dflash(head, tmp_path / "d")
    with pytest.raises(SystemExit, match="drafts at most 3 tokens"):
        _job(target_dir, folder, "--k", "4")
    job = _job(target_dir, folder, "--num-prompts", "2", "--max-tokens", "12")
    assert job["method"] == "dflash"
    assert_draftsmith_side_is_plain_greedy(target, job)


# ------------------------------------------------------------------ the engine itself


@pytest.fixture(scope="module")
def fitted(tmp_path_factory):
    """A 4-layer engine-compatible target with pruned-vocabulary EAGLE-3 and P-EAGLE heads (one
    and two layers) and Medusa heads."""
    root = tmp_path_factory.mktemp("engine")
    target = engine_llama(4)
    target_dir = save_target(target, root / "target")
    corpus = greedy_corpus(target, rows=16, length=40)
    head = fit_eagle3(target, corpus, draft_vocab_size=128, steps=40)
    medusa = fit_medusa(target, corpus, num_heads=3, steps=40)
    two_layers = fit_eagle3(target, corpus, draft_vocab_size=128, steps=40, num_layers=2)
    # The block drafter is fitted on the check's own prompts continued greedily: a head this
    # small accepts almost nothing on prompts it never saw, and then nothing would be checked.
    seen = torch.tensor(check_engine.make_prompts(target.config.vocab_size, 2, 16, seed=0))
    with torch.no_grad():
        seen = target.generate(seen, max_new_tokens=32, do_sample=False, eos_token_id=None)
    block = fit_dflash(target, seen, block_size=4, steps=150, draft_vocab_size=128)
    return {
        "dflash": export_dflash(block, root / "dflash" / "vllm"),
        "dflash_speculators": export_dflash(
            block, root / "dflash" / "speculators", "speculators", verifier=str(target_dir)
        ),
        "target": target_dir,
        "vllm": export_eagle3(head, root / "eagle3" / "vllm", "vllm"),
        "speculators": export_eagle3(
            head, root / "eagle3" / "speculators", "speculators", verifier=str(target_dir)
        ),
        "vllm_two_layers": export_eagle3(two_layers, root / "eagle3_2" / "vllm", "vllm"),
        "medusa": export_medusa(medusa, root / "medusa" / "vllm"),
        "peagle": export_peagle(
            fit_peagle(target, corpus, draft_vocab_size=128, steps=40),
            target.get_input_embeddings().weight,
            root / "peagle" / "speculators",
            verifier=str(target_dir),
        ),
        "peagle_two_layers": export_peagle(
            fit_peagle(target, corpus, draft_vocab_size=128, steps=40, num_layers=2),
            target.get_input_embeddings().weight,
            root / "peagle_2" / "speculators",
            verifier=str(target_dir),
        ),
    }


@pytest.mark.engines
@pytest.mark.skipif(not HAVE_VLLM, reason="vLLM is not importable (set DRAFTSMITH_ENGINE_PYTHON)")
@pytest.mark.parametrize(
    "layout",
    [
        *("vllm", "speculators", "medusa", "peagle", "vllm_two_layers", "peagle_two_layers"),
        *("dflash", "dflash_speculators"),
    ],
)
def test_exports_run_in_vllm_exactly_as_in_draftsmith(fitted, layout: str, tmp_path) -> None:
    argv = ["--target", str(fitted["target"]), "--drafter", str(fitted[layout])]
    argv += ["--num-prompts", "2", "--max-tokens", "24", "--json", str(tmp_path / "r.json")]
    # float32: exact equality across engines (in bfloat16 their kernels may break near-ties
    # apart, and "auto" picks bfloat16 on a CPU with its kernels).
    argv += ["--dtype", "float32"]
    if ENGINE_PYTHON:
        argv += ["--engine-python", ENGINE_PYTHON]
    assert check_engine.main(argv) == 0
    report = json.loads((tmp_path / "r.json").read_text())
    assert all(report["verdict"]["engine_equal_plain"])
    assert all(report["verdict"]["draftsmith_equal_plain"])
    assert report["verdict"]["acceptance_close"]


def test_benchmark_files_give_an_accept_length_per_benchmark_on_both_sides(tmp_path) -> None:
    """--benchmark: each file's prompts through the target's chat template, one group each;
    the report shows each benchmark's 1 + accepted / drafts for the engine and for draftsmith
    (here the engine's counters are draftsmith's own, taken group by group)."""
    from tiny_models import tiny_causal_lm, tiny_tokenizer

    tokenizer = tiny_tokenizer()
    target = tiny_causal_lm("llama", vocab_size=len(tokenizer), hidden_size=64, num_layers=4)
    target = target.float().eval()
    target_dir = save_target(target, tmp_path / "t")
    tokenizer.save_pretrained(target_dir)
    head = Eagle3Head(Eagle3Config.for_target(target.config, draft_vocab_size=128))
    folder = export_eagle3(head, tmp_path / "e", "speculators", verifier=str(target_dir))
    mtbench = tmp_path / "question.jsonl"
    mtbench.write_text("".join(
        json.dumps({"question_id": i, "category": "x", "turns": [f"Say {i}.", "Again."]}) + "\n"
        for i in range(3)
    ))  # fmt: skip
    gsm8k = tmp_path / "test.jsonl"
    gsm8k.write_text(json.dumps({"question": "What is 2 + 2?", "answer": "#### 4"}) + "\n")
    job = _job(target_dir, folder, "--num-prompts", "2", "--max-tokens", "8", "--dtype",
               "float32", "--benchmark", f"mtbench={mtbench}", "--benchmark", f"gsm8k={gsm8k}")  # fmt: skip
    assert job["groups"] == [["mtbench", 2], ["gsm8k", 1]] and len(job["prompts"]) == 3
    text = tokenizer.apply_chat_template(
        [{"role": "user", "content": "Say 1."}], add_generation_prompt=True, tokenize=False
    )
    chat = tokenizer(text, add_special_tokens=False)["input_ids"]
    assert job["prompts"][1] == list(chat)  # the first turn, through the chat template
    ours = check_engine.run_draftsmith(job)
    assert [g["name"] for g in ours["groups"]] == ["mtbench", "gsm8k"]
    assert sum(g["drafts"] for g in ours["groups"]) == ours["drafts"]
    assert sum(g["accepted"] for g in ours["groups"]) == ours["accepted"]
    # An engine reporting cumulative counters: per-group differences recover the groups.
    total = check_engine.counter_difference(ours, {"drafts": 0, "draft_tokens": 0,
                                                   "accepted": 0, "accepted_per_position": []})  # fmt: skip
    assert total["accepted"] == ours["accepted"]
    engine = {**ours, "plain": ours["speculative"], "engine": "fake"}
    verdict = check_engine.compare(engine, ours, 0.0)
    report = check_engine.format_report(job, engine, ours, verdict)
    for group, name in zip(
        ours["groups"], ("mtbench (2 prompts)", "gsm8k (1 prompts)"), strict=True
    ):
        line = next(row for row in report.splitlines() if name in row)
        assert line.split()[-2:] == [f"{check_engine.accept_length(group):.2f}"] * 2


def test_broken_configs_tolerance_and_json_path_are_refused(tmp_path) -> None:
    """A config.json that is not JSON or not an object, a NaN tolerance, a --json folder:
    one message each, never a JSON traceback."""
    folder = tmp_path / "d"
    folder.mkdir()
    (folder / "config.json").write_text("{not json")
    with pytest.raises(SystemExit, match=r"config\.json is not UTF-8 JSON"):
        check_engine.drafter_method(folder)
    (folder / "config.json").write_text("[1, 2]")
    with pytest.raises(SystemExit, match=r"config\.json holds a JSON list, not an object"):
        check_engine.drafter_method(folder)
    parser = check_engine.build_parser()
    base = ["--target", str(folder), "--drafter", str(folder)]
    with pytest.raises(SystemExit, match="--tolerance must be a finite number >= 0"):
        check_engine.build_job(parser.parse_args([*base, "--tolerance", "nan"]))
    with pytest.raises(SystemExit, match=r"--json .* is a folder"):
        check_engine.build_job(parser.parse_args([*base, "--json", str(tmp_path)]))
    with pytest.raises(SystemExit, match=r"--target .*config\.json holds a JSON list"):
        check_engine.build_job(parser.parse_args(base))
