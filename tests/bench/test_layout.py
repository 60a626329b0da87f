"""bench/'s layout, read from the sources (ast): a script imports no other script, only bench.common (the GPU
check's modules also each other); the product imports nothing of bench; every folder says what it holds."""
from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
BENCH = ROOT / "bench"
PRODUCT = ("pdserve", "router", "prefill_worker", "decode_worker")


def bench_imports(path: Path) -> set[str]:
    """The bench modules a source imports (absolute imports; `from bench.x import y` may name a module)."""
    out = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            out.update(a.name for a in node.names if a.name.split(".")[0] == "bench")
        elif isinstance(node, ast.ImportFrom) and node.module and node.module.split(".")[0] == "bench":
            out.update(f"{node.module}.{a.name}" for a in node.names)
    return out


def module_of(name: str) -> str:
    """The module an imported name is: itself, or the module it is an attribute of."""
    parts = name.split(".")
    while len(parts) > 1 and not (BENCH.parent.joinpath(*parts).with_suffix(".py").exists()
                                  or BENCH.parent.joinpath(*parts, "__init__.py").exists()):
        parts.pop()
    return ".".join(parts)


def test_a_script_imports_only_the_shared_module():
    bad = []
    for path in sorted(BENCH.rglob("*.py")):
        folder = path.relative_to(BENCH).parts[0]
        allowed = {"bench.common"} | ({"bench.gpu"} if folder == "gpu" else set())
        for name in sorted(bench_imports(path)):
            module = module_of(name)
            if module not in allowed and not any(module.startswith(a + ".") for a in allowed):
                bad.append(f"{path.relative_to(ROOT)} imports {module}")
    assert bad == []


def test_the_product_imports_nothing_of_bench():
    bad = [f"{p.relative_to(ROOT)}: {sorted(bench_imports(p))}" for top in PRODUCT
           for p in sorted((ROOT / top).rglob("*.py")) if bench_imports(p)]
    assert bad == []


def test_every_folder_says_what_it_holds():
    for init in [BENCH / "__init__.py", *sorted(BENCH.glob("*/__init__.py"))]:
        doc = ast.get_docstring(ast.parse(init.read_text())) or ""
        assert len(doc) > 80, f"{init.relative_to(ROOT)}: a docstring saying what the folder holds"
    folders = {p.parent for p in BENCH.glob("*/*.py")} | {p.parent for p in BENCH.glob("*/*.sh")}
    assert all((f / "__init__.py").exists() for f in folders), "a folder of bench/ without __init__.py"


def test_the_checks_can_fail(tmp_path):
    src = tmp_path / "x.py"
    src.write_text("import os\nfrom bench.common import Table\nfrom bench.cluster import compare_modes\n"
                   "def f():\n    import bench.router.router_scale\n")
    assert bench_imports(src) == {"bench.common.Table", "bench.cluster.compare_modes", "bench.router.router_scale"}
    assert module_of("bench.common.Table") == "bench.common"
    assert module_of("bench.cluster.compare_modes") == "bench.cluster.compare_modes"
