"""OpenAI's request bodies, checked strictly, and its error schema.

Bodies are parsed by hand (size cap, then JSON, then a strict pydantic model) so that every
problem, malformed JSON included, is answered as ``{"error": {"message", "type", "param",
"code"}}`` with a 4xx status, never a crash. The JSON must be standard: ``NaN`` and
``Infinity`` are not JSON, nesting is bounded by the parser, and a string holding a lone UTF-16
surrogate (``"\\ud800"``: valid JSON, not valid Unicode, and fatal to the tokenizer and to UTF-8
output) is refused naming its parameter. Types are strict: ``"0.5"`` is not a number and
``true`` is not an integer. The sampling parameters become the decoder's ``SamplingConfig``,
which is their one validator (a value it refuses is a 400 naming the parameter). Parameters the
server cannot honour (``n > 1``, penalties, ``logprobs``, ``echo``, ...) are rejected by name
instead of being silently ignored; unknown fields are rejected as OpenAI does. The body must be
UTF-8 (RFC 8259; a leading byte order mark is ignored): ``json`` alone would also take UTF-16
and UTF-32. A key given twice in one object is refused rather than resolved silently to its
last value (parsers disagree on which copy wins). Whatever a client sent is echoed in an error
message cut to ``_ECHO_CHARS`` characters.
"""

from __future__ import annotations

import json
import re
from functools import cached_property
from typing import Any, Literal, TypeVar

from draftsmith.decode.sampling import SamplingConfig
from pydantic import BaseModel, ConfigDict, Field, ValidationError

MAX_STOP_SEQUENCES = 4
# Characters per stop sequence: the stream holds back any tail of the answer that begins a
# stop, checking each possible length per token (draftsmith.decode.serving.text), so the bound keeps that
# check to microseconds; 16,000-character stops cost ~50 ms of the event loop per token.
MAX_STOP_CHARS = 512
_SURROGATE = re.compile(r"[\ud800-\udfff]")
_ECHO_CHARS = 80  # how much of a rejected value an error message repeats
SEED_RANGE = (-(2**63), 2**64 - 1)  # what torch.Generator.manual_seed accepts


class APIError(Exception):
    """An error answered in OpenAI's schema with an HTTP status."""

    def __init__(
        self,
        status: int,
        message: str,
        type: str = "invalid_request_error",
        param: str | None = None,
        code: str | None = None,
    ) -> None:
        super().__init__(message)
        self.status = status
        self.message = message
        self.type = type
        self.param = param
        self.code = code

    def body(self) -> dict[str, Any]:
        return error_body(self.message, self.type, self.param, self.code)


def error_body(
    message: str, type: str, param: str | None = None, code: str | None = None
) -> dict[str, Any]:
    return {"error": {"message": message, "type": type, "param": param, "code": code}}


def error_json(body: dict[str, Any]) -> bytes:
    """An error body as JSON bytes; non-ASCII is escaped, so encoding can never fail."""
    return json.dumps(body, separators=(",", ":")).encode("ascii")


class _Strict(BaseModel):
    model_config = ConfigDict(strict=True, extra="forbid")


class StreamOptions(_Strict):
    include_usage: bool = False


