"""Ray pipelines (hcqa.ray) on a local three-node Ray cluster on this one machine.

Skipped when ``ray`` is not installed (it is the optional ``ray`` extra). One
cluster for the module (a head node with resource ``head``, nodes with ``b`` and
``c``); the killed-node test adds and removes a node of its own. Cost on a 2-core host:
~15 s for the cluster, ~1-3 s per pipeline opened (an actor per remote segment, a
worker process per stage).
"""

from __future__ import annotations

import asyncio
import os
import threading
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import trio
import trio.testing

ray = pytest.importorskip("ray", reason="Ray (the optional ray extra) is not installed")

from ray.cluster_utils import Cluster  # noqa: E402

from hcqa.errors import DeviceClosed, DeviceFault, HcqaError, InvalidCommand, SignalTimeout  # noqa: E402
from hcqa.processes import ProcessStage  # noqa: E402
from hcqa.ray import open_ray_pipeline  # noqa: E402

TESTS = str(Path(__file__).parent)
STORE = 80 * 1024 * 1024  # object store per node (Ray's minimum is 75 MiB)


@pytest.fixture(scope="module")
def cluster() -> Iterator[Cluster]:
    c = Cluster(
        initialize_head=True,
        head_node_args={
            "num_cpus": 1,
            "resources": {"head": 1},
            "object_store_memory": STORE,
            "include_dashboard": False,
        },
    )
    try:
        c.add_node(num_cpus=1, resources={"b": 2}, object_store_memory=STORE)
        c.add_node(num_cpus=1, resources={"c": 2}, object_store_memory=STORE)
        ray.init(address=c.address, logging_level="ERROR", log_to_driver=False)
        c.wait_for_nodes()
        yield c
    finally:
        ray.shutdown()
        c.shutdown()


def node_of(c: Cluster, resource: str) -> Any:
    """The cluster's (alive) node that has ``resource``."""
    ids = {n["NodeID"] for n in ray.nodes() if n["Alive"] and resource in n["Resources"]}
    for n in c.list_all_nodes():
        if n.node_id in ids:
            return n
    raise AssertionError(f"no node with resource {resource!r}")


def raylet_pid(node: Any) -> int:
    return int(node.all_processes["raylet"][0].process.pid)


def parent_pid(pid: int) -> int:
    with open(f"/proc/{pid}/stat") as f:
        return int(f.read().rsplit(")", 1)[1].split()[1])


def tagged(slot: int) -> ProcessStage:
    return ProcessStage(fn="_ray_stages:tagged", args={"slot": slot, "tags": 12})


async def wait_exited(pid: int) -> None:
    """Until process ``pid`` has exited (a pidfd: woken by the kernel)."""
    try:
        fd = os.pidfd_open(pid)
    except ProcessLookupError:
        return
    try:
        await trio.lowlevel.wait_readable(fd)
    finally:
        os.close(fd)


async def test_results_and_placement(cluster: Cluster) -> None:
    """Stages on the driver's node, on a node given by id and on one given by resources:
    results match numpy and each stage ran in a worker of the segment's host, whose
    parent is the raylet of the node it was placed on."""
    head, b = node_of(cluster, "head"), node_of(cluster, "b")
    placement = [head.node_id, head.node_id, b.node_id, {"resources": {"c": 1}}]
    stages = [tagged(12 + i) for i in range(4)]
    async with open_ray_pipeline(
        stages, placement=placement, in_shape=(16,), dtype="float64", depth=4, path=[TESTS]
    ) as pipe:
        stats = pipe.statistics()
        assert stats.local == (True, False, False)
        assert stats.segments[:2] == (head.node_id, b.node_id)
        assert stats.segments[2] == node_of(cluster, "c").node_id
        assert stats.hosts[0] == os.getpid()
        assert parent_pid(stats.hosts[1]) == raylet_pid(b)
        assert parent_pid(stats.hosts[2]) == raylet_pid(node_of(cluster, "c"))
        hosts = [stats.hosts[0], stats.hosts[0], stats.hosts[1], stats.hosts[2]]

        async def caller(j: int, out: list[bool]) -> None:
            for i in range(5):
                x = np.arange(16, dtype=np.float64) * (j + 1) + i
                y = await pipe(x)
                want = x.copy()
                for _ in range(4):
                    want = want * 2 + 1
                assert np.array_equal(y[:12], want[:12])
                assert list(y[12:]) == hosts
                assert y.flags.writeable  # a small result is the caller's own
            out.append(True)

        done: list[bool] = []
        async with trio.open_nursery() as nursery:
            for j in range(6):
                nursery.start_soon(caller, j, done)
        assert len(done) == 6
        assert pipe.statistics().completed == 30
        processes = [*stats.hosts[1:], *(pid for seg in stats.workers for pid in seg)]
        assert len(processes) == 2 + 4
    with trio.fail_after(10):  # no actor or worker process outlives the block
        for pid in processes:
            await wait_exited(pid)
    forks = [t for t in threading.enumerate() if t.name == "hcqa process-pipeline forks"]
    assert forks == []


