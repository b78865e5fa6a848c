"""Symbolic integers: ``Variable(name, lo, hi)`` and small expressions over them.

Theory of operation
-------------------
Any integer argument of a command (kernel vals, sizes, signal values) may be a
:class:`Variable` or an expression built from one with ``+ - * //`` and ints.
Queues and graphs keep the symbolic form and resolve it when they are submitted
or replayed, against ``var_vals`` (a mapping keyed by Variable or by name).
Resolution checks every variable against its ``[lo, hi]`` range and raises
:class:`~hcqa.errors.InvalidCommand` before anything is queued.
"""

from __future__ import annotations

import operator
from collections.abc import Callable, Mapping
from typing import Any

import attrs

from hcqa.errors import InvalidCommand

__all__ = ["Expr", "IntLike", "VarVals", "Variable", "resolve", "variables_of"]

_OPS: dict[str, Callable[[int, int], int]] = {
    "+": operator.add,
    "-": operator.sub,
    "*": operator.mul,
    "//": operator.floordiv,
}


class _Arith:
    """The operators shared by variables and expressions."""

    def _op(self, op: str, other: object, swap: bool = False) -> Expr:
        if not isinstance(other, (int, Variable, Expr)) or isinstance(other, bool):
            return NotImplemented  # type: ignore[no-any-return]
        sym: Sym = self  # type: ignore[assignment]
        if swap:
            return Expr(op=op, lhs=other, rhs=sym)
        return Expr(op=op, lhs=sym, rhs=other)

    def __add__(self, other: IntLike) -> Expr:
        return self._op("+", other)

    def __radd__(self, other: int) -> Expr:
        return self._op("+", other, swap=True)

    def __sub__(self, other: IntLike) -> Expr:
        return self._op("-", other)

    def __rsub__(self, other: int) -> Expr:
        return self._op("-", other, swap=True)

    def __mul__(self, other: IntLike) -> Expr:
        return self._op("*", other)

    def __rmul__(self, other: int) -> Expr:
        return self._op("*", other, swap=True)

    def __floordiv__(self, other: IntLike) -> Expr:
        return self._op("//", other)

    def __rfloordiv__(self, other: int) -> Expr:
        return self._op("//", other, swap=True)


@attrs.frozen(cache_hash=True)  # hashed at every replay: once is enough
class Variable(_Arith):
    """A named integer in ``[lo, hi]``, bound to a value at submit or replay."""

    name: str = attrs.field()
    lo: int = attrs.field()
    hi: int = attrs.field()

    @name.validator
    def _check_name(self, _: object, name: object) -> None:
        if not isinstance(name, str) or not name:
            raise InvalidCommand(f"'name' must be a non-empty str (got {name!r})")

    @lo.validator
    def _check_lo(self, _: object, lo: object) -> None:
        if not isinstance(lo, int) or isinstance(lo, bool):
            raise InvalidCommand(f"'lo' must be an int (got {type(lo).__name__})")

    @hi.validator
    def _check_hi(self, _: object, hi: object) -> None:
        if not isinstance(hi, int) or isinstance(hi, bool):
            raise InvalidCommand(f"'hi' must be an int (got {type(hi).__name__})")
        if hi < self.lo:
            raise InvalidCommand(f"'hi' must be >= lo = {self.lo} (got {hi})")

    def __str__(self) -> str:
        return self.name


@attrs.frozen(cache_hash=True)
class Expr(_Arith):
    """``lhs op rhs`` over ints, variables and expressions."""

    op: str
    lhs: IntLike
    rhs: IntLike

    def __str__(self) -> str:
        return f"({self.lhs} {self.op} {self.rhs})"


Sym = Variable | Expr
IntLike = int | Variable | Expr
VarVals = Mapping[Variable, int] | Mapping[str, int] | Mapping[Variable | str, int]


def variables_of(x: IntLike) -> set[Variable]:
    """The variables an int-like mentions."""
    if isinstance(x, Variable):
        return {x}
    if isinstance(x, Expr):
        return variables_of(x.lhs) | variables_of(x.rhs)
    return set()


def _bind(var: Variable, var_vals: VarVals | None) -> int:
    if var_vals is None:
        raise InvalidCommand(f"variable {var.name!r} is unbound (no var_vals given)")
    vv: Mapping[Any, int] = var_vals
    if var in vv:
        value = vv[var]
    elif var.name in vv:
        value = vv[var.name]
    else:
        raise InvalidCommand(
            f"variable {var.name!r} is unbound (var_vals has {sorted(map(str, var_vals))})"
        )
    if not isinstance(value, int) or isinstance(value, bool):
        raise InvalidCommand(
            f"variable {var.name!r} must be bound to an int (got {type(value).__name__})"
        )
    if not var.lo <= value <= var.hi:
        raise InvalidCommand(f"variable {var.name!r} must be in [{var.lo}, {var.hi}] (got {value})")
    return value


def resolve(x: IntLike, var_vals: VarVals | None) -> int:
    """The int value of ``x`` under ``var_vals`` (InvalidCommand if unbound or out of range)."""
    if isinstance(x, int):
        return x
    if isinstance(x, Variable):
        return _bind(x, var_vals)
    lhs, rhs = resolve(x.lhs, var_vals), resolve(x.rhs, var_vals)
    if x.op == "//" and rhs == 0:
        raise InvalidCommand(f"{x} divides by zero under the given var_vals")
    return _OPS[x.op](lhs, rhs)
