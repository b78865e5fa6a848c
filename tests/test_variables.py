"""Variables: ranges, expressions over ints, and resolution against var_vals."""

from __future__ import annotations

import attrs
import pytest
from hypothesis import given
from hypothesis import strategies as st

from hcqa import InvalidCommand, Variable
from hcqa.variables import Expr, resolve, variables_of

# -- construction --------------------------------------------------------------------------


def test_variable_fields_and_str() -> None:
    v = Variable("n", 1, 4096)
    assert (v.name, v.lo, v.hi) == ("n", 1, 4096)
    assert str(v) == "n"
    assert Variable("n", 1, 4096) == v
    assert hash(Variable("n", 1, 4096)) == hash(v)
    assert Variable("n", 1, 4097) != v


def test_variable_single_value_range() -> None:
    v = Variable("k", 7, 7)
    assert resolve(v, {v: 7}) == 7
    with pytest.raises(InvalidCommand):
        resolve(v, {v: 8})


def test_variable_is_frozen() -> None:
    v = Variable("n", 0, 10)
    with pytest.raises(attrs.exceptions.FrozenInstanceError):
        v.hi = 11  # type: ignore[misc]


def test_hi_below_lo() -> None:
    with pytest.raises(InvalidCommand, match=r"'hi' must be >= lo = 5 \(got 3\)"):
        Variable("n", 5, 3)


@pytest.mark.parametrize(
    ("lo", "hi"),
    [(1.0, 5), (1, 5.0), ("1", 5), (1, None), (True, 5), (0, False)],
)
def test_non_int_bounds(lo: object, hi: object) -> None:
    with pytest.raises(TypeError, match="must be an int"):
        Variable("n", lo, hi)  # type: ignore[arg-type]


def test_non_str_name() -> None:
    with pytest.raises(TypeError):
        Variable(3, 0, 1)  # type: ignore[arg-type]


# -- expressions ---------------------------------------------------------------------------


def test_expressions_with_ints_on_both_sides() -> None:
    v = Variable("v", -100, 100)
    vals: dict[Variable | str, int] = {v: 7}
    assert resolve(v + 3, vals) == 10
    assert resolve(3 + v, vals) == 10
    assert resolve(v - 3, vals) == 4
    assert resolve(3 - v, vals) == -4
    assert resolve(v * 3, vals) == 21
    assert resolve(3 * v, vals) == 21
    assert resolve(v // 2, vals) == 3
    assert resolve(50 // v, vals) == 7
    # floor division rounds toward -inf, as Python's does
    assert resolve(v // 2, {v: -7}) == -4
    assert resolve(-7 // v, {v: 2}) == -4


def test_expressions_nest_and_mix_variables() -> None:
    a = Variable("a", 0, 100)
    b = Variable("b", 1, 100)
    e = (a + 1) * b - a // b
    assert isinstance(e, Expr)
    assert variables_of(e) == {a, b}
    assert resolve(e, {a: 9, b: 4}) == 10 * 4 - 2
    assert str(a + 1) == "(a + 1)"
    assert str(2 * (a - b)) == "(2 * (a - b))"


@pytest.mark.parametrize("other", [1.5, "1", None, True, [1]])
def test_expressions_refuse_non_ints(other: object) -> None:
    v = Variable("v", 0, 10)
    with pytest.raises(TypeError):
        _ = v + other  # type: ignore[operator]
    with pytest.raises(TypeError):
        _ = other * v  # type: ignore[operator]


@given(
    x=st.integers(-1000, 1000),
    k=st.integers(-50, 50).filter(lambda k: k != 0),
)
def test_expression_matches_python(x: int, k: int) -> None:
    v = Variable("v", -1000, 1000)
    for expr, want in (
        (v + k, x + k),
        (k - v, k - x),
        (v * k, x * k),
        (v // k, x // k),
        ((v - k) * 2 + 1, (x - k) * 2 + 1),
    ):
        assert resolve(expr, {v: x}) == want
        assert resolve(expr, {"v": x}) == want


# -- resolution ----------------------------------------------------------------------------


def test_resolve_ints_pass_through() -> None:
    assert resolve(42, None) == 42
    assert resolve(42, {}) == 42


def test_resolve_by_variable_and_by_name() -> None:
    v = Variable("v", 0, 10)
    assert resolve(v, {v: 3}) == 3
    assert resolve(v, {"v": 4}) == 4
    # the Variable key wins over the name
    assert resolve(v, {v: 5, "v": 6}) == 5


def test_unbound_without_var_vals() -> None:
    v = Variable("width", 1, 64)
    with pytest.raises(InvalidCommand, match=r"'width'.*unbound"):
        resolve(v + 1, None)


def test_unbound_with_other_names() -> None:
    v = Variable("width", 1, 64)
    other = Variable("height", 1, 64)
    with pytest.raises(InvalidCommand, match=r"'width'.*unbound") as info:
        resolve(v * 2, {other: 3})
    assert "height" in str(info.value)  # says what was bound instead


@pytest.mark.parametrize("value", [0, 65, -1, 10**20])
def test_out_of_range_names_variable_range_and_value(value: int) -> None:
    v = Variable("width", 1, 64)
    with pytest.raises(InvalidCommand) as info:
        resolve(v + 1, {v: value})
    msg = str(info.value)
    assert "'width'" in msg
    assert "[1, 64]" in msg
    assert f"got {value}" in msg


def test_range_bounds_are_inclusive() -> None:
    v = Variable("v", -3, 3)
    assert resolve(v, {v: -3}) == -3
    assert resolve(v, {v: 3}) == 3


def test_binding_to_a_non_int() -> None:
    v = Variable("v", 0, 10)
    with pytest.raises(TypeError, match="'v'"):
        resolve(v, {v: 2.0})  # type: ignore[dict-item]
    with pytest.raises(TypeError, match="'v'"):
        resolve(v, {v: True})


def test_division_by_zero() -> None:
    v = Variable("v", 0, 10)
    with pytest.raises(InvalidCommand, match="divides by zero"):
        resolve(7 // v, {v: 0})
    with pytest.raises(InvalidCommand, match="divides by zero"):
        resolve(v // (v - 2), {v: 2})
    with pytest.raises(InvalidCommand, match="divides by zero"):
        resolve(v // 0, {v: 5})


def test_variables_of() -> None:
    a, b = Variable("a", 0, 1), Variable("b", 0, 1)
    assert variables_of(5) == set()
    assert variables_of(a) == {a}
    assert variables_of(1 + a * (b - 2)) == {a, b}
