"""What the scripts under bench/ share, and the only module they import from one another: their argument
parser, the local cluster they serve from, `pdserve profile`, `pdserve serve` and `pdserve bench` in their own
processes, the run's header, JSON results, fixed-width tables, a /metrics page summed by pool, the simulators'
roofline and trace draws, and the checkpoints and transformers baselines the engine scripts measure against.

The scripts run as modules from the checkout's root (`python -m bench.cluster.compare_modes`), so the root is
on sys.path and pdserve, router and the workers import without an install. This module imports only the
standard library itself; what it needs of pdserve, router, torch or transformers it imports when called, so
`--help` stays fast and bench.gpu runs where Ray is missing.
"""
from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import os
import shlex
import signal
import socket
import subprocess
import sys
import time
from contextlib import asynccontextmanager
from datetime import datetime, timezone
from pathlib import Path
from typing import Any, NamedTuple

ROOT = Path(__file__).resolve().parent.parent


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
    from router.compose import build_router
    from router.config import RouterConfig

    router = build_router(cluster, RouterConfig(port=0, **settings))
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


# The seeded workload bench.cluster.compare_modes sends unless told otherwise, and bench.cluster.plan_vs_bench
# plans. 32 requests at 0.3/s: about 2 minutes a mode on 2 cores with SmolLM2, both modes below saturation.
# Prompts of 384-640 tokens make each prefill (~2 s on one thread) long enough to stall the decodes it shares a
# colocated worker with; 48-80 output tokens.
MODES_BENCH_ARGS = ["--num-prompts", "32", "--request-rate", "0.3", "--lengths", "uniform", "--input-len", "512",
                    "--output-len", "64", "--range-ratio", "0.25", "--seed", "0",
                    "--slo-ttft-ms", "4000", "--slo-tpot-ms", "150", "--timeout", "300"]


def bench_report(out: Path, rc: int, failed: str, log: str = "") -> dict:
    """The report `pdserve bench` wrote to out; exits with `failed (exit rc)` and the end of a server's log
    when the run failed."""
    if rc != 0 or not out.exists():
        raise SystemExit(f"{failed} (exit {rc})" + (f"\n{log[-3000:]}" if log else ""))
    return json.loads(out.read_text())


# -- `pdserve serve` in its own process --------------------------------------------------------------------
# `ray start` turns Ray's token authentication on (the token in ~/.ray): routers joining it say they use it.
RAY_TOKEN_ENV = {**os.environ, "RAY_AUTH_MODE": "token"}


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def session_pids(sid: int) -> list[int]:
    """Processes of session sid: the server's, Ray's (raylet, GCS, actors) included: they do not setsid."""
    def session(d: Path) -> int | None:
        try:
            return int((d / "stat").read_text().rsplit(")", 1)[1].split()[3])
        except (OSError, ValueError, IndexError):  # gone meanwhile
            return None
    return [int(d.name) for d in Path("/proc").iterdir() if d.name.isdigit() and session(d) == sid]


