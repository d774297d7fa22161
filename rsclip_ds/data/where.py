"""A row filter: ``--where "img_quality_score >= 0.5 and resolution <= 2"``.

A small expression language over a row's columns, parsed with Python's own grammar
(``ast.parse(mode="eval")``) and then *interpreted* node by node from a whitelist, never
evaluated: comparisons (``== != < <= > >=``, chained ``0.3 <= score < 0.9``), ``in`` / ``not in``
a literal list, ``and`` / ``or`` / ``not``, parentheses, numbers, strings, ``true``/``false``/
``null`` (or Python's spellings), unary minus, and ``len(column)``. Anything else (calls,
attributes, subscripts, arithmetic, lambdas) is a WhereError naming what is allowed.

The same filter runs in ``make-shards`` over the input rows and at load time (``data.where``)
over the sample JSON that make-shards wrote, so one set of shards serves several experiments.
A column that a row lacks, or holds null, makes every comparison on it false (SQL's rule, so a
row with a missing score is dropped by ``score >= 0.5`` and by ``score < 0.5`` alike).
"""

from __future__ import annotations

import ast
import json
from typing import Any, Iterable, Mapping

_COMPARE = {ast.Eq: lambda a, b: a == b, ast.NotEq: lambda a, b: a != b, ast.Lt: lambda a, b: a < b,
            ast.LtE: lambda a, b: a <= b, ast.Gt: lambda a, b: a > b, ast.GtE: lambda a, b: a >= b,
            ast.In: lambda a, b: a in b, ast.NotIn: lambda a, b: a not in b}
_WORDS = {"true": True, "false": False, "null": None, "True": True, "False": False, "None": None}
ALLOWED = ("comparisons (== != < <= > >=, chained), 'in'/'not in' a [list], and/or/not, parentheses, "
           "numbers, 'strings', true/false/null, unary minus and len(column)")


class WhereError(ValueError):
    """A filter expression that cannot be parsed or run; the message names what is allowed."""


class Where:
    """A compiled filter; ``where(row)`` -> bool. ``Where.parse(None or "")`` keeps every row."""

    def __init__(self, text: str, tree: ast.expr | None):
        self.text, self._tree = text, tree
        nodes = list(ast.walk(tree)) if tree is not None else []
        calls = {id(n.func) for n in nodes if isinstance(n, ast.Call)}
        self.columns = sorted({n.id for n in nodes if isinstance(n, ast.Name) and n.id not in _WORDS
                               and id(n) not in calls})

    @classmethod
    def parse(cls, text: str | None) -> "Where":
        if not text or not text.strip():
            return cls("", None)
        try:
            tree = ast.parse(text.strip(), mode="eval").body
        except SyntaxError as err:
            raise WhereError(f"filter {text!r}: cannot parse it ({err.msg} at column {err.offset}); "
                             f"allowed: {ALLOWED}") from None
        for node in ast.walk(tree):
            _check_node(node, text)
        return cls(text.strip(), tree)

    def __bool__(self) -> bool:
        return self._tree is not None

    def check_columns(self, present: Iterable[str], where: str) -> None:
        """Raise WhereError when the filter names a column ``present`` lacks (a typo)."""
        present = set(present)
        missing = [c for c in self.columns if c not in present]
        if missing:
            raise WhereError(f"filter {self.text!r} names {missing}, which {where} does not have; "
                             f"its columns: {sorted(present)}")

    def __call__(self, row: Mapping[str, Any]) -> bool:
        if self._tree is None:
            return True
        return bool(_eval(self._tree, row, self.text))


def _check_node(node: ast.AST, text: str) -> None:
    ok = (ast.BoolOp, ast.And, ast.Or, ast.UnaryOp, ast.Not, ast.USub, ast.Compare, ast.Name,
          ast.Load, ast.Constant, ast.List, ast.Tuple, ast.Call, *_COMPARE)
    if not isinstance(node, ok):
        raise WhereError(f"filter {text!r}: {type(node).__name__} is not allowed; allowed: {ALLOWED}")
    if isinstance(node, ast.Call) and not (isinstance(node.func, ast.Name) and node.func.id == "len"
                                           and len(node.args) == 1 and not node.keywords
                                           and isinstance(node.args[0], ast.Name)):
        raise WhereError(f"filter {text!r}: the only call allowed is len(column); allowed: {ALLOWED}")


def json_columns(raw: bytes | None) -> dict:
    """A sample's JSON member as the row data.where sees: its object, or {} (every comparison
    false) when there is none, it does not parse, or it is not an object. The loader
    (transforms.SampleDecoder.keep) and the start-up count (filter_counts.py) both read it here."""
    if raw is None:
        return {}
    try:
        row = json.loads(raw)
    except ValueError:
        return {}
    return row if isinstance(row, dict) else {}


_MISSING = object()


def _value(node: ast.expr, row: Mapping[str, Any], text: str):
    if isinstance(node, ast.Constant):
        return node.value
    if isinstance(node, ast.Name):
        return _WORDS[node.id] if node.id in _WORDS else row.get(node.id, _MISSING)
    if isinstance(node, (ast.List, ast.Tuple)):
        return [_value(e, row, text) for e in node.elts]
    if isinstance(node, ast.Call):   # len(column), checked in parse
        v = _value(node.args[0], row, text)
        return _MISSING if v is _MISSING or v is None else len(v)
    if isinstance(node, ast.UnaryOp) and isinstance(node.op, ast.USub):
        v = _value(node.operand, row, text)
        return v if v is _MISSING or v is None else -v
    return _eval(node, row, text)


def _eval(node: ast.expr, row: Mapping[str, Any], text: str):
    if isinstance(node, ast.BoolOp):
        parts = (_eval(v, row, text) for v in node.values)
        return all(parts) if isinstance(node.op, ast.And) else any(parts)
    if isinstance(node, ast.UnaryOp) and isinstance(node.op, ast.Not):
        return not _eval(node.operand, row, text)
    if isinstance(node, ast.Compare):
        left = _value(node.left, row, text)
        for op, right_node in zip(node.ops, node.comparators):
            right = _value(right_node, row, text)
            if left is _MISSING or right is _MISSING:
                return False
            if (left is None or right is None) and not isinstance(op, (ast.Eq, ast.NotEq)):
                return False   # null orders with nothing
            try:
                if not _COMPARE[type(op)](left, right):
                    return False
            except TypeError:
                raise WhereError(f"filter {text!r}: cannot compare {left!r} with {right!r} "
                                 f"({type(left).__name__} and {type(right).__name__}); quote strings, "
                                 "leave numbers bare") from None
            left = right
        return True
    v = _value(node, row, text)   # a bare column or constant: its truth
    return False if v is _MISSING else bool(v)
