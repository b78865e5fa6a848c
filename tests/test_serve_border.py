"""The server's border under attack: slow and vanishing clients, bad numbers, big JSON,
drains, the access log's path (hcqa.serve)."""

from __future__ import annotations

import json
import math
import os
import re
import signal
import stat
import subprocess
import sys
import threading
import time
from collections.abc import AsyncIterator, Callable
from contextlib import asynccontextmanager
from functools import partial
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import trio

import hcqa

pytest.importorskip("hypercorn")

from hcqa.serve import serve
from hcqa.serve.bodies import InputError, dumps_array, loads_json
from hcqa.serve.inputs import Shape, from_json

RAW = "application/octet-stream"
JSON = "application/json"


def double(out: np.ndarray, x: np.ndarray) -> None:
    np.multiply(x, 2, out=out)


@asynccontextmanager
async def server(
    in_shape: tuple[int, ...] = (4, 3), kernel: Callable[..., None] = double, **options: Any
) -> AsyncIterator[int]:
    """A one-stage pipeline doubling its input, served on a free port."""
    async with hcqa.open_devices("cpu:0") as (d0,):
        # check=False: no dry run of a kernel that may wait on a test's gate
        pipe = hcqa.Pipeline([(d0, kernel)], in_shape=in_shape, depth=2, check=False)
        async with trio.open_nursery() as nursery:
            yield await nursery.start(partial(serve, pipe, port=0, **options))
            nursery.cancel_scope.cancel()


def head(length: int | None, content_type: str = RAW, path: str = "/infer") -> bytes:
    size = "transfer-encoding: chunked" if length is None else f"content-length: {length}"
    lines = [f"POST {path} HTTP/1.1", "host: t", f"content-type: {content_type}", size, "", ""]
    return "\r\n".join(lines).encode()


def get(path: str) -> bytes:
    return f"GET {path} HTTP/1.1\r\nhost: t\r\n\r\n".encode()


class Answer:
    def __init__(self, status: int, headers: dict[str, str], body: bytes) -> None:
        self.status, self.headers, self.body = status, headers, body

    def json(self) -> Any:
        return json.loads(self.body)


async def read_answer(stream: trio.SocketStream) -> Answer | None:
    """One HTTP/1.1 response from ``stream`` (None on EOF before one arrived)."""
    data = b""
    while b"\r\n\r\n" not in data:
        chunk = await stream.receive_some(65536)
        if not chunk:
            return None
        data += chunk
    top, rest = data.split(b"\r\n\r\n", 1)
    lines = top.decode("latin-1").split("\r\n")
    headers = dict(line.lower().split(": ", 1) for line in lines[1:])
    n = int(headers.get("content-length", "0"))
    got = bytearray(rest)
    while len(got) < n:
        chunk = await stream.receive_some(1 << 20)
        assert chunk, "EOF in the middle of an answer"
        got += chunk
    return Answer(int(lines[0].split()[1]), headers, bytes(got[:n]))


async def ask(port: int, request: bytes) -> Answer:
    stream = await trio.open_tcp_stream("127.0.0.1", port)
    async with stream:
        await stream.send_all(request)
        answer = await read_answer(stream)
    assert answer is not None
    return answer


async def health(port: int) -> Any:
    return (await ask(port, get("/health"))).json()


async def metric(port: int, name: str) -> float:
    text = (await ask(port, get("/metrics"))).body.decode()
    found = re.search(rf"^{re.escape(name)} (\S+)$", text, re.M)
    return float(found.group(1)) if found else 0.0


async def until(check: Callable[[], Any]) -> None:
    """Poll a real server's state (another connection) until ``check()`` is true."""
    with trio.fail_after(10):
        while not await check():
            await trio.sleep(0.005)


SAMPLE = np.arange(3, dtype=np.float32)
HOSTS = pytest.mark.parametrize("http", ["hcqa", "hypercorn"])  # both HTTP servers serve() runs


# -- admission and the body's time limit --------------------------------------------------


