"""Multi-host benchmark: hcqa over Ray vs Ray Compiled Graphs, stages split 2 + 2.

Run from the repository root (on a shared host, one benchmark at a time)::

    python -m bench.bench_multihost              # 3 rounds per side, interleaved (< 6 min)
    python -m bench.bench_multihost --quick      # 1 round per side, fewer items (< 2 min)
    python -m bench.bench_multihost --primitives [rt trio cg tput cg4]   # Ray's primitive costs

The cluster: a local 2-node ``ray.cluster_utils.Cluster`` (head node with custom resource
``node_a``, a second node with ``node_b``; 2 CPUs and 300 MB of object store each, no
dashboard), the driver connected to the head, so the driver sits on node_a. Each side of
each round runs in a child process of its own that starts its own cluster and shuts it
down after: every side gets a fresh Ray driver, and nothing one side leaves behind (idle
workers, actors being killed, objects being freed) is counted in the other's CPU or
latency. Starting a cluster takes ~10 s of the round, outside every measurement.

The pipeline: 4 stages, each the trivial numpy stage ``out = inp + 1`` (so a result is
``x + 4``, checked against numpy for every item: a wrong result fails the bench loudly),
stages 1-2 on node_a and 3-4 on node_b.

* **hcqa**: ``open_ray_pipeline(["hcqa.workers:add_one"] * 4, placement=[a, a, b, b],
  depth=10)`` with ``a``, ``b`` the two nodes' ids (``hcqa.ray``; skipped, and said so,
  where it is not importable).
* **Ray Compiled Graphs**: 4 actors with the same stage, pinned with one unit of
  ``node_a`` / ``node_b`` each, ``b2(b1(a2(a1(inp))))``,
  ``experimental_compile(_max_inflight_executions=10)``.

Measured per side, for 16 float32 and 4 MiB items: sequential latency p50 and p99; items/s
with 10 in flight (10 concurrent callers / a window of 10 outstanding ``execute`` refs);
CPU over 2 s idle (pipeline open, nothing submitted) of every process of the side -- for
hcqa the driver, the segment actors and their process-pipeline workers, for Ray the driver
and its 4 actors -- with Ray's own daemons (GCS, raylets, idle workers, ...) reported
apart. Each round pairs one hcqa run with one Ray run (the side that goes first
alternates); ratios are taken per round and their median is reported. Targets: p50
<= 0.5x Ray CG's, items/s >= 2x Ray CG's, idle CPU of hcqa's processes < 5 % of a core.
"""

from __future__ import annotations

import argparse
import collections
import importlib
import importlib.util
import json
import os
import signal
import subprocess
import sys
import time
import traceback
from collections.abc import Sequence
from functools import partial
from pathlib import Path
from typing import Any

import numpy as np
import numpy.typing as npt

from bench._multihost_report import (
    _per_round,
    report,
)
from bench._procs import (
    CpuWindow,
    Plan,
    descendants,
    emit,
    emit_latency,
    guarded,
    start_time,
)
from bench._ray_primitives import (
    Echo,
    call_echo,
    execute_copy,
    remove_ray_semaphores,
    sample_interleaved,
    start_cluster,
)
from bench._util import percentile

ROOT = Path(__file__).resolve().parents[1]
SMALL = 16  # float32 items
BIG = (4 << 20) // 4  # float32 items: 4 MiB
STAGES = 4
IN_FLIGHT = 10
STAGE = "hcqa.workers:add_one"
NODES = ("node_a", "node_a", "node_b", "node_b")  # the placement of the 4 stages


FULL = Plan("full", 3, 50, 400, 60, 1500, 60, 2.0, 100.0)
QUICK = Plan("quick", 1, 20, 150, 20, 400, 20, 2.0, 80.0)
PLANS = {p.name: p for p in (FULL, QUICK)}


class _Stage:
    """The Ray CG side's actor: the same trivial numpy stage as ``hcqa.workers:add_one``."""

    def pid(self) -> int:
        return os.getpid()

    def fwd(self, x: npt.NDArray[np.float32]) -> npt.NDArray[np.float32]:
        return x + 1


def _inputs(n: int) -> list[npt.NDArray[np.float32]]:
    """A few distinct inputs used in turn, so a stale or foreign result cannot pass."""
    base = np.arange(n, dtype=np.float32) % 1000
    return [base + 1000 * k for k in range(4)]


def _check(y: Any, x: npt.NDArray[np.float32]) -> None:
    if not np.array_equal(np.asarray(y), x + STAGES):
        raise AssertionError(f"wrong result: expected x + {STAGES}, got {np.asarray(y)[:4]}...")


