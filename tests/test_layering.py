"""Import layering, read from the sources (ast): who may import whom, and no import circle anywhere.

pdserve/ is the library every part imports, grouped by concern; prefill_worker/ and decode_worker/ depend
on it alone; the router composes them all (router/cli.py is the composition root). An import inside a
function, or under `if TYPE_CHECKING`, counts as much as one at the top of a module.
"""
from __future__ import annotations

import ast
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
SERVICES = ("router", "prefill_worker", "decode_worker")

# What each part may import, besides itself. Lowest first: a part imports only parts above its row. The
# modules at pdserve/'s root (config, hf_config, tiers, faults, derived, processes) are the vocabulary every
# package shares.
ALLOWED: dict[str, set[str]] = {
    "pdserve.tiers": set(),
    "pdserve.faults": set(),
    "pdserve.derived": set(),
    "pdserve.processes": set(),
    "pdserve.v1": set(),  # generated gRPC stubs
    "pdserve.hf_config": set(),
    "pdserve.config": {"pdserve.tiers", "pdserve.hf_config"},
    "pdserve.parallel": {"pdserve.config"},
    "pdserve.kernels": {"pdserve.derived"},
    "pdserve.model": {"pdserve.config", "pdserve.derived", "pdserve.parallel", "pdserve.kernels"},
    "pdserve.transfer": {"pdserve.config", "pdserve.faults", "pdserve.parallel"},
    "pdserve.perf": {"pdserve.config", "pdserve.parallel", "pdserve.transfer", "pdserve.model"},
    "pdserve.weights": {"pdserve.config", "pdserve.parallel", "pdserve.model", "pdserve.transfer", "pdserve.v1"},
    "pdserve.engine": {"pdserve.config", "pdserve.tiers", "pdserve.faults", "pdserve.derived", "pdserve.processes",
                       "pdserve.parallel", "pdserve.kernels", "pdserve.model", "pdserve.transfer", "pdserve.perf",
                       "pdserve.weights"},
    "pdserve.client": {"pdserve.v1"},
    "pdserve.loadgen": {"pdserve.tiers", "pdserve.client"},
    "pdserve.planner": {"pdserve.config", "pdserve.tiers", "pdserve.processes", "pdserve.parallel", "pdserve.model",
                        "pdserve.transfer", "pdserve.engine", "pdserve.loadgen", "pdserve.perf"},
    "pdserve.serving": {"pdserve.config", "pdserve.tiers", "pdserve.faults", "pdserve.parallel", "pdserve.kernels",
                        "pdserve.model", "pdserve.transfer", "pdserve.engine", "pdserve.perf", "pdserve.weights"},
    "pdserve.cli": {"pdserve.config", "pdserve.tiers", "pdserve.engine", "pdserve.client", "pdserve.loadgen",
                    "pdserve.planner"},
    "prefill_worker": {"pdserve"},
    "decode_worker": {"pdserve"},
    "router": {"pdserve", "prefill_worker", "decode_worker"},
}
FIRST_PARTY = {"pdserve", *SERVICES}


def module_name(path: Path) -> str:
    parts = list(path.relative_to(ROOT).with_suffix("").parts)
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def imported_modules(source: str) -> set[str]:
    """Every first-party module a source imports (absolute imports; `from p import m` may name a module)."""
    out = set()
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Import):
            out.update(a.name for a in node.names if a.name.split(".")[0] in FIRST_PARTY)
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            if node.module.split(".")[0] in FIRST_PARTY:
                out.update(f"{node.module}.{a.name}" for a in node.names)
    return out


def sources() -> dict[str, Path]:
    found = {}
    for top in FIRST_PARTY:
        for path in sorted((ROOT / top).rglob("*.py")):
            found[module_name(path)] = path
    return found


def resolve(name: str, modules: dict[str, Path]) -> str | None:
    """The module an imported name is: itself, or the module it is an attribute of."""
    while name and name not in modules:
        name = name.rpartition(".")[0]
    return name or None


def part(module: str) -> str:
    """The row of ALLOWED a module belongs to (its package, or the root module itself)."""
    p = module.split(".")
    if p[0] != "pdserve":
        return p[0]
    return "pdserve" if len(p) == 1 else f"pdserve.{p[1]}"


def graph() -> dict[str, set[str]]:
    modules = sources()
    edges = {}
    for name, path in modules.items():
        edges[name] = {m for m in (resolve(i, modules) for i in imported_modules(path.read_text()))
                       if m is not None and m != name}
    return edges


def layering_violations(edges: dict[str, set[str]]) -> list[str]:
    found = []
    for src, dsts in sorted(edges.items()):
        mine = part(src)
        if mine == "pdserve":
            continue  # pdserve/__init__.py: a docstring
        if mine not in ALLOWED:
            found.append(f"{src} is in no row of ALLOWED (a new package: give it one)")
            continue
        allowed = ALLOWED[mine]
        for dst in sorted(dsts):
            theirs = part(dst)
            if theirs != mine and theirs not in allowed and theirs.split(".")[0] not in allowed:
                found.append(f"{src} imports {dst} ({mine} may import {sorted(allowed) or 'nothing'})")
    return found


def cycles(edges: dict[str, set[str]]) -> list[list[str]]:
    """Every import circle (strongly connected components of more than one module), Tarjan's way."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    out = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in sorted(edges.get(v, ())):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = []
            while True:
                w = stack.pop()
                on_stack.discard(w)
                component.append(w)
                if w == v:
                    break
            if len(component) > 1:
                out.append(sorted(component))

    for v in sorted(edges):
        if v not in index:
            visit(v)
    return out


def test_every_import_follows_the_table():
    assert layering_violations(graph()) == []


def test_no_import_circle():
    assert cycles(graph()) == []


@pytest.mark.parametrize("package", SERVICES)
def test_a_worker_never_imports_the_other_or_the_router(package):
    edges = graph()
    bad = [f"{s} imports {d}" for s, ds in edges.items() if s.split(".")[0] == package
           for d in ds if d.split(".")[0] in set(SERVICES) - {package} - ALLOWED[package]]
    assert bad == []


def test_every_package_says_what_it_owns():
    for init in sorted((ROOT / "pdserve").glob("*/__init__.py")):
        doc = ast.get_docstring(ast.parse(init.read_text())) or ""
        assert len(doc) > 80, f"{init.relative_to(ROOT)}: a docstring saying what it owns and may import"


def test_the_checks_can_fail():
    source = "import os\nfrom pdserve.config import X\n\ndef f():\n    from router.cluster import Cluster\n" \
             "    import decode_worker.actor\n"
    assert imported_modules(source) == {"pdserve.config.X", "router.cluster.Cluster", "decode_worker.actor"}
    assert imported_modules("from . import sibling\n") == set()  # relative: inside its own package
    edges = {"pdserve.model.llama": {"pdserve.engine.runner"}, "pdserve.engine.runner": {"pdserve.model.llama"},
             "pdserve.engine.x": set()}
    assert cycles(edges) == [["pdserve.engine.runner", "pdserve.model.llama"]]
    assert layering_violations(edges) == [
        "pdserve.model.llama imports pdserve.engine.runner (pdserve.model may import "
        "['pdserve.config', 'pdserve.derived', 'pdserve.kernels', 'pdserve.parallel'])"]
    assert layering_violations({"pdserve.newpkg.mod": set()}) == [
        "pdserve.newpkg.mod is in no row of ALLOWED (a new package: give it one)"]
