"""Decoding defaults are defined once (decode/defaults.py): every command line, dataclass and
recipe field that has one reports that value, so none can drift from the others."""

from __future__ import annotations

import inspect

from draftsmith.decode.defaults import (
    ADAPTIVE_DRAFT_TOKENS,
    NUM_DRAFT_TOKENS,
    TREE_TOP_K,
    TREE_TOTAL_TOKENS,
)
from draftsmith.decode.drafters.base import TreeSpec
from draftsmith.decode.engine import SpeculativeDecoder
from draftsmith.decode.measure.evaluate import build_parser
from draftsmith.decode.measure.side_by_side import EvalSettings
from draftsmith.decode.serving.app import OpenAIServer
from draftsmith.decode.serving.config import ServeConfig
from draftsmith.train.ablation.grid import GridSettings
from draftsmith.train.config import SpeedEvalConfig
from draftsmith.train.speed_report import measure_and_report
from script_helpers import load_script


def _default(function, name: str):
    return inspect.signature(function).parameters[name].default


def test_draft_length_and_tree_shape_have_one_default_everywhere() -> None:
    evaluate = build_parser().parse_args(["--target", "t"])
    benchmark = load_script("benchmark").parse_args(
        ["--target", "t", "--json", "r.json", "--plots", "p"]
    )
    speed = SpeedEvalConfig()
    assert (TreeSpec().top_k, TreeSpec().total_tokens) == (TREE_TOP_K, TREE_TOTAL_TOKENS)
    for args in (evaluate, benchmark):
        assert args.num_draft_tokens == NUM_DRAFT_TOKENS
        assert (args.tree_top_k, args.tree_total_tokens) == (TREE_TOP_K, TREE_TOTAL_TOKENS)
    serve = ServeConfig.__dataclass_fields__
    assert (serve["tree_top_k"].default, serve["tree_total_tokens"].default) == (
        TREE_TOP_K,
        TREE_TOTAL_TOKENS,
    )
    assert speed.speed_eval_draft_tokens == NUM_DRAFT_TOKENS
    assert speed.speed_eval_adaptive_draft_tokens == ADAPTIVE_DRAFT_TOKENS
    assert benchmark.adaptive_draft_tokens == ADAPTIVE_DRAFT_TOKENS
    assert _default(measure_and_report, "adaptive_draft_tokens") == ADAPTIVE_DRAFT_TOKENS
    assert speed.speed_eval_tree_top_k == TREE_TOP_K
    drafted = [
        EvalSettings().num_draft_tokens,
        ServeConfig.__dataclass_fields__["num_draft_tokens"].default,
        _default(SpeculativeDecoder.__init__, "num_draft_tokens"),
        _default(OpenAIServer.__init__, "num_draft_tokens"),
        _default(measure_and_report, "num_draft_tokens"),
        GridSettings.__dataclass_fields__["num_draft_tokens"].default,
    ]
    assert drafted == [NUM_DRAFT_TOKENS] * len(drafted)
