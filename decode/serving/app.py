"""The HTTP layer: OpenAI's routes over the request queue and the decoder (a thread of this
process, or a process of its own: ``draftsmith.decode.serving.backend``).

``GET /v1/models``, ``POST /v1/completions``, ``POST /v1/chat/completions`` (non-streamed, or
``stream: true`` as server-sent events in OpenAI's chunk format ending with ``data: [DONE]``),
``GET /health`` and ``GET /metrics`` (Prometheus text). Each answer carries the request's own
acceptance statistics in an extra ``draftsmith`` field (in a stream: on the chunk with the
``finish_reason``).

Every failure is answered as ``{"error": {"message", "type", "param", "code"}}``: 400 for bad
bodies, 401 for a missing or wrong API key, 404 for unknown models and routes (405 for a wrong
method), 408 for a body that does not arrive in time, 413 for oversized bodies, 415 for a body
declared as anything but JSON, 429 when the queue is full (or too many requests are being
received at once); 500/503
only when the server itself fails (generation fails, the server stops), never for what a client
sent. ``/openapi.json`` needs the API key like every route but ``/health``; ``/docs`` is off.

A client that hangs up is noticed at once, not by polling: a task waits on the ASGI
``http.disconnect`` message while the answer is produced, and the request's decoder row is
dropped at the next round (a streamed or a plain answer alike). Such a request is counted
as 499 (nginx's "client closed request").
"""

from __future__ import annotations

import asyncio
import contextlib
import hmac
import logging
import time
from collections.abc import AsyncIterator, Callable, Iterator, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch
from draftsmith.decode.defaults import NUM_DRAFT_TOKENS
from draftsmith.decode.drafters.base import Drafter, TreeSpec
from draftsmith.decode.forward.attention_layout import learned_position_limit, single_row_problem
from draftsmith.decode.serving.backend import DecoderProcess, DecoderThread
from draftsmith.decode.serving.config import MAX_BATCH_SIZE, ServeConfig
from draftsmith.decode.serving.guard import CLIENT_CLOSED_REQUEST, RequestGuard
from draftsmith.decode.serving.jobs import (
    DoneEvent,
    ErrorEvent,
    Event,
    GenerationJob,
    QueueClosed,
    QueueFull,
    RequestQueue,
    SamplingParams,
    TokensEvent,
)
from draftsmith.decode.serving.metrics import CONTENT_TYPE, ServerMetrics
from draftsmith.decode.serving.protocol import (
    APIError,
    ChatCompletionRequest,
    CompletionRequest,
    cut,
    error_body,
    error_json,
    parse_body,
)
from draftsmith.decode.serving.responses import DONE, Answer, ChunkShape, sse
from draftsmith.decode.serving.scheduler import BatchWorker
from draftsmith.decode.serving.text import TextStream
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, PlainTextResponse, Response, StreamingResponse
from starlette.background import BackgroundTask
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.requests import ClientDisconnect

if TYPE_CHECKING:
    import uvicorn

logger = logging.getLogger(__name__)

ROUTES = (
    "GET /v1/models, GET /v1/models/{model}, POST /v1/completions, POST /v1/chat/completions, "
    "GET /health and GET /metrics"
)
IM_END = "<|im_end|>"


