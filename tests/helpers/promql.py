"""Just enough PromQL to evaluate a Grafana panel's query over two real scrapes (before and after some
traffic) the way Prometheus would at the second: selectors with label matchers, rate / increase
over the window between the scrapes, sum / max / min / avg [by (...)], histogram_quantile, clamp_min,
+ - * / between vectors and numbers. No Prometheus server is installable here; this is the part of
its query engine our dashboards use, so a panel that would be empty in Grafana is empty here too.

    query = Query(before=samples_then, after=samples_now, elapsed_s=12.0)
    series = query.evaluate('sum by (le) (rate(x_bucket{model_name="m"}[5m]))')  # {labels: value}
"""
from __future__ import annotations

import math
import re
from collections import defaultdict

Labels = frozenset  # of (name, value) pairs
Samples = dict  # {(sample name, Labels): value}
Vector = dict  # {Labels: value}

_TOKEN = re.compile(r"""\s*(?:(?P<number>\d+(?:\.\d+)?(?:e-?\d+)?)|(?P<string>"(?:[^"\\]|\\.)*")|
    (?P<name>[A-Za-z_:][A-Za-z0-9_:]*)|(?P<range>\[[^\]]+\])|(?P<op>=~|!=|!~|[-+*/(){},=]))""", re.VERBOSE)
_AGGREGATIONS = {"sum": sum, "max": max, "min": min, "avg": lambda values: sum(values) / len(values)}


def tokenize(expr: str) -> list[tuple[str, str]]:
    tokens, position = [], 0
    expr = expr.strip()
    while position < len(expr):
        match = _TOKEN.match(expr, position)
        if match is None or match.end() == position:
            raise ValueError(f"cannot parse {expr[position:position + 20]!r} in {expr!r}")
        kind = match.lastgroup
        tokens.append((kind, match.group(kind)))
        position = match.end()
        while position < len(expr) and expr[position].isspace():
            position += 1
    return tokens