async def test_large_items_concurrent_callers(cluster: Cluster) -> None:
    """1 MiB items through two remote nodes, several callers at once: exact results."""
    b, c = node_of(cluster, "b"), node_of(cluster, "c")
    stages = ["hcqa.processes.stages:add_one"] * 4
    rng = np.random.default_rng(7)
    async with open_ray_pipeline(
        stages,
        placement=[b.node_id, b.node_id, c.node_id, c.node_id],
        in_shape=(512, 512),
        depth=3,
    ) as pipe:

        async def caller(x: np.ndarray[Any, Any], results: list[bool]) -> None:
            y = await pipe(x)
            results.append(bool(np.array_equal(y, x + 4)))

        results: list[bool] = []
        async with trio.open_nursery() as nursery:
            for _ in range(8):
                x = rng.integers(-1000, 1000, (512, 512)).astype(np.float32)
                nursery.start_soon(caller, x, results)
        assert results == [True] * 8
        assert pipe.statistics().batches < 8 * 2  # items ready together share Ray calls


async def test_shapes_and_dtypes_change_across_ray_hops(cluster: Cluster) -> None:
    """Stages that change shape and dtype on each side of each Ray hop, several items per
    batch: every hop cuts its batch by the shape the previous stage gave (exact results)."""
    head, b = node_of(cluster, "head"), node_of(cluster, "b")
    stages = [
        ProcessStage(fn="_ray_stages:fold", out_shape=(4, 4), out_dtype="float64"),
        ProcessStage(fn="_ray_stages:fold", out_shape=(8,), out_dtype="int32"),
        ProcessStage(fn="_ray_stages:fold", out_shape=(3,), out_dtype="float32"),
    ]
    async with open_ray_pipeline(
        stages,
        placement=[head.node_id, b.node_id, head.node_id],
        in_shape=(2, 16),
        dtype="int16",
        depth=4,
        path=[TESTS],
    ) as pipe:

        async def caller(j: int, out: dict[int, bool]) -> None:
            x = (np.arange(32, dtype=np.int16) * (j + 1)).reshape(2, 16)
            f = x.reshape(-1)
            s1 = (f[:16] + f[16:]).astype(np.float64)  # (4, 4) float64
            s2 = (s1[:8] + s1[8:]).astype(np.int32)  # (8,) int32
            want = (s2[:3] + s2[4:7]).astype(np.float32)  # (3,) float32
            y = await pipe(x)
            out[j] = y.dtype == np.float32 and y.shape == (3,) and bool(np.array_equal(y, want))

        results: dict[int, bool] = {}
        async with trio.open_nursery() as nursery:
            for j in range(8):
                nursery.start_soon(caller, j, results)
        assert results == dict.fromkeys(range(8), True)


async def test_big_batches_wait_for_their_ray_leg_and_merge(
    cluster: Cluster, tmp_path: Path
) -> None:
    """Big items (80 KB each: they cross Ray as arrays) arriving while a big batch holds
    the Ray leg queue behind it and go on as one merged batch; each caller gets its own
    exact result, also through the local segment after the leg."""
    head, b = node_of(cluster, "head"), node_of(cluster, "b")
    fifo = str(tmp_path / "gate")
    os.mkfifo(fifo)
    gate = os.open(fifo, os.O_RDWR | os.O_NONBLOCK)  # the stage's open finds a writer
    n = 20000
    try:
        async with open_ray_pipeline(
            [
                ProcessStage(fn="_ray_stages:held", args={"fifo": fifo}),
                "hcqa.processes.stages:add_one",
            ],
            placement=[b.node_id, head.node_id],
            in_shape=(n,),
            depth=8,
            path=[TESTS],
        ) as pipe:
            results: dict[int, bool] = {}

            async def caller(j: int) -> None:
                x = np.arange(n, dtype=np.float32) * (j + 1) + 1000 * j
                y = await pipe(x)
                results[j] = bool(np.array_equal(y, x * 2 + 2))

            async with trio.open_nursery() as nursery:
                for j in range(5):  # one at a time: five batches of one item
                    nursery.start_soon(caller, j)
                    await trio.testing.wait_all_tasks_blocked()
                assert pipe.statistics().in_flight == 5
                os.write(gate, b"x" * 5)  # the first item through, then the other four
            stats = pipe.statistics()
        assert results == dict.fromkeys(range(5), True)
        assert (stats.batches, stats.coalesced) == (5, 3)  # four queued, merged into one
    finally:
        os.close(gate)


