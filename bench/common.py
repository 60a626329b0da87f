"""What the scripts in bench/ share: their argument parser, the local cluster they serve from, `pdserve
profile` and `pdserve bench` in their own processes, JSON results, fixed-width tables, and the simulators'
roofline and trace draws.

The scripts run as `python bench/NAME.py`, so this directory is first on sys.path and `from common import ...`
finds this file (as `from tp_cpu import ...` finds a sibling script). Importing it puts the checkout's root on
sys.path too, for pdserve, router and the workers without an install. It imports only the standard library
itself; what it needs of pdserve and router it imports when called, so `--help` stays fast.
"""
from __future__ import annotations

import argparse
import asyncio
import json
import subprocess
import sys
from contextlib import asynccontextmanager
from pathlib import Path
from typing import Any, NamedTuple

ROOT = Path(__file__).resolve().parent.parent
if str(ROOT) not in sys.path:  # run as a script from a checkout
    sys.path.insert(0, str(ROOT))


# -- arguments and results -----------------------------------------------------------------------------
def parser(doc: str) -> argparse.ArgumentParser:
    """The parser of a script whose docstring, as written, is its --help text."""
    return argparse.ArgumentParser(description=doc, formatter_class=argparse.RawDescriptionHelpFormatter)


def add_prompt_args(ap: argparse.ArgumentParser, max_len: int, output_len: int) -> None:
    """--model and a batch of seeded random prompts: --num-prompts of --min-len to --max-len tokens, --output-len
    tokens out each (the scripts that time one batch, offline and through the cluster)."""
    ap.add_argument("--model", default=None, help="GGUF file or HF directory (default: SmolLM2-135M-Instruct)")
    ap.add_argument("--num-prompts", type=int, default=32)
    ap.add_argument("--min-len", type=int, default=16)
    ap.add_argument("--max-len", type=int, default=max_len)
    ap.add_argument("--output-len", type=int, default=output_len)


def write_json(path: str | Path, data: Any) -> None:
    Path(path).write_text(json.dumps(data, indent=1) + "\n")


# -- a local cluster -------------------------------------------------------------------------------------
# Ray itself is started once per script with router.pools.init_local_ray (loopback, a small object store).
@asynccontextmanager
async def local_cluster(config):
    """A started router.cluster.Cluster of config's pools, shut down on the way out."""
    from router.cluster import Cluster

    cluster = Cluster(config)
    await cluster.start()
    try:
        yield cluster
    finally:
        await cluster.shutdown()


@asynccontextmanager
async def local_router(cluster, **settings):
    """The gRPC router over cluster on 127.0.0.1, any free port (router.port), RouterConfig's other settings
    as given; stopped on the way out (5 s for requests in flight)."""
    from router.server import Router, RouterConfig

    router = Router(cluster, RouterConfig(port=0, **settings))
    await router.start()
    try:
        yield router
    finally:
        await router.stop(grace=5)


def pdserve_profile(out: str | Path) -> None:
    """`pdserve profile` of this machine with one torch thread (as each worker of a local cluster gets) into out."""
    subprocess.run([sys.executable, "-m", "pdserve.cli", "profile", "--threads", "1", "--output", str(out)],
                   check=True, cwd=ROOT)


async def pdserve_bench(port: int, bench_args: list[str], label: str, out: Path) -> int:
    """`pdserve bench` against the router on port, in its own process (the client's work must not run on the
    router's event loop), its report written to out; its exit status."""
    proc = await asyncio.create_subprocess_exec(
        sys.executable, "-m", "pdserve.cli", "bench", "--target", f"127.0.0.1:{port}", *bench_args,
        "--label", label, "--output", str(out), cwd=str(ROOT))
    return await proc.wait()


def bench_report(out: Path, rc: int, failed: str) -> dict:
    """The report pdserve_bench wrote to out; exits with `failed (exit rc)` when the run failed."""
    if rc != 0 or not out.exists():
        raise SystemExit(f"{failed} (exit {rc})")
    return json.loads(out.read_text())


# -- tables ----------------------------------------------------------------------------------------------
class Table:
    """Fixed-width columns, made a line at a time (a benchmark prints each row as it is measured).

    columns: (title, width, spec) each. A cell is format(value, width + spec), right-aligned; a spec starting
    with "<" aligns the column left, title included (a column of row names). A str cell is only aligned, so
    a row can carry its own formats ("12.5x"). sep goes between columns."""

    def __init__(self, *columns: tuple[str, int, str], sep: str = " "):
        self.columns, self.sep = columns, sep

    def header(self) -> str:
        return self.row(*(title for title, _, _ in self.columns))

    def row(self, *cells: Any) -> str:
        out = []
        for cell, (_, width, spec) in zip(cells, self.columns, strict=True):
            align, spec = ("<", spec[1:]) if spec.startswith("<") else (">", spec)
            out.append(format(cell, f"{align}{width}" if isinstance(cell, str) else f"{align}{width}{spec}"))
        return self.sep.join(out)

    @property
    def width(self) -> int:
        return sum(w for _, w, _ in self.columns) + len(self.sep) * (len(self.columns) - 1)


# -- the simulators (autoscale_sim.py, tiers_sim.py) -----------------------------------------------------
BLOCK = 16  # KV block size of the simulated workers


class Roofline(NamedTuple):
    device: Any  # pdserve.perf.hardware.Gpu
    name: str  # the model's
    config: Any  # its ModelConfig
    costs: Any  # RooflineCosts of the model on one such GPU
    kv_blocks: int  # KV blocks of BLOCK tokens one GPU holds beside the weights


def roofline_of(gpu_name: str, model: str) -> Roofline:
    """The model on one GPU by the planner's roofline (datasheet peaks, assumed efficiencies)."""
    from pdserve.perf.hardware import gpu, kv_budget_bytes, resolve_model, roofline

    device = gpu(gpu_name)
    name, cfg = resolve_model(model)
    costs = roofline(cfg, device)
    kv_blocks = kv_budget_bytes(device, costs.weight_bytes) // (costs.kv_bytes_per_token * BLOCK)
    return Roofline(device, name, cfg, costs, kv_blocks)


def lognormal(g, n: int, mean: float, sigma: float, lo: int, hi: int):
    """n integer lengths from g (a numpy Generator), log-normal of the given mean, clipped to [lo, hi]."""
    import numpy as np

    return np.clip(g.lognormal(np.log(mean) - sigma**2 / 2, sigma, n), lo, hi).astype(int)