class Server:
    """`pdserve serve` in its own session; stop() sends SIGINT, waits, then kills whatever of the session is left."""

    def __init__(self, argv: list[str], log: Path, http: bool = False, root: Path = ROOT):
        """http: the OpenAI door on a free port too (http_port); root: the checkout whose pdserve serves (another
        commit's, side by side with this one)."""
        self.port, self.metrics_port = free_port(), free_port()
        self.http_port = free_port() if http else 0
        self.argv = [sys.executable, "-m", "router.cli", "serve", "--host", "127.0.0.1", "--port", str(self.port),
                     "--metrics-host", "127.0.0.1", "--metrics-port", str(self.metrics_port),
                     "--http-port", str(self.http_port), *argv]
        self.log = log
        env = dict(RAY_TOKEN_ENV, PYTHONPATH=str(root)) if root != ROOT else RAY_TOKEN_ENV
        self.proc = subprocess.Popen(self.argv, cwd=root, stdout=log.open("w"), stderr=subprocess.STDOUT,
                                     start_new_session=True, env=env)

    def wait_ready(self, workers: int, timeout: float) -> None:
        from pdserve.client.grpc_client import Client

        deadline, last = time.monotonic() + timeout, None
        with Client(f"127.0.0.1:{self.port}") as client:
            while time.monotonic() < deadline:
                if self.proc.poll() is not None:
                    raise SystemExit(f"pdserve serve exited {self.proc.returncode}:\n{self.log.read_text()[-2000:]}")
                try:
                    st = client.cluster_status(timeout=5)
                    if st.serving and sum(w.state == "ready" for p in st.pools for w in p.workers) >= workers:
                        return
                except Exception as e:  # noqa: BLE001 - not up yet
                    last = e
                time.sleep(2)
        raise SystemExit(f"pdserve serve not ready in {timeout:.0f} s ({last}):\n{self.log.read_text()[-2000:]}")

    def metrics_page(self) -> str:
        """The router's /metrics, as text."""
        import urllib.request

        return urllib.request.urlopen(f"http://127.0.0.1:{self.metrics_port}/metrics", timeout=10).read().decode()

    def stop(self, timeout: float = 60) -> None:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGINT)
            try:
                self.proc.wait(timeout)
            except subprocess.TimeoutExpired:
                print(f"pdserve serve did not stop in {timeout:.0f} s: killing its session", file=sys.stderr)
        deadline = time.monotonic() + 5  # Ray's processes end shortly after the driver; kill what is left
        while (left := session_pids(self.proc.pid)) and time.monotonic() < deadline:
            time.sleep(0.5)
        for pid in left:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)
        self.proc.wait(10)


def pool_sums(text: str, name: str) -> dict[str, float]:
    """A worker series (a counter's _total, or a gauge) of a /metrics page, summed by pool."""
    from prometheus_client.parser import text_string_to_metric_families

    out: dict[str, float] = {}
    for fam in text_string_to_metric_families(text):
        for s in fam.samples if fam.name == name else ():
            if s.name.endswith("_total") or fam.type == "gauge":
                out[s.labels["pool"]] = out.get(s.labels["pool"], 0.0) + s.value
    return out


def late_steps(server: Server) -> tuple[dict[str, float], dict[str, float]]:
    """The simulated workers' late steps (host work outlasting the simulated step) and all their steps, by pool."""
    page = server.metrics_page()
    return pool_sums(page, "pdserve_worker_late_steps"), pool_sums(page, "pdserve_worker_steps")


def cpu_model() -> str:
    out = subprocess.run(["lscpu"], capture_output=True, text=True, check=False).stdout
    return next((ln.split(":", 1)[1].strip() for ln in out.splitlines() if ln.startswith("Model name")), "?")


def run_header() -> dict:
    """The run's machine, date, command and load, printed and returned; a SIGTERM then exits through the
    callers' `finally` (their servers stop)."""
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))
    head = {"machine": f"{cpu_model()}, {os.cpu_count()} cores",
            "date": datetime.now(timezone.utc).isoformat(timespec="seconds"),
            "command": shlex.join([Path(sys.executable).name, *sys.argv]), "load_before": os.getloadavg()}
    print(f"machine: {head['machine']}; date: {head['date']}; load average before: "
          f"{' '.join(f'{x:.2f}' for x in head['load_before'])}\ncommand: {head['command']}", flush=True)
    return head


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


# -- the simulators (bench.simulated) ---------------------------------------------------------------------
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


