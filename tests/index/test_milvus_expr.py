"""The Milvus expression builder alone (the backend's injection defence): every input stays one
string literal, whatever it holds. Milvus itself runs these expressions in test_backends."""

from __future__ import annotations

import random

import pytest

from qswap.errors import InvalidInputError
from qswap.index.backends.milvus.expr import filter_expr, ids_expr, quote, tags, type_tag

INJECTIONS = ['x" or id > 0 or "', 'a\\" or true or \\"', '\\', '"', '" || 1 == 1 || "', "ends with \\",
              'tab\tnew\nline\rreturn', "' or '1'='1", "ünïcødé \"quoted\" ☃"]
_UNESCAPE = {"\\": "\\", '"': '"', "n": "\n", "r": "\r", "t": "\t"}


def read_literal(expr: str, start: int = 0) -> tuple[str, int]:
    """Parse one Milvus string literal at ``start``: (its value, the index just past it)."""
    assert expr[start] == '"', expr
    out, i = [], start + 1
    while expr[i] != '"':
        if expr[i] == "\\":
            out.append(_UNESCAPE[expr[i + 1]])
            i += 2
        else:
            out.append(expr[i])
            i += 1
    return "".join(out), i + 1


@pytest.mark.parametrize("value", INJECTIONS)
def test_a_hostile_value_stays_one_literal(value):
    lit = quote(value)
    got, end = read_literal(lit)
    assert (got, end) == (value, len(lit))


def test_random_text_round_trips():
    rng = random.Random(0)
    alphabet = 'ab "\\\n\r\t\'()=<>![]{}é☃'
    for _ in range(500):
        value = "".join(rng.choice(alphabet) for _ in range(rng.randint(0, 30)))
        lit = quote(value)
        assert read_literal(lit) == (value, len(lit))


@pytest.mark.parametrize("ch", ["\x00", "\x1b", "\x7f", "\x08"])
def test_control_characters_milvus_cannot_escape_are_refused(ch):
    with pytest.raises(InvalidInputError, match="control character"):
        quote(f"a{ch}b")


def test_filter_is_one_comparison_per_field_on_typed_tags():
    assert filter_expr(None) == "" and filter_expr({}) == ""
    expr = filter_expr({"section": INJECTIONS[0], "year": 2001})
    left, right = expr.split(" and ")
    field, end = read_literal(left, left.index('"'))
    assert field == "section" and left[end:end + 5] == "] == "
    assert read_literal(left, end + 5) == ("s:" + INJECTIONS[0], len(left) - 1) and left.endswith(")")
    assert right == '(tags["year"] == "n:2001")'


def test_types_stay_strict():
    assert [type_tag(v) for v in (True, 1, 1.0, "1", None, 1.5)] == ["b:true", "n:1", "n:1", "s:1", "z:", "n:1.5"]
    assert type_tag([1]) is None and type_tag({"a": 1}) is None
    assert tags({"a": True, "b": [1], "c": "x"}) == {"a": "b:true", "c": "s:x"}


def test_field_names_are_checked_before_any_expression_is_built():
    with pytest.raises(InvalidInputError):
        filter_expr({INJECTIONS[0]: "games"})


def test_ids_are_literals_too():
    expr = ids_expr(["d1", INJECTIONS[0]])
    assert expr.startswith("id in [") and expr.endswith("]")
    first, end = read_literal(expr, len("id in ["))
    second, end2 = read_literal(expr, end + 2)
    assert (first, second) == ("d1", INJECTIONS[0]) and expr[end:end + 2] == ", " and end2 == len(expr) - 1
