"""Loaders for user data: text files, JSONL text, conversations and prompts.

Formats:

- text files: any UTF-8 files, one document per file;
- JSONL: one JSON object per line; blank lines are ignored;
- JSON: a list of objects, or an object whose ``"data"`` key holds that list;
- conversations: a field (default ``messages``) holding a list of
  ``{"role": "system" | "user" | "assistant" | "tool", "content": str}`` in the OpenAI chat
  format, or ShareGPT's ``conversations`` field of ``{"from", "value"}`` turns (``human``,
  ``gpt``, ``system``, ``tool``/``function``/``observation``; see ``SHAREGPT_ROLES``), read as
  the same messages; other keys of a message are dropped;
- anything that is not an existing path and does not look like one is passed to
  ``datasets.load_dataset`` as a dataset name (needs the hub or its local cache).

Every error names the file (and line), the field, the fields that are present, and what to
change.
"""

from __future__ import annotations

import json
from collections.abc import Iterator, Mapping, Sequence
from pathlib import Path
from typing import Any

import datasets

ROLES = ("system", "user", "assistant", "tool")
# ShareGPT's speaker names (``from``) -> OpenAI roles, as the ShareGPT, UltraChat-ShareGPT,
# SlimOrca and glaive exports spell them.
SHAREGPT_ROLES = {
    "human": "user",
    "user": "user",
    "gpt": "assistant",
    "assistant": "assistant",
    "chatgpt": "assistant",
    "bard": "assistant",
    "bing": "assistant",
    "model": "assistant",
    "system": "system",
    "tool": "tool",
    "function": "tool",
    "observation": "tool",
}
SHAREGPT_FIELD = "conversations"
_LOCAL_SUFFIXES = (".jsonl", ".json")


def load_text_files(paths: Sequence[str | Path]) -> datasets.Dataset:
    """One row per file: ``text`` (its UTF-8 content) and ``path`` (as given)."""
    if len(paths) == 0:
        raise ValueError("load_text_files got no paths; pass at least one text file")
    texts: list[str] = []
    for path in map(Path, paths):
        if path.is_dir():
            raise ValueError(
                f"{path} is a folder; pass its files, e.g. sorted(Path('{path}').rglob('*.txt'))"
            )
        if not path.is_file():
            raise FileNotFoundError(f"text file {path} does not exist; check the path")
        try:
            texts.append(path.read_bytes().decode("utf-8"))
        except UnicodeDecodeError as error:
            raise ValueError(
                f"{path} is not valid UTF-8 ({error}); convert it to UTF-8 or leave it out"
            ) from error
    return datasets.Dataset.from_dict(
        {"text": texts, "path": [str(path) for path in paths]},
        features=datasets.Features(
            {"text": datasets.Value("string"), "path": datasets.Value("string")}
        ),
    )


def _looks_local(source: str) -> bool:
    return (
        source.endswith(_LOCAL_SUFFIXES)
        or Path(source).exists()
        or source.startswith((".", "/", "~"))
    )


# Python's codec for UTF-8 that drops one leading byte-order mark (editors on Windows write one).
UTF8_WITH_OPTIONAL_BOM = "utf-8-sig"


def utf8_text(path: Path, expected: str) -> str:
    """The text of ``path``; ``ValueError`` naming it and ``expected`` (what to pass instead)
    if it is not UTF-8."""
    try:
        return path.read_text(encoding=UTF8_WITH_OPTIONAL_BOM)
    except UnicodeDecodeError as error:
        raise _not_utf8(path, error, expected) from None


def _not_utf8(path: Path, error: UnicodeDecodeError, expected: str) -> ValueError:
    return ValueError(f"{path} is not UTF-8 text ({error}); pass {expected}")


def _read_json_records(path: Path) -> Iterator[tuple[str, dict[str, Any]]]:
    """Yield ``(where, record)`` from a .jsonl or .json file; ``where`` is "file:line"."""
    if path.is_dir():
        raise ValueError(f"{path} is a folder; pass a .jsonl or .json file")
    if not path.is_file():
        raise FileNotFoundError(f"data file {path} does not exist; check the path")
    if path.suffix not in (".jsonl", ".json"):
        raise ValueError(f"{path} has suffix {path.suffix!r}; use a .jsonl or .json file")
    expected = f"a {path.suffix} data file of UTF-8 JSON"
    if path.suffix == ".jsonl":  # streamed: a training set may not fit in memory twice
        with path.open(encoding=UTF8_WITH_OPTIONAL_BOM) as handle:
            try:
                for number, line in enumerate(handle, start=1):
                    if not line.strip():
                        continue
                    where = f"{path}:{number}"
                    try:
                        record = json.loads(line)
                    except json.JSONDecodeError as error:
                        raise ValueError(
                            f"{where} is not valid JSON ({error.msg}); each line of a .jsonl "
                            "file must be one JSON object"
                        ) from error
                    yield where, record
            except UnicodeDecodeError as error:
                raise _not_utf8(path, error, expected) from None
        return
    text = utf8_text(path, expected)
    try:
        content = json.loads(text)
    except json.JSONDecodeError as error:
        raise ValueError(
            f"{path} is not valid JSON ({error.msg} at line {error.lineno})"
        ) from error
    if isinstance(content, Mapping) and isinstance(content.get("data"), list):
        content = content["data"]
    if not isinstance(content, list):
        raise ValueError(
            f"{path} holds a JSON {type(content).__name__}; expected a list of records or an "
            'object {"data": [records]}'
        )
    for number, record in enumerate(content):
        yield f"{path}[{number}]", record