@HOSTS
async def test_slow_bodies_hold_no_admission_slot(http: str) -> None:
    body = SAMPLE.tobytes()
    async with server(max_pending=2, http=http) as port:
        slow = [await trio.open_tcp_stream("127.0.0.1", port) for _ in range(3)]
        for s in slow:  # three bodies trickle: a third of one sample, then nothing for now
            await s.send_all(head(len(body)) + body[:4])

        async def receiving() -> bool:
            return bool((await health(port))["requests_receiving"] == 3)

        await until(receiving)
        answer = await ask(port, head(len(body)) + body)  # a whole request: admitted
        assert answer.status == 200, answer.body
        np.testing.assert_array_equal(np.frombuffer(answer.body, "<f4"), SAMPLE * 2)
        doc = await health(port)
        assert (doc["requests_pending"], doc["requests_receiving"]) == (0, 3)
        for s in slow:  # the slow ones finish their bodies, one by one: answered too
            await s.send_all(body[4:])
            answer = await read_answer(s)
            assert answer is not None and answer.status == 200
            await s.aclose()


@HOSTS
async def test_a_body_slower_than_body_timeout_gets_408_and_the_connection_closes(
    http: str,
) -> None:
    body = SAMPLE.tobytes()
    async with server(body_timeout=0.3, http=http) as port:
        for request in (head(len(body)) + body[:4], head(None) + b"4\r\n" + body[:4] + b"\r\n"):
            stream = await trio.open_tcp_stream("127.0.0.1", port)
            async with stream:
                t0 = time.perf_counter()
                await stream.send_all(request)
                with trio.fail_after(10):
                    answer = await read_answer(stream)
                    assert answer is not None
                    assert await stream.receive_some(100) == b""  # then closed
            assert time.perf_counter() - t0 >= 0.3
            assert answer.status == 408
            assert answer.headers["connection"] == "close"
            message = answer.json()["error"]
            assert "within 0.3 s" in message and "got 4" in message, message
        assert (await ask(port, head(len(body)) + body)).status == 200  # the server is fine


async def test_body_timeout_is_checked() -> None:
    async with hcqa.open_devices("cpu:0") as (d0,):
        pipe = hcqa.Pipeline([(d0, double)], in_shape=(4, 3))
        for bad in (0, -1.0, math.nan, math.inf, "5"):
            with pytest.raises(hcqa.InvalidCommand, match="'body_timeout' must be"):
                await serve(pipe, port=0, body_timeout=bad)  # type: ignore[arg-type]


# -- bodies that are not what they claim ------------------------------------------------


@HOSTS
async def test_huge_declared_bodies_chunked_bodies_and_garbage_headers(http: str) -> None:
    body = SAMPLE.tobytes()
    async with server(http=http) as port:
        answer = await ask(port, head(10**15) + b"x")  # refused before it is read
        assert answer.status == 413 and answer.headers["connection"] == "close"
        assert "got 1000000000000000 bytes" in answer.json()["error"]
        chunk = b"0" * 65536
        flood = head(None) + b"".join(b"10000\r\n" + chunk + b"\r\n" for _ in range(17))
        answer = await ask(port, flood)  # chunked past the 1 MiB limit: refused as it comes
        assert answer.status == 413 and "larger than 1048576 bytes" in answer.json()["error"]
        ok = head(None) + b"c\r\n" + body + b"\r\n0\r\n\r\n"  # a chunked body within limits
        answer = await ask(port, ok)
        assert answer.status == 200
        np.testing.assert_array_equal(np.frombuffer(answer.body, "<f4"), SAMPLE * 2)
        for bad_size in (b"zz", b"-10", b"0x10", b"1_0", b"f" * 24):  # a malformed chunked body
            answer = await ask(port, head(None) + bad_size + b"\r\n" + body + b"\r\n0\r\n\r\n")
            assert answer.status == 400, (bad_size, answer.status)
        answer = await ask(port, head(None) + b"4\r\n" + body + b"\r\n0\r\n\r\n")  # data > size
        assert answer.status == 400
        for garbage in (
            b"\x00\xff garbage\r\n\r\n",
            b"POST /infer HTTP/1.1\r\ncontent-length: -5\r\n\r\n",
            b"POST /infer HTTP/1.1\r\ncontent-length: 1, 2\r\n\r\n",
            b"POST /infer HTTP/1.1\r\nbad header line\r\n\r\n",
        ):
            answer = await ask(port, garbage)
            assert answer.status == 400
        assert (await health(port))["status"] == "ok"
        assert await metric(port, 'hcqa_requests_total{endpoint="/infer",status="500"}') == 0


