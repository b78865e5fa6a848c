"""Issue 13 item 6: paths another user could prepare. The C kernel cache is private and
never loads a library it can't trust; the Tracer writes through an unpredictable temp file,
never follows a planted symlink, and says at once when it can't write its trace."""

from __future__ import annotations

import ctypes
import json
import os
import stat
import uuid
import warnings
from pathlib import Path

import numpy as np
import pytest
import trio

import hcqa
from hcqa import InvalidCommand
from hcqa._native.compiler import compile_c

NOBODY = 65534
as_root = pytest.mark.skipif(os.getuid() != 0, reason="needs root to chown to another user")


def _source(tag: str, delta: str = "1.0f") -> str:
    """A unique add kernel (its own cache key), ``out = a + delta``."""
    return (
        f"/* {tag} */ void addk(float *out, const float *a, int n) "
        f"{{ for (int i = 0; i < n; i++) out[i] = a[i] + {delta}; }}"
    )


def _run(kernel: hcqa._native.compiler.CKernel) -> float:
    a = np.zeros(4, np.float32)
    out = np.empty(4, np.float32)
    kernel.fn(out.ctypes.data_as(ctypes.c_void_p), a.ctypes.data_as(ctypes.c_void_p), 4)
    return float(out[0])


def _mode(path: Path) -> int:
    return stat.S_IMODE(os.stat(path).st_mode)


# -- the C kernel cache ---------------------------------------------------------------------------


def test_the_cache_dir_is_made_private(tmp_path: Path) -> None:
    root = tmp_path / "a" / "cache"
    k = compile_c(_source(uuid.uuid4().hex), "addk", cache_dir=root)
    assert _mode(root) == 0o700
    assert _mode(Path(k.path)) & 0o077 == 0
    assert _run(k) == 1.0


def test_the_default_cache_dir_is_private(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("HCQA_CACHE_DIR", raising=False)
    monkeypatch.setenv("HOME", str(tmp_path))
    k = compile_c(_source(uuid.uuid4().hex), "addk")
    root = tmp_path / ".cache" / "hcqa" / "kernels"
    assert Path(k.path).parent == root and _mode(root) == 0o700


def test_an_open_cache_dir_of_ours_is_tightened(tmp_path: Path) -> None:
    root = tmp_path / "shared"
    root.mkdir()
    os.chmod(root, 0o777)
    compile_c(_source(uuid.uuid4().hex), "addk", cache_dir=root)
    assert _mode(root) == 0o700


@as_root
def test_a_cache_dir_of_another_user_is_refused(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    root = tmp_path / "theirs"
    root.mkdir(mode=0o755)
    os.chown(root, NOBODY, NOBODY)
    monkeypatch.setenv("HCQA_CACHE_DIR", str(root))
    with pytest.raises(
        InvalidCommand,
        match=rf"must be owned by you \(uid 0\).*\(got a directory of uid {NOBODY}\)",
    ):
        compile_c(_source(uuid.uuid4().hex), "addk")
    assert list(root.iterdir()) == []


def _plant(tmp_path: Path, cache: Path, source: str) -> Path:
    """Put a library that adds 666 where ``source``'s cache entry goes; return its path."""
    key = Path(compile_c(source, "addk", cache_dir=tmp_path / "probe").path).name
    evil = compile_c(_source(uuid.uuid4().hex, "666.0f"), "addk", cache_dir=tmp_path / "evil")
    cache.mkdir(mode=0o700, exist_ok=True)
    planted = cache / key
    planted.write_bytes(Path(evil.path).read_bytes())
    return planted


@pytest.mark.parametrize("how", ["group-writable", "world-writable", "symlink", "other-user"])
def test_a_planted_library_is_never_loaded(tmp_path: Path, how: str) -> None:
    if how == "other-user" and os.getuid() != 0:
        pytest.skip("needs root to chown to another user")
    source = _source(uuid.uuid4().hex)
    cache = tmp_path / "cache"
    planted = _plant(tmp_path, cache, source)
    if how == "group-writable":
        os.chmod(planted, 0o775)
    elif how == "world-writable":
        os.chmod(planted, 0o757)
    elif how == "symlink":
        target = tmp_path / "elsewhere.so"
        planted.rename(target)
        planted.symlink_to(target)
    else:
        os.chmod(planted, 0o755)
        os.chown(planted, NOBODY, NOBODY)
    k = compile_c(source, "addk", cache_dir=cache)
    assert _run(k) == 1.0  # compiled afresh, not the planted +666
    st = os.lstat(k.path)
    assert stat.S_ISREG(st.st_mode) and st.st_uid == os.getuid() and not st.st_mode & 0o077


def test_a_trusted_library_is_reused(tmp_path: Path) -> None:
    """The baseline: a cached library of ours is loaded as is (no second compile)."""
    source = _source(uuid.uuid4().hex)
    first = compile_c(source, "addk", cache_dir=tmp_path)
    mtime = os.stat(first.path).st_mtime_ns
    again = compile_c(source, "addk", cache_dir=tmp_path)
    assert again.path == first.path and os.stat(again.path).st_mtime_ns == mtime


# -- the Tracer -----------------------------------------------------------------------------------


async def _tiny() -> None:
    async with hcqa.open_device("cpu:0") as d:
        await d.alloc(8).copyin(bytes(8))


def test_the_tracer_replaces_a_planted_symlink_instead_of_following_it(tmp_path: Path) -> None:
    victim = tmp_path / "victim"
    victim.write_text("precious")
    target = tmp_path / "trace.json"
    target.symlink_to(victim)
    trio.run(_tiny, instruments=[hcqa.Tracer(target)])
    assert victim.read_text() == "precious"
    assert not target.is_symlink() and "traceEvents" in json.loads(target.read_text())


def test_the_tracer_uses_no_predictable_temp_path(tmp_path: Path) -> None:
    victim = tmp_path / "victim"
    victim.write_text("precious")
    target = tmp_path / "trace.json"
    for guess in (f"{target}.tmp{os.getpid()}", f"{target}.tmp", f"{target}~"):
        Path(guess).symlink_to(victim)
    trio.run(_tiny, instruments=[hcqa.Tracer(target)])
    assert victim.read_text() == "precious"
    assert "traceEvents" in json.loads(target.read_text())
    assert sorted(p.name for p in tmp_path.iterdir() if not p.is_symlink()) == [
        "trace.json",
        "victim",
    ]  # no temp file left behind


def test_an_unwritable_trace_path_is_refused_at_construction(tmp_path: Path) -> None:
    with pytest.raises(InvalidCommand, match=r"can't write the trace to .*No such file"):
        hcqa.Tracer(tmp_path / "missing" / "trace.json")
    with pytest.raises(InvalidCommand, match=r"must be a file \(got a directory"):
        hcqa.Tracer(tmp_path)
    with pytest.raises(InvalidCommand, match=r"'path' must be a str or os.PathLike \(got int\)"):
        hcqa.Tracer(3)  # type: ignore[arg-type]


def test_a_trace_that_cannot_be_saved_at_the_end_is_reported(tmp_path: Path) -> None:
    folder = tmp_path / "gone"
    folder.mkdir()
    tracer = hcqa.Tracer(folder / "trace.json")
    folder.rmdir()  # after construction: the save at the end of the run fails
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        trio.run(_tiny, instruments=[tracer])
    messages = [str(w.message) for w in caught if issubclass(w.category, RuntimeWarning)]
    assert any("can't write the trace to" in m and "trace.json" in m for m in messages), messages
    with pytest.raises(OSError, match="can't write the trace to"):
        tracer.save()