async def test_actor_dying_ends_batches_waiting_for_its_leg(
    cluster: Cluster, tmp_path: Path
) -> None:
    """The leg's actor killed while one big batch is in it and four wait for it: every
    call ends with the one sticky DeviceFault naming the node (none hangs)."""
    b = node_of(cluster, "b")
    fifo = str(tmp_path / "gate")
    os.mkfifo(fifo)
    gate = os.open(fifo, os.O_RDWR | os.O_NONBLOCK)
    errors: list[BaseException] = []
    try:
        async with open_ray_pipeline(
            [ProcessStage(fn="_ray_stages:held", args={"fifo": fifo})],
            placement=[b.node_id],
            in_shape=(20000,),
            depth=8,
            path=[TESTS],
        ) as pipe:

            async def caller(j: int) -> None:
                try:
                    await pipe(np.full(20000, j, np.float32))
                except HcqaError as exc:
                    errors.append(exc)

            with trio.fail_after(30):
                async with trio.open_nursery() as nursery:
                    for j in range(5):
                        nursery.start_soon(caller, j)
                        await trio.testing.wait_all_tasks_blocked()
                    os.kill(pipe.statistics().hosts[0], 9)
        assert len(errors) == 5 and all(e is errors[0] for e in errors), errors
        assert isinstance(errors[0], DeviceFault) and b.node_id in str(errors[0])
    finally:
        os.close(gate)


async def test_stage_raises_is_sticky_fault_naming_node_and_stage(cluster: Cluster) -> None:
    b = node_of(cluster, "b")
    stages = ["hcqa.processes.stages:add_one", "_ray_stages:fail_on_negative"]
    async with open_ray_pipeline(
        stages, placement=[b.node_id, b.node_id], in_shape=(16,), path=[TESTS]
    ) as pipe:
        x = np.zeros(16, np.float32)
        assert np.array_equal(await pipe(x), x + 1)
        with pytest.raises(DeviceFault) as info:
            await pipe(np.full(16, -5, np.float32))
        message = str(info.value)
        assert "stage 1 ('_ray_stages:fail_on_negative')" in message
        assert b.node_id in message
        assert "negative input -4.0" in message
        with pytest.raises(DeviceFault) as again:
            await pipe(x)
        assert again.value is info.value
        assert pipe.statistics().faulted


async def test_cancelled_callers_leave_others_exact(cluster: Cluster) -> None:
    head = node_of(cluster, "head")
    async with open_ray_pipeline(
        ["hcqa.processes.stages:add_one"] * 2,
        placement=[head.node_id, {"resources": {"c": 1}}],
        in_shape=(16,),
        depth=2,
        local=False,  # the driver's node too in an actor
    ) as pipe:
        assert pipe.statistics().local == (False, False)
        assert parent_pid(pipe.statistics().hosts[0]) == raylet_pid(head)
        results: dict[int, bool] = {}

        async def caller(j: int) -> None:
            x = np.full(16, j, np.float32)
            y = await pipe(x)
            results[j] = bool(np.array_equal(y, x + 2))

        scopes: list[trio.CancelScope] = []

        async def cancellable(j: int) -> None:
            with trio.CancelScope() as scope:
                scopes.append(scope)
                await caller(j)

        async with trio.open_nursery() as nursery:
            for j in range(10):
                nursery.start_soon(cancellable if j % 2 else caller, j)
            await trio.testing.wait_all_tasks_blocked()
            for scope in scopes:
                scope.cancel()
        assert all(results.get(j) for j in range(0, 10, 2))  # uncancelled: exact
        assert all(results.values())  # a cancelled one that finished first: exact too
        for j in range(20, 24):
            await caller(j)
            assert results[j]


def test_same_calls_under_asyncio(cluster: Cluster) -> None:
    b = node_of(cluster, "b")

    async def main() -> list[bool]:
        async with open_ray_pipeline(
            ["hcqa.processes.stages:add_one"] * 2,
            placement=[b.node_id, {"resources": {"c": 1}}],
            in_shape=(16,),
        ) as pipe:
            xs = [np.full(16, j, np.float32) for j in range(6)]
            ys = await asyncio.gather(*(pipe(x) for x in xs))
            return [bool(np.array_equal(y, x + 2)) for x, y in zip(xs, ys, strict=True)]

    assert asyncio.run(main()) == [True] * 6