# -- clients that leave mid-body ------------------------------------------------------------


@HOSTS
async def test_a_client_that_leaves_mid_body_is_a_disconnect_not_a_500(
    http: str, capfd: pytest.CaptureFixture[str]
) -> None:
    async with server(http=http) as port:
        for _ in range(20):
            stream = await trio.open_tcp_stream("127.0.0.1", port)
            await stream.send_all(head(1000) + b"x" * 10)
            await stream.aclose()
        name = 'hcqa_client_disconnects_total{endpoint="/infer"}'

        async def counted() -> bool:
            return await metric(port, name) == 20

        await until(counted)
        assert await metric(port, 'hcqa_requests_total{endpoint="/infer",status="500"}') == 0
        assert (await health(port))["requests_receiving"] == 0
    err = capfd.readouterr().err
    assert "Traceback" not in err
    assert len(err) < 200, err


# -- numbers ----------------------------------------------------------------------------------

FLOAT3 = Shape((3,), np.dtype("float32"))
SCALAR = Shape((), np.dtype("float32"))


@pytest.mark.parametrize(
    ("body", "shape", "words"),
    [
        (b'{"inputs": [1, 1e39, 3]}', FLOAT3, ["fit in float32", "1e+39 at inputs[1]"]),
        (b'{"inputs": [[1, 2, 3], [1, 2, -1e39]]}', FLOAT3, ["-1e+39 at inputs[1][2]"]),
        (b'{"inputs": [1, 1e309, 3]}', FLOAT3, ["fit in a 64-bit float", "got 1e309"]),
        (b'{"inputs": [1, -1e400, 3]}', FLOAT3, ["fit in a 64-bit float", "got -1e400"]),
        (b'{"inputs": [1, 10' + b"0" * 400 + b", 3]}", FLOAT3, ["fit in float32"]),
        (b'{"inputs": 1e39}', SCALAR, ["fit in float32", "1e+39 at inputs"]),
        (b'{"inputs": 1e400}', SCALAR, ["fit in a 64-bit float"]),
        (b'{"inputs": true}', SCALAR, ["must be numbers", "got a boolean at inputs"]),
        (b'{"inputs": null}', SCALAR, ["must be numbers", "got null at inputs"]),
        (b'{"inputs": {"a": 1}}', SCALAR, ["must be numbers", "got an object at inputs"]),
        (b'{"inputs": "1"}', SCALAR, ["must be numbers", "got a string at inputs"]),
        (b'{"inputs": [1, false]}', SCALAR, ["got a boolean at inputs[1]"]),
        (b'{"inputs": Infinity}', SCALAR, ["finite", "got Infinity"]),
    ],
)
def test_numbers_that_do_not_fit_are_refused(body: bytes, shape: Shape, words: list[str]) -> None:
    with pytest.raises(InputError) as info:
        from_json(body, shape)
    assert info.value.status == 400
    for word in words:
        assert word in str(info.value), str(info.value)


async def test_scalar_samples_over_http() -> None:
    async with server(in_shape=(4,)) as port:
        for body in (b'{"inputs": true}', b'{"inputs": null}', b'{"inputs": {"a": 1}}'):
            answer = await ask(port, head(len(body), JSON) + body)
            assert answer.status == 400, (body, answer.body)
            assert "inputs must be numbers" in answer.json()["error"]
        for body in (b'{"inputs": 1e39}', b'{"inputs": [1e309, 1]}'):
            answer = await ask(port, head(len(body), JSON) + body)
            assert answer.status == 400, (body, answer.body)
        body = b'{"inputs": 2.5}'
        answer = await ask(port, head(len(body), JSON) + body)
        assert answer.status == 200 and answer.json()["outputs"] == 5.0


