"""Bad arguments to ``open_process_pipeline`` (issue 14): a clear hcqa error naming what
was expected and what was seen, raised before any worker process is spawned."""

from __future__ import annotations

import math
import os
import resource
from typing import Any

import numpy as np
import pytest
import trio

import hcqa
from hcqa.processes import open_process_pipeline

ADD = "hcqa.processes.stages:add_one"


def _children() -> int:
    me = str(os.getpid())
    n = 0
    for name in os.listdir("/proc"):
        if name.isdigit():
            try:
                with open(f"/proc/{name}/stat") as f:
                    stat = f.read()
            except OSError:
                continue
            n += stat[stat.rindex(")") + 2 :].split()[1] == me
    return n


def _stage_fn(out: Any, inp: Any) -> None:  # pragma: no cover - never run
    pass


CASES: list[tuple[str, Any, dict[str, Any], str]] = [
    ("a str as stages", "hcqa.workers:add_one", {}, r"'stages' must be a list .*got one str"),
    ("bytes as stages", b"ab", {}, r"'stages' must be a list .*got one bytes"),
    ("a ProcessStage as stages", hcqa.ProcessStage(fn=ADD), {}, r"write \["),
    ("a dict as stages", {"a": 1}, {}, r"'stages' must be a list of stages \(got dict"),
    ("no stages", [], {}, r"at least one stage \(got none\)"),
    ("a function", [_stage_fn], {}, r"stage 0 must be named .*got the callable '_stage_fn'"),
    ("a lambda", [ADD, lambda o, i: None], {}, r"stage 1 must be named .*callable '<lambda>'"),
    ("an int", [3], {}, r"stage 0 must be a 'module:function' string .*\(got int 3\)"),
    ("None", [None], {}, r"\(got NoneType None\)"),
    ("no colon", ["numpy.add"], {}, r"stage 0 must be named 'module:function' \(got 'numpy.add'\)"),
    ("empty function", ["mod:"], {}, r"\(got 'mod:'\)"),
    ("bad out_dtype", [hcqa.ProcessStage(fn=ADD, out_dtype="float33")], {}, r"got 'float33'"),
    ("object out_dtype", [hcqa.ProcessStage(fn=ADD, out_dtype="O")], {}, r"plain .*got object"),
    ("bad out_shape", [hcqa.ProcessStage(fn=ADD, out_shape=(0,))], {}, r"ints >= 1 \(got \(0,\)"),
    ("args not JSON", [hcqa.ProcessStage(fn=ADD, args={"a": object()})], {}, "JSON"),
    ("args NaN", [hcqa.ProcessStage(fn=ADD, args={"a": math.nan})], {}, "JSON"),
    ("depth 0", [ADD], {"depth": 0}, r"'depth' must be an int in 1\.\.64 \(got 0\)"),
    ("depth huge", [ADD], {"depth": 100_000}, r"\(got 100000\)"),
    ("depth float", [ADD], {"depth": 2.0}, r"\(got 2\.0\)"),
    ("depth bool", [ADD], {"depth": True}, r"\(got True\)"),
    (
        "grace -1",
        [ADD],
        {"grace": -1},
        r"'grace' must be a finite number of seconds >= 0 \(got -1\)",
    ),
    ("grace NaN", [ADD], {"grace": math.nan}, r"\(got nan\)"),
    ("grace inf", [ADD], {"grace": math.inf}, r"\(got inf\)"),
    ("grace str", [ADD], {"grace": "5"}, r"\(got '5'\)"),
    ("hang_limit 0", [ADD], {"hang_limit": 0}, r"'hang_limit' must be .*> 0 .*\(got 0\)"),
    ("hang_limit NaN", [ADD], {"hang_limit": math.nan}, r"\(got nan\)"),
    ("hang_limit -1", [ADD], {"hang_limit": -1.0}, r"\(got -1\.0\)"),
    ("blas_threads 0", [ADD], {"blas_threads": 0}, r"'blas_threads' must be None or an int"),
    ("path a str", [ADD], {"path": "/tmp"}, r"'path' must be a list of directory names"),
    ("path with ''", [ADD], {"path": [""]}, r"'path' must be a list"),
    (
        "in_shape str",
        [ADD],
        {"in_shape": "4"},
        r"'in_shape' must be an int or a tuple of ints >= 1 \(got '4'\)",
    ),
    ("in_shape 0", [ADD], {"in_shape": (4, 0)}, r"\(got \(4, 0\)\)"),
    ("in_shape empty", [ADD], {"in_shape": ()}, r"\(got \(\)\)"),
    ("dtype typo", [ADD], {"dtype": "float33"}, r"'dtype' must be a numpy dtype \(got 'float33'\)"),
    ("dtype object", [ADD], {"dtype": object}, r"plain numeric or bool dtype.*\(got object\)"),
    ("dtype structured", [ADD], {"dtype": [("a", "f4")]}, r"plain .*got \[\('a', '<f4'\)\]"),
]


@pytest.mark.parametrize(
    ("stages", "kwargs", "match"), [c[1:] for c in CASES], ids=[c[0] for c in CASES]
)
async def test_bad_arguments_are_refused_before_any_worker_starts(
    stages: Any, kwargs: dict[str, Any], match: str
) -> None:
    kwargs = {"in_shape": (4,), **kwargs}
    before = _children()
    with pytest.raises(hcqa.InvalidCommand, match=match):
        async with open_process_pipeline(stages, **kwargs):
            pass  # pragma: no cover
    assert _children() == before


async def test_a_depth_that_would_exhaust_fds_is_out_of_memory() -> None:
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    used = len(os.listdir("/proc/self/fd"))
    resource.setrlimit(resource.RLIMIT_NOFILE, (used + 40, hard))
    try:
        before = _children()
        with pytest.raises(hcqa.OutOfMemory, match=r"needs about \d+ file descriptors, but only"):
            async with open_process_pipeline([ADD, ADD, ADD], in_shape=(4,), depth=64):
                pass  # pragma: no cover
        assert _children() == before
    finally:
        resource.setrlimit(resource.RLIMIT_NOFILE, (soft, hard))


async def test_the_largest_depth_still_works() -> None:
    """depth=64 fits one set-up message (the kernel's 253 fds) with a loan per slot."""
    n = (128 << 10) // 4  # outputs over the inline copy: 64 loans
    async with open_process_pipeline([ADD], in_shape=(n,), depth=64) as pipe:
        assert pipe.loans == 64
        with trio.fail_after(30):
            y = await pipe(np.ones(n, np.float32))
        assert float(y[0]) == 2.0
