"""The command lines that serve an exported drafter: vLLM's and SGLang's, exact and copyable.

One place writes them for the folder cards (``draftsmith.train.export.formats``,
``draftsmith.train.export.dflash``), the drafter's model card and ``draftsmith-export``.

vLLM (``vllm serve``; its OpenAI server module for the CPU build, whose ``vllm`` console script
looks the package up under the wrong name, docs/guides/serving-engines.md):

- a ``vllm`` folder (EAGLE-3, Medusa, DFlash) is the draft model of the target:
  ``vllm serve TARGET --speculative-config '{"method": M, "model": FOLDER,
  "num_speculative_tokens": N}'``;
- a ``speculators`` folder (EAGLE-3, P-EAGLE) names its verifier itself, so vLLM is given the
  folder as the model: ``vllm serve FOLDER --speculative-config '{"num_speculative_tokens": N}'``.

SGLang (``python -m sglang.launch_server``, flags of ``sglang/srt/server_args.py``) serves a
single-layer EAGLE-3 ``sglang`` folder: ``--speculative-algorithm EAGLE3`` with N steps, top-k 1
(a chain) and N + 1 draft tokens (the N drafts and the token they extend).

N is the draft length the head was trained for (EAGLE-3's unroll steps, P-EAGLE's depths,
Medusa's heads, DFlash's block minus one): the length its later positions learned to draft.
"""

from __future__ import annotations

import json
import shlex
from pathlib import Path

VLLM_METHODS = {"eagle3": "eagle3", "medusa": "medusa", "dflash": "dflash"}
"""Drafter kind -> vLLM's ``method`` for its ``vllm``-layout folder."""
VLLM_CPU_SERVER = "python -m vllm.entrypoints.openai.api_server"
SGLANG_SERVER = "python -m sglang.launch_server"


def vllm_speculative_config(
    kind: str, fmt: str, folder: str | Path, num_speculative_tokens: int
) -> dict[str, object]:
    """The JSON object of ``--speculative-config`` for a ``fmt`` folder of a ``kind`` drafter."""
    _check_length(num_speculative_tokens)
    if fmt == "speculators":
        return {"num_speculative_tokens": num_speculative_tokens}
    if fmt != "vllm" or kind not in VLLM_METHODS:
        raise ValueError(f"vLLM serves no {fmt!r} folder of a {kind} drafter")
    return {
        "method": VLLM_METHODS[kind],
        "model": str(folder),
        "num_speculative_tokens": num_speculative_tokens,
    }


def vllm_serve_line(
    kind: str,
    fmt: str,
    target: str | Path,
    folder: str | Path,
    num_speculative_tokens: int,
    *,
    cpu_build: bool = False,
) -> str:
    """``vllm serve MODEL --speculative-config '{...}'`` (the CPU build's server module with
    ``--model MODEL`` when ``cpu_build``); MODEL is the target, or a speculators folder."""
    config = vllm_speculative_config(kind, fmt, folder, num_speculative_tokens)
    model = shlex.quote(str(folder if fmt == "speculators" else target))
    start = f"{VLLM_CPU_SERVER} --model {model}" if cpu_build else f"vllm serve {model}"
    return f"{start} --speculative-config {shlex.quote(json.dumps(config))}"


def sglang_launch_line(target: str | Path, folder: str | Path, num_speculative_tokens: int) -> str:
    """SGLang's launch line for an EAGLE-3 ``sglang`` folder drafting chains of N tokens."""
    _check_length(num_speculative_tokens)
    return (
        f"{SGLANG_SERVER} --model-path {shlex.quote(str(target))} "
        f"--speculative-algorithm EAGLE3 --speculative-draft-model-path "
        f"{shlex.quote(str(folder))} --speculative-num-steps {num_speculative_tokens} "
        f"--speculative-eagle-topk 1 --speculative-num-draft-tokens {num_speculative_tokens + 1}"
    )


def serve_lines(
    kind: str, fmt: str, target: str | Path, folder: str | Path, num_speculative_tokens: int
) -> dict[str, str]:
    """Engine name -> the line serving a ``fmt`` folder (vLLM, its CPU build, SGLang)."""
    if fmt == "sglang":
        return {"SGLang": sglang_launch_line(target, folder, num_speculative_tokens)}
    return {
        "vLLM": vllm_serve_line(kind, fmt, target, folder, num_speculative_tokens),
        "vLLM (CPU build, vllm-cpu)": vllm_serve_line(
            kind, fmt, target, folder, num_speculative_tokens, cpu_build=True
        ),
    }


def _check_length(num_speculative_tokens: int) -> None:
    if isinstance(num_speculative_tokens, bool) or num_speculative_tokens < 1:
        raise ValueError(
            f"the draft length must be an integer >= 1, got {num_speculative_tokens!r}"
        )
