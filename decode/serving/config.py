"""Typed configuration of the server: one default per field, a YAML file, then flags.

``--config serve.yaml`` (a flat mapping of field: value) sets values and command-line flags
override them; unknown keys are errors that list the valid ones. Every field is a flag with
dashes or underscores (``--num-draft-tokens 4`` or ``--num_draft_tokens 4``), parsed with
``transformers.HfArgumentParser``.
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import typing
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from draftsmith.decode.cpu_threads import check_thread_count
from draftsmith.decode.defaults import (
    LOOKUP_DRAFT_TOKENS,
    NUM_DRAFT_TOKENS,
    TREE_TOP_K,
    TREE_TOTAL_TOKENS,
)
from draftsmith.decode.precision import DTYPE_NAMES
from draftsmith.decode.yaml_values import (
    describe_type,
    describe_value,
    load_plain_yaml,
    typed_value,
)

DTYPES = (*DTYPE_NAMES, "float64")  # float64: exactness tests
API_KEY_ENV = "DRAFTSMITH_API_KEY"
LOG_LEVELS = ("critical", "error", "warning", "info", "debug", "trace")  # uvicorn's
# Rows decoded at once (``--max-batch-size``): more requests wait in the queue until one retires.
MAX_BATCH_SIZE = 32
# How each round's draft length is chosen (``--draft-policy``): from the round's measured cost at
# its batch size and each row's acceptance (decode/draft_length.py, LoadAwareDraftLength); always
# --num-draft-tokens; or the decoder's pooled adaptive length (and tree shapes with --tree).
DRAFT_POLICIES = ("load-aware", "fixed", "adaptive")
DECODER_PLACES = ("process", "thread")  # draftsmith.decode.serving.backend


def _f(default: Any, help: str) -> Any:
    return field(default=default, metadata={"help": help})


@dataclass
class ServeConfig:
    """What to serve, where, and the limits every request is checked against."""

    target: str = field(metadata={"help": "target model folder (Hugging Face layout)"})
    drafter: str | None = _f(
        None,
        "drafter folder written by training (not needed for ngram or none; without one and "
        "without --drafter-kind the target is served plainly, --drafter-kind none)",
    )
    drafter_kind: str | None = _f(
        None,
        "registry key (draft_lm, ngram, medusa, eagle3, peagle, dflash, hybrid, none); "
        "default: read from the --drafter folder, or none without one",
    )
    tokenizer: str | None = _f(None, "tokenizer folder (default: the target folder)")
    served_model_name: str | None = _f(None, "the `model` clients ask for (default: folder name)")
    host: str = _f("127.0.0.1", "interface to bind; loopback unless you mean to expose it")
    port: int = _f(8000, "TCP port")
    api_key: str | None = _f(
        None, f"require 'Authorization: Bearer KEY' (default: ${API_KEY_ENV} if set, else none)"
    )
    num_draft_tokens: int = _f(
        NUM_DRAFT_TOKENS, "tokens drafted per round (the most, with --adaptive)"
    )
    draft_policy: str = _f(
        "load-aware",
        "how each chain round's draft length in 0..N is chosen: load-aware (from the round's "
        "measured cost at its batch size and each row's recent acceptance; 0 is a plain step), "
        "fixed (always N), adaptive (the decoder's pooled estimate; with --tree, tree shapes)",
    )
    adaptive: bool = _f(False, "the same as --draft-policy adaptive")
    tree: bool = _f(
        False,
        "draft trees (eagle3: EAGLE-2 dynamic trees; medusa: static choices) for greedy "
        "requests, and for sampled ones with --tree-when-sampling; chains otherwise",
    )
    tree_when_sampling: bool = _f(
        False, "keep --tree for sampled requests (eagle3 then drafts sampled trees)"
    )
    tree_top_k: int = _f(TREE_TOP_K, "children per expanded node of a --tree")
    tree_total_tokens: int = _f(TREE_TOTAL_TOKENS, "nodes kept per --tree")
    tree_frontier: int = _f(
        0,
        "nodes of each eagle3 --tree level that grow children (0: all --tree-top-k, EAGLE-2; "
        "1: the greedy chain with its runners-up, one-row draft steps)",
    )
    lookup_tokens: int | None = _f(
        None,
        "with --drafter-kind hybrid: the most tokens a lookup round copies when no row runs "
        f"the network (default {LOOKUP_DRAFT_TOKENS}, at least --num-draft-tokens)",
    )
    trust_remote_code: bool = _f(False, "allow custom modelling code shipped with the target")
    dtype: str = _f(
        "auto",
        "dtype of the target (auto: bfloat16 where the CPU has AVX512-BF16/AMX kernels or the "
        f"GPU supports it, float32 elsewhere): {', '.join(DTYPES)}",
    )
    device: str = _f("auto", "cpu, cuda, cuda:1 ... (auto: cuda when available)")
    decoder: str = _f(
        "process",
        "where the decoder runs: process (a process of its own that loads the models and "
        "decodes on its main thread, with no second OpenMP team or GIL beside the HTTP front "
        "end: decode/serving/backend.py) or thread (a thread of the server's process, much "
        "slower on a CPU)",
    )
    num_threads: int | None = _f(
        None, "torch intra-op CPU threads (default: torch's choice; 1 on a busy machine)"
    )
    max_batch_size: int = _f(
        MAX_BATCH_SIZE,
        "requests decoded at once (continuous batching: they join and leave between rounds)",
    )
    max_queue: int = _f(
        64,
        "requests waiting for the decoder, and requests being received (body, tokenising) at "
        "once; more are answered 429",
    )
    max_tokens_limit: int = _f(1024, "largest max_tokens a request may ask for")
    max_context_length: int | None = _f(
        None, "prompt + max_tokens limit (default: the target's max_position_embeddings)"
    )
    default_max_tokens: int = _f(16, "max_tokens of a completion that gives none (OpenAI: 16)")
    max_request_bytes: int = _f(1 << 20, "largest request body accepted")
    timeout_keep_alive: float = _f(
        5.0, "seconds a connection may stay idle (before its first request or between requests)"
    )
    timeout_headers: float = _f(
        10.0, "seconds from a request's first byte to the end of its headers; then 408, closed"
    )
    timeout_body: float = _f(
        30.0, "seconds from a request's headers to the end of its body; then 408, closed"
    )
    seed: int = _f(0, "seed of the generator that draws per-batch seeds of unseeded sampling")
    log_level: str = _f("info", "uvicorn log level")

    def __post_init__(self) -> None:
        if self.drafter is None and self.drafter_kind is None:
            self.drafter_kind = "none"  # plain decoding with continuous batching

    @property
    def chosen_draft_policy(self) -> str:
        """``--draft-policy``, or adaptive under ``--adaptive``."""
        return "adaptive" if self.adaptive else self.draft_policy

    def validate(self) -> None:
        """Check values that need no model; raise naming the flag and the fix."""
        if self.dtype not in DTYPES:
            raise ValueError(f"--dtype {self.dtype!r} is not valid; choose one of {DTYPES}")
        if self.log_level not in LOG_LEVELS:
            raise ValueError(
                f"--log-level {self.log_level!r} is not valid; choose one of {', '.join(LOG_LEVELS)}"
            )
        if self.api_key is not None and not self.api_key.strip():
            raise ValueError(
                f"--api-key (or ${API_KEY_ENV}) is empty: no client could match it; give a key, "
                "or leave both unset to serve without one"
            )
        positive = {
            "num_draft_tokens": self.num_draft_tokens,
            "max_batch_size": self.max_batch_size,
            "tree_top_k": self.tree_top_k,
            "tree_total_tokens": self.tree_total_tokens,
            "max_queue": self.max_queue,
            "max_tokens_limit": self.max_tokens_limit,
            "default_max_tokens": self.default_max_tokens,
            "max_request_bytes": self.max_request_bytes,
        }
        for name, value in positive.items():
            if value < 1:
                raise ValueError(f"--{name.replace('_', '-')} must be >= 1, got {value}")
        for name in ("timeout_keep_alive", "timeout_headers", "timeout_body"):
            seconds = getattr(self, name)
            if not 0 < seconds < float("inf"):
                raise ValueError(f"--{name.replace('_', '-')} must be > 0 seconds, got {seconds}")
        if self.num_threads is not None:
            check_thread_count(self.num_threads, "--num-threads")
        if self.max_context_length is not None and self.max_context_length < 2:
            raise ValueError(f"--max-context-length must be >= 2, got {self.max_context_length}")
        if not 0 <= self.port <= 65535:
            raise ValueError(f"--port must lie in [0, 65535], got {self.port}")
        if not 0 <= self.tree_frontier <= self.tree_top_k:
            raise ValueError(
                f"--tree-frontier must lie in [0, --tree-top-k={self.tree_top_k}] (0: every "
                f"node of a level grows children), got {self.tree_frontier}"
            )
        if self.lookup_tokens is not None and self.lookup_tokens < 1:
            raise ValueError(f"--lookup-tokens must be >= 1, got {self.lookup_tokens}")
        from draftsmith.decode.drafters.hybrid import lookup_tokens_problem

        problem = lookup_tokens_problem(self.lookup_tokens, self.drafter_kind)
        if problem:
            raise ValueError(problem)
        if self.tree_when_sampling and not self.tree:
            raise ValueError("--tree-when-sampling keeps trees for sampled requests: add --tree")
        if self.draft_policy not in DRAFT_POLICIES:
            raise ValueError(
                f"--draft-policy {self.draft_policy!r} is not valid; choose one of "
                f"{', '.join(DRAFT_POLICIES)}"
            )
        if self.decoder not in DECODER_PLACES:
            raise ValueError(
                f"--decoder {self.decoder!r} is not valid; choose one of {', '.join(DECODER_PLACES)}"
            )
        if self.adaptive and self.draft_policy == "fixed":
            raise ValueError("--adaptive and --draft-policy fixed contradict: drop one")
        if self.drafter_kind == "none" and self.tree:
            raise ValueError(
                "--tree drafts trees, but no drafter is served (--drafter-kind none): pass "
                "--drafter PATH (an eagle3 or medusa folder), or drop --tree"
            )


def parse_serve_args(argv: list[str] | None = None) -> ServeConfig:
    """Parse ``--config FILE`` first, then the flags on top of it; fill the API key from env."""
    from transformers import HfArgumentParser

    pre = argparse.ArgumentParser(add_help=False)
    pre.add_argument("--config", default=None)
    known, _ = pre.parse_known_args(argv)
    parser = HfArgumentParser(
        ServeConfig, epilog="example: draftsmith-serve --target DIR --drafter DIR --port 8000"
    )
    parser.add_argument("--config", default=None, help="YAML of field: value; flags override")
    if known.config is not None:
        values = read_config_file(known.config)
        parser.set_defaults(**values)
        for action in parser._actions:
            if action.dest in values:
                action.required = False
    namespace = parser.parse_args(argv)
    del namespace.config
    config = ServeConfig(**vars(namespace))
    if config.api_key is None:
        config.api_key = os.environ.get(API_KEY_ENV) or None
    config.validate()
    return config


def read_config_file(path: str | Path) -> dict[str, Any]:
    """A flat YAML mapping of ``ServeConfig`` fields, every key checked."""
    path = Path(path)
    if not path.is_file():
        raise FileNotFoundError(f"--config {path}: no such file")
    data = load_plain_yaml(path, "a server config YAML of field: value lines")
    if not isinstance(data, dict):
        raise ValueError(f"{path}: the server config is a mapping of field: value")
    valid = {f.name for f in dataclasses.fields(ServeConfig)}
    unknown = sorted(set(data) - valid, key=str)
    if unknown:
        raise ValueError(f"{path}: unknown keys {unknown}; valid keys: {', '.join(sorted(valid))}")
    hints = typing.get_type_hints(ServeConfig)
    checked = {}
    for key, value in data.items():
        ok, checked[key] = typed_value(value, hints[key])
        if not ok:
            raise ValueError(
                f"{path}: {key} must be {describe_type(hints[key])}, got "
                f"{describe_value(value)}; fix the value or pass --{key.replace('_', '-')}"
            )
    return checked
