"""The CPU kernels of pdserve: one C++ extension (pdserve/kernels/csrc/*.cpp), built once per machine and cached.

It defines the torch ops ``torch.ops.pdserve.paged_decode_attention_out`` (pdserve.kernels.cpu_attention) and
``torch.ops.pdserve.linear`` (pdserve.model.linear). Each caller checks ``available()`` and keeps a torch
path for when the build fails or the inputs do not fit.

Build: compiled on first use with torch.utils.cpp_extension (needs a C++ compiler and ninja) into
``$TORCH_EXTENSIONS_DIR`` when set, else ``pdserve.derived.cache_root() / "torch_extensions"``
(``$PDSERVE_CACHE_DIR``, default ~/.cache/pdserve), in a directory named after the Python and torch
versions and a hash of the sources (their place and their text), so processes and runs share one build and
rebuild only when a source or a flag changes, and two checkouts (or branches) used in turn each keep their own
build instead of rebuilding the one directory each time (~18 s).
The first build takes ~18 s on 2 cores (28 s of CPU); later processes only load the library that a finished build
stamped (its size, time and flags in ``pdserve.built``), without torch's build path (workers call
``available()`` at start-up so no request pays for it). Flags: ``-O3`` and OpenMP (to use torch's
thread pool); the hot functions are multiversioned in the sources (AVX2+FMA and baseline x86-64, picked
at load time), so one build is portable without ``-march=native``. If the build fails, one warning is
logged and the process uses the torch paths from then on.

Environment, read at every call (A/B runs, debugging): ``PDSERVE_CPU_KERNELS=torch`` forces the torch
path of every kernel, ``auto`` (or unset) uses a kernel wherever the inputs allow it;
``PDSERVE_CPU_ATTENTION=torch`` forces it for decode attention alone.
"""
from __future__ import annotations

import fcntl
import functools
import hashlib
import logging
import os
import shutil
import sys
import threading
from pathlib import Path

import torch

log = logging.getLogger(__name__)

ENV_VAR = "PDSERVE_CPU_KERNELS"
_NAME = "pdserve_cpu_kernels"
_SOURCE_DIR = Path(__file__).resolve().parent / "csrc"
_SOURCES = sorted(_SOURCE_DIR.glob("*.cpp"))

_lock = threading.Lock()
_loaded = False
_failed = False  # the build failed in this process: never try again
_warned_values: set[str] = set()


def build_directory() -> Path:
    """Where the extension is built and cached (created on demand)."""
    root = os.environ.get("TORCH_EXTENSIONS_DIR")
    if root:
        base = Path(root)
    else:
        from pdserve.derived import cache_root

        base = cache_root() / "torch_extensions"
    tag = f"py{sys.version_info.major}{sys.version_info.minor}-torch{torch.__version__}".replace("+", "_")
    return base / tag / f"{_NAME}-{sources_key(_SOURCE_DIR)}"


@functools.cache
def sources_key(source_dir: Path) -> str:
    """A hash of the sources' directory and of every source and header in it. The build's ninja file names the
    sources by path, so one directory shared by two checkouts (even of the same sources) is rebuilt whenever
    the other one last built it."""
    digest = hashlib.sha256(str(source_dir).encode())
    for f in sorted(source_dir.iterdir()):
        if f.suffix in (".cpp", ".h"):
            digest.update(f"\0{f.name}\0".encode())
            digest.update(f.read_bytes())
    return digest.hexdigest()[:16]


def _openmp_flags() -> list[str]:
    if "parallel backend: OpenMP" in torch.__config__.parallel_info():
        # at::parallel_for is inline over `#pragma omp parallel`: without -fopenmp it runs serially. The
        # library links libgomp.so.1, which resolves to the copy torch has already loaded (same soname).
        return ["-fopenmp"]
    return []


_CFLAGS = ["-O3"]


def _library(directory: Path) -> Path:
    return directory / f"{_NAME}.so"


def _stamp(library: Path) -> str:
    """What a finished build writes: the library's size and time, and the flags it was built with."""
    st = library.stat()
    return " ".join([str(st.st_size), str(st.st_mtime_ns), *_CFLAGS, *_openmp_flags()])