def _node_ids(ray: Any) -> dict[str, str]:
    """{"node_a": node id, "node_b": node id} from the alive nodes' resources."""
    ids = {}
    for node in ray.nodes():
        if node.get("Alive"):
            for name in ("node_a", "node_b"):
                if name in node.get("Resources", {}):
                    ids[name] = str(node["NodeID"])
    return ids


def _is_hcqa_worker(pid: int) -> bool:
    try:
        return b"hcqa.processes" in Path(f"/proc/{pid}/cmdline").read_bytes()
    except OSError:
        return False


def _groups(me: int, hosts: Sequence[int]) -> dict[str, list[int]]:
    """The side's processes vs Ray's daemons: the driver, the actors hosting stages, the
    process-pipeline workers (children of an actor, or of the driver for a segment it
    runs itself); everything else the driver started is Ray's (GCS, raylets, idle workers)."""
    everyone = descendants(me)
    actors = [p for p in hosts if p != me]
    workers = [p for a in actors for p in descendants(a)]
    workers += [p for p in everyone if p not in workers and _is_hcqa_worker(p)]
    ours = {me, *actors, *workers}
    return {
        "driver": [me],
        "actors": actors,
        "workers": workers,
        "ray-daemons": [p for p in everyone if p not in ours],
    }


def _emit_cpu(groups: dict[str, list[int]], seconds: float) -> None:
    window = CpuWindow(groups)
    time.sleep(seconds)
    _, pct = window.stop()
    emit("procs", {k: len(v) for k, v in groups.items()})
    emit("idle_cpu", sum(v for k, v in pct.items() if k != "ray-daemons"))
    for k, v in pct.items():
        emit(f"idle_cpu:{k}", v)


# -- the Ray Compiled Graphs side ----------------------------------------------------------


