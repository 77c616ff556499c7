"""The HTTP layer: OpenAI's routes over the request queue and the decoder thread.

``GET /v1/models``, ``POST /v1/completions``, ``POST /v1/chat/completions`` (non-streamed, or
``stream: true`` as server-sent events in OpenAI's chunk format ending with ``data: [DONE]``),
``GET /health`` and ``GET /metrics`` (Prometheus text). Each answer carries the request's own
acceptance statistics in an extra ``draftsmith`` field (in a stream: on the chunk with the
``finish_reason``).

Every failure is answered as ``{"error": {"message", "type", "param", "code"}}``: 400 for bad
bodies, 401 for a missing or wrong API key, 404 for unknown models and routes, 413 for
oversized bodies, 429 when the queue is full, 500/503 when generation fails or the server stops.
"""

from __future__ import annotations

import asyncio
import contextlib
import hmac
import logging
import time
from collections.abc import AsyncIterator, Awaitable, Callable, Sequence
from dataclasses import dataclass
from typing import Any

import torch
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, PlainTextResponse, Response, StreamingResponse
from starlette.exceptions import HTTPException as StarletteHTTPException

from decode.drafters.base import Drafter
from decode.serving.metrics import CONTENT_TYPE, ServerMetrics
from decode.serving.protocol import (
    APIError,
    ChatCompletionRequest,
    CompletionRequest,
    error_body,
    parse_body,
)
from decode.serving.responses import DONE, Answer, ChunkShape, sse
from decode.serving.scheduler import (
    BatchWorker,
    DoneEvent,
    ErrorEvent,
    GenerationJob,
    QueueFull,
    RequestQueue,
    SamplingParams,
    TokensEvent,
)
from decode.serving.text import TextStream

logger = logging.getLogger(__name__)

DISCONNECT_POLL_S = 0.5  # how often a waiting request checks whether its client is still there
ENDPOINTS = ("/v1/models", "/v1/completions", "/v1/chat/completions", "/health", "/metrics")
IM_END = "<|im_end|>"
CLIENT_CLOSED_REQUEST = 499  # nginx's status for a client that left before the answer


@dataclass(frozen=True)
class ServingLimits:
    """What one request may ask for; beyond it the answer is a 400 (413 for the body)."""

    max_tokens_limit: int = 1024
    max_context_length: int = 2048
    default_max_tokens: int = 16
    max_request_bytes: int = 1 << 20


class _ClientGone(Exception):
    """The client hung up before its answer was complete."""


def stop_token_ids(tokenizer: Any, target: torch.nn.Module) -> list[int]:
    """EOS ids: the tokenizer's, the target's generation config's, and ``<|im_end|>`` if known."""
    ids: list[int] = []
    candidates: list[Any] = [tokenizer.eos_token_id]
    configured = getattr(getattr(target, "generation_config", None), "eos_token_id", None)
    candidates.extend(configured if isinstance(configured, list) else [configured])
    if IM_END in tokenizer.get_vocab():
        candidates.append(tokenizer.convert_tokens_to_ids(IM_END))
    for token in candidates:
        if isinstance(token, int) and token not in ids:
            ids.append(token)
    return ids


