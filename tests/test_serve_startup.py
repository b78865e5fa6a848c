"""``hcqa serve``'s start-up status (``hcqa/cli/_startup.py``): a live rich status per model on
a terminal, one plain line per event anywhere else, never a control code off a terminal."""

from __future__ import annotations

import io
import re

from hcqa.cli._startup import startup

ANSI = re.compile(r"\x1b\[[0-9;?]*[A-Za-z]")  # a control sequence (cursor, colour)


class _Tty(io.StringIO):
    def isatty(self) -> bool:
        return True


def _start(stream: io.StringIO) -> None:
    with startup(["a", "b"], stream) as status:
        status.event("a", "loading a.onnx (onnxruntime on cpu:0)")
        status.event("a", "building")  # the server's first build of it: said already
        status.event("a", "building batch size 1 of 2")
        status.event("b", "building")  # a model the CLI is not loading (the demo MLP)
        status.event("a", "building batch size 2 of 2")
        status.event("a", "warming up")
        status.event("a", "ready")
        status.event("b", "failed: InvalidCommand: no")  # never ready: the CLI's error line
        status.event("a", "rebuilding (device cpu:0 faulted)")  # after the start-up
        status.event("a", "ready")


def test_off_a_terminal_each_event_is_one_plain_line() -> None:
    pipe = io.StringIO()
    _start(pipe)
    lines = pipe.getvalue().splitlines()
    assert lines[:6] == [
        "hcqa: model a: loading a.onnx (onnxruntime on cpu:0)",
        "hcqa: model a: building batch size 1 of 2",
        "hcqa: model b: building",
        "hcqa: model a: building batch size 2 of 2",
        "hcqa: model a: warming up",
        lines[5],
    ]
    assert re.fullmatch(r"hcqa: model a: ready in \d+\.\d s", lines[5])
    assert lines[6] == "hcqa: model a: rebuilding (device cpu:0 faulted)"
    assert re.fullmatch(r"hcqa: model a: ready in \d+\.\d s", lines[7])
    assert len(lines) == 8  # b's failure is left to the command's one error line
    assert "\x1b" not in pipe.getvalue()


def test_on_a_terminal_the_status_is_live_and_ends_with_each_models_outcome() -> None:
    tty = _Tty()
    _start(tty)
    drawn = tty.getvalue()
    assert ANSI.search(drawn)  # drawn in place, with rich's cursor codes
    plain = ANSI.sub("", drawn)
    assert "model a: building batch size 2 of 2" in plain
    assert re.search(r"✔ model a: ready in \d+\.\d s", plain)
    assert "✘ model b: failed: InvalidCommand: no" in plain
    assert "hcqa: model a: building batch size" not in plain  # no plain lines while live
    # after the start-up (every model ready or failed) the live status is gone: plain lines
    assert plain.rstrip().splitlines()[-2] == "hcqa: model a: rebuilding (device cpu:0 faulted)"
    assert re.fullmatch(r"hcqa: model a: ready in \d+\.\d s", plain.rstrip().splitlines()[-1])
