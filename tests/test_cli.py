"""The ``hcqa`` command: version, errors as one line, tracebacks on request, the bench runner."""

from __future__ import annotations

import argparse
import importlib.metadata
import subprocess
import sys
from pathlib import Path

import pytest

from hcqa import cli
from hcqa.cli import _benchrun


def _boom(args: argparse.Namespace) -> int:
    raise RuntimeError("the engine fell over\nsecond line")


@pytest.fixture
def broken_info(monkeypatch: pytest.MonkeyPatch) -> None:
    """``hcqa info`` replaced by a command that fails unexpectedly."""
    old = cli.COMMANDS["info"]
    monkeypatch.setitem(
        cli.COMMANDS, "info", cli.Command(help=old.help, configure=old.configure, run=_boom)
    )
    monkeypatch.delenv("HCQA_DEBUG", raising=False)


@pytest.mark.parametrize("flag", ["-V", "--version"])
def test_version(flag: str, capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as exc:
        cli.main([flag])
    assert exc.value.code == 0
    assert capsys.readouterr().out == f"hcqa {importlib.metadata.version('hcqa')}\n"


def test_an_unexpected_error_is_one_line_that_says_how_to_see_more(
    broken_info: None, capsys: pytest.CaptureFixture[str]
) -> None:
    assert cli.main(["info"]) == 2
    err = capsys.readouterr().err
    assert err == (
        "hcqa: error: RuntimeError: the engine fell over "
        "(--traceback or HCQA_DEBUG=1 shows where)\n"
    )


@pytest.mark.parametrize(
    ("argv", "env"),
    [(["--traceback", "info"], None), (["info", "--traceback"], None), (["info"], "1")],
)
def test_traceback_on_request(
    argv: list[str],
    env: str | None,
    broken_info: None,
    monkeypatch: pytest.MonkeyPatch,
    capsys: pytest.CaptureFixture[str],
) -> None:
    if env is not None:
        monkeypatch.setenv("HCQA_DEBUG", env)
    assert cli.main(argv) == 2
    err = capsys.readouterr().err
    assert err.startswith("Traceback (most recent call last):")
    assert "in _boom" in err and "RuntimeError: the engine fell over" in err
    assert err.endswith("hcqa: error: RuntimeError: the engine fell over\n")


@pytest.mark.parametrize("value", ["", "0", "no"])
def test_hcqa_debug_off_values(
    value: str,
    broken_info: None,
    monkeypatch: pytest.MonkeyPatch,
    capsys: pytest.CaptureFixture[str],
) -> None:
    monkeypatch.setenv("HCQA_DEBUG", value)
    assert cli.main(["info"]) == 2
    assert "Traceback" not in capsys.readouterr().err


def test_traceback_after_a_nested_subcommand(
    tmp_path: object, capsys: pytest.CaptureFixture[str]
) -> None:
    assert cli.main(["trace", "summary", "--traceback", "/nonexistent/t.json"]) == 2
    err = capsys.readouterr().err
    assert "Traceback" in err and err.endswith(
        "hcqa: error: cannot read trace '/nonexistent/t.json': No such file or directory\n"
    )


def test_the_installed_command_runs() -> None:
    proc = subprocess.run(
        [sys.executable, "-m", "hcqa.cli", "-V"], capture_output=True, text=True, timeout=60
    )
    assert proc.returncode == 0 and proc.stdout.startswith("hcqa ")


# -- hcqa bench: the runner and its one summary table ------------------------------------------

REPORT_LINES = [
    "## Memory-only write (value word only, no eventfd) after 0.3 s idle",
    "hcqa p50 = 1.45x the raw eventfd floor (target ≤ 2x: met); p99 = 1.10x.",
    "target: seen within 100 ms: MISSED",
    "- target 1a launch+await Python kernel <= 1.0x to_thread (p50): MISSED (1.24x: 80 µs)",
    "- target 3c transfer 256 MiB >= 0.8x numpy.copyto: skipped (not measured in a quick run)",
    "- idle CPU < 5.0 % of a core (0.0 %): met",
    "- latency 16 float32 ≤ 0.3x Ray's (no Ray numbers): n/a",
    "| S_hcqa / S_ctrl | 2.27 (rounds: 0.99, 4.29) | >= 0.85 | met |",
    "| case | throughput |",
    "a line that says nothing about targets: it met a friend",
]


def test_the_runner_reads_every_verdict_form() -> None:
    got = [(v.target, v.state) for v in _benchrun.verdicts(REPORT_LINES)]
    assert got == [
        ("hcqa p50 = 1.45x the raw eventfd floor (target ≤ 2x)", "met"),
        ("Memory-only write: seen within 100 ms", "MISSED"),
        ("1a launch+await Python kernel <= 1.0x to_thread (p50) (1.24x: 80 µs)", "MISSED"),
        ("3c transfer 256 MiB >= 0.8x numpy.copyto (not measured in a quick run)", "skipped"),
        ("idle CPU < 5.0 % of a core (0.0 %)", "met"),
        ("latency 16 float32 ≤ 0.3x Ray's (no Ray numbers)", "n/a"),
        ("S_hcqa / S_ctrl 2.27 (rounds: 0.99, 4.29) >= 0.85", "met"),
    ]


def _outcome(name: str, code: int, lines: list[str]) -> _benchrun.Outcome:
    return _benchrun.Outcome(
        name=name,
        returncode=code,
        seconds=1.0,
        report=Path(f"/r/{name}.txt"),
        verdicts=tuple(_benchrun.verdicts(lines)),
        last_line=lines[-1] if lines else "",
    )


def test_a_quick_summary_is_indicative_and_never_missed() -> None:
    outcomes = [_outcome("bench_a", 0, REPORT_LINES), _outcome("bench_b", 0, ["nothing"])]
    text, failed = _benchrun.summary(outcomes, quick=True, reports=Path("/r"))
    assert "MISSED" not in text and not failed
    assert "indicative (below target)" in text and "indicative (at target)" in text
    assert "sizes too small to judge the targets" in text and "full reports: /r/" in text
    assert "(no target judged; see its report)" in text
    assert "its report is printed above" not in text


def test_a_full_summary_judges_and_fails_on_a_miss_or_a_crash() -> None:
    ok = _outcome("bench_ok", 0, ["- target x: met (1x)"])
    text, failed = _benchrun.summary([ok], quick=False, reports=Path("/r"))
    assert not failed and "indicative" not in text
    missed = _outcome("bench_pipeline", 1, ["| r | 0.5 | >= 0.85 | MISSED |"])
    text, failed = _benchrun.summary([ok, missed], quick=False, reports=Path("/r"))
    assert failed and "MISSED" in text
    crashed = _outcome("bench_c", 2, ["Traceback ...", "ImportError: no module named ray"])
    text, failed = _benchrun.summary([ok, crashed], quick=False, reports=Path("/r"))
    assert failed and "FAILED" in text and "exited 2: ImportError: no module named ray" in text


def test_the_runner_runs_a_benchmark_and_keeps_its_report(tmp_path: Path) -> None:
    root = tmp_path / "checkout"
    (root / "bench").mkdir(parents=True)
    (root / "bench" / "__init__.py").write_text("")
    (root / "bench" / "bench_fake.py").write_text(
        "import sys\n"
        "print('# fake', sys.argv[1:])\n"
        "print('- target speed >= 1x the floor: met (1.5x)')\n"
    )
    outcomes, folder = _benchrun.run_benches(
        ["bench_fake"], root=root, quick=True, reports=tmp_path / "reports"
    )
    (o,) = outcomes
    assert o.returncode == 0 and folder == tmp_path / "reports"
    assert [(v.target, v.state) for v in o.verdicts] == [("speed >= 1x the floor (1.5x)", "met")]
    assert o.report.read_text().startswith("# fake ['--quick']\n")


def _hcqa_script() -> str:
    """The ``hcqa`` command installed beside this interpreter, as a user's shell finds it."""
    script = Path(sys.executable).with_name("hcqa")
    assert script.is_file(), f"the hcqa console script is not installed ({script})"
    return str(script)


def test_hcqa_bench_runs_from_any_directory_as_users_run_it(tmp_path: Path) -> None:
    # The command found the wrong folder once (one level off), in every checkout: run it as a
    # user does, from another directory, and see a real benchmark run and its verdict printed.
    proc = subprocess.run(
        [_hcqa_script(), "bench", "--quick", "--no-progress", "pipeline"],
        cwd=tmp_path,
        capture_output=True,
        text=True,
        timeout=300,
        check=False,
    )
    assert proc.returncode == 0, proc.stderr
    out = proc.stdout
    assert "1 benchmark(s), quick runs (indicative only): bench_pipeline" in out
    assert "S_hcqa / S_ctrl" in out and "indicative (" in out, out
    assert "FAILED" not in out


def test_hcqa_bench_outside_a_checkout_says_how_to_get_one(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    import hcqa

    # hcqa installed from a wheel (site-packages has no bench/), run from a folder that is not
    # a checkout either.
    site = tmp_path / "site-packages" / "hcqa"
    site.mkdir(parents=True)
    monkeypatch.setattr(hcqa, "__file__", str(site / "__init__.py"))
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    monkeypatch.chdir(elsewhere)
    assert cli.main(["bench", "pipeline"]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "pip install -e ." in err and "inside one" in err

    # ... and from inside a checkout (a subfolder of it), that checkout is the one run.
    checkout = tmp_path / "checkout"
    (checkout / "bench").mkdir(parents=True)
    (checkout / "bench" / "__init__.py").write_text("")
    (checkout / "pyproject.toml").write_text("[project]\nname = 'hcqa'\n")
    (checkout / "docs").mkdir()
    assert _benchrun.find_checkout(checkout / "docs") == checkout
    assert _benchrun.find_checkout(elsewhere) is None


def test_output_into_a_pipe_that_closes_stops_quietly(tmp_path: Path) -> None:
    # `hcqa ... | head -3`: head exits early and the next write hits a closed pipe. That is
    # no error of the command's: no "BrokenPipeError" line, no traceback at exit.
    proc = subprocess.Popen(
        [_hcqa_script(), "info"],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        cwd=tmp_path,
    )
    assert proc.stdout is not None and proc.stderr is not None
    proc.stdout.close()  # before the command writes anything: its first write fails
    err = proc.stderr.read().decode()
    assert proc.wait(timeout=60) in (0, 1)
    assert err == ""


def test_info_without_any_cuda_package_says_so(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    """A fresh venv with no ``cuda`` package at all (not even the namespace): ``hcqa info``
    says cuda-bindings is not installed instead of failing on find_spec's import."""
    from hcqa.cli import main

    for name in [m for m in sys.modules if m.startswith("cuda.")]:  # imported by other tests
        monkeypatch.delitem(sys.modules, name)
    monkeypatch.setitem(sys.modules, "cuda", None)
    assert main(["info"]) == 0
    (row,) = [line for line in capsys.readouterr().out.splitlines() if line.startswith("cuda:")]
    assert "cuda-bindings not installed (pip install -e '.[cuda]'" in row