@pytest.mark.parametrize(
    "text",
    [
        '{"inputs": [1, 2.5, -3e2]}',
        "[]",
        " [ [ 1 , 2 ] , [ ] ] ",
        '{"a": [[1,2],[3]], "b": {"c": "x,]"}, "d": [true, null, "s"], "a": 0}',
        '{"a":[{"b":[1,[2,[3]]]}], "": {}}',
        "[-0, 0.0, 1E5, 2e-3, 123456789012345678901234567890]",
        "1.5",
        '"\\u00e9\\n"',
        json.dumps(list(range(20000))),  # pieces cut at commas
        json.dumps({"x": np.linspace(-1, 1, 9000).reshape(3, 3000).tolist()}),
    ],
)
def test_loads_json_in_pieces_is_json_loads(text: str) -> None:
    assert loads_json(text.encode()) == json.loads(text)


@pytest.mark.parametrize(
    "text",
    [
        "[1,2,]",
        "[1,,2]",
        '{"a":1,}',
        "[1 2]",
        '{"a" 1}',
        "[1,2",
        "",
        "[01]",
        "[1.]",
        "1 2",
        "[" * 80,
    ],
)
def test_loads_json_refuses_what_json_loads_refuses(text: str) -> None:
    with pytest.raises(json.JSONDecodeError):
        json.loads(text)
    with pytest.raises(InputError):
        loads_json(text.encode())


def test_dumps_array_is_json_dumps() -> None:
    rng = np.random.default_rng(1)
    for a in (
        np.float32(1.5) * np.ones(()),
        np.zeros((0, 3)),
        rng.standard_normal(10000),
        rng.standard_normal((2, 5000)).astype(np.float32),
        rng.standard_normal((700, 16)),
    ):
        assert json.loads(dumps_array(a)) == a.tolist()


# -- the loop while a big JSON body is parsed and answered ---------------------------------


async def test_the_loop_keeps_running_while_a_big_json_batch_is_parsed() -> None:
    x = np.random.default_rng(2).standard_normal((1000, 256)).astype(np.float32)
    body = json.dumps({"inputs": x.tolist()}).encode()  # about 5 MB
    async with server(in_shape=(64, 256), max_body=len(body)) as port:
        lags: list[float] = []

        async def heartbeat(task_status: trio.TaskStatus[None]) -> None:
            task_status.started()
            while True:
                t0 = time.perf_counter()
                await trio.sleep(0.002)
                lags.append(time.perf_counter() - t0 - 0.002)

        async with trio.open_nursery() as nursery:
            await nursery.start(heartbeat)
            answer = await ask(port, head(len(body), JSON) + body)
            nursery.cancel_scope.cancel()
        assert answer.status == 200, answer.body[:200]
        np.testing.assert_allclose(answer.json()["outputs"], x * 2)
        worst = max(lags)
        print(f"worst lag {worst * 1e3:.1f} ms over {len(lags)} beats")
        assert worst < 0.15, f"the loop stalled {worst * 1e3:.0f} ms"