@dataclass(frozen=True)
class ServingLimits:
    """What one request may ask for, and how long its client may take to send it.

    Beyond the sizes the answer is a 400 (413 for the body). At most ``max_receiving`` requests
    are received at once (body read, parsed, prompt tokenised), so the bodies held in memory
    stay below ``max_receiving * max_request_bytes``; one more is a 429. A connection that sends nothing
    for ``keep_alive_timeout_s`` is closed; a request's headers must arrive within
    ``header_timeout_s`` of its first byte and its body within ``body_timeout_s`` of its
    headers, or the answer is 408 and the connection is closed.
    """

    max_tokens_limit: int = 1024
    max_context_length: int = 2048
    default_max_tokens: int = 16
    max_request_bytes: int = 1 << 20
    max_receiving: int = 64  # requests read, parsed and tokenised at once; more: 429
    keep_alive_timeout_s: float = 5.0
    header_timeout_s: float = 10.0
    body_timeout_s: float = 30.0


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
        num_draft_tokens: int = NUM_DRAFT_TOKENS,
        draft_policy: str = "load-aware",
        tree: TreeSpec | None = None,
        tree_when_sampling: bool = False,
        limits: ServingLimits | None = None,
        api_key: str | None = None,
        max_batch_size: int = MAX_BATCH_SIZE,
        max_queue: int = 64,
        seed: int = 0,
        decoder_process: ServeConfig | None = None,
    ) -> None:
        """``decoder_process``: run the decoder in a process of its own that loads the models
        ``ServeConfig`` names (``draftsmith.decode.serving.backend``); the server then keeps
        no reference to ``target`` and ``drafter``, which only its checks read. None: a thread
        of this process decodes with ``target`` and ``drafter``."""
        self.tokenizer = tokenizer
        self.model_name = model_name
        self.limits = limits or ServingLimits()
        table = learned_position_limit(target)
        if table is not None and self.limits.max_context_length > table:
            raise ValueError(
                f"--max-context-length {self.limits.max_context_length} passes the {table} "
                f"positions of this target's learned position table: pass at most {table}"
            )
        self._api_key = api_key
        self.vocab_size = drafter.vocab_size
        if len(tokenizer) > self.vocab_size:
            raise ValueError(
                f"the tokenizer has {len(tokenizer)} tokens but the target's vocabulary only "
                f"{self.vocab_size}: serve the tokenizer the target was trained with"
            )
        problem = single_row_problem(target) if max_batch_size > 1 else None
        if problem is not None:
            raise ValueError(f"{problem}: serve it with --max-batch-size 1")
        self.eos_token_ids = stop_token_ids(tokenizer, target)
        pad = tokenizer.pad_token_id
        if pad is None:
            pad = self.eos_token_ids[0] if self.eos_token_ids else 0
        if drafter.kind == "none":
            draft_policy = "fixed"  # plain decoding: no length to choose
        self.draft_policy = draft_policy
        self.metrics = ServerMetrics(model_name, drafter.kind, num_draft_tokens, draft_policy)
        settings: dict[str, Any] = {
            "num_draft_tokens": num_draft_tokens,
            "draft_policy": draft_policy,
            "tree": tree,
            "tree_when_sampling": tree_when_sampling,
            "max_batch_size": max_batch_size,
            "eos_token_ids": self.eos_token_ids,
            "pad_token_id": pad,
            "seed": seed,
        }
        reports = {  # BatchWorker's callbacks, wherever it runs
            "on_decode": self.metrics.record_decode,
            "on_prefill": self.metrics.record_prefill,
            "on_round": self.metrics.record_round,
        }
        self.backend: DecoderThread | DecoderProcess
        if decoder_process is None:
            queue = RequestQueue(max_queue)
            worker = BatchWorker(target, drafter, queue, **settings, **reports)
            self.backend = DecoderThread(queue, worker)
        else:
            self.backend = DecoderProcess(decoder_process, settings, max_queue, reports)
        self.tree = tree
        self.drafter_kind = drafter.kind
        self.num_draft_tokens = num_draft_tokens
        self.created = int(time.time())
        self._prompt_thread: ThreadPoolExecutor | None = None  # see ``_off_loop``
        self._receiving_now = 0  # requests inside ``_receiving``

    # -- the application ------------------------------------------------------------------

    def app(self) -> FastAPI:
        """The ASGI app; its lifespan starts and stops the decoder thread."""

        @contextlib.asynccontextmanager
        async def lifespan(_: FastAPI) -> AsyncIterator[None]:
            await asyncio.to_thread(self.backend.start)
            yield
            await asyncio.to_thread(self.backend.stop)
            if self._prompt_thread is not None:
                self._prompt_thread.shutdown(wait=False, cancel_futures=True)
                self._prompt_thread = None

        app = FastAPI(
            title="draftsmith",
            lifespan=lifespan,
            docs_url=None,
            redoc_url=None,
            openapi_url=None,  # served below, behind the API key
        )
        # Outermost of the user middleware: no exception gets past it to Starlette's error
        # middleware, which would re-raise it and make uvicorn reset the connection.
        app.add_middleware(
            RequestGuard, metrics=self.metrics, body_timeout=self.limits.body_timeout_s
        )
        app.add_exception_handler(APIError, _api_error_response)  # type: ignore[arg-type]
        app.add_exception_handler(StarletteHTTPException, _http_error_response)  # type: ignore[arg-type]
        app.add_exception_handler(_ClientGone, _client_gone_response)  # type: ignore[arg-type]

        async def openapi(request: Request) -> JSONResponse:
            self._authorize(request)
            return JSONResponse(app.openapi())

        app.add_api_route("/openapi.json", openapi, methods=["GET"], include_in_schema=False)
        app.add_api_route("/health", self.health, methods=["GET"])
        app.add_api_route("/metrics", self.prometheus, methods=["GET"])
        app.add_api_route("/v1/models", self.list_models, methods=["GET"])
        app.add_api_route("/v1/models/{model_id:path}", self.get_model, methods=["GET"])
        app.add_api_route("/v1/completions", self.completions, methods=["POST"])
        app.add_api_route("/v1/chat/completions", self.chat_completions, methods=["POST"])
        return app

    def uvicorn_config(self, host: str, port: int, **options: Any) -> uvicorn.Config:
        """uvicorn's settings for this app: its connection deadlines, h11, graceful stop.

        ``options`` go to ``uvicorn.Config`` as they are (``log_level``, ``log_config``).
        """
        import uvicorn
        from draftsmith.decode.serving.connection import guarded_h11

        def rejected(status: int) -> None:  # answered by the connection, before any route
            self.metrics.record_response("other", status)

        return uvicorn.Config(
            self.app(),
            host=host,
            port=port,
            http=guarded_h11(self.limits.header_timeout_s, rejected),
            timeout_keep_alive=self.limits.keep_alive_timeout_s,  # type: ignore[arg-type]
            timeout_graceful_shutdown=10,
            **options,
        )

    async def health(self) -> JSONResponse:
        alive = self.backend.alive
        return JSONResponse(
            {"status": "ok" if alive else "error", "model": self.model_name},
            status_code=200 if alive else 503,
        )

    async def prometheus(self, request: Request) -> PlainTextResponse:
        self._authorize(request)
        text = self.metrics.render(
            queue_depth=self.backend.queue_depth, running=self.backend.running
        )
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
        with self._receiving():
            body = parse_body(await self._read_body(request), CompletionRequest)
            self._check_model(body.model)
            prompt = body.prompt_text_or_ids()
            if isinstance(prompt, str):
                prompt_ids = await self._off_loop(self._encode, prompt)
            else:
                prompt_ids = self._check_token_ids(prompt)
        return await self._serve(request, body, prompt_ids, body.max_tokens, chat=False)

    async def chat_completions(self, request: Request) -> Response:
        self._authorize(request)
        with self._receiving():
            body = parse_body(await self._read_body(request), ChatCompletionRequest)
            self._check_model(body.model)
            prompt_ids = await self._off_loop(self._render_chat, body)
        return await self._serve(request, body, prompt_ids, body.requested_tokens, chat=True)

    @contextlib.contextmanager
    def _receiving(self) -> Iterator[None]:
        """Count a request while its body is read and its prompt tokenised; beyond
        ``limits.max_receiving`` at once, a 429 (``ServingLimits``)."""
        most = self.limits.max_receiving
        if self._receiving_now >= most:
            raise APIError(
                429,
                f"the server is busy ({most} requests are being received already); retry later",
                type="rate_limit_error",
                code="too_many_requests",
            )
        self._receiving_now += 1  # the event loop's thread alone changes it
        try:
            yield
        finally:
            self._receiving_now -= 1

    async def _off_loop(self, function: Callable[[Any], list[int]], argument: Any) -> list[int]:
        """Run a prompt's tokenisation on the prompt thread, not on the event loop.

        A prompt near the body limit takes a second or more to tokenise (or to render through
        the chat template); on the loop that would stall every stream and ``/health``. One
        thread keeps tokeniser calls one at a time.
        """
        if self._prompt_thread is None:
            self._prompt_thread = ThreadPoolExecutor(1, thread_name_prefix="draftsmith-prompts")
        loop = asyncio.get_running_loop()
        return await loop.run_in_executor(self._prompt_thread, function, argument)

    def _encode(self, prompt: str) -> list[int]:
        return list(self.tokenizer(prompt)["input_ids"])

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
        _check_content_type(request.headers.get("content-type", ""))
        limit = self.limits.max_request_bytes
        declared = request.headers.get("content-length", "")
        if declared.isascii() and declared.isdigit() and int(declared[:20]) > limit:
            raise APIError(413, f"the request body is larger than this server's {limit} bytes")
        chunks, size = [], 0
        try:
            async for chunk in request.stream():
                size += len(chunk)
                if size > limit:
                    raise APIError(
                        413, f"the request body is larger than this server's {limit} bytes"
                    )
                chunks.append(chunk)
        except ClientDisconnect:  # it hung up mid-upload (or its body was too slow: 408)
            raise _ClientGone from None
        return b"".join(chunks)

    def _check_model(self, model: str) -> None:
        if model != self.model_name:
            shown = cut(model)
            raise APIError(
                404,
                f"The model `{shown}` does not exist; this server serves `{self.model_name}` "
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
        params = SamplingParams(body.sampling, seed=body.seed, ignore_eos=body.ignore_eos)
        job = GenerationJob(prompt_ids, max_tokens, params)
        try:
            self.backend.put(job)
        except QueueClosed as closed:
            raise APIError(
                503, f"{closed}; retry later", type="server_error", code="server_unavailable"
            ) from None
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
                events,
                media_type="text/event-stream",
                headers={"Cache-Control": "no-cache"},
                # A client gone before the stream began never runs it: drop the job then too.
                background=BackgroundTask(self._drop, job),
            )
        pieces: list[str] = []
        answer: Answer | None = None
        async with contextlib.aclosing(self._run(request, job, text)) as deltas:
            async for delta, last in deltas:  # raises _ClientGone, answered 499
                pieces.append(delta)
                answer = last or answer
        assert answer is not None
        return JSONResponse(shape.response("".join(pieces), answer, self._extra(answer)))

    async def _run(
        self, request: Request, job: GenerationJob, text: TextStream
    ) -> AsyncIterator[tuple[str, Answer | None]]:
        """Text deltas as tokens arrive; the last pair carries the finished answer.

        Raises ``_ClientGone`` as soon as the client hangs up, whether or not tokens flow.
        """
        done = False
        gone = asyncio.ensure_future(_disconnected(request))
        try:
            while True:
                event = await _next_event(job, gone)
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
                self.metrics.record_request(answer.stats)
                yield text.finish(), answer
                return
        finally:
            gone.cancel()
            if not done:  # the client left (or the handler was cancelled): free the slot
                job.cancel()
                waiting = self.backend.discard(job)
                self.metrics.record_cancelled()
                logger.info(
                    "client disconnected from %s: its request stopped %s after %d tokens",
                    request.url.path,
                    "in the queue" if waiting else "decoding",
                    text.num_tokens,
                )

    def _drop(self, job: GenerationJob) -> None:
        """Free the decoder row of a job whose answer is over (a no-op if it finished)."""
        job.cancel()
        self.backend.discard(job)

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


