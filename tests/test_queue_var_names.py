"""A Queue submit refuses values for variables the queue does not use, as a graph replay does:
a misspelt name would otherwise leave the real variable unbound (an error naming the wrong
thing) or, with a default in the caller's code, run with values nobody meant."""

from __future__ import annotations

from typing import Any

import numpy as np
import numpy.typing as npt
import pytest

import hcqa
from hcqa.errors import InvalidCommand


def fill(out: npt.NDArray[Any], n: int) -> None:
    out[:] = n


async def test_unknown_variable_names_are_refused() -> None:
    async with hcqa.open_device("cpu:0") as d:
        out = d.alloc(shape=(4,), dtype="int64")
        prog = d.program("fill", fill)
        n = hcqa.Variable("n", 0, 100)
        q = d.compute_queue().exec(prog, (out,), vals=(n,))
        before = d.statistics()
        for bad in ({"n": 3, "m": 4}, {"N": 3}, {n: 3, hcqa.Variable("k", 0, 9): 1}):
            with pytest.raises(InvalidCommand, match="unknown variables"):
                q.submit(bad)
            with pytest.raises(InvalidCommand, match="unknown variables"):
                await q.submit_async(bad)
        with pytest.raises(InvalidCommand, match="not the one this queue uses"):
            q.submit({hcqa.Variable("n", 0, 5): 3})
        with pytest.raises(InvalidCommand, match="must be a dict"):
            q.submit([("n", 3)])  # type: ignore[arg-type]
        assert d.statistics() == before  # nothing queued
        constant = d.compute_queue().exec(prog, (out,), vals=(1,))
        with pytest.raises(InvalidCommand, match=r"variables \['n'\] \(the queue has \[\]"):
            constant.submit({"n": 1})
        constant.submit({})  # nothing to bind: fine
        await q.submit({"n": 7})  # by name
        await q.submit({n: 8})  # by the Variable
        host = np.zeros(4, np.int64)
        await out.copyout(host)
        assert host.tolist() == [8] * 4
        q.exec(prog, (out,), vals=(hcqa.Variable("m", 0, 9),))  # a new verb: m is known now
        await q.submit({"n": 1, "m": 2})
        await out.copyout(host)
        assert host.tolist() == [2] * 4