def rl_trace(waves: int, per_wave: int, burst_s: float, period_s: float, input_mean: float, output_mean: float,
             max_len: int, seed: int = 0):
    """(arrival s, prompt tokens, output tokens) of waves of rollouts: each wave's requests arrive within
    burst_s, a wave every period_s; log-normal lengths (outputs long and heavy-tailed), seeded."""
    import numpy as np

    g = np.random.default_rng(seed)
    arrival = np.concatenate([w * period_s + np.sort(g.uniform(0, burst_s, per_wave)) for w in range(waves)])
    inputs = lognormal(g, len(arrival), input_mean, 0.5, 32, max_len // 4)
    outputs = lognormal(g, len(arrival), output_mean, 0.8, 16, max_len - max_len // 4)
    return arrival, inputs, outputs


# -- models and baselines of the engine scripts ----------------------------------------------------------
def smollm2_sized_checkpoint(directory: Path) -> Path:
    """A seeded random Llama checkpoint of SmolLM2-135M's size with 8 heads over 2 KV heads (TP 2 splits
    them; SmolLM2's own 9 over 3 it cannot)."""
    import torch
    import transformers

    torch.manual_seed(0)
    cfg = transformers.LlamaConfig(vocab_size=49152, hidden_size=576, intermediate_size=1536, num_hidden_layers=30,
                                   num_attention_heads=8, num_key_value_heads=2, max_position_embeddings=2048,
                                   tie_word_embeddings=True)
    transformers.LlamaForCausalLM(cfg).save_pretrained(directory, safe_serialization=True)
    return directory


def read_bandwidth() -> float:
    """Bytes/s of reading a 1 GiB fp32 tensor once (a sum), best of 5: the floor under a step that reads its
    weights."""
    import torch

    x = torch.ones(1 << 28)
    x.sum()
    best = float("inf")
    for _ in range(5):
        t0 = time.perf_counter()
        x.sum()
        best = min(best, time.perf_counter() - t0)
    return x.nbytes / best


def load_hf(path: str | Path, fmt: str = "hf", dtype=None, device="cpu"):
    """transformers' model of a checkpoint (a directory, or a GGUF file with fmt "gguf"), fp32 unless dtype
    says, on device, in eval mode; its warnings silenced."""
    import warnings

    import torch
    import transformers
    from transformers.utils import logging

    warnings.filterwarnings("ignore")
    logging.set_verbosity_error()
    kw = dict(dtype=dtype or torch.float32)
    if fmt == "gguf":
        d, name = os.path.split(path)
        model = transformers.AutoModelForCausalLM.from_pretrained(d, gguf_file=name, **kw)
    else:
        model = transformers.AutoModelForCausalLM.from_pretrained(str(path), **kw)
    return model.to(device).eval()


def hf_generate(model, prompts: list[list[int]], new_tokens: int, device="cpu", exact: bool = True):
    """Greedy generate() of all prompts as one left-padded batch: [prompts, width + generated]. exact: new_tokens
    each, EOS suppressed until then; else up to new_tokens (bench.gpu compares tokens that way)."""
    import torch

    width = max(map(len, prompts))
    ids = torch.zeros(len(prompts), width, dtype=torch.long)
    mask = torch.zeros(len(prompts), width, dtype=torch.long)
    for i, p in enumerate(prompts):  # left padding, as batched generation requires
        ids[i, width - len(p):] = torch.tensor(p)
        mask[i, width - len(p):] = 1
    with torch.inference_mode():
        return model.generate(ids.to(device), attention_mask=mask.to(device), max_new_tokens=new_tokens,
                              min_new_tokens=new_tokens if exact else None, do_sample=False, pad_token_id=0)


# -- copy-heavy prompts: replies that copy from their context (prompt lookup drafts them) -------------------------
STORE_PY = '''import json
import os


class Store:
    """A key-value store persisted as one JSON file."""

    def __init__(self, path):
        self.path = path
        self.data = {}
        if os.path.exists(path):
            with open(path) as f:
                self.data = json.load(f)

    def get(self, key, default=None):
        return self.data.get(key, default)

    def put(self, key, value):
        self.data[key] = value
        self.save()

    def delete(self, key):
        if key in self.data:
            del self.data[key]
            self.save()

    def save(self):
        with open(self.path, "w") as f:
            json.dump(self.data, f)
'''
ARTICLE = ("The city council voted on Tuesday to extend the night bus service to the northern suburbs. The "
           "service will run every twenty minutes between midnight and five in the morning. Council member Ana "
           "Ruiz said that the change was requested by hospital staff and restaurant workers who finish late. "
           "The extension costs 1.2 million a year and will be paid from the parking fund. A trial will start "
           "in March and be reviewed after six months.")


def agent_edit(method: str, renamed: str, source: str = STORE_PY) -> str:
    """An agent's edit of a file it was given: the whole file back, one method renamed."""
    return f"Here is store.py:\n\n{source}\nRewrite the whole file with the method `{method}` renamed to " \
           f"`{renamed}`. Output only the code."


def quoting_summary(article: str, sentences: str = "three") -> str:
    """A summary that quotes its source, `sentences` long."""
    return f"Article:\n{article}\n\nSummarise the article in {sentences} sentences, quoting its exact words where " \
           "you can."
