"""Ray's primitive costs on a local 2-node cluster (``bench.bench_multihost --primitives``).

What a transport between hcqa nodes could be built from, each measured on this host, every
variant of one question interleaved sample by sample (A, B, A, B, ...) so host load hits all:

1. ``ray.get(a.f.remote(x))`` to a sync actor on node_a (the driver's node) vs node_b;
2. the same to an ``async def`` actor;
3. a chain ``ray.get(b.f.remote(a.f.remote(x)))`` (a on node_a, b on node_b: the driver is not
   on the path between them) vs two separate round trips;
4. waking a trio task from an ObjectRef: ``ref.future().add_done_callback`` ->
   ``TrioToken.run_sync_soon`` -> ``trio.Event`` vs ``trio.to_thread.run_sync(ray.get, ref)``;
5. a Ray Compiled Graph of one actor (driver -> actor -> driver), actor on node_b vs node_a;
6. calls/s with 10 calls in flight to one actor on node_b, one item per call vs a list of 10.

Every ``f`` returns its argument (an echo), so an item crosses twice per round trip. Items: 16
float32 and 4 MiB of float32. The cluster: ``ray.cluster_utils.Cluster``, head node with
resource ``node_a`` and a second node with ``node_b``, 2 CPUs and 300 MB of object store each,
no dashboard; the driver connects to the head. Actors take ``num_cpus=0`` and one unit of
their node's resource, so placement is exact.
"""

from __future__ import annotations

import collections
import importlib
import logging
import os
import time
import traceback
from collections.abc import Callable, Sequence
from functools import partial
from pathlib import Path
from typing import Any

import numpy as np

from bench._util import markdown_table, percentile

SMALL = 16
BIG = (4 << 20) // 4
IN_FLIGHT = 10
STORE_BYTES = 300 * 1024 * 1024


class Echo:
    """A sync actor: ``f`` returns its argument."""

    def f(self, x: Any) -> Any:
        return x

    def node(self) -> str:
        return str(importlib.import_module("ray").get_runtime_context().get_node_id())

    def pid(self) -> int:
        return os.getpid()


class AsyncEcho:
    """The same with ``async def`` methods (Ray runs them on the actor's asyncio loop)."""

    async def f(self, x: Any) -> Any:
        return x

    async def node(self) -> str:
        return str(importlib.import_module("ray").get_runtime_context().get_node_id())


def start_cluster() -> tuple[Any, Any]:
    """(ray module, Cluster): the 2-node cluster, the driver connected to its head."""
    ray: Any = importlib.import_module("ray")
    cluster_utils: Any = importlib.import_module("ray.cluster_utils")
    common = {"num_cpus": 2, "object_store_memory": STORE_BYTES}
    cluster = cluster_utils.Cluster(
        initialize_head=True,
        head_node_args={**common, "resources": {"node_a": 10}, "include_dashboard": False},
    )
    cluster.add_node(**common, resources={"node_b": 10})
    ray.init(address=cluster.address, log_to_driver=False, logging_level=logging.WARNING)
    cluster.wait_for_nodes()
    return ray, cluster


def remove_ray_semaphores(pids: Sequence[int]) -> None:
    """Remove the named semaphores Ray's shared-memory channels leave in /dev/shm after
    shutdown (``sem.hdr<pid>-*``, ``sem.obj<pid>-*``) for those of ``pids`` that have ended."""
    shm = Path("/dev/shm")
    for pid in pids:
        try:
            stat = Path(f"/proc/{pid}/stat").read_text()
        except OSError:
            stat = ""
        if not stat or stat[stat.rindex(")") + 2] == "Z":  # gone, or a zombie
            for kind in ("hdr", "obj"):
                for leftover in shm.glob(f"sem.{kind}{pid}-*"):
                    leftover.unlink(missing_ok=True)


def _tree(root: int) -> list[int]:
    """Every live descendant of ``root`` (from /proc)."""
    children: dict[int, list[int]] = {}
    for name in os.listdir("/proc"):
        if name.isdigit():
            try:
                stat = Path(f"/proc/{name}/stat").read_text()
            except OSError:
                continue
            children.setdefault(int(stat[stat.rindex(")") + 2 :].split()[1]), []).append(int(name))
    out, stack = [], [root]
    while stack:
        for child in children.get(stack.pop(), []):
            out.append(child)
            stack.append(child)
    return out