class OpenAIServer:
    """A target, its drafter and tokenizer, served with OpenAI's API; ``app()`` for ASGI."""

    def __init__(
        self,
        target: torch.nn.Module,
        tokenizer: Any,
        drafter: Drafter,
        *,
        model_name: str,
        num_draft_tokens: int = 4,
        adaptive: bool = False,
        limits: ServingLimits | None = None,
        api_key: str | None = None,
        max_batch_size: int = 8,
        max_queue: int = 64,
        seed: int = 0,
    ) -> None:
        self.tokenizer = tokenizer
        self.model_name = model_name
        self.limits = limits or ServingLimits()
        self._api_key = api_key
        self.vocab_size = drafter.vocab_size
        if len(tokenizer) > self.vocab_size:
            raise ValueError(
                f"the tokenizer has {len(tokenizer)} tokens but the target's vocabulary only "
                f"{self.vocab_size}: serve the tokenizer the target was trained with"
            )
        self.eos_token_ids = stop_token_ids(tokenizer, target)
        pad = tokenizer.pad_token_id
        if pad is None:
            pad = self.eos_token_ids[0] if self.eos_token_ids else 0
        self.queue = RequestQueue(max_queue)
        self.metrics = ServerMetrics(model_name, drafter.kind, num_draft_tokens)
        self.worker = BatchWorker(
            target,
            drafter,
            self.queue,
            num_draft_tokens=num_draft_tokens,
            adaptive=adaptive,
            max_batch_size=max_batch_size,
            eos_token_ids=self.eos_token_ids,
            pad_token_id=pad,
            seed=seed,
            on_batch=self.metrics.record_batch,
        )
        self.drafter_kind = drafter.kind
        self.num_draft_tokens = num_draft_tokens
        self.created = int(time.time())

    # -- the application ------------------------------------------------------------------

    def app(self) -> FastAPI:
        """The ASGI app; its lifespan starts and stops the decoder thread."""

        @contextlib.asynccontextmanager
        async def lifespan(_: FastAPI) -> AsyncIterator[None]:
            self.worker.start()
            yield
            await asyncio.to_thread(self.worker.stop)

        app = FastAPI(title="draftsmith", lifespan=lifespan, docs_url=None, redoc_url=None)
        app.add_middleware(_CountResponses, metrics=self.metrics)
        app.add_exception_handler(APIError, _api_error_response)  # type: ignore[arg-type]
        app.add_exception_handler(StarletteHTTPException, _http_error_response)  # type: ignore[arg-type]
        app.add_exception_handler(Exception, _internal_error_response)
        app.add_api_route("/health", self.health, methods=["GET"])
        app.add_api_route("/metrics", self.prometheus, methods=["GET"])
        app.add_api_route("/v1/models", self.list_models, methods=["GET"])
        app.add_api_route("/v1/models/{model_id:path}", self.get_model, methods=["GET"])
        app.add_api_route("/v1/completions", self.completions, methods=["POST"])
        app.add_api_route("/v1/chat/completions", self.chat_completions, methods=["POST"])
        return app

    async def health(self) -> JSONResponse:
        alive = self.worker.alive
        return JSONResponse(
            {"status": "ok" if alive else "error", "model": self.model_name},
            status_code=200 if alive else 503,
        )

    async def prometheus(self, request: Request) -> PlainTextResponse:
        self._authorize(request)
        text = self.metrics.render(queue_depth=len(self.queue), running=self.worker.running)
        return PlainTextResponse(text, media_type=CONTENT_TYPE)

    async def list_models(self, request: Request) -> JSONResponse:
        self._authorize(request)
        return JSONResponse({"object": "list", "data": [self._model_card()]})

    async def get_model(self, request: Request, model_id: str) -> JSONResponse:
        self._authorize(request)
        self._check_model(model_id)
        return JSONResponse(self._model_card())

    async def completions(self, request: Request) -> Response:
        self._authorize(request)
        body = parse_body(await self._read_body(request), CompletionRequest)
        self._check_model(body.model)
        prompt = body.prompt_text_or_ids()
        if isinstance(prompt, str):
            prompt_ids = list(self.tokenizer(prompt)["input_ids"])
        else:
            prompt_ids = self._check_token_ids(prompt)
        return await self._serve(request, body, prompt_ids, body.max_tokens, chat=False)

    async def chat_completions(self, request: Request) -> Response:
        self._authorize(request)
        body = parse_body(await self._read_body(request), ChatCompletionRequest)
        self._check_model(body.model)
        prompt_ids = self._render_chat(body)
        return await self._serve(request, body, prompt_ids, body.requested_tokens, chat=True)

    # -- checks ---------------------------------------------------------------------------

    def _authorize(self, request: Request) -> None:
        if self._api_key is None:
            return
        scheme, _, token = request.headers.get("authorization", "").partition(" ")
        if scheme.lower() != "bearer" or not token.strip():
            raise APIError(
                401,
                "You didn't provide an API key. Send it in an Authorization header using "
                "Bearer auth (Authorization: Bearer YOUR_KEY).",
                code="invalid_api_key",
            )
        if not hmac.compare_digest(token.strip().encode(), self._api_key.encode()):
            raise APIError(401, "Incorrect API key provided.", code="invalid_api_key")

    async def _read_body(self, request: Request) -> bytes:
        limit = self.limits.max_request_bytes
        declared = request.headers.get("content-length", "")
        if declared.isdigit() and int(declared) > limit:
            raise APIError(413, f"the request body is larger than this server's {limit} bytes")
        chunks, size = [], 0
        async for chunk in request.stream():
            size += len(chunk)
            if size > limit:
                raise APIError(413, f"the request body is larger than this server's {limit} bytes")
            chunks.append(chunk)
        return b"".join(chunks)

    def _check_model(self, model: str) -> None:
        if model != self.model_name:
            raise APIError(
                404,
                f"The model `{model}` does not exist; this server serves `{self.model_name}` "
                "(see GET /v1/models).",
                param="model",
                code="model_not_found",
            )

    def _check_token_ids(self, ids: Sequence[int]) -> list[int]:
        bad = [token for token in ids if not 0 <= token < self.vocab_size]
        if bad:
            raise APIError(
                400,
                f"prompt token ids must lie in [0, {self.vocab_size}), got {bad[:5]}",
                param="prompt",
            )
        return list(ids)

    def _render_chat(self, body: ChatCompletionRequest) -> list[int]:
        if not getattr(self.tokenizer, "chat_template", None):
            raise APIError(
                400,
                "the model's tokenizer has no chat template: use /v1/completions",
                param="messages",
            )
        messages = [message.as_template_input() for message in body.messages]
        try:
            encoded = self.tokenizer.apply_chat_template(messages, add_generation_prompt=True)
        except Exception as error:  # the template's own raise_exception, bad role order, ...
            raise APIError(
                400, f"the chat template rejected the messages: {error}", param="messages"
            ) from None
        ids = encoded["input_ids"] if hasattr(encoded, "keys") else encoded
        return list(ids)

    def _max_tokens(self, requested: int | None, prompt_tokens: int, chat: bool) -> int:
        limits = self.limits
        room = limits.max_context_length - prompt_tokens
        if requested is None:
            default = limits.max_tokens_limit if chat else limits.default_max_tokens
            requested = max(1, min(default, room))
        if requested > limits.max_tokens_limit:
            raise APIError(
                400,
                f"max_tokens is {requested}, more than this server's limit of "
                f"{limits.max_tokens_limit}",
                param="max_tokens",
                code="max_tokens_too_large",
            )
        if prompt_tokens + requested > limits.max_context_length:
            raise APIError(
                400,
                f"This model's maximum context length is {limits.max_context_length} tokens. "
                f"However, you requested {prompt_tokens + requested} tokens ({prompt_tokens} in "
                f"the prompt, {requested} for the completion). Please reduce the prompt or "
                "max_tokens.",
                param="messages" if chat else "prompt",
                code="context_length_exceeded",
            )
        return requested

    # -- generation -----------------------------------------------------------------------

    async def _serve(
        self,
        request: Request,
        body: CompletionRequest | ChatCompletionRequest,
        prompt_ids: list[int],
        requested_tokens: int | None,
        chat: bool,
    ) -> Response:
        if not prompt_ids:
            bos = self.tokenizer.bos_token_id
            if bos is None:
                raise APIError(400, "the prompt is empty", param="messages" if chat else "prompt")
            prompt_ids = [bos]
        max_tokens = self._max_tokens(requested_tokens, len(prompt_ids), chat)
        eos = () if body.ignore_eos else self.eos_token_ids
        text = TextStream(self.tokenizer, prompt_ids, body.stop_strings(), eos)
        params = SamplingParams(
            temperature=body.temperature,
            top_p=body.top_p,
            top_k=max(body.top_k, 0),
            seed=body.seed,
            ignore_eos=body.ignore_eos,
        )
        job = GenerationJob(prompt_ids, max_tokens, params)
        try:
            self.queue.put(job)
        except QueueFull as full:
            raise APIError(
                429,
                f"the server is busy ({full}); retry later",
                type="rate_limit_error",
                code="queue_full",
            ) from None
        shape = ChunkShape(chat, self.model_name)
        if body.stream:
            events = self._stream(request, job, text, shape, body.include_usage)
            return StreamingResponse(
                events, media_type="text/event-stream", headers={"Cache-Control": "no-cache"}
            )
        pieces: list[str] = []
        answer: Answer | None = None
        try:
            async with contextlib.aclosing(self._run(request, job, text)) as deltas:
                async for delta, last in deltas:
                    pieces.append(delta)
                    answer = last or answer
        except _ClientGone:
            return Response(status_code=CLIENT_CLOSED_REQUEST)
        assert answer is not None
        return JSONResponse(shape.response("".join(pieces), answer, self._extra(answer)))

    async def _run(
        self, request: Request, job: GenerationJob, text: TextStream
    ) -> AsyncIterator[tuple[str, Answer | None]]:
        """Text deltas as tokens arrive; the last pair carries the finished answer."""
        done = False
        try:
            while True:
                try:
                    event = await asyncio.wait_for(job.events.get(), DISCONNECT_POLL_S)
                except asyncio.TimeoutError:
                    if await request.is_disconnected():
                        raise _ClientGone from None
                    continue
                if isinstance(event, ErrorEvent):
                    done = True
                    raise APIError(event.status, event.message, type="server_error")
                if isinstance(event, TokensEvent):
                    if not text.stopped:
                        for token in event.tokens:
                            if text.push(token):
                                job.cancel()  # a stop string or EOS: no more tokens needed
                                break
                    delta = text.take()
                    if delta:
                        yield delta, None
                    continue
                assert isinstance(event, DoneEvent)
                done = True
                answer = Answer(
                    finish_reason=text.finish_reason or "length",
                    prompt_tokens=len(job.prompt_ids),
                    completion_tokens=text.num_tokens,
                    stats=event.stats,
                    batch_size=event.batch_size,
                )
                self.metrics.record_answer(answer.prompt_tokens, answer.completion_tokens)
                yield text.finish(), answer
                return
        finally:
            if not done:  # the client left (or the handler was cancelled): free the slot
                job.cancel()
                self.queue.discard(job)
                self.metrics.record_cancelled()

    async def _stream(
        self,
        request: Request,
        job: GenerationJob,
        text: TextStream,
        shape: ChunkShape,
        include_usage: bool,
    ) -> AsyncIterator[str]:
        """Server-sent events: a chunk per round, the finish chunk, usage, then [DONE]."""
        if shape.chat:
            yield sse(shape.chunk({"role": "assistant", "content": ""}))
        try:
            async with contextlib.aclosing(self._run(request, job, text)) as deltas:
                async for delta, answer in deltas:
                    if delta:
                        yield sse(shape.chunk(shape.delta(delta)))
                    if answer is not None:
                        final = shape.chunk(shape.delta(None), answer.finish_reason)
                        final["draftsmith"] = self._extra(answer)
                        yield sse(final)
                        if include_usage:
                            yield sse(shape.usage_chunk(answer.usage()))
        except APIError as error:
            yield sse(error.body())
        except _ClientGone:
            return
        yield DONE

    def _extra(self, answer: Answer) -> dict[str, Any]:
        """This request's acceptance statistics (its own rows of the batch)."""
        stats = answer.stats
        return {
            "drafter_kind": self.drafter_kind,
            "num_draft_tokens": self.num_draft_tokens,
            "batch_size": answer.batch_size,
            "target_forward_passes": stats.target_forward_passes,
            "tau": stats.tau,
            "alpha_per_position": stats.alpha_per_position,
            "accepted_per_position": stats.accepted_per_position,
            "verified_per_position": stats.reached_per_position,
        }

    def _model_card(self) -> dict[str, Any]:
        return {
            "id": self.model_name,
            "object": "model",
            "created": self.created,
            "owned_by": "draftsmith",
        }


