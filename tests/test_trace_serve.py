"""A served model's trace: requests and batches on named tracks, linked to the kernels."""

from __future__ import annotations

import importlib.util
import itertools
import json
import time
from collections import Counter
from functools import partial
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import trio
from _kinds import opencl_missing

import hcqa
from hcqa.serve import Model, serve
from hcqa.trace import Tracer

pytest.importorskip("starlette")

_spec = importlib.util.spec_from_file_location(
    "hcqa_example_loadtest", Path(__file__).resolve().parents[1] / "examples" / "loadtest.py"
)
assert _spec is not None and _spec.loader is not None
loadtest = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(loadtest)

ROWS, WIDTH, CLIENTS, EACH = 4, 3, 8, 2
V2 = "POST /v2/models/doubler/infer"
PLAIN = "POST /infer (model doubler)"


def slow_double(out: np.ndarray, x: np.ndarray) -> None:
    time.sleep(0.004)  # a busy device: requests pile up behind a running batch
    np.multiply(x, 2, out=out)


def row_sums(out: np.ndarray, x: np.ndarray) -> None:
    np.sum(x, axis=1, out=out)


def slow_row_sums(out: np.ndarray, x: np.ndarray) -> None:
    time.sleep(0.004)
    np.sum(x, axis=1, out=out)


TWICE = """
__kernel void twice(__global float *out, __global const float *x, int n) {
    int i = get_global_id(0);
    if (i < n) out[i] = 2.0f * x[i];
}
"""
# the device ranges each batch's kernels show up as, by where the first stage runs
KERNELS = {"cpu": {"stage0", "stage1"}, "opencl": {"twice", "stage1"}}


async def _served_workload(path: Path, kind: str) -> int:
    """``CLIENTS`` clients x ``EACH`` requests (v2 and plain) to a two-device pipeline served
    as model 'doubler', traced to ``path``; returns how many were answered. Its first stage
    runs on ``cpu:0`` or, for ``kind`` opencl, as an OpenCL kernel on ``opencl:0``."""
    answered = 0
    with Tracer(path):
        async with hcqa.open_devices(f"{kind}:0", "cpu:1") as (d0, d1):
            if kind == "opencl":
                stages = [
                    hcqa.Stage(
                        device=d0,
                        program=d0.program("twice", TWICE),
                        vals=(ROWS * WIDTH,),
                        global_size=(ROWS * WIDTH, 1, 1),
                    ),
                    hcqa.Stage(device=d1, program=slow_row_sums, out_shape=(ROWS,)),
                ]
            else:
                stages = [
                    hcqa.Stage(device=d0, program=slow_double),
                    hcqa.Stage(device=d1, program=row_sums, out_shape=(ROWS,)),
                ]
            pipe = hcqa.Pipeline(stages, in_shape=(ROWS, WIDTH), depth=2)
            model = Model(name="doubler", pipeline=pipe, max_wait=0.005)
            async with trio.open_nursery() as nursery:
                port = await nursery.start(partial(serve, model, port=0, handle_signals=False))

                async def client(k: int) -> None:
                    nonlocal answered
                    async with await loadtest.Client.connect("127.0.0.1", port) as c:
                        for i in range(EACH):
                            x = np.full(WIDTH, k + i, np.float32)
                            if (k + i) % 2:
                                r = await c.request(
                                    "POST", "/infer", x.tobytes(), "application/octet-stream"
                                )
                                y = float(np.frombuffer(r.body, "<f4")[0])
                            else:
                                body = {
                                    "inputs": [
                                        {
                                            "name": "input",
                                            "shape": [1, WIDTH],
                                            "datatype": "FP32",
                                            "data": x.tolist(),
                                        }
                                    ]
                                }
                                r = await c.request(
                                    "POST", "/v2/models/doubler/infer", json.dumps(body)
                                )
                                y = r.json()["outputs"][0]["data"][0]
                            assert r.status == 200, r.body
                            assert y == 2 * WIDTH * (k + i)
                            answered += 1

                with trio.fail_after(30):
                    async with trio.open_nursery() as clients:
                        for k in range(CLIENTS):
                            clients.start_soon(client, k)
                nursery.cancel_scope.cancel()
    return answered


@pytest.fixture(
    scope="module",
    params=[
        "cpu",
        pytest.param(
            "opencl",
            marks=pytest.mark.skipif(opencl_missing() is not None, reason=str(opencl_missing())),
        ),
    ],
)
def served(
    request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory
) -> dict[str, Any]:
    path = tmp_path_factory.mktemp("served") / "serve.json"
    assert trio.run(_served_workload, path, request.param) == CLIENTS * EACH
    doc: dict[str, Any] = json.loads(path.read_text())
    doc["kind"] = request.param
    return doc


def _enclosing(ranges: list[dict[str, Any]], e: dict[str, Any]) -> dict[str, Any]:
    """The range on ``e``'s track that holds ``e``'s time (a flow's end is bound to it)."""
    hits = [
        r
        for r in ranges
        if (r["pid"], r["tid"]) == (e["pid"], e["tid"]) and r["ts"] <= e["ts"] <= r["ts"] + r["dur"]
    ]
    assert len(hits) == 1, (e, hits)
    return hits[0]


