"""Every block opener, left by a cancellation at set-up, in the body, at exit and by Ctrl-C,
ends its close within its grace period: no hang, whatever the cancellation cut short.

Each opener runs in a child interpreter (``_cancel_child.py``), all children at once, each
under a hard limit: a child that hangs dumps every thread's stack (faulthandler) and the
test fails with it. The child cancels the set-up at every task step until the body is
reached (see its docstring), so a new await in an opener's set-up is covered too.
"""

from __future__ import annotations

import importlib.util
import json
import subprocess
import sys
from pathlib import Path

import pytest
from _kinds import opencl_missing

CHILD = Path(__file__).with_name("_cancel_child.py")
HARD_LIMIT = 120.0  # seconds a child may take in all before it is a hang
GRACE = 1.0  # the child's openers' grace period (_cancel_child.GRACE)
SLACK = 5.0  # on top of the grace: a kill and reap on a loaded 2-core host
# An opener whose work in flight can't be withdrawn (OpenCL: the driver runs every launch
# it was handed) closes once that work is done, however it was cancelled: its bound adds
# twice the longest "drain" of the same work (from its last enqueue to its last fence, no
# close in it), timed in the same child beside the runs: the bound follows the host's load
# (a busy 2-core host stretches the kernels) instead of assuming an idle one, and a close
# slower than its work still fails.
UNCANCELLABLE = {"opencl"}

OPENERS = ["devices", "devices_read", "process", "batcher", "serve"]
if importlib.util.find_spec("ray") is not None:
    OPENERS.append("ray")
if importlib.util.find_spec("hypercorn") is None:
    OPENERS.remove("serve")
if opencl_missing() is None:  # two hcqa devices on opencl:0 beside cpu:0
    OPENERS.append("opencl")


def _start(name: str) -> subprocess.Popen[str]:
    return subprocess.Popen(
        [sys.executable, str(CHILD), name, str(HARD_LIMIT)],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        cwd=CHILD.parent,
    )


@pytest.fixture(scope="module")
def children() -> dict[str, tuple[int, str, str]]:
    """Every opener's child, run in parallel: name -> (status, stdout, stderr)."""
    procs = {name: _start(name) for name in OPENERS}
    out: dict[str, tuple[int, str, str]] = {}
    for name, proc in procs.items():
        try:
            stdout, stderr = proc.communicate(timeout=HARD_LIMIT + 30)
        except subprocess.TimeoutExpired:
            proc.kill()
            stdout, stderr = proc.communicate()
        out[name] = (proc.returncode, stdout, stderr)
    return out


@pytest.mark.parametrize("name", OPENERS)
def test_every_close_ends(children: dict[str, tuple[int, str, str]], name: str) -> None:
    """Set-up cancelled at each step, a deadline in the body, the close cancelled at
    several of its steps, one Ctrl-C: each leaves within the grace period (plus slack),
    and nothing of the block (threads of hcqa) is left behind."""
    status, stdout, stderr = children[name]
    assert status == 0, f"{name}: the child failed or hung (status {status}):\n{stderr[-6000:]}"
    runs = [json.loads(line) for line in stdout.splitlines() if line.startswith("{")]
    done = runs.pop()
    assert done["done"] == name
    names = [r["run"] for r in runs]
    setups = [r for r in runs if r["run"].startswith("setup-")]
    assert setups[-1]["reached"] and not any(r["reached"] for r in setups[:-1])
    assert len(setups) >= 3, names  # the set-up has awaits of its own, each was cancelled
    assert "body" in names and "sigint" in names
    exits = [r for r in runs if r["run"].startswith("exit-")]
    assert exits[0]["cancelled"], exits  # the first step of the close was cancelled
    drains = [r["leave"] for r in runs if r["run"] == "drain"]
    assert len(drains) == (2 if name in UNCANCELLABLE else 0), names
    bound = GRACE + SLACK + 2 * max(drains, default=0.0)
    slow = [r for r in runs if r["run"] != "drain" and not r["leave"] <= bound]
    assert not slow, f"{name}: closes slower than {bound:.2f} s (grace, slack, drain): {slow}"
    left = [t for t in done["threads"] if t.startswith("hcqa")]
    assert not left, f"{name}: threads outlive the block: {left}"