class _GenerationRequest(_Strict):
    """Fields shared by completions and chat completions."""

    model: str
    max_tokens: int | None = Field(default=None, ge=1)
    temperature: float = 1.0  # these three are checked by ``sampling`` (SamplingConfig)
    top_p: float = 1.0
    top_k: int = 0  # vLLM's extension; -1 and 0 disable it
    n: int = 1
    stream: bool = False
    stream_options: StreamOptions | None = None
    stop: str | list[str] | None = None
    seed: int | None = None
    ignore_eos: bool = False  # vLLM's extension: generate exactly max_tokens tokens
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    logit_bias: dict[str, float] | None = None
    user: str | None = None

    def stop_strings(self) -> list[str]:
        stops = [self.stop] if isinstance(self.stop, str) else list(self.stop or [])
        if len(stops) > MAX_STOP_SEQUENCES:
            raise APIError(
                400, f"'stop' holds at most {MAX_STOP_SEQUENCES} sequences", param="stop"
            )
        if any(stop == "" for stop in stops):
            raise APIError(400, "'stop' sequences must be non-empty strings", param="stop")
        if any(len(stop) > MAX_STOP_CHARS for stop in stops):
            raise APIError(
                400,
                f"'stop' sequences hold at most {MAX_STOP_CHARS} characters each; cut the "
                "longer ones to a distinctive ending",
                param="stop",
            )
        return stops

    def check_supported(self) -> None:
        """Reject parameters this server does not implement, naming each."""
        if self.n != 1:
            raise APIError(400, f"only n=1 is supported, got n={self.n}", param="n")
        if self.presence_penalty != 0.0 or self.frequency_penalty != 0.0:
            param = "presence_penalty" if self.presence_penalty != 0.0 else "frequency_penalty"
            raise APIError(400, f"'{param}' is not supported: leave it at 0", param=param)
        if self.logit_bias:
            raise APIError(400, "'logit_bias' is not supported", param="logit_bias")
        if self.stream_options is not None and not self.stream:
            raise APIError(
                400, "'stream_options' is only allowed with stream=true", param="stream_options"
            )
        if self.seed is not None and not SEED_RANGE[0] <= self.seed <= SEED_RANGE[1]:
            raise APIError(400, "'seed' must fit in 64 bits", param="seed")
        self.stop_strings()
        _ = self.sampling

    @cached_property
    def sampling(self) -> SamplingConfig:
        """The decoder's sampling settings; a value ``SamplingConfig`` refuses is a 400."""
        top_k = 0 if self.top_k == -1 else self.top_k  # vLLM's "disabled" is the decoder's 0
        try:
            return SamplingConfig(temperature=self.temperature, top_k=top_k, top_p=self.top_p)
        except ValueError as error:
            message = str(error)
            name = message.split(" ", 1)[0]
            param = name if name in ("temperature", "top_k", "top_p") else None
            raise APIError(400, message, param=param, code="invalid_value") from None

    @property
    def include_usage(self) -> bool:
        return self.stream_options is not None and self.stream_options.include_usage


class CompletionRequest(_GenerationRequest):
    """``POST /v1/completions``: one prompt, as text or token ids."""

    prompt: str | list[int] | list[str]
    logprobs: int | None = None
    echo: bool = False
    best_of: int | None = None
    suffix: str | None = None

    def check_supported(self) -> None:
        super().check_supported()
        if self.logprobs is not None:
            raise APIError(400, "'logprobs' is not supported", param="logprobs")
        if self.echo:
            raise APIError(400, "'echo' is not supported", param="echo")
        if self.best_of not in (None, 1):
            raise APIError(400, "only best_of=1 is supported", param="best_of")
        if self.suffix is not None:
            raise APIError(400, "'suffix' is not supported", param="suffix")
        self.prompt_text_or_ids()

    def prompt_text_or_ids(self) -> str | list[int]:
        prompt = self.prompt
        if isinstance(prompt, list) and prompt and isinstance(prompt[0], str):
            if len(prompt) != 1:
                raise APIError(
                    400,
                    f"one prompt per request is supported, got a list of {len(prompt)}: send "
                    "them as separate requests (they are batched on the server)",
                    param="prompt",
                )
            return prompt[0]
        return prompt  # type: ignore[return-value]


class TextPart(_Strict):
    type: Literal["text"]
    text: str


class ChatMessage(_Strict):
    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: str | list[TextPart]
    name: str | None = None

    def as_template_input(self) -> dict[str, str]:
        content = self.content
        text = content if isinstance(content, str) else "".join(part.text for part in content)
        return {"role": self.role, "content": text}


class ChatCompletionRequest(_GenerationRequest):
    """``POST /v1/chat/completions``: messages rendered by the tokenizer's chat template."""

    messages: list[ChatMessage] = Field(min_length=1)
    max_completion_tokens: int | None = Field(default=None, ge=1)
    logprobs: bool = False
    top_logprobs: int | None = None

    def check_supported(self) -> None:
        super().check_supported()
        if self.logprobs or self.top_logprobs is not None:
            raise APIError(400, "'logprobs' is not supported", param="logprobs")
        if self.max_tokens is not None and self.max_completion_tokens is not None:
            raise APIError(
                400,
                "give either 'max_tokens' or 'max_completion_tokens', not both",
                param="max_completion_tokens",
            )

    @property
    def requested_tokens(self) -> int | None:
        return self.max_completion_tokens or self.max_tokens


RequestT = TypeVar("RequestT", bound=_GenerationRequest)