def test_asyncio_cancellation_leaves_others_exact(cluster: Cluster) -> None:
    c = node_of(cluster, "c")

    async def main() -> tuple[list[Any], bool]:
        async with open_ray_pipeline(
            ["hcqa.processes.stages:add_one"] * 2,
            placement=[c.node_id, c.node_id],
            in_shape=(16,),
            depth=3,
        ) as pipe:
            xs = [np.full(16, j, np.float32) for j in range(8)]
            tasks = [asyncio.create_task(pipe(x)) for x in xs]
            await asyncio.sleep(0)  # a checkpoint: every task has started its call
            for t in tasks[1::2]:
                t.cancel()
            ys = await asyncio.gather(*tasks, return_exceptions=True)
            after = await pipe(xs[3])
            return ys, bool(np.array_equal(after, xs[3] + 2))

    ys, after_ok = asyncio.run(main())
    for j, y in enumerate(ys):
        if j % 2 == 0 or not isinstance(y, asyncio.CancelledError):
            assert isinstance(y, np.ndarray) and np.array_equal(y, np.full(16, j + 2)), (j, y)
    assert after_ok


async def test_open_close_cycles_free_actors_and_resources(cluster: Cluster) -> None:
    total = ray.cluster_resources()["b"]
    for i in range(4):  # each cycle checks that its actor and resource came back
        async with open_ray_pipeline(
            ["hcqa.processes.stages:add_one"],
            placement=[{"resources": {"b": 1}}],
            in_shape=(4,),
        ) as pipe:
            assert ray.available_resources().get("b", 0) == total - 1
            assert np.array_equal(await pipe(np.full(4, i, np.float32)), np.full(4, i + 1))
            host = pipe.statistics().hosts[0]
        with trio.fail_after(10):
            await wait_exited(host)
        assert ray.available_resources().get("b", 0) == total


async def test_killed_node_ends_every_waiting_call(cluster: Cluster) -> None:
    node = cluster.add_node(num_cpus=1, resources={"doomed": 1}, object_store_memory=STORE)
    await trio.to_thread.run_sync(cluster.wait_for_nodes)
    b = node_of(cluster, "b")
    errors: list[BaseException] = []
    async with open_ray_pipeline(
        ["hcqa.processes.stages:add_one", "_ray_stages:slow"],
        placement=[b.node_id, node.node_id],
        in_shape=(16,),
        depth=2,
        hang_limit=4.0,
        path=[TESTS],
    ) as pipe:

        async def caller(j: int) -> None:
            try:
                await pipe(np.full(16, j, np.float32))
            except HcqaError as exc:
                errors.append(exc)

        with trio.fail_after(30):
            async with trio.open_nursery() as nursery:
                for j in range(3):
                    nursery.start_soon(caller, j)
                await trio.testing.wait_all_tasks_blocked()
                await trio.to_thread.run_sync(cluster.remove_node, node)
        assert len(errors) == 3
        assert all(e is errors[0] for e in errors)
        assert isinstance(errors[0], (DeviceFault, SignalTimeout))
        assert node.node_id in str(errors[0])
        assert "stage 1 ('_ray_stages:slow')" in str(errors[0])
        with pytest.raises(HcqaError) as later:
            await pipe(np.zeros(16, np.float32))
        assert later.value is errors[0]


async def test_stuck_stage_times_out_naming_stage_and_node(cluster: Cluster) -> None:
    c = node_of(cluster, "c")
    errors: list[BaseException] = []
    async with open_ray_pipeline(
        ["hcqa.processes.stages:add_one", "_ray_stages:stuck"],
        placement=[c.node_id, c.node_id],
        in_shape=(16,),
        hang_limit=2.0,
        path=[TESTS],
    ) as pipe:
        host = pipe.statistics().hosts[0]

        async def caller(j: int) -> None:
            try:
                await pipe(np.full(16, j, np.float32))
            except HcqaError as exc:
                errors.append(exc)

        with trio.fail_after(20):
            async with trio.open_nursery() as nursery:
                for j in range(2):
                    nursery.start_soon(caller, j)
        assert len(errors) == 2 and errors[0] is errors[1]
        assert isinstance(errors[0], SignalTimeout)
        assert "stage 1 ('_ray_stages:stuck')" in str(errors[0])
        assert c.node_id in str(errors[0])
        assert "made no progress for 2 s" in str(errors[0])  # the segment's own watchdog
    with trio.fail_after(10):
        await wait_exited(host)  # the faulted pipeline's actor is gone


