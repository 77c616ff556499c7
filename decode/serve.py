"""Serve a target with a trained drafter behind OpenAI's API.

    python decode/serve.py --target PATH --drafter PATH [--drafter-kind KIND]
        [--host 127.0.0.1] [--port 8000] [--num-draft-tokens N] [--api-key KEY]
        [--tree [--tree-top-k K] [--tree-total-tokens M] [--tree-frontier F]
               [--tree-when-sampling]]
    python decode/serve.py --target PATH --drafter-kind ngram      # prompt lookup, no weights
    python decode/serve.py --target PATH --drafter-kind none       # plain decoding, no drafter

Requests are batched continuously: a new one joins the running batch at the next round and a
finished one leaves it (decode/serving/scheduler.py). ``--tree`` serves EAGLE-3 and Medusa
drafters with trees (the flags and defaults of ``draftsmith.decode.measure.evaluate``), chains otherwise. Then any
OpenAI client works against ``http://127.0.0.1:8000/v1`` (completions, chat
completions through the tokenizer's chat template, ``stream: true``); ``GET /metrics`` gives
Prometheus totals (tau, acceptance per position) and ``GET /health`` liveness. Binds loopback
unless ``--host`` says otherwise; ``--api-key`` (or ``$DRAFTSMITH_API_KEY``) requires a bearer
key on every route but ``/health``; ``--trust-remote-code`` is off by default; weights load
from safetensors only. Slow clients are cut off: ``--timeout-keep-alive`` (idle connections),
``--timeout-headers``, ``--timeout-body``. All flags: ``--help``; the routes and limits:
decode/serving/app.py; connection deadlines: decode/serving/connection.py.
"""

from __future__ import annotations

import ipaddress
import logging
from pathlib import Path
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from draftsmith.decode.serving.app import OpenAIServer
    from draftsmith.decode.serving.config import ServeConfig

logger = logging.getLogger("draftsmith.serve")


def build_server(config: ServeConfig) -> OpenAIServer:
    """Load the models named by a ``ServeConfig`` and wrap them in an ``OpenAIServer``."""
    from draftsmith.decode.drafters.base import TreeSpec
    from draftsmith.decode.serving.app import OpenAIServer, ServingLimits
    from draftsmith.decode.serving.loading import load_components

    target, tokenizer, drafter = load_components(config)
    context = config.max_context_length or getattr(target.config, "max_position_embeddings", None)
    if context is None:
        raise ValueError(
            "the target's config has no max_position_embeddings: pass --max-context-length"
        )
    limits = ServingLimits(
        max_tokens_limit=config.max_tokens_limit,
        max_context_length=int(context),
        default_max_tokens=config.default_max_tokens,
        max_request_bytes=config.max_request_bytes,
        max_receiving=config.max_queue,
        keep_alive_timeout_s=config.timeout_keep_alive,
        header_timeout_s=config.timeout_headers,
        body_timeout_s=config.timeout_body,
    )
    return OpenAIServer(
        target,
        tokenizer,
        drafter,
        model_name=config.served_model_name or Path(config.target).resolve().name,
        num_draft_tokens=config.num_draft_tokens,
        draft_policy=config.chosen_draft_policy,
        tree=TreeSpec(config.tree_top_k, config.tree_total_tokens, frontier=config.tree_frontier)
        if config.tree
        else None,
        tree_when_sampling=config.tree_when_sampling,
        limits=limits,
        api_key=config.api_key,
        max_batch_size=config.max_batch_size,
        max_queue=config.max_queue,
        seed=config.seed,
        decoder_process=config if config.decoder == "process" else None,
    )


def main(argv: list[str] | None = None) -> int:
    import uvicorn
    from draftsmith.decode.serving.config import parse_serve_args

    config = parse_serve_args(argv)
    logging.basicConfig(
        level=config.log_level.upper(), format="%(levelname)s %(name)s: %(message)s"
    )
    if not _is_loopback(config.host) and config.api_key is None:
        logger.warning(
            "binding %s without an API key: anyone who can reach this port can use the model "
            "(pass --api-key or set $DRAFTSMITH_API_KEY)",
            config.host,
        )
    server = build_server(config)
    logger.info(
        "serving %s with a %s drafter (%d draft tokens, %s lengths, %s) on http://%s:%d/v1",
        server.model_name,
        server.drafter_kind,
        server.num_draft_tokens,
        server.draft_policy,
        "chains" if server.tree is None else f"trees {server.tree}",
        config.host,
        config.port,
    )
    uvicorn.Server(
        server.uvicorn_config(config.host, config.port, log_level=config.log_level)
    ).run()
    return 0


def _is_loopback(host: str) -> bool:
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


if __name__ == "__main__":
    from draftsmith.decode.command_line import run_command

    raise SystemExit(run_command(main))