def parse_body(body: bytes, model: type[RequestT]) -> RequestT:
    """JSON bytes -> a checked request, or an ``APIError`` naming the parameter at fault."""
    text = _utf8_text(body)
    try:
        data = json.loads(text, parse_constant=_not_json, object_pairs_hook=_unique_keys)
    except ValueError as error:  # JSONDecodeError is a ValueError
        raise APIError(
            400,
            f"We could not parse the JSON body of your request ({error}). The body must be a "
            "JSON object.",
        ) from None
    except RecursionError:
        raise APIError(400, "the JSON body of your request is nested too deeply to parse") from None
    if not isinstance(data, dict):
        raise APIError(400, f"the request body must be a JSON object, got {type(data).__name__}")
    param = _lone_surrogate(data)
    if param is not None:
        raise APIError(
            400,
            f"Invalid value for '{param}': the string holds a lone UTF-16 surrogate (such as "
            "\\ud800), which is not Unicode text; send UTF-8 text (a character beyond U+FFFF is "
            "escaped as a surrogate *pair*).",
            param=param,
            code="invalid_value",
        )
    try:
        request = model.model_validate(data)
    except ValidationError as error:
        raise _validation_error(error) from None
    request.check_supported()
    return request


def _not_json(constant: str) -> Any:
    raise ValueError(f"{constant} is not a JSON value")


def _utf8_text(body: bytes) -> str:
    """The body decoded as UTF-8 (a leading byte order mark dropped), or a 400 saying so."""
    try:
        text = body.decode("utf-8")
    except UnicodeDecodeError as error:
        raise APIError(
            400,
            f"the request body is not UTF-8 text (byte {body[error.start]:#04x} at offset "
            f"{error.start}); send the JSON encoded as UTF-8",
            code="invalid_encoding",
        ) from None
    return text.removeprefix("\ufeff")


def _unique_keys(pairs: list[tuple[str, Any]]) -> dict[str, Any]:
    """A JSON object as a dict; a key given twice is a 400 naming it."""
    data: dict[str, Any] = {}
    for key, value in pairs:
        if key in data:
            raise APIError(
                400,
                f"the JSON body gives the key {echo(key)} more than once; send each parameter once",
                code="duplicate_key",
            )
        data[key] = value
    return data


def echo(value: object) -> str:
    """``repr(value)`` cut to ``_ECHO_CHARS`` characters, for an error message."""
    return cut(repr(value))


def cut(text: str) -> str:
    """``text`` cut to ``_ECHO_CHARS`` characters, for an error message that repeats it."""
    return text if len(text) <= _ECHO_CHARS else f"{text[:_ECHO_CHARS]}..."


def _escaped(text: str) -> str:
    """``text`` with any lone surrogate written as its escape, so it can be sent as UTF-8."""
    return text.encode("utf-8", "backslashreplace").decode("utf-8")


def _lone_surrogate(data: Any) -> str | None:
    """The dotted path of the first string (value or key) holding a lone surrogate, if any.

    Iterative, so a deeply nested body cannot exhaust the stack here.
    """
    stack: list[tuple[Any, str]] = [(data, "")]
    while stack:
        value, path = stack.pop()
        if isinstance(value, str):
            if not value.isascii() and _SURROGATE.search(value):
                return path
        elif isinstance(value, dict):
            items = []
            for key, item in value.items():
                where = f"{path}.{_escaped(key)}" if path else _escaped(key)
                if not key.isascii() and _SURROGATE.search(key):
                    return where
                items.append((item, where))
            stack.extend(reversed(items))
        elif isinstance(value, list):
            stack.extend((value[i], f"{path}.{i}") for i in reversed(range(len(value))))
    return None


def _is_type_tag(part: str) -> bool:
    return "[" in part or part in {"str", "int", "float", "bool", "dict", "list", "none"}


def _validation_error(error: ValidationError) -> APIError:
    first = error.errors()[0]
    location = [str(part) for part in first["loc"]]
    # Union branches add their type to the location ("prompt.str"): keep the field path only.
    param = ".".join(part for part in location if not _is_type_tag(part))
    kind = first["type"]
    if kind == "missing":
        return APIError(400, f"Missing required parameter: '{param}'.", param=param)
    if kind == "extra_forbidden":
        shown = cut(param)
        return APIError(
            400,
            f"Unrecognized request argument supplied: {shown}; remove it or check its spelling",
            param=shown,
        )
    return APIError(
        400,
        f"Invalid value for '{param}': {first['msg']} (got {echo(first.get('input'))}).",
        param=param,
        code="invalid_type" if kind.endswith(("_type", "_parsing")) else "invalid_value",
    )
