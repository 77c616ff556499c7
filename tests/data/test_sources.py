"""User-data loaders: happy paths and the error messages that name the file and the field."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from draftsmith.data import sources
from draftsmith.data.sources import (
    load_conversations,
    load_jsonl,
    load_prompts,
    load_records,
    load_text_files,
)

CHAT = [
    {"role": "system", "content": "Be brief."},
    {"role": "user", "content": "2+2?"},
    {"role": "assistant", "content": "4", "name": "bot"},
]


def _jsonl(path: Path, records: list[object]) -> Path:
    path.write_text("\n".join(json.dumps(r) for r in records) + "\n\n", encoding="utf-8")
    return path


def test_load_text_files(tmp_path: Path) -> None:
    (tmp_path / "a.txt").write_text("alpha\n", encoding="utf-8")
    (tmp_path / "b.txt").write_text("b\u00e9ta", encoding="utf-8")
    dataset = load_text_files([tmp_path / "a.txt", str(tmp_path / "b.txt")])
    assert dataset["text"] == ["alpha\n", "b\u00e9ta"]
    assert dataset["path"] == [str(tmp_path / "a.txt"), str(tmp_path / "b.txt")]
    with pytest.raises(FileNotFoundError, match=r"missing\.txt"):
        load_text_files([tmp_path / "missing.txt"])
    with pytest.raises(ValueError, match="is a folder"):
        load_text_files([tmp_path])
    (tmp_path / "latin.txt").write_bytes("caf\u00e9".encode("latin-1"))
    with pytest.raises(ValueError, match=r"latin\.txt is not valid UTF-8"):
        load_text_files([tmp_path / "latin.txt"])
    with pytest.raises(ValueError, match="no paths"):
        load_text_files([])


def test_load_jsonl_and_its_errors(tmp_path: Path) -> None:
    path = _jsonl(tmp_path / "t.jsonl", [{"body": "one", "id": 1}, {"body": "two", "id": 2}])
    assert load_jsonl(path, text_field="body")["text"] == ["one", "two"]
    with pytest.raises(
        ValueError, match=r"t\.jsonl:1 has no field 'text'.*\['body', 'id'\].*text_field"
    ):
        load_jsonl(path)
    with pytest.raises(FileNotFoundError, match=r"nope\.jsonl"):
        load_jsonl(tmp_path / "nope.jsonl")
    empty = tmp_path / "empty.jsonl"
    empty.write_text("\n", encoding="utf-8")
    with pytest.raises(ValueError, match=r"empty\.jsonl holds no records"):
        load_jsonl(empty)
    broken = tmp_path / "broken.jsonl"
    broken.write_text('{"text": "ok"}\n{"text": \n', encoding="utf-8")
    with pytest.raises(ValueError, match=r"broken\.jsonl:2 is not valid JSON"):
        load_jsonl(broken)
    numbers = _jsonl(tmp_path / "n.jsonl", [{"text": 3}])
    with pytest.raises(ValueError, match="'text' is a int, not a string"):
        load_jsonl(numbers)
    for suffix in (".jsonl", ".json"):
        binary = tmp_path / f"binary{suffix}"
        binary.write_bytes(bytes(range(256)))
        with pytest.raises(ValueError, match=rf"binary\{suffix} is not UTF-8 text"):
            load_jsonl(binary)
    separator = tmp_path / "u2028.jsonl"  # U+2028 is legal raw inside a JSON string
    separator.write_text('{"text": "a\u2028b"}\n', encoding="utf-8")
    assert load_jsonl(separator)["text"] == ["a\u2028b"]
    for suffix, body in ((".jsonl", '{"text": "bom"}\n'), (".json", '[{"text": "bom"}]')):
        marked = tmp_path / f"bom{suffix}"  # Windows editors start UTF-8 files with a BOM
        marked.write_bytes(b"\xef\xbb\xbf" + body.encode())
        assert load_jsonl(marked)["text"] == ["bom"]


def test_load_conversations_jsonl_and_json(tmp_path: Path) -> None:
    path = _jsonl(tmp_path / "c.jsonl", [{"messages": CHAT}, {"messages": CHAT[1:]}])
    dataset = load_conversations(path)
    assert dataset.column_names == ["messages"]
    assert dataset[0]["messages"] == [{"role": m["role"], "content": m["content"]} for m in CHAT]
    as_json = tmp_path / "c.json"
    as_json.write_text(json.dumps({"data": [{"turns": CHAT}]}), encoding="utf-8")
    assert len(load_conversations(as_json, messages_field="turns")) == 1


def test_conversation_errors(tmp_path: Path) -> None:
    with pytest.raises(FileNotFoundError, match=r"absent\.jsonl"):
        load_conversations(str(tmp_path / "absent.jsonl"))
    path = _jsonl(tmp_path / "c.jsonl", [{"conversation": CHAT}])
    with pytest.raises(ValueError, match=r"c\.jsonl:1 has no field 'messages'.*\['conversation'\]"):
        load_conversations(path)
    bad_role = _jsonl(tmp_path / "r.jsonl", [{"messages": [{"role": "human", "content": "x"}]}])
    with pytest.raises(ValueError, match=r"r\.jsonl:1: message 0 .*unknown role 'human'"):
        load_conversations(bad_role)
    sharegpt = _jsonl(tmp_path / "s.jsonl", [{"messages": [{"from": "narrator", "value": "x"}]}])
    with pytest.raises(ValueError, match=r"s\.jsonl:1: message 0 .*comes from 'narrator'"):
        load_conversations(sharegpt)
    half = _jsonl(tmp_path / "h.jsonl", [{"messages": [{"from": "human"}]}])
    with pytest.raises(ValueError, match=r"h\.jsonl:1: message 0.*'from' and 'value' \(ShareGPT\)"):
        load_conversations(half)
    empty = _jsonl(tmp_path / "e.jsonl", [{"messages": []}])
    with pytest.raises(ValueError, match=r"e\.jsonl:1: field 'messages' must be a non-empty list"):
        load_conversations(empty)
    nothing = tmp_path / "nothing.jsonl"
    nothing.write_text("", encoding="utf-8")
    with pytest.raises(ValueError, match="holds no conversations"):
        load_conversations(nothing)


def test_load_prompts(tmp_path: Path) -> None:
    path = _jsonl(
        tmp_path / "p.jsonl",
        [{"prompt": "Write a haiku."}, {"messages": CHAT}, {"messages": CHAT[:2]}],
    )
    prompts = load_prompts(path)
    assert prompts[0] == "Write a haiku."
    assert prompts[1] == [{"role": m["role"], "content": m["content"]} for m in CHAT[:2]]
    assert prompts[2] == prompts[1]
    missing = _jsonl(tmp_path / "m.jsonl", [{"question": "?"}])
    with pytest.raises(
        ValueError, match=r"m\.jsonl:1 has neither 'prompt' nor 'messages'.*question"
    ):
        load_prompts(missing)
    only_assistant = _jsonl(tmp_path / "a.jsonl", [{"messages": [CHAT[2]]}])
    with pytest.raises(ValueError, match=r"a\.jsonl:1: after removing the final assistant turn"):
        load_prompts(only_assistant)


def test_a_folder_or_an_unloadable_name_is_named(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    folder = tmp_path / "prompts.jsonl"
    folder.mkdir()
    with pytest.raises(ValueError, match=r"prompts\.jsonl is a folder; pass a \.jsonl"):
        load_prompts(folder)

    def offline(*args: object, **kwargs: object) -> None:
        raise ConnectionError("Couldn't reach 'banana' on the Hub")

    monkeypatch.setattr(sources.datasets, "load_dataset", offline)
    for load in (load_prompts, load_records):
        with pytest.raises(FileNotFoundError, match=r"banana: not a file or folder here.*offline"):
            load("banana")