def sample_interleaved(
    fns: Sequence[Callable[[], object]], n: int, warmup: int
) -> list[list[float]]:
    """Seconds per call of each fn, interleaved: fn0, fn1, ..., fn0, fn1, ..."""
    for _ in range(warmup):
        for fn in fns:
            fn()
    out: list[list[float]] = [[] for _ in fns]
    for _ in range(n):
        for i, fn in enumerate(fns):
            t = time.perf_counter()
            fn()
            out[i].append(time.perf_counter() - t)
    return out


Row = list[object]


def _row(what: str, size: str, samples: Sequence[float]) -> Row:
    return [
        what,
        size,
        f"{percentile(samples, 50) * 1e6:,.0f}",
        f"{percentile(samples, 99) * 1e6:,.0f}",
        len(samples),
    ]


def _items(n_small: int, n_big: int) -> list[tuple[str, np.ndarray[Any, Any], int]]:
    return [
        ("16 f32", np.arange(SMALL, dtype=np.float32), n_small),
        ("4 MiB", np.arange(BIG, dtype=np.float32), n_big),
    ]


def _check(got: Any, x: np.ndarray[Any, Any]) -> None:
    np.testing.assert_array_equal(np.asarray(got), x)


def call_echo(ray: Any, actor: Any, x: Any) -> object:
    return ray.get(actor.f.remote(x))


def _chain(ray: Any, a: Any, b: Any, x: Any) -> object:
    return ray.get(b.f.remote(a.f.remote(x)))


def _two_trips(ray: Any, a: Any, b: Any, x: Any) -> object:
    return ray.get(b.f.remote(ray.get(a.f.remote(x))))


def execute_copy(ray: Any, cdag: Any, x: Any) -> object:
    # Ray returns a zero-copy view of the channel buffer, locked while it lives: copy it
    return np.array(ray.get(cdag.execute(x)))