def _stamped(directory: Path) -> bool:
    """Whether the library in `directory` is the one its last finished build stamped, with today's flags (a
    link killed midway leaves a file that crashes the loader, and that ninja would take as up to date)."""
    try:
        return (directory / "pdserve.built").read_text() == _stamp(_library(directory))
    except OSError:
        return False


def _load_stamped(directory: Path) -> bool:
    """Load the library in `directory` if a finished build stamped it (the caller holds the build's flock)."""
    if not _stamped(directory):
        return False
    torch.ops.load_library(str(_library(directory)))
    return True


def _load_built(directory: Path) -> bool:
    """Load the library a finished build left in `directory` (False if there is none): under the build's flock,
    shared, so that no build is writing it. This skips torch's build path (its import of setuptools and a
    ninja run: ~0.12 s of CPU in every process that loads the kernels)."""
    if not (directory / "pdserve.built").is_file():
        return False
    with open(directory / "pdserve.flock", "a") as held:
        fcntl.flock(held, fcntl.LOCK_SH)
        return _load_stamped(directory)


def _build() -> None:
    directory = build_directory()
    if _load_built(directory):
        return
    from torch.utils import cpp_extension

    compiler = os.environ.get("CXX", "c++")
    if shutil.which(compiler) is None:
        raise RuntimeError(f"no C++ compiler ({compiler!r}, or $CXX) on PATH")
    if shutil.which("ninja") is None:
        # The `ninja` wheel puts its binary next to the interpreter, which is not on PATH unless the
        # virtual environment is activated; torch looks for it on PATH.
        try:
            import ninja

            os.environ["PATH"] = ninja.BIN_DIR + os.pathsep + os.environ.get("PATH", "")
        except ImportError:
            pass
    openmp = _openmp_flags()
    directory.mkdir(parents=True, exist_ok=True)
    # torch's own build lock is a file that a killed build leaves behind, and every later build then
    # waits on it forever. Builds take an flock first (the kernel drops it when its process dies): whoever
    # holds it is the only builder, so a torch lock file found then is a dead build's, and is removed.
    with open(directory / "pdserve.flock", "w") as held:
        fcntl.flock(held, fcntl.LOCK_EX)
        if _load_stamped(directory):  # built by another process while this one waited
            return
        _library(directory).unlink(missing_ok=True)  # unstamped: linked again from the objects
        stale = directory / "lock"
        if stale.exists():
            log.warning("CPU kernels: removing %s, left by a build that did not finish", stale)
            stale.unlink(missing_ok=True)
        cpp_extension.load(name=_NAME, sources=[str(s) for s in _SOURCES], extra_cflags=[*_CFLAGS, *openmp],
                           extra_ldflags=openmp, build_directory=str(directory), is_python_module=False,
                           verbose=False)
        (directory / "pdserve.built").write_text(_stamp(_library(directory)))


def available() -> bool:
    """Whether the kernels are built and loaded (building them now if this process has not tried yet)."""
    global _loaded, _failed
    if not _loaded and not _failed:
        with _lock:
            if not _loaded and not _failed:
                try:
                    _build()
                    _loaded = True
                except Exception as e:  # noqa: BLE001 - any build or load failure means: use torch
                    _failed = True
                    log.warning("CPU kernels unavailable, using the torch paths: %s", e)
    return _loaded


def applies(t: torch.Tensor) -> bool:
    """Whether ops on this activation take the CPU kernels: a CPU tensor of a dtype they cover (fp32,
    bf16), kernels not forced off, and built."""
    return t.is_cpu and t.dtype in (torch.float32, torch.bfloat16) and enabled() and available()


def enabled(env_var: str = ENV_VAR) -> bool:
    """False when PDSERVE_CPU_KERNELS (or the given switch) forces the torch path."""
    value = os.environ.get(env_var, "auto").strip().lower()
    if value in ("", "auto"):
        return True
    if value == "torch":
        return False
    if value not in _warned_values:
        _warned_values.add(value)
        log.warning("%s=%r not understood (expected 'auto' or 'torch'); using 'auto'", env_var, value)
    return True
