"""Plain YAML files and the typed values read from them (recipes, the server's config).

A file a user hands a command is data, never code: :func:`load_plain_yaml` parses it with
``yaml.safe_load`` (a tag such as ``!!python/object`` is refused, not run), refuses a key
given twice in one mapping (YAML would keep the last silently), and turns every parse or
encoding failure into a ``ValueError`` that names the file. :func:`typed_value` checks
a value against a dataclass field's annotation (``int``, ``float``, ``str``, ``bool``, ``None``,
their unions and ``list[...]``): an integer widens to a float, a bool is never a number, and a
YAML 1.1 exponent without a dot (``1e-3``, which YAML reads as a string) counts as a number.
:func:`describe_value` quotes a value in an error message cut short, so a nested alias bomb
(billion laughs) in a file costs a short message, never its expansion.
"""

from __future__ import annotations

import math
import re
import reprlib
import types
import typing
from pathlib import Path
from typing import Any

import yaml

_FLOAT_TEXT = re.compile(r"^[-+]?(\d+\.?\d*|\.\d+)([eE][-+]?\d+)?$")
_TYPE_NAMES = {
    bool: "true or false",
    int: "an integer",
    float: "a finite number",
    str: "a string",
    type(None): "null",
}
_SHORT_REPR = reprlib.Repr()
_SHORT_REPR.maxlevel = 2
_SHORT_REPR.maxstring = 80
_SHORT_REPR.maxother = 80
_SHORT_REPR.maxlist = _SHORT_REPR.maxtuple = _SHORT_REPR.maxdict = 6


class _PlainLoader(yaml.SafeLoader):
    """``yaml.SafeLoader`` that refuses a key given twice in one mapping."""

    def construct_mapping(self, node: yaml.MappingNode, deep: bool = False) -> dict[Any, Any]:
        """The mapping, after checking that no explicit key repeats (merged ``<<`` keys may
        be overridden, as YAML intends)."""
        seen: set[Any] = set()
        for key_node, _ in node.value:
            if key_node.tag == "tag:yaml.org,2002:merge":
                continue
            key = self.construct_object(key_node, deep=deep)
            try:
                repeated = key in seen
                seen.add(key)
            except TypeError:  # an unhashable key: the base class names it
                continue
            if repeated:
                raise yaml.constructor.ConstructorError(
                    "while constructing a mapping",
                    node.start_mark,
                    f"found the key {_SHORT_REPR.repr(key)} twice (keep one)",
                    key_node.start_mark,
                )
        return super().construct_mapping(node, deep=deep)


def load_plain_yaml(path: Path, expected: str) -> Any:
    """``path`` parsed as plain YAML (empty: ``{}``); ``ValueError`` naming it and ``expected``
    (what to pass instead) if it is not UTF-8, not plain YAML or repeats a key."""
    try:
        return (
            yaml.load(path.read_text(encoding="utf-8"), Loader=_PlainLoader) or {}
        )  # safe: no object tags
    except UnicodeDecodeError as error:
        raise ValueError(f"{path} is not UTF-8 text ({error}); pass {expected}") from None
    except yaml.YAMLError as error:  # malformed YAML, or a tag such as !!python/object
        detail = " ".join(str(error).split())
        raise ValueError(
            f"{path} is not a valid plain YAML file ({detail}); pass {expected}"
        ) from None


def typed_value(value: Any, hint: Any) -> tuple[bool, Any]:
    """(whether ``value`` has the type ``hint``, the value converted: ints widened to float)."""
    origin = typing.get_origin(hint)
    if origin in (typing.Union, types.UnionType):
        for option in typing.get_args(hint):
            ok, converted = typed_value(value, option)
            if ok:
                return True, converted
        return False, value
    if hint is type(None):
        return value is None, value
    if origin in (list, tuple):  # tuple[X, ...]: a list in YAML and JSON
        if not isinstance(value, (list, tuple)):
            return False, value
        item = typing.get_args(hint)[0]
        checked = [typed_value(v, item) for v in value]
        return all(ok for ok, _ in checked), origin(v for _, v in checked)
    if hint is bool:
        return isinstance(value, bool), value
    if hint is int:
        return isinstance(value, int) and not isinstance(value, bool), value
    if hint is float:
        if isinstance(value, str) and _FLOAT_TEXT.match(value.strip()):
            value = float(value)  # YAML 1.1 reads 1e-3 (no dot) as a string
        if isinstance(value, (int, float)) and not isinstance(value, bool):
            return math.isfinite(value), float(value)
        return False, value
    if hint is str:
        return isinstance(value, str), value
    return False, value


def describe_type(hint: Any) -> str:
    """``hint`` in words, as an error message states what a field takes."""
    origin = typing.get_origin(hint)
    if origin in (typing.Union, types.UnionType):
        return " or ".join(describe_type(option) for option in typing.get_args(hint))
    if origin in (list, tuple):
        item = typing.get_args(hint)[0]
        return f"a list of {describe_type(item).removeprefix('a ').removeprefix('an ')}s"
    return _TYPE_NAMES.get(hint, str(hint))


def describe_value(value: Any) -> str:
    """``value`` (cut short) and its YAML kind, as an error message states what it got."""
    if value is None:
        return "null"
    kind = {bool: "a boolean", int: "an integer", float: "a float", str: "a string"}.get(
        type(value), f"a {type(value).__name__}"
    )
    return f"{_SHORT_REPR.repr(value)} ({kind})"