async def _disconnected(request: Request) -> None:
    """Return once the client has hung up (ASGI ``http.disconnect``)."""
    while (await request.receive())["type"] != "http.disconnect":
        pass


async def _next_event(job: GenerationJob, gone: asyncio.Future[None]) -> Event:
    """The job's next event, or ``_ClientGone`` as soon as ``gone`` is done, whichever first."""
    if gone.done():
        raise _ClientGone
    if not job.events.empty():
        return job.events.get_nowait()
    getter = asyncio.ensure_future(job.events.get())
    try:
        await asyncio.wait((getter, gone), return_when=asyncio.FIRST_COMPLETED)
    finally:
        if not getter.done():
            getter.cancel()  # takes nothing from the queue
    if not getter.done():
        raise _ClientGone
    return getter.result()


def _check_content_type(value: str) -> None:
    """A body declared as anything but JSON is a 415 naming the header to send (none: JSON)."""
    media_type = value.split(";", 1)[0].strip().lower()
    if not media_type or media_type == "application/json" or media_type.endswith("+json"):
        return
    shown = cut(value)
    raise APIError(
        415,
        f"the request body is declared as Content-Type {shown!r}, but this API reads JSON: "
        "send the body as JSON with 'Content-Type: application/json'",
        code="unsupported_media_type",
    )