class Query:
    def __init__(self, before: Samples, after: Samples, elapsed_s: float) -> None:
        self.before, self.after, self.elapsed_s = before, after, elapsed_s

    def evaluate(self, expr: str) -> Vector | float:
        self.tokens, self.index = tokenize(expr), 0
        value = self._additive()
        if self.index != len(self.tokens):
            raise ValueError(f"unexpected {self.tokens[self.index]} in {expr!r}")
        return value

    # ---- parser / evaluator (recursive descent, evaluating as it goes) ----

    def _peek(self, offset: int = 0) -> tuple[str, str]:
        position = self.index + offset
        return self.tokens[position] if position < len(self.tokens) else ("end", "")

    def _take(self, value: str | None = None) -> str:
        kind, text = self._peek()
        if value is not None and text != value:
            raise ValueError(f"expected {value!r}, got {text!r}")
        self.index += 1
        return text

    def _additive(self):
        return self._left_associative(("+", "-"), self._multiplicative)

    def _multiplicative(self):
        return self._left_associative(("*", "/"), self._term)

    def _left_associative(self, operators: tuple[str, ...], operand):
        """operand (op operand)*, evaluated left to right: one precedence level."""
        left = operand()
        while self._peek()[1] in operators:
            op = self._take()
            left = _binary(left, operand(), op)
        return left

    def _term(self):
        kind, text = self._peek()
        if kind == "number":
            self._take()
            return float(text)
        if text == "(":
            self._take()
            value = self._additive()
            self._take(")")
            return value
        if kind == "name" and text in _AGGREGATIONS:
            return self._aggregation()
        if kind == "name" and self._peek(1)[1] == "(":
            return self._function()
        if kind == "name":
            return self._selector()[0]
        raise ValueError(f"unexpected {text!r}")

    def _labels_list(self) -> list[str]:
        self._take("(")
        names = []
        while self._peek()[1] != ")":
            names.append(self._take())
            if self._peek()[1] == ",":
                self._take()
        self._take(")")
        return names

    def _aggregation(self) -> Vector:
        function = _AGGREGATIONS[self._take()]
        by = None
        if self._peek()[1] == "by":
            self._take()
            by = self._labels_list()
        self._take("(")
        vector = self._additive()
        self._take(")")
        if self._peek()[1] == "by":
            self._take()
            by = self._labels_list()
        groups = defaultdict(list)
        for labels, value in vector.items():
            groups[frozenset((k, v) for k, v in labels if by is not None and k in by)].append(value)
        return {labels: function(values) for labels, values in groups.items()}

    def _function(self):
        name = self._take()
        self._take("(")
        if name in ("rate", "increase"):
            vector, window = self._selector()
            if window is None:
                raise ValueError(f"{name}() needs a range selector")
            self._take(")")
            return {labels: increase / (self.elapsed_s if name == "rate" else 1.0)
                    for labels, increase in window.items()}
        if name == "histogram_quantile":
            quantile = float(self._take())
            self._take(",")
            vector = self._additive()
            self._take(")")
            return _histogram_quantile(quantile, vector)
        if name == "clamp_min":
            vector = self._additive()
            self._take(",")
            floor = float(self._take())
            self._take(")")
            return {labels: max(value, floor) for labels, value in vector.items()} if isinstance(vector, dict) \
                else max(vector, floor)
        raise ValueError(f"function {name}() is not supported here")

    def _selector(self) -> tuple[Vector, Vector | None]:
        """The selector's instant vector at `after`, and (with a [range]) the increase since `before`."""
        name = self._take()
        matchers = []
        if self._peek()[1] == "{":
            self._take("{")
            while self._peek()[1] != "}":
                label, op, value = self._take(), self._take(), self._take()
                matchers.append((label, op, value[1:-1]))
                if self._peek()[1] == ",":
                    self._take()
            self._take("}")
        window = None
        if self._peek()[0] == "range":
            self._take()
            window = {}
        instant = {}
        for (sample, labels), value in self.after.items():
            if sample == name and all(_matches(dict(labels).get(label, ""), op, want) for label, op, want in matchers):
                instant[labels] = value
                if window is not None:
                    window[labels] = value - self.before.get((sample, labels), 0.0)
        return instant, window


def _matches(value: str, op: str, want: str) -> bool:
    if op == "=":
        return value == want
    if op == "!=":
        return value != want
    if op == "=~":
        return re.fullmatch(want, value) is not None
    return re.fullmatch(want, value) is None


def _binary(left, right, op: str):
    apply = {"+": lambda a, b: a + b, "-": lambda a, b: a - b, "*": lambda a, b: a * b,
             "/": lambda a, b: a / b if b else (math.nan if a == 0 else math.copysign(math.inf, a))}[op]
    if not isinstance(left, dict) and not isinstance(right, dict):
        return apply(left, right)
    if not isinstance(left, dict):
        return {labels: apply(left, value) for labels, value in right.items()}
    if not isinstance(right, dict):
        return {labels: apply(value, right) for labels, value in left.items()}
    return {labels: apply(value, right[labels]) for labels, value in left.items() if labels in right}


def _histogram_quantile(quantile: float, vector: Vector) -> Vector:
    """Prometheus's: linear interpolation inside the bucket the rank falls in."""
    groups = defaultdict(list)
    for labels, value in vector.items():
        le = dict(labels).get("le")
        if le is not None:
            groups[frozenset((k, v) for k, v in labels if k != "le")].append((float(le), value))
    result = {}
    for labels, buckets in groups.items():
        buckets.sort()
        total = buckets[-1][1]
        if total <= 0:
            result[labels] = math.nan
            continue
        rank = quantile * total
        lower_bound, lower_count = 0.0, 0.0
        for bound, count in buckets:
            if count >= rank:
                if math.isinf(bound):
                    result[labels] = lower_bound
                else:
                    width = count - lower_count
                    result[labels] = lower_bound + (bound - lower_bound) * ((rank - lower_count) / width if width else 1)
                break
            lower_bound, lower_count = bound, count
    return result