def json_records(path: str | Path) -> list[tuple[str, Any]]:
    """``(where, record)`` of every record of a local .jsonl/.json file, records as parsed."""
    return list(_read_json_records(Path(path).expanduser()))


def _records(source: str | Path, split: str) -> Iterator[tuple[str, dict[str, Any]]]:
    """Records of a local .jsonl/.json file, or of a ``datasets`` name's split."""
    if isinstance(source, Path) or _looks_local(source):
        for where, record in _read_json_records(Path(source).expanduser()):
            if not isinstance(record, Mapping):
                raise ValueError(
                    f"{where} is a JSON {type(record).__name__}; each record must be an object"
                )
            yield where, dict(record)
        return
    for number, record in enumerate(_named_dataset(source, split)):
        yield f"{source}[{split}][{number}]", record


def _named_dataset(source: str, split: str) -> datasets.Dataset:
    """``datasets.load_dataset(source, split=split)``, a failure named as the user's mistake
    (a path that does not exist reads as a dataset name, and the hub is offline here)."""
    try:
        return datasets.load_dataset(source, split=split)
    except Exception as error:
        raise FileNotFoundError(
            f"{source}: not a file or folder here, and datasets.load_dataset could not load it "
            f"({type(error).__name__}: {error}); pass a local .jsonl file, a text folder, "
            "stdlib, or a dataset name available offline"
        ) from error


def load_records(source: str | Path, split: str = "train") -> datasets.Dataset:
    """Every record of a local .jsonl/.json file, or of a ``datasets`` name's ``split``, as is.

    The one reader of JSON records: each must be an object; an empty file is an error. A name
    that is not a local path goes to ``datasets.load_dataset`` (the hub or its local cache).
    """
    if isinstance(source, Path) or _looks_local(source):
        records = [record for _, record in _records(source, split)]
        if not records:
            raise ValueError(f"--dataset {source} holds no records; the file is empty")
        return datasets.Dataset.from_list(records)
    return _named_dataset(source, split)


def _field(record: Mapping[str, Any], field: str, where: str, argument: str) -> Any:
    if field not in record:
        raise ValueError(
            f"{where} has no field {field!r} (fields present: {sorted(record)}); pass "
            f"{argument}= the field that holds it"
        )
    return record[field]


def conversation_field(fields: Any, messages_field: str = "messages") -> str | None:
    """The field of a record (or the column of a table) that holds its conversation:
    ``messages_field``, else ShareGPT's ``conversations`` when ``messages_field`` is the default;
    None when neither is there."""
    if messages_field in fields:
        return messages_field
    if messages_field == "messages" and SHAREGPT_FIELD in fields:
        return SHAREGPT_FIELD
    return None


def _sharegpt_turn(message: Mapping[str, Any], where: str, index: int, field: str) -> dict:
    """One ShareGPT turn ``{"from", "value"}`` as an OpenAI message ``{"role", "content"}``."""
    speaker = str(message["from"]).lower()
    if speaker not in SHAREGPT_ROLES:
        raise ValueError(
            f"{where}: message {index} of field {field!r} comes from {message['from']!r}, not a "
            f"ShareGPT speaker this reader knows ({sorted(SHAREGPT_ROLES)}); rename it"
        )
    return {"role": SHAREGPT_ROLES[speaker], "content": message["value"]}