async def test_actor_without_room_times_out_at_open(cluster: Cluster) -> None:
    total = ray.cluster_resources()["b"]
    async with open_ray_pipeline(
        ["hcqa.processes.stages:add_one"], placement=[{"resources": {"b": 1}}], in_shape=(4,)
    ):
        with pytest.raises(
            SignalTimeout, match=r"stage 0 \('hcqa.processes.stages:add_one'\) did not"
        ):
            async with open_ray_pipeline(
                ["hcqa.processes.stages:add_one"],
                placement=[{"resources": {"b": total}}],
                in_shape=(4,),
                start_limit=1.0,
            ):
                pass
        assert ray.available_resources().get("b", 0) == total - 1
    assert ray.available_resources().get("b", 0) == total


@pytest.mark.parametrize(
    ("placement", "message"),
    [
        (["x"], "'placement' must have one entry per stage (got 1 for 2 stages)"),
        ("abc", "'placement' must be a list with one entry per stage"),
        (["zz", "ab"], "placement 0 must be a Ray node id"),
        (["ab" * 28, "ab" * 28], "placement 0 must be the id of an alive Ray node"),
        ([{"resources": {"nowhere": 1}}] * 2, "placement 0's resources must fit on one alive"),
        ([{"resources": {"b": 3}}] * 2, "(asked b=3; the most any node has: b=2)"),
        ([{"resources": {"b": 0}}] * 2, "placement 0's resource 'b' must be a number > 0"),
        ([{"cpus": 1}] * 2, "placement 0 must be {'resources'"),
    ],
)
async def test_bad_placement_refused_before_any_actor(
    cluster: Cluster, monkeypatch: pytest.MonkeyPatch, placement: Any, message: str
) -> None:
    def no_actor(*args: Any) -> None:
        raise AssertionError("an actor was started")

    monkeypatch.setattr("hcqa.ray.opening._start_actor", no_actor)
    with pytest.raises(InvalidCommand) as info:
        async with open_ray_pipeline(
            ["hcqa.processes.stages:add_one"] * 2, placement=placement, in_shape=(4,)
        ):
            pass
    assert message in str(info.value)


async def test_ray_not_initialised_refused(
    cluster: Cluster, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(ray, "is_initialized", lambda: False)
    with pytest.raises(InvalidCommand, match="needs a connected Ray driver"):
        async with open_ray_pipeline(
            ["hcqa.processes.stages:add_one"], placement=[{"resources": {"b": 1}}], in_shape=(4,)
        ):
            pass


async def test_close_drains_items_in_flight_and_refuses_waiting_callers(
    cluster: Cluster,
) -> None:
    c = node_of(cluster, "c")
    outcomes: dict[int, object] = {}

    async def caller(pipe: Any, j: int) -> None:
        x = np.full(4, j, np.float32)
        try:
            y = await pipe(x)
            outcomes[j] = bool(np.array_equal(y, x + 1))
        except DeviceClosed as exc:
            outcomes[j] = exc

    async with trio.open_nursery() as outer:
        async with open_ray_pipeline(
            ["hcqa.processes.stages:add_one"],
            placement=[c.node_id],
            in_shape=(4,),
            depth=1,
        ) as pipe:
            for j in range(3):
                outer.start_soon(caller, pipe, j)
            await trio.testing.wait_all_tasks_blocked()
            assert pipe.statistics().in_flight == 1  # one place: the others wait for it
    # the item in flight when the block ended was drained (trio starts tasks in any order)
    assert sorted(map(str, outcomes.values())) == sorted(
        ["True", "the Ray pipeline is closed", "the Ray pipeline is closed"]
    ), outcomes


async def test_stage_that_cannot_load_fails_the_open_naming_node(cluster: Cluster) -> None:
    b = node_of(cluster, "b")
    total = ray.cluster_resources()["b"]
    with pytest.raises(DeviceFault) as info:
        async with open_ray_pipeline(
            ["hcqa.processes.stages:add_one", "_no_such_module:stage"],
            placement=[b.node_id, {"resources": {"b": 1}}],
            in_shape=(4,),
        ):
            pass
    assert "stage 1 ('_no_such_module:stage')" in str(info.value)
    assert b.node_id in str(info.value)  # the only node with resource b
    assert ray.available_resources().get("b", 0) == total  # its actors are gone


async def test_closed_pipeline_refuses(cluster: Cluster) -> None:
    async with open_ray_pipeline(
        ["hcqa.processes.stages:add_one"], placement=[{"resources": {"c": 1}}], in_shape=(4,)
    ) as pipe:
        pass
    with pytest.raises(DeviceClosed):
        await pipe(np.zeros(4, np.float32))
