"""Generated token ids -> text, one token at a time: EOS, ``stop`` strings, safe deltas.

Detokenisation is incremental (the scheme of vLLM's ``detokenize_incrementally``): each step
decodes a short window ``ids[prefix_offset:]`` and emits what it adds beyond
``ids[prefix_offset:read_offset]``, so the cost per token is constant and a multi-byte
character split across tokens is held back until complete (a trailing U+FFFD). The window
starts on the last few prompt tokens so that tokenisers which drop a leading space on the
first token (SentencePiece) still produce the text that follows the prompt.

``stop`` strings: the output ends *before* the earliest occurrence of any of them (OpenAI's
rule). Text that might still become the start of a stop string is not released until the next
token decides it, so a streamed answer never shows a stop string and streamed and
non-streamed answers are the same string.
"""

from __future__ import annotations

from collections.abc import Collection, Sequence
from typing import Any

REPLACEMENT = "\ufffd"
PROMPT_CONTEXT_TOKENS = 5


class TextStream:
    """The text of one generation, fed token by token; ``take`` returns what may be sent now."""

    def __init__(
        self,
        tokenizer: Any,
        prompt_ids: Sequence[int],
        stop: Sequence[str] = (),
        eos_token_ids: Collection[int] = (),
    ) -> None:
        self._tokenizer = tokenizer
        self._stop = list(stop)
        self._longest_stop = max((len(s) for s in self._stop), default=0)
        self._eos = frozenset(eos_token_ids)
        context = list(prompt_ids[-PROMPT_CONTEXT_TOKENS:])
        if self._decode(context).endswith(REPLACEMENT):
            context = []  # a prompt ending mid-character would shift every delta
        self._ids: list[int] = context
        self._prefix_offset = 0
        self._read_offset = len(context)
        self._text = ""  # the answer so far, cut before a stop string once one appears
        self._sent = 0  # characters of _text already returned by take()
        self._stop_checked = 0  # _text[:_stop_checked] holds no complete stop string
        self.num_tokens = 0  # tokens consumed, the one that ended the generation included
        self.finish_reason: str | None = None  # "stop" once EOS or a stop string ended it

    @property
    def text(self) -> str:
        return self._text

    @property
    def stopped(self) -> bool:
        return self.finish_reason is not None

    def push(self, token: int) -> bool:
        """Consume one generated token; True when it ends the answer (EOS or a stop string)."""
        if self.stopped:
            raise RuntimeError("push() after the answer stopped; check the return value")
        self.num_tokens += 1
        if token in self._eos:
            self.finish_reason = "stop"
            return True
        self._ids.append(token)
        self._text += self._decode_step(final=False)
        return self._find_stop()

    def take(self) -> str:
        """Text not yet returned that no later token can take back."""
        end = len(self._text)
        if not self.stopped:
            end -= self._stop_prefix_length()
        delta = self._text[self._sent : max(end, self._sent)]
        self._sent += len(delta)
        return delta

    def finish(self) -> str:
        """The generation ended (length, EOS or stop): flush everything still held back."""
        if not self.stopped:
            self._text += self._decode_step(final=True)
            self._find_stop()
        delta = self._text[self._sent :]
        self._sent = len(self._text)
        return delta

    def _decode(self, ids: Sequence[int]) -> str:
        return self._tokenizer.decode(list(ids), skip_special_tokens=True)

    def _decode_step(self, final: bool) -> str:
        prefix = self._decode(self._ids[self._prefix_offset : self._read_offset])
        full = self._decode(self._ids[self._prefix_offset :])
        if len(full) > len(prefix) and (final or not full.endswith(REPLACEMENT)):
            self._prefix_offset = self._read_offset
            self._read_offset = len(self._ids)
            return full[len(prefix) :]
        return ""

    def _find_stop(self) -> bool:
        if not self._stop:
            return False
        start = max(0, self._stop_checked - self._longest_stop + 1)
        hits = [i for i in (self._text.find(s, start) for s in self._stop) if i != -1]
        if hits:
            self._text = self._text[: min(hits)]
            self.finish_reason = "stop"
            return True
        self._stop_checked = len(self._text)
        return False

    def _stop_prefix_length(self) -> int:
        """Length of the longest suffix of the text that begins some stop string."""
        for length in range(min(self._longest_stop - 1, len(self._text)), 0, -1):
            tail = self._text[-length:]
            if any(stop.startswith(tail) for stop in self._stop):
                return length
        return 0