def validate_messages(messages: Any, where: str, field: str = "messages") -> list[dict[str, str]]:
    """Check one conversation and return it as ``[{"role", "content"}, ...]``.

    Messages are OpenAI's ``{"role", "content"}`` or ShareGPT's ``{"from", "value"}`` turns
    (converted through ``SHAREGPT_ROLES``).
    """
    if not isinstance(messages, list) or len(messages) == 0:
        raise ValueError(
            f"{where}: field {field!r} must be a non-empty list of messages, got "
            f"{type(messages).__name__} {str(messages)[:80]!r}"
        )
    clean: list[dict[str, str]] = []
    for index, message in enumerate(messages):
        if isinstance(message, Mapping) and "from" in message and "value" in message:
            message = _sharegpt_turn(message, where, index, field)
        if not isinstance(message, Mapping) or "role" not in message or "content" not in message:
            keys = sorted(message) if isinstance(message, Mapping) else type(message).__name__
            raise ValueError(
                f"{where}: message {index} of field {field!r} has {keys}; each message needs "
                "'role' and 'content' (OpenAI) or 'from' and 'value' (ShareGPT)"
            )
        role, content = message["role"], message["content"]
        if role not in ROLES:
            raise ValueError(
                f"{where}: message {index} of field {field!r} has unknown role {role!r}; use "
                f"one of {list(ROLES)}"
            )
        if not isinstance(content, str):
            raise ValueError(
                f"{where}: message {index} of field {field!r} has content of type "
                f"{type(content).__name__}; content must be a string"
            )
        clean.append({"role": role, "content": content})
    return clean


def load_jsonl(path: str | Path, text_field: str = "text") -> datasets.Dataset:
    """Rows of a .jsonl (or .json) file as a ``Dataset`` with one column ``text``."""
    texts: list[str] = []
    for where, record in _read_json_records(Path(path)):
        if not isinstance(record, Mapping):
            raise ValueError(
                f"{where} is a JSON {type(record).__name__}; each line must be an object"
            )
        text = _field(record, text_field, where, "text_field")
        if not isinstance(text, str):
            raise ValueError(
                f"{where}: field {text_field!r} is a {type(text).__name__}, not a string; pass "
                "text_field= a field that holds text"
            )
        texts.append(text)
    if not texts:
        raise ValueError(
            f"{path} holds no records; add at least one JSON object with {text_field!r}"
        )
    return datasets.Dataset.from_dict(
        {"text": texts}, features=datasets.Features({"text": datasets.Value("string")})
    )


def load_conversations(
    source: str | Path,
    messages_field: str = "messages",
    split: str = "train",
) -> datasets.Dataset:
    """Conversations from a .jsonl/.json file or a ``datasets`` name, as column ``messages``.

    ``split`` is used only for ``datasets`` names. A record without ``messages_field`` may hold
    ShareGPT's ``conversations`` (when ``messages_field`` is the default). Each message is
    checked (role in ``ROLES``, string content) and reduced to ``{"role", "content"}``.
    """
    conversations = []
    for where, record in _records(source, split):
        field = conversation_field(record, messages_field) or messages_field
        messages = _field(record, field, where, "messages_field")
        conversations.append(validate_messages(messages, where, field))
    if not conversations:
        raise ValueError(
            f"{source} holds no conversations; add records with a {messages_field!r} list"
        )
    message = datasets.Features(
        {"role": datasets.Value("string"), "content": datasets.Value("string")}
    )
    return datasets.Dataset.from_dict(
        {"messages": conversations},
        features=datasets.Features({"messages": datasets.List(message)}),
    )


def load_prompts(
    source: str | Path,
    prompt_field: str = "prompt",
    messages_field: str = "messages",
    split: str = "train",
) -> list[str | list[dict]]:
    """Prompts for regenerating responses with the target.

    A record with ``prompt_field`` (a string) gives a plain prompt; otherwise a record with
    ``messages_field`` (or ShareGPT's ``conversations``) gives its conversation minus the final
    assistant turn (a conversation that ends with a user or tool turn is kept whole). The result
    is in file order.
    """
    prompts: list[str | list[dict]] = []
    for where, record in _records(source, split):
        if prompt_field in record:
            prompt = record[prompt_field]
            if not isinstance(prompt, str) or not prompt:
                raise ValueError(
                    f"{where}: field {prompt_field!r} must be a non-empty string, got "
                    f"{type(prompt).__name__} {str(prompt)[:80]!r}"
                )
            prompts.append(prompt)
        elif (field := conversation_field(record, messages_field)) is not None:
            messages = validate_messages(record[field], where, field)
            if messages[-1]["role"] == "assistant":
                messages = messages[:-1]
            if not messages or messages[-1]["role"] not in ("user", "tool"):
                ends = f"ends with {messages[-1]['role']!r}" if messages else "is empty"
                raise ValueError(
                    f"{where}: after removing the final assistant turn, field {field!r} "
                    f"{ends}; a prompt must end with a user (or tool) turn for the target to answer"
                )
            prompts.append(messages)
        else:
            raise ValueError(
                f"{where} has neither {prompt_field!r} nor {messages_field!r} (fields present: "
                f"{sorted(record)}); pass prompt_field= or messages_field= the field to read"
            )
    if not prompts:
        raise ValueError(f"{source} holds no records; add at least one prompt")
    return prompts