def _error_response(
    body: dict[str, Any], status: int, headers: dict[str, str] | None = None
) -> Response:
    return Response(error_json(body), status, headers, media_type="application/json")


async def _api_error_response(_: Request, error: APIError) -> Response:
    headers = {"WWW-Authenticate": "Bearer"} if error.status == 401 else None
    return _error_response(error.body(), error.status, headers)


async def _http_error_response(request: Request, error: StarletteHTTPException) -> Response:
    code = "not_found" if error.status_code == 404 else None
    headers = getattr(error, "headers", None)
    return _error_response(
        error_body(_routing_message(request, error), "invalid_request_error", code=code),
        error.status_code,
        headers,
    )


def _routing_message(request: Request, error: StarletteHTTPException) -> str:
    """What was wrong with a request no route took (404, 405), and what to send instead."""
    path = request.url.path
    shown = cut(path)
    if error.status_code == 404:
        return f"Not Found: no route {request.method} {shown}; this server serves {ROUTES}"
    if error.status_code == 405:
        allowed = (error.headers or {}).get("Allow", "")
        return f"Method Not Allowed: {request.method} {shown}; use {allowed or 'another method'}"
    return str(error.detail)


async def _client_gone_response(_: Request, __: _ClientGone) -> Response:
    return Response(status_code=CLIENT_CLOSED_REQUEST)  # nobody reads it; RequestGuard counts it
