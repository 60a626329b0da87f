"""Import layering, read from the sources (ast): the library imports no service, a worker not the other.

pdserve/ is the library every part imports; prefill_worker/ and decode_worker/ depend on it alone; the
router composes them all (router/cli.py is the composition root). An import inside a function counts
as much as one at the top of a module.
"""
from __future__ import annotations

import ast
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
FORBIDDEN = {
    "pdserve": {"router", "prefill_worker", "decode_worker"},
    "prefill_worker": {"router", "decode_worker"},
    "decode_worker": {"router", "prefill_worker"},
}


def imported_packages(source: str) -> set[str]:
    """Top-level package of every module a source imports (absolute imports)."""
    out = set()
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Import):
            out.update(alias.name.split(".")[0] for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            out.add(node.module.split(".")[0])
    return out


def violations(package: str) -> list[str]:
    found = []
    for path in sorted((ROOT / package).rglob("*.py")):
        bad = imported_packages(path.read_text()) & FORBIDDEN[package]
        found += [f"{path.relative_to(ROOT)} imports {name}" for name in sorted(bad)]
    return found


@pytest.mark.parametrize("package", sorted(FORBIDDEN))
def test_no_forbidden_imports(package):
    assert violations(package) == []


def test_the_check_sees_imports_anywhere_in_a_module():
    source = "import os\nfrom pdserve.config import X\n\ndef f():\n    from router.cluster import Cluster\n" \
             "    import decode_worker.actor\n"
    assert imported_packages(source) == {"os", "pdserve", "router", "decode_worker"}
    assert imported_packages("from . import sibling\n") == set()  # relative: inside its own package
