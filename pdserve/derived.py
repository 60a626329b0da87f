"""A local cache of conversions derived from a model file (tokenizers, dequantized weights)."""
from __future__ import annotations

import fcntl
import hashlib
import os
import shutil
import tempfile
from collections.abc import Callable
from pathlib import Path


def cache_root() -> Path:
    root = os.environ.get("PDSERVE_CACHE_DIR")
    return Path(root) if root else Path.home() / ".cache" / "pdserve"


def cached_conversion(kind: str, source: Path, marker: str, build: Callable[[Path], None]) -> Path:
    """The directory `build` fills from `source`, made on first use and reused while source is unchanged.

    `marker` names the file whose presence says the directory is complete. A replaced or rewritten
    source gets a new key, so a stale conversion is never reused. The directory is built in a sibling
    temp dir and renamed, so readers never see a half-written one. One process builds: the others that
    need it meanwhile (a cluster's workers starting at once) wait on the build's flock and then read what
    it made, rather than each converting the model again (~12 s of CPU for SmolLM2's GGUF).
    """
    source = source.resolve()
    stat = source.stat()
    key = hashlib.sha256(f"{source}\0{stat.st_size}\0{stat.st_mtime_ns}".encode()).hexdigest()
    target = cache_root() / kind / key
    if (target / marker).is_file():
        return target
    target.parent.mkdir(parents=True, exist_ok=True)
    locks = cache_root() / ".locks"  # apart: a kind's directory holds its conversions and nothing else
    locks.mkdir(exist_ok=True)
    with open(locks / f"{kind}-{key}", "a") as held:
        fcntl.flock(held, fcntl.LOCK_EX)  # released by the kernel if this process dies mid-build
        if (target / marker).is_file():  # built by another process while this one waited
            return target
        tmp = Path(tempfile.mkdtemp(prefix=f".{key}-", dir=target.parent))
        try:
            build(tmp)
            os.rename(tmp, target)
        except OSError:
            # The rename finds the target made only where a builder took no lock (an older pdserve sharing the
            # cache): that one is read.
            if not (target / marker).is_file():
                raise
        finally:
            shutil.rmtree(tmp, ignore_errors=True)
    return target