def round_trips(ray: Any, n_small: int, n_big: int) -> list[Row]:
    """Questions 1-3: sync and async actors on either node, a chain vs two round trips."""
    sync, asyn = ray.remote(Echo), ray.remote(AsyncEcho)

    def on(cls: Any, node: str) -> Any:
        return cls.options(num_cpus=0, resources={node: 1}).remote()

    sa, sb, aa, ab = on(sync, "node_a"), on(sync, "node_b"), on(asyn, "node_a"), on(asyn, "node_b")
    nodes = ray.get([h.node.remote() for h in (sa, sb, aa, ab)])
    assert nodes[0] == nodes[2] != nodes[1] == nodes[3], nodes
    rows: list[Row] = []
    for size, x, n in _items(n_small, n_big):
        for h in (sa, sb, aa, ab):
            _check(ray.get(h.f.remote(x)), x)
        _check(ray.get(sb.f.remote(sa.f.remote(x))), x)
        fns: list[Callable[[], object]] = [
            *(partial(call_echo, ray, h, x) for h in (sa, sb, aa, ab)),
            partial(_chain, ray, sa, sb, x),
            partial(_two_trips, ray, sa, sb, x),
        ]
        s = sample_interleaved(fns, n, warmup=max(10, n // 10))
        rows += [
            _row("1. sync actor, node_a (driver's node)", size, s[0]),
            _row("1. sync actor, node_b", size, s[1]),
            _row("2. async actor, node_a", size, s[2]),
            _row("2. async actor, node_b", size, s[3]),
            _row("3. chain a(node_a) -> b(node_b), one ray.get", size, s[4]),
            _row("3. two round trips: get(a), then get(b)", size, s[5]),
        ]
    for h in (sa, sb, aa, ab):
        ray.kill(h)
    return rows


def trio_wakes(ray: Any, n_small: int, n_big: int) -> list[Row]:
    """Question 4: a call to a sync actor on node_b, awaited from trio two ways."""
    import trio

    b = ray.remote(Echo).options(num_cpus=0, resources={"node_b": 1}).remote()
    rows: list[Row] = []

    async def main() -> None:
        token = trio.lowlevel.current_trio_token()

        async def by_callback(x: np.ndarray[Any, Any]) -> Any:
            ev = trio.Event()
            ref = b.f.remote(x)
            ref.future().add_done_callback(lambda _f: token.run_sync_soon(ev.set))
            await ev.wait()
            return ray.get(ref)  # ready: only the deserialisation

        async def by_thread(x: np.ndarray[Any, Any]) -> Any:
            return await trio.to_thread.run_sync(ray.get, b.f.remote(x))

        for size, x, n in _items(n_small, n_big):
            for _ in range(max(10, n // 10)):
                _check(await by_callback(x), x)
                _check(await by_thread(x), x)
            s: list[list[float]] = [[], []]
            for _ in range(n):
                for i, fn in enumerate((by_callback, by_thread)):
                    t = time.perf_counter()
                    await fn(x)
                    s[i].append(time.perf_counter() - t)
            rows.append(_row("4. node_b call, trio woken by future callback", size, s[0]))
            rows.append(_row("4. node_b call, trio.to_thread(ray.get)", size, s[1]))

    trio.run(main)
    ray.kill(b)
    return rows


def compiled_hops(ray: Any, n_small: int, n_big: int) -> list[Row]:
    """Question 5: a one-actor compiled graph, actor on node_b vs node_a."""
    InputNode: Any = importlib.import_module("ray.dag").InputNode
    cls = ray.remote(Echo)
    rows: list[Row] = []
    for size, x, n in _items(n_small, n_big):
        graphs = []
        for node in ("node_b", "node_a"):
            actor = cls.options(num_cpus=0, resources={node: 1}).remote()
            with InputNode() as inp:
                dag = actor.f.bind(inp)
            graphs.append((actor, dag.experimental_compile(_max_inflight_executions=IN_FLIGHT)))
        for _, cdag in graphs:
            # a zero-copy view of the channel buffer, locked while it lives: copy, then drop
            _check(np.array(ray.get(cdag.execute(x))), x)

        s = sample_interleaved(
            [partial(execute_copy, ray, g, x) for _, g in graphs], n, max(10, n // 10)
        )
        rows.append(_row("5. compiled graph, driver -> b(node_b) -> driver", size, s[0]))
        rows.append(_row("5. compiled graph, driver -> a(node_a) -> driver", size, s[1]))
        for actor, cdag in graphs:
            cdag.teardown()
            ray.kill(actor)
    return rows


def compiled_chain(ray: Any, n_small: int, n_big: int) -> list[Row]:
    """The peer in small: a 4-actor compiled chain, 2 on node_a then 2 on node_b
    (``b2(b1(a2(a1(x))))``), sequential latency and items/s with 10 in flight."""
    InputNode: Any = importlib.import_module("ray.dag").InputNode
    cls = ray.remote(Echo)
    actors = [
        cls.options(num_cpus=0, resources={n: 1}).remote()
        for n in ("node_a", "node_a", "node_b", "node_b")
    ]
    with InputNode() as inp:
        node = inp
        for actor in actors:
            node = actor.f.bind(node)
    cdag = node.experimental_compile(_max_inflight_executions=IN_FLIGHT)
    rows: list[Row] = []
    try:
        for size, x, n in _items(n_small, n_big):
            _check(np.array(ray.get(cdag.execute(x))), x)
            s = sample_interleaved([partial(execute_copy, ray, cdag, x)], n, max(10, n // 10))
            rows.append(_row("7. compiled chain a1,a2 (node_a) -> b1,b2 (node_b)", size, s[0]))
            k = n * 2
            window: collections.deque[Any] = collections.deque()
            t = time.perf_counter()
            for _ in range(k):
                if len(window) >= IN_FLIGHT:
                    np.array(ray.get(window.popleft()))
                window.append(cdag.execute(x))
            while window:
                np.array(ray.get(window.popleft()))
            rate = k / (time.perf_counter() - t)
            rows.append(["7. same chain, 10 in flight", size, f"{rate:,.0f} items/s", "", k])
    except Exception:
        traceback.print_exc()
        raise
    finally:
        cdag.teardown(kill_actors=True)
        for actor in actors:
            ray.kill(actor)
    return rows


def throughput(ray: Any, calls: int) -> list[Row]:
    """Question 6: calls/s and items/s with 10 calls in flight to one actor on node_b."""
    b = ray.remote(Echo).options(num_cpus=0, resources={"node_b": 1}).remote()
    one = np.arange(SMALL, dtype=np.float32)
    ten = [one + i for i in range(10)]
    big = np.arange(BIG, dtype=np.float32)
    bigs = [big + i for i in range(10)]  # distinct arrays: pickle sends a repeated one once

    def flood(arg: Any, n: int, depth: int) -> float:
        window: collections.deque[Any] = collections.deque()
        t = time.perf_counter()
        for _ in range(n):
            if len(window) >= depth:
                ray.get(window.popleft())
            window.append(b.f.remote(arg))
        while window:
            ray.get(window.popleft())
        return n / (time.perf_counter() - t)

    got = ray.get(b.f.remote(ten))
    assert len(got) == 10 and all(np.array_equal(g, w) for g, w in zip(got, ten, strict=True))
    big_calls = max(20, calls // 50)
    cases = [
        ("16 f32, 1 item/call, 10 in flight", one, calls, 1, IN_FLIGHT),
        ("16 f32, 10 items/call, 10 in flight", ten, calls, 10, IN_FLIGHT),
        ("16 f32, 1 item/call, 1 in flight", one, calls // 4, 1, 1),
        ("4 MiB, 1 item/call, 10 in flight", big, big_calls, 1, IN_FLIGHT),
        ("4 MiB, 1 item/call, 2 in flight", big, big_calls, 1, 2),
        ("4 MiB, 1 item/call, 1 in flight", big, big_calls, 1, 1),
        ("4 MiB, 10 items/call, 1 in flight", bigs, max(10, big_calls // 2), 10, 1),
        ("4 MiB, 10 items/call, 2 in flight", bigs, max(10, big_calls // 2), 10, 2),
    ]
    rates: dict[str, list[float]] = {c[0]: [] for c in cases}
    for _ in range(3):  # rounds, interleaved
        for name, arg, n, _k, depth in cases:
            flood(arg, max(5, n // 10), depth)
            rates[name].append(flood(arg, n, depth))
    ray.kill(b)
    rows: list[Row] = []
    for name, _arg, n, k, _d in cases:
        med = float(np.median(rates[name]))
        rows.append(
            [f"6. {name}, node_b", "", f"{med:,.0f} calls/s", f"{med * k:,.0f} items/s", f"3 x {n}"]
        )
    return rows


def run(
    n_small: int = 300,
    n_big: int = 300,
    calls: int = 2000,
    only: Sequence[str] = ("rt", "trio", "cg", "tput", "cg4"),
) -> int:
    """Start the cluster, answer the chosen questions, print one table, shut down."""
    t0 = time.perf_counter()
    ray, cluster = start_cluster()
    print(
        f"cluster up in {time.perf_counter() - t0:.1f} s; ray {ray.__version__}; "
        f"load {os.getloadavg()[0]:.1f}",
        flush=True,
    )
    rows: list[Row] = []
    try:
        for key, fn in (
            ("rt", round_trips),
            ("trio", trio_wakes),
            ("cg", compiled_hops),
            ("cg4", compiled_chain),
        ):
            if key in only:
                t = time.perf_counter()
                rows += fn(ray, n_small, n_big)
                print(f"[{key} took {time.perf_counter() - t:.1f} s]", flush=True)
        if "tput" in only:
            rows += throughput(ray, calls)
    finally:
        print(markdown_table(["what", "item", "p50 µs", "p99 µs", "samples"], rows))
        started = _tree(os.getpid())
        ray.shutdown()
        cluster.shutdown()
        remove_ray_semaphores(started)
    print(f"(ran in {time.perf_counter() - t0:.1f} s)")
    return 0


if __name__ == "__main__":
    import argparse

    parser = argparse.ArgumentParser(description="Ray's primitive costs (2-node local cluster)")
    parser.add_argument(
        "only",
        nargs="*",
        default=["rt", "trio", "cg", "tput", "cg4"],
        help="rt (1-3), trio (4), cg (5), tput (6), cg4 (7); default all",
    )
    parser.add_argument("--samples", type=int, default=300, help="per variant and item size")
    parser.add_argument("--calls", type=int, default=2000, help="per throughput case and round")
    args = parser.parse_args()
    raise SystemExit(run(args.samples, args.samples, args.calls, args.only))
