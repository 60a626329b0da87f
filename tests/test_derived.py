"""pdserve.derived: a conversion is made once, by one process, and every other that needs it meanwhile waits for it."""
from __future__ import annotations

import os
import threading
from pathlib import Path

import pytest

from pdserve.derived import cached_conversion

from conftest import wait_for


def _waiting_on(lock: Path) -> bool:
    """Whether some process is blocked on `lock`'s flock: /proc/locks lists a waiter as `N: -> FLOCK ...`
    with the file's device:inode."""
    inode = f":{os.stat(lock).st_ino} "
    with open("/proc/locks") as f:
        return any("->" in line and "FLOCK" in line and inode in line for line in f)


@pytest.fixture
def source(tmp_path, monkeypatch) -> Path:
    monkeypatch.setenv("PDSERVE_CACHE_DIR", str(tmp_path / "cache"))
    path = tmp_path / "model.gguf"
    path.write_bytes(b"weights")
    return path


@pytest.mark.skipif(not os.path.exists("/proc/locks"), reason="reads the kernel's lock table (Linux)")
def test_a_second_caller_waits_for_the_build_and_reads_it(source, tmp_path):
    builds: list[str] = []
    started, go = threading.Event(), threading.Event()

    def build(out: Path) -> None:
        builds.append(threading.current_thread().name)
        started.set()
        assert go.wait(30)
        (out / "done").write_text("converted")

    results: dict[str, Path] = {}

    def convert() -> None:
        results[threading.current_thread().name] = cached_conversion("kind", source, "done", build)

    first = threading.Thread(target=convert, name="first")
    first.start()
    assert started.wait(30)
    (lock,) = (tmp_path / "cache" / ".locks").iterdir()
    second = threading.Thread(target=convert, name="second")
    second.start()
    wait_for(lambda: _waiting_on(lock), timeout=30, what="the second caller to wait on the build's lock")
    go.set()
    first.join(30)
    second.join(30)
    assert builds == ["first"]
    assert results["first"] == results["second"]
    assert (results["second"] / "done").read_text() == "converted"
    assert list(results["first"].parent.iterdir()) == [results["first"]]  # no temp directory left


def test_a_failed_build_leaves_nothing_and_the_next_caller_builds(source):
    def fail(out: Path) -> None:
        (out / "half").write_text("")
        raise RuntimeError("conversion failed")

    with pytest.raises(RuntimeError, match="conversion failed"):
        cached_conversion("kind", source, "done", fail)
    made = cached_conversion("kind", source, "done", lambda out: (out / "done").write_text("ok"))
    assert (made / "done").read_text() == "ok" and not (made / "half").exists()
    assert cached_conversion("kind", source, "done", fail) == made  # made: read, not built again