_FIRST_REQUESTS = """
import json, sys, trio, numpy as np, hcqa
from functools import partial
from hcqa.serve import Model, serve

def double(out, x):
    np.multiply(x, 2, out=out)

async def ask(port, data):
    stream = await trio.open_tcp_stream("127.0.0.1", port)
    async with stream:
        await stream.send_all(data)
        got = b""
        while chunk := await stream.receive_some(1 << 16):
            got += chunk
    return int(got.split()[1])

def post(path, body, ctype):
    head = f"POST {path} HTTP/1.1\\r\\nhost: t\\r\\nconnection: close\\r\\n"
    head += f"content-type: {ctype}\\r\\ncontent-length: {len(body)}\\r\\n\\r\\n"
    return head.encode() + body

async def main():
    async with hcqa.open_devices("cpu:0") as (d0,):
        pipe = hcqa.Pipeline([(d0, double)], in_shape=(64, 256), depth=2)
        async with trio.open_nursery() as nursery:
            port = await nursery.start(partial(serve, [Model(name="m", pipeline=pipe)], port=0))
            before = set(sys.modules)
            x = np.ones((64, 256), np.float32)
            doc = json.dumps({"inputs": x.tolist()}).encode()  # past 64 KiB: a worker thread
            v2 = json.dumps({"inputs": [{"name": "input", "datatype": "FP32",
                                         "shape": [64, 256], "data": x.ravel().tolist()}]})
            statuses = [
                await ask(port, post("/infer", doc, "application/json")),
                await ask(port, post("/infer", x.tobytes(), "application/octet-stream")),
                await ask(port, post("/v2/models/m/infer", v2.encode(), "application/json")),
            ]
            for path in ("/health", "/stats", "/metrics", "/v2/health/ready"):
                get = f"GET {path} HTTP/1.1\\r\\nhost: t\\r\\nconnection: close\\r\\n\\r\\n"
                statuses.append(await ask(port, get.encode()))
            print(json.dumps([statuses, sorted(set(sys.modules) - before)]))
            nursery.cancel_scope.cancel()

trio.run(main)
"""


def test_the_first_requests_import_nothing_on_the_loop() -> None:
    # anyio loads its trio backend when serve() starts, not in the first request: that import
    # blocked the loop 17 ms here, 170-230 ms on a loaded host
    out = subprocess.run(
        [sys.executable, "-c", _FIRST_REQUESTS], capture_output=True, text=True, timeout=120
    )
    assert out.returncode == 0, out.stderr
    statuses, imported = json.loads(out.stdout.strip().splitlines()[-1])
    assert statuses == [200] * 7
    assert imported == []


# -- the access log ---------------------------------------------------------------------------


async def test_the_access_log_is_never_written_through_a_symlink(tmp_path: Path) -> None:
    victim = tmp_path / "victim"
    victim.write_text("precious\n")
    link = tmp_path / "access.log"
    link.symlink_to(victim)
    fifo = tmp_path / "fifo"
    os.mkfifo(fifo)
    async with hcqa.open_devices("cpu:0") as (d0,):
        pipe = hcqa.Pipeline([(d0, double)], in_shape=(4, 3))
        for path, words in ((link, "got a symlink"), (fifo, "got a FIFO"), (tmp_path, "directory")):
            with (
                trio.fail_after(10),  # (a server that accepts the path serves until then)
                pytest.raises(hcqa.InvalidCommand, match="must be a regular file") as info,
            ):
                await serve(pipe, port=0, access_log=str(path))
            assert words in str(info.value)
    assert victim.read_text() == "precious\n"
    assert link.is_symlink()
    log = tmp_path / "new.log"
    async with server(access_log=str(log)) as port:
        assert (await ask(port, get("/health"))).status == 200
    assert stat.S_IMODE(log.stat().st_mode) == 0o600
    assert '"GET /health 1.1" 200' in log.read_text()


# -- draining -----------------------------------------------------------------------------------


async def _cli(*options: str) -> tuple[subprocess.Popen[str], int]:
    argv = [sys.executable, "-m", "hcqa.cli", "serve", "--port", "0", "--width", "8"]
    argv += ["--max-batch", "4", "--access-log", "none", *options]
    proc = subprocess.Popen(
        argv, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, start_new_session=True
    )
    first = await trio.to_thread.run_sync(proc.stdout.readline)  # type: ignore[union-attr]
    match = re.search(r"http://127\.0\.0\.1:(\d+)", first)
    assert match, first + proc.stderr.read()  # type: ignore[union-attr]
    return proc, int(match.group(1))