def _cg_round(ray: Any, plan: Plan) -> None:
    InputNode: Any = importlib.import_module("ray.dag").InputNode
    me = os.getpid()
    stage: Any = ray.remote(_Stage)
    actors = [stage.options(num_cpus=0, resources={n: 1}).remote() for n in NODES]
    pids = ray.get([a.pid.remote() for a in actors])
    with InputNode() as inp:
        node = inp
        for actor in actors:
            node = actor.fwd.bind(node)
    t = time.perf_counter()
    cdag = node.experimental_compile(_max_inflight_executions=IN_FLIGHT)
    emit("setup_s", time.perf_counter() - t)

    def get(ref: Any) -> npt.NDArray[np.float32]:
        # Ray returns a zero-copy view of its channel buffer, locked while the view
        # lives (holding it blocks the next read): copy what is kept
        return np.array(ray.get(ref))

    for tag, n, lat_n, tput_n in (
        ("small", SMALL, plan.lat_small, plan.tput_small),
        ("big", BIG, plan.lat_big, plan.tput_big),
    ):
        xs = _inputs(n)
        for i in range(plan.warmup // (1 if n == SMALL else 5)):
            _check(get(cdag.execute(xs[i % 4])), xs[i % 4])
        samples = []
        for i in range(lat_n):
            x = xs[i % 4]
            t = time.perf_counter()
            y = get(cdag.execute(x))
            samples.append(time.perf_counter() - t)
            _check(y, x)
        emit_latency(tag, samples)

        window: collections.deque[tuple[Any, npt.NDArray[np.float32]]] = collections.deque()
        t = time.perf_counter()
        for i in range(tput_n):
            if len(window) >= IN_FLIGHT:
                ref, x = window.popleft()
                _check(get(ref), x)
            window.append((cdag.execute(xs[i % 4]), xs[i % 4]))
        while window:
            ref, x = window.popleft()
            _check(get(ref), x)
        emit(f"tput_{tag}", tput_n / (time.perf_counter() - t))
        if tag == "small":
            _emit_cpu(_groups(me, pids), plan.idle_s)
    emit("teardown_s", guarded(lambda: cdag.teardown(kill_actors=True)))
    _floors(ray, plan)


def _floors(ray: Any, plan: Plan) -> None:
    """What one cross-node round trip costs through Ray (driver -> node_b -> driver), the
    least a 2 + 2 pipeline whose driver sits on node_a can pay: a one-actor compiled graph
    and a plain sync actor call, interleaved."""
    InputNode: Any = importlib.import_module("ray.dag").InputNode
    echo: Any = ray.remote(Echo)
    b, c = (echo.options(num_cpus=0, resources={"node_b": 1}).remote() for _ in range(2))
    with InputNode() as inp:
        dag = c.f.bind(inp)
    cdag = dag.experimental_compile()
    for tag, n, count in (("small", SMALL, plan.lat_small), ("big", BIG, plan.lat_big)):
        x = _inputs(n)[0]
        fns = [partial(execute_copy, ray, cdag, x), partial(call_echo, ray, b, x)]
        cg_hop, call = sample_interleaved(fns, count, warmup=max(5, count // 10))
        emit(f"floor_cg_{tag}", percentile(cg_hop, 50) * 1e6)
        emit(f"floor_call_{tag}", percentile(call, 50) * 1e6)
    emit("floor_teardown_s", guarded(cdag.teardown))
    for actor in (b, c):
        ray.kill(actor)


# -- the hcqa side --------------------------------------------------------------------------


async def _caller(pipe: Any, xs: Sequence[npt.NDArray[np.float32]], left: list[int]) -> None:
    """Items until ``left[0]`` (shared by the callers) runs out; every result checked."""
    while left[0] > 0:
        left[0] -= 1
        x = xs[left[0] % 4]
        _check(await pipe(x), x)


async def _hcqa_round(ray: Any, plan: Plan) -> None:
    import trio

    open_ray_pipeline: Any = importlib.import_module("hcqa.ray").open_ray_pipeline
    me = os.getpid()
    ids = _node_ids(ray)
    placement = [ids[n] for n in NODES]

    for tag, n, lat_n, tput_n in (
        ("small", SMALL, plan.lat_small, plan.tput_small),
        ("big", BIG, plan.lat_big, plan.tput_big),
    ):
        xs = _inputs(n)
        t = time.perf_counter()
        async with open_ray_pipeline(
            [STAGE] * STAGES,
            placement=placement,
            in_shape=(n,),
            dtype="float32",
            depth=IN_FLIGHT,
            hang_limit=30.0,
        ) as pipe:
            if tag == "small":
                emit("setup_s", time.perf_counter() - t)
            for i in range(plan.warmup // (1 if n == SMALL else 5)):
                _check(await pipe(xs[i % 4]), xs[i % 4])
            samples = []
            for i in range(lat_n):
                x = xs[i % 4]
                t = time.perf_counter()
                y = await pipe(x)
                samples.append(time.perf_counter() - t)
                _check(y, x)
            emit_latency(tag, samples)

            left = [tput_n]
            t = time.perf_counter()
            async with trio.open_nursery() as nursery:
                for _ in range(IN_FLIGHT):
                    nursery.start_soon(_caller, pipe, xs, left)
            emit(f"tput_{tag}", tput_n / (time.perf_counter() - t))
            if tag == "small":
                stats = pipe.statistics()
                hosts = list(stats.hosts)
                emit("segments", ["driver" if loc else "actor" for loc in stats.local])
                await trio.to_thread.run_sync(_emit_cpu, _groups(me, hosts), plan.idle_s)
            t = time.perf_counter()
        if tag == "big":
            emit("teardown_s", time.perf_counter() - t)


# -- one side in a child process ------------------------------------------------------------


def child_main(side: str, plan: Plan) -> None:
    """One side's round; exits 1 (after its traceback and an ``error`` line) on any error,
    a wrong result included."""
    me = os.getpid()
    t = time.perf_counter()
    ray, cluster = start_cluster()
    emit("init_s", time.perf_counter() - t)
    emit("ray_pids", [[p, start_time(p)] for p in descendants(me)])
    code = 1
    try:
        if side == "cg":
            _cg_round(ray, plan)
        else:
            import trio

            trio.run(_hcqa_round, ray, plan)
        emit("done", True)
        code = 0
    except BaseException as exc:
        traceback.print_exc()
        emit("error", f"{type(exc).__name__}: {exc}"[:300])
    finally:
        emit("ray_pids", [[p, start_time(p)] for p in descendants(me)])
        emit("shutdown_s", guarded(lambda: (ray.shutdown(), cluster.shutdown())))
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(code)  # a hung Ray thread must not hold the process at exit


def run_child(side: str, plan: Plan) -> dict[str, Any]:
    """One round of ``side`` in a child process (its own session); what it reported."""
    cmd = [sys.executable, "-m", "bench.bench_multihost", "--child", side, "--plan", plan.name]
    # a cross-node compiled graph's actors outlive teardown() (30 s each by default, then
    # force-killed): wait 1 s each instead; the table reports how long teardown took
    env = {**os.environ, "RAY_CGRAPH_teardown_timeout": "1"}
    proc = subprocess.Popen(
        cmd,
        cwd=ROOT,
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        start_new_session=True,
    )
    try:
        out, err = proc.communicate(timeout=plan.child_timeout_s)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        out, err = proc.communicate()
        err += f"\n[bench] {side} round timed out after {plan.child_timeout_s:.0f} s".encode()
    results: dict[str, Any] = {}
    pids: list[list[int]] = []
    for line in out.decode(errors="replace").splitlines():
        if line.startswith("{"):
            item = json.loads(line)
            pids += item.pop("ray_pids", [])
            results.update(item)
    try:
        os.killpg(proc.pid, signal.SIGKILL)  # whatever of its session is left
    except ProcessLookupError:
        pass
    for pid, started in pids:  # Ray's daemons start sessions of their own
        if start_time(pid) == started:
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
    remove_ray_semaphores([pid for pid, _ in pids])
    if "done" not in results:
        tail = err.decode(errors="replace").strip().splitlines()[-12:]
        what = results.get("error") or " / ".join(tail)
        results["error"] = f"rc={proc.returncode}: {what}"
    return results


# -- the parent side: rounds, per-round ratios, the table -----------------------------------


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0] if __doc__ else None)
    parser.add_argument("--quick", action="store_true", help="1 round per side, fewer items")
    parser.add_argument("--rounds", type=int, default=None, help="rounds per side")
    parser.add_argument("--no-hcqa", action="store_true", help="the Ray CG side only")
    parser.add_argument(
        "--primitives",
        nargs="*",
        metavar="Q",
        help="Ray's primitive costs instead: rt trio cg tput cg4 (default all)",
    )
    parser.add_argument("--samples", type=int, default=300, help="--primitives: per variant")
    parser.add_argument("--child", choices=("hcqa", "cg"), help=argparse.SUPPRESS)
    parser.add_argument("--plan", choices=tuple(PLANS), default="full", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if importlib.util.find_spec("ray") is None:
        print("bench_multihost needs Ray: pip install -e '.[ray]'")
        return 1
    if args.child:
        child_main(args.child, PLANS[args.plan])
        return 0
    if args.primitives is not None:
        from bench import _ray_primitives

        only = args.primitives or ["rt", "trio", "cg", "tput", "cg4"]
        return _ray_primitives.run(args.samples, args.samples, only=only)

    plan = QUICK if args.quick else FULL
    rounds = args.rounds or plan.rounds
    with_hcqa = not args.no_hcqa and importlib.util.find_spec("hcqa.ray") is not None
    note = "" if with_hcqa or args.no_hcqa else " (hcqa.ray not importable: hcqa side skipped)"
    print(
        f"# bench_multihost{' --quick' if args.quick else ''}: 4 stages (out = inp + 1), 2 on "
        f"node_a + 2 on node_b of a local 2-node Ray cluster (one per side and round), "
        f"{rounds} round(s) per side, interleaved; {os.cpu_count()} CPUs, load "
        f"{os.getloadavg()[0]:.1f}{note}\n"
    )
    started = time.perf_counter()
    hc: list[dict[str, Any]] = []
    cg: list[dict[str, Any]] = []
    failed = False
    for r in range(rounds):
        for side in ("hcqa", "cg") if r % 2 == 0 else ("cg", "hcqa"):
            if side == "hcqa" and not with_hcqa:
                continue
            res = run_child(side, plan)
            (hc if side == "hcqa" else cg).append(res)
            if "error" in res:
                failed = True
                print(f"[round {r + 1}, {side}] {res['error']}", file=sys.stderr)
    segments = next((r["segments"] for r in hc if "segments" in r), None)
    if segments:
        print(f"hcqa segments: {' + '.join(segments)} (node_a, node_b)")
    for label, rounds_of in (("hcqa", hc), ("CG", cg)):
        procs = next((r["procs"] for r in rounds_of if "procs" in r), None)
        if procs:
            print(f"{label} processes counted: {', '.join(f'{k} {v}' for k, v in procs.items())}")
    print()
    ok = report(hc, cg)
    print()
    print(_per_round("hcqa rounds", hc))
    print(_per_round("CG rounds", cg))
    print(f"\n(ran in {time.perf_counter() - started:.0f} s, load {os.getloadavg()[0]:.1f})")
    if failed:
        print("A round failed (a wrong result or an error above): the bench FAILED.")
        return 2
    return 0 if ok or args.quick or not with_hcqa else 1


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