class _CountResponses:
    """ASGI middleware: count every HTTP answer by endpoint and status code."""

    def __init__(self, app: Any, metrics: ServerMetrics) -> None:
        self.app = app
        self.metrics = metrics

    async def __call__(
        self,
        scope: dict[str, Any],
        receive: Callable[[], Awaitable[Any]],
        send: Callable[[Any], Awaitable[None]],
    ) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        status = 500

        async def send_with_status(message: dict[str, Any]) -> None:
            nonlocal status
            if message["type"] == "http.response.start":
                status = message["status"]
            await send(message)

        try:
            await self.app(scope, receive, send_with_status)
        finally:
            path = scope.get("path", "")
            endpoint = path if path in ENDPOINTS else "other"
            self.metrics.record_response(endpoint, status)


async def _api_error_response(_: Request, error: APIError) -> JSONResponse:
    headers = {"WWW-Authenticate": "Bearer"} if error.status == 401 else None
    return JSONResponse(error.body(), status_code=error.status, headers=headers)


async def _http_error_response(_: Request, error: StarletteHTTPException) -> JSONResponse:
    code = "not_found" if error.status_code == 404 else None
    return JSONResponse(
        error_body(str(error.detail), "invalid_request_error", code=code),
        status_code=error.status_code,
        headers=getattr(error, "headers", None),
    )


async def _internal_error_response(_: Request, error: Exception) -> JSONResponse:
    logger.exception("unhandled error", exc_info=error)
    return JSONResponse(
        error_body(f"internal server error: {type(error).__name__}", "server_error"),
        status_code=500,
    )
