"""Milvus boolean expressions from user input: metadata equality filters and id lists.

This module is the Milvus backend's injection defence: every field name, string value and id
is written as an escaped string literal (:func:`quote`), so no input can change an
expression's structure; control characters Milvus cannot escape are refused. Metadata values
are compared as typed strings (:func:`type_tag`) so that filters are as strict as in the
FAISS backend.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

from qswap.errors import InvalidInputError
from qswap.index.checks import check_filter
from qswap.index.hit import FilterValue

_ESCAPES = {"\\": "\\\\", '"': '\\"', "\n": "\\n", "\r": "\\r", "\t": "\\t"}


def quote(value: str) -> str:
    """A Milvus string literal of ``value``: backslash and quote escaped, so it stays one literal.

    Milvus's parser knows no ``\\u`` escapes: other control characters are refused.
    """
    out = []
    for ch in value:
        if ch in _ESCAPES:
            out.append(_ESCAPES[ch])
        elif ord(ch) < 0x20 or ord(ch) == 0x7F:
            raise InvalidInputError(f"{value[:40]!r} holds control character {ch!r}, which Milvus expressions "
                                    "cannot carry", "remove control characters from filter values and ids")
        else:
            out.append(ch)
    return '"' + "".join(out) + '"'


def type_tag(value: Any) -> str | None:
    """A metadata scalar as a typed string ("s:games", "n:2001", "b:true", "z:"): Milvus compares
    JSON booleans and numbers loosely (``true == 1``); comparing typed strings keeps filters
    strict, as in the FAISS backend (1 and 1.0 are the same number there too)."""
    if isinstance(value, bool):
        return "b:true" if value else "b:false"
    if value is None:
        return "z:"
    if isinstance(value, int):
        return f"n:{value}"
    if isinstance(value, float):
        return f"n:{int(value)}" if value.is_integer() and abs(value) < 2 ** 63 else f"n:{value!r}"
    if isinstance(value, str):
        return "s:" + value
    return None  # lists and objects match no equality filter


def tags(metadata: dict[str, Any]) -> dict[str, str]:
    """The typed-string tags of ``metadata``'s scalar fields (what filters compare against)."""
    return {k: t for k, v in metadata.items() if (t := type_tag(v)) is not None}


def filter_expr(flt: dict[str, FilterValue] | None) -> str:
    """Milvus boolean expression for equality on top-level metadata fields ("" for no filter).

    Types are strict as in the FAISS backend: ``True`` matches JSON ``true`` only, numbers
    match numbers, strings match strings, ``None`` matches null (see :func:`type_tag`).
    """
    if not flt:
        return ""
    check_filter(flt)
    return " and ".join(f"(tags[{quote(field)}] == {quote(str(type_tag(value)))})" for field, value in flt.items())


def ids_expr(ids: Iterable[str]) -> str:
    """``id in [...]`` for ``ids``, each an escaped literal."""
    return f"id in [{', '.join(quote(i) for i in ids)}]"