async def test_a_drain_ends_once_requests_in_flight_are_answered() -> None:
    proc, port = await _cli("--sleep-ms", "150", "--grace-period", "60")
    try:
        with trio.fail_after(30):
            body = np.ones(8, np.float32).tobytes()
            idle = await trio.open_tcp_stream("127.0.0.1", port)  # a keep-alive connection
            await idle.send_all(get("/health"))
            assert (await read_answer(idle)) is not None
            keep = await trio.open_tcp_stream("127.0.0.1", port)
            # a request in flight, and a second one behind it on the same connection
            await keep.send_all(head(len(body)) + body + head(len(body)) + body)

            async def in_flight() -> bool:
                return bool((await health(port))["requests_pending"] >= 1)

            await until(in_flight)
            proc.send_signal(signal.SIGTERM)
            t0 = time.perf_counter()
            first = await read_answer(keep)
            assert first is not None and first.status == 200
            assert first.headers["connection"] == "close"  # don't send more on this one
            assert await read_answer(keep) is None  # the second was never read: closed
            await keep.aclose()
            # sent on the idle keep-alive connection after the signal: answered, not run
            try:
                await idle.send_all(head(len(body)) + body)
                late = await read_answer(idle)
            except trio.BrokenResourceError:
                late = None  # (the drain was already over: closed, as HTTP allows)
            if late is not None:
                assert late.status == 503 and late.headers["connection"] == "close"
            await idle.aclose()
            rc = await trio.to_thread.run_sync(proc.wait)
            drained = time.perf_counter() - t0
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    err = proc.stderr.read()  # type: ignore[union-attr]
    assert rc == 0, err
    assert drained < 10, f"{drained:.1f} s to drain one 0.3 s request (grace period 60 s)"


async def test_a_second_signal_drops_queued_kernels() -> None:
    proc, port = await _cli("--sleep-ms", "300", "--depth", "16", "--max-pending", "1000")
    try:
        with trio.fail_after(60):
            body = np.ones(8, np.float32).tobytes()
            streams = [await trio.open_tcp_stream("127.0.0.1", port) for _ in range(100)]
            for s in streams:
                await s.send_all(head(len(body)) + body)

            async def queued() -> bool:
                return bool((await health(port))["requests_pending"] == 100)

            await until(queued)  # 25 batches, 16 of them on the devices: ~5 s of kernels
            proc.send_signal(signal.SIGTERM)
            err_line = await trio.to_thread.run_sync(proc.stderr.readline)  # type: ignore[union-attr]
            assert "draining" in err_line
            proc.send_signal(signal.SIGTERM)
            t0 = time.perf_counter()
            rc = await trio.to_thread.run_sync(proc.wait)
            stopped = time.perf_counter() - t0
            for s in streams:
                await s.aclose()
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    assert rc == 130, proc.stderr.read()  # type: ignore[union-attr]
    assert stopped < 2.5, f"{stopped:.1f} s from the second signal to the exit"


# -- a big batch of small rows ------------------------------------------------------------------


def _tasks() -> int:
    """How many trio tasks this run has now."""
    count, todo = 0, [trio.lowlevel.current_root_task()]
    while todo:
        task = todo.pop()
        count += 1
        todo.extend(t for n in task.child_nurseries for t in n.child_tasks)
    return count


async def test_a_batch_of_many_chunks_runs_on_a_few_tasks() -> None:
    gate = threading.Event()

    def gated(out: np.ndarray, x: np.ndarray) -> None:
        gate.wait(10)
        np.multiply(x, 2, out=out)

    x = np.arange(3000, dtype=np.float32).reshape(1000, 3)  # 250 pipeline batches of 4 rows
    async with server(kernel=gated) as port, trio.open_nursery() as nursery:
        before = _tasks()
        answers: list[Answer | None] = []

        async def post() -> None:
            answers.append(await ask(port, head(x.nbytes) + x.tobytes()))

        nursery.start_soon(post)

        async def running() -> bool:
            return bool((await health(port))["pipeline"]["in_flight"] == 2)

        await until(running)
        assert _tasks() - before < 40  # not one task per chunk
        gate.set()
    answer = answers[0]
    assert answer is not None and answer.status == 200
    np.testing.assert_array_equal(np.frombuffer(answer.body, "<f4").reshape(1000, 3), x * 2)