def test_requests_and_batches_are_on_tracks_named_by_endpoint_and_model(
    served: dict[str, Any],
) -> None:
    events = served["traceEvents"]
    names = {
        (e["pid"], e["tid"]): e["args"]["name"]
        for e in events
        if e["ph"] == "M" and e["name"] == "thread_name"
    }
    serve_ranges = [e for e in events if e["ph"] == "X" and e["cat"] == "serve"]
    requests = [e for e in serve_ranges if e["name"] == "doubler request"]
    batches = [e for e in serve_ranges if e["name"].startswith("doubler batch x")]
    assert len(requests) == CLIENTS * EACH
    assert Counter(e["args"]["endpoint"] for e in requests) == {V2: 8, PLAIN: 8}
    assert all(e["args"]["status"] == 200 for e in requests)
    for e in requests:  # each on a lane of its endpoint: "POST /v2/models/doubler/infer #2"
        assert names[e["pid"], e["tid"]].startswith(e["args"]["endpoint"] + " #")
    assert all(names[e["pid"], e["tid"]].startswith("model doubler batches #") for e in batches)
    for lane in {(e["pid"], e["tid"]) for e in serve_ranges}:  # a lane's ranges never overlap
        spans = sorted(
            (e["ts"], e["ts"] + e["dur"]) for e in serve_ranges if (e["pid"], e["tid"]) == lane
        )
        assert all(a[1] <= b[0] for a, b in itertools.pairwise(spans))
    # the connections' tasks are named by what they served, not trio's _run_handler
    http = [n for n in names.values() if n.startswith("http ")]
    assert len(http) == CLIENTS
    assert not [n for n in names.values() if "_run_handler" in n]
    assert [n for n in names.values() if n.startswith("batch of doubler")]


def test_a_request_links_to_its_batch_and_the_batch_to_its_kernels(
    served: dict[str, Any],
) -> None:
    events = served["traceEvents"]
    ranges = [e for e in events if e["ph"] == "X"]
    flows = [e for e in events if e["ph"] in "sf" and e["cat"] == "serve"]
    ends = {e["id"]: e for e in flows if e["ph"] == "f"}
    starts = [e for e in flows if e["ph"] == "s"]
    assert {e["id"] for e in starts} == set(ends)  # every arrow has both ends
    into: dict[int, list[dict[str, Any]]] = {}  # id(range) -> the ranges it points to
    by_id = {id(r): r for r in ranges}
    for s in starts:
        a, b = _enclosing(ranges, s), _enclosing(ranges, ends[s["id"]])
        assert s["ts"] <= ends[s["id"]]["ts"]
        into.setdefault(id(a), []).append(b)
    requests = [r for r in ranges if r["name"] == "doubler request"]
    seen_batches = set()
    for req in requests:
        (batch,) = into[id(req)]  # one arrow: to its batch
        assert batch["name"].startswith("doubler batch x")
        seen_batches.add(id(batch))
        kernels = [r for r in into[id(batch)] if r["cat"] == "device"]
        assert kernels, batch  # and from the batch to its device work
        number = batch["args"]["batch"]
        assert all(k["args"]["batch"] == number for k in kernels)
        tagged = {
            r["name"]
            for r in ranges
            if r["cat"] == "device" and (r.get("args") or {}).get("batch") == number
        }
        assert KERNELS[served["kind"]] <= tagged  # both stages' kernels, one range each
    # every batch's request count is the arrows into it, and they add up to every request
    batches = [by_id[b] for b in seen_batches]
    assert sum(b["args"]["requests"] for b in batches) == len(requests)
    assert max(b["args"]["requests"] for b in batches) > 1  # batches really formed


def test_the_plot_names_the_served_rows_and_ties_requests_to_batches_and_kernels(
    served: dict[str, Any], tmp_path: Path
) -> None:
    pytest.importorskip("matplotlib")
    from hcqa.trace import plot

    info = plot(served, tmp_path / "served.png")
    assert (tmp_path / "served.png").stat().st_size > 0
    assert info.served == (
        f"{PLAIN}  8 requests",
        f"{V2}  8 requests",
        info.served[2],
    )
    assert info.served[2].startswith("model doubler batches  ")
    assert not [r for r in info.rows if "_run_handler" in r]
    assert 1 <= len(info.chains) <= 6
    colors = {c.color for c in info.chains}
    assert len(colors) == len(info.chains)  # each chain a colour of its own
    for c in info.chains:
        assert c.batch.startswith("doubler batch x")
        assert c.requests == int(c.batch.rpartition("x")[2])  # every request of it, tied
        assert KERNELS[served["kind"]] <= set(c.kernels)
        assert f"batch {c.number}: {c.requests} requests -> {len(c.kernels)} device ranges" in (
            info.legend
        )
