"""OpenAI's response, chunk and usage objects, and server-sent-event framing.

Completions answer with ``text_completion`` objects; chat with ``chat.completion`` and, when
streamed, ``chat.completion.chunk`` objects whose first delta carries the role. A stream ends
with the chunk carrying ``finish_reason`` (and this server's ``draftsmith`` statistics), an
optional usage chunk with no choices (``stream_options.include_usage``), then ``data: [DONE]``.
"""

from __future__ import annotations

import json
import time
import uuid
from dataclasses import dataclass
from typing import Any

from draftsmith.decode.stats import DecodeStats

DONE = "data: [DONE]\n\n"


@dataclass
class Answer:
    """How one request ended: the numbers its response reports."""

    finish_reason: str
    prompt_tokens: int
    completion_tokens: int
    stats: DecodeStats
    batch_size: int

    def usage(self) -> dict[str, Any]:
        """OpenAI's token counts plus ``speculative``: this request's own acceptance."""
        return {
            "prompt_tokens": self.prompt_tokens,
            "completion_tokens": self.completion_tokens,
            "total_tokens": self.prompt_tokens + self.completion_tokens,
            "speculative": speculative_usage(self.stats),
        }


def speculative_usage(stats: DecodeStats) -> dict[str, float | int]:
    """One request's acceptance: draft tokens proposed for it and accepted over its
    verification rounds, and ``tau`` = 1 + accepted / rounds (tokens per target pass,
    decode/stats.py); a tree counts its depth as drafted."""
    return {
        "rounds": stats.rounds,
        "drafted_tokens": stats.draft_positions,
        "accepted_tokens": sum(stats.accepted_per_position),
        "tau": stats.tau,
    }


class ChunkShape:
    """OpenAI's response and chunk objects for completions or chat completions."""

    def __init__(self, chat: bool, model: str) -> None:
        self.chat = chat
        self.model = model
        self.id = f"{'chatcmpl' if chat else 'cmpl'}-{uuid.uuid4().hex}"
        self.created = int(time.time())

    def delta(self, text: str | None) -> dict[str, Any] | str:
        if not self.chat:
            return text or ""
        return {} if text is None else {"content": text}

    def chunk(
        self, delta: dict[str, Any] | str, finish_reason: str | None = None
    ) -> dict[str, Any]:
        choice: dict[str, Any] = {"index": 0, "logprobs": None, "finish_reason": finish_reason}
        choice["delta" if self.chat else "text"] = delta
        return self._envelope("chat.completion.chunk" if self.chat else "text_completion", choice)

    def usage_chunk(self, usage: dict[str, Any]) -> dict[str, Any]:
        envelope = self._envelope("chat.completion.chunk" if self.chat else "text_completion")
        envelope["usage"] = usage
        return envelope

    def response(self, text: str, answer: Answer, extra: dict[str, Any]) -> dict[str, Any]:
        choice: dict[str, Any] = {"index": 0, "logprobs": None}
        choice["finish_reason"] = answer.finish_reason
        if self.chat:
            choice["message"] = {"role": "assistant", "content": text}
        else:
            choice["text"] = text
        body = self._envelope("chat.completion" if self.chat else "text_completion", choice)
        body["usage"] = answer.usage()
        body["draftsmith"] = extra
        return body

    def _envelope(self, kind: str, choice: dict[str, Any] | None = None) -> dict[str, Any]:
        return {
            "id": self.id,
            "object": kind,
            "created": self.created,
            "model": self.model,
            "system_fingerprint": None,
            "choices": [choice] if choice is not None else [],
        }


def sse(payload: dict[str, Any]) -> str:
    return f"data: {json.dumps(payload, ensure_ascii=False)}\n\n"
