"""``hcqa info`` on OpenCL, run as a user runs it: the devices in ``opencl:N`` order, the thread
settings in force (hcqa's PoCL default, or the user's own), a missing PyOpenCL and a missing
``ld`` said in words."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("pyopencl")

BIN = Path(sys.executable).parent


def _env(**changes: str | None) -> dict[str, str]:
    env = dict(os.environ)
    for name in ("POCL_MAX_PTHREAD_COUNT", "OPENBLAS_NUM_THREADS", "OMP_NUM_THREADS"):
        env.pop(name, None)
    for name, value in changes.items():
        if value is None:
            env.pop(name, None)
        else:
            env[name] = value
    return env


def _info(env: dict[str, str]) -> dict[str, str]:
    """``hcqa info``'s rows, by name."""
    script = BIN / "hcqa"  # the installed command, as a user types it
    command = [str(script)] if script.exists() else [sys.executable, "-m", "hcqa.cli"]
    proc = subprocess.run(
        [*command, "info"],
        capture_output=True,
        text=True,
        timeout=120,
        env=env,
        cwd=Path(__file__).parent,
    )
    assert proc.returncode == 0, proc.stderr
    rows = {}
    for line in proc.stdout.splitlines():
        name, _, value = line.partition(": ")
        rows[name.rstrip(":").strip()] = value.strip()
    return rows


def _raw_devices(env: dict[str, str]) -> list[tuple[str, int]]:
    """(name, compute units) of every device over all platforms, straight from PyOpenCL."""
    code = (
        "import pyopencl as cl\n"
        "for p in cl.get_platforms():\n"
        "    for d in p.get_devices(): print(d.max_compute_units, d.name.strip())\n"
    )
    out = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, timeout=120, env=env
    )
    assert out.returncode == 0, out.stderr
    return [(n, int(cu)) for cu, n in (line.split(" ", 1) for line in out.stdout.splitlines())]


def _units(row: str) -> int:
    m = re.search(r"(\d+) compute units", row)
    assert m is not None, row
    return int(m.group(1))


def test_info_lists_every_device_in_spec_order_with_hcqas_pocl_default() -> None:
    from hcqa.devices.opencl.platforms import default_pocl_threads

    rows = _info(_env())
    default = str(default_pocl_threads())
    assert rows["POCL_MAX_PTHREAD_COUNT"].startswith(f"{default} (hcqa's default")
    # the same machine seen by raw PyOpenCL with that setting: same devices, same order, and
    # PoCL's compute units show the default reached PoCL before its first platform query
    raw = _raw_devices(_env(POCL_MAX_PTHREAD_COUNT=default))
    assert raw, "this test needs an OpenCL device (PoCL comes with the [test] extra)"
    assert rows["opencl"].endswith(f"{len(raw)} device(s)")
    for i, (name, units) in enumerate(raw):
        row = rows[f"opencl:{i}"]
        assert row.startswith(name) and _units(row) == units
    assert f"opencl:{len(raw)}" not in rows
    assert rows["ld"].endswith("/ld")


def test_info_respects_the_users_own_pocl_setting() -> None:
    rows = _info(_env(POCL_MAX_PTHREAD_COUNT="1"))
    assert rows["POCL_MAX_PTHREAD_COUNT"] == "1 (yours)"
    pocl = [i for i, (name, _) in enumerate(_raw_devices(_env())) if name.startswith("pthread")]
    if pocl:  # PoCL's CPU device has as many compute units as worker threads
        assert _units(rows[f"opencl:{pocl[0]}"]) == 1


def test_info_says_how_to_install_pyopencl_when_it_is_missing(tmp_path: Path) -> None:
    shadow = tmp_path / "pyopencl"  # what a user without the extra sees: no importable pyopencl
    shadow.mkdir()
    (shadow / "__init__.py").write_text("raise ImportError('No module named pyopencl')\n")
    rows = _info(_env(PYTHONPATH=str(tmp_path)))
    assert rows["opencl"].startswith("PyOpenCL not installed")
    assert "pip install -e '.[opencl]'" in rows["opencl"]
    assert not any(name.startswith("opencl:") for name in rows)


def test_info_warns_when_ld_is_not_on_path() -> None:
    rows = _info(_env(PATH=str(BIN)))  # the venv's own bin: python, no binutils
    assert rows["ld"].startswith("NOT FOUND on PATH")
    assert "aborts" in rows["ld"] and "binutils" in rows["ld"]
    assert "opencl:0" in rows  # listing needs no linker: only a kernel's first launch does


def test_contention_is_said_when_pocl_and_blas_threads_outnumber_the_cores(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    from hcqa.devices.opencl import platforms

    monkeypatch.setattr(platforms, "_usable_cores", lambda: 4)
    monkeypatch.setenv("POCL_MAX_PTHREAD_COUNT", "2")
    monkeypatch.setattr(platforms, "blas_threads", lambda: 2)
    assert platforms.contention() is None  # 2 + 2 on 4 cores: each has its own
    monkeypatch.setattr(platforms, "blas_threads", lambda: 4)
    warning = platforms.contention()
    assert warning is not None
    assert "PoCL 2 + BLAS 4 threads on 4 cores" in warning and "limit BLAS to 2" in warning
    monkeypatch.delenv("POCL_MAX_PTHREAD_COUNT")  # unset: hcqa's default (half) is what counts
    warning = platforms.contention()
    assert warning is not None and "PoCL 2 + BLAS 4" in warning
    monkeypatch.setattr(platforms, "blas_threads", lambda: None)  # no threadpoolctl: unknown
    assert platforms.contention() is None
