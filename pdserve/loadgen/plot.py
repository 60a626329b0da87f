"""A PNG of one or more bench reports: CDFs of TTFT, TPOT, ITL and E2E latency, and the output
throughput over time. Needs matplotlib (`pip install 'pdserve[bench]'`); drawn with the Agg backend."""
from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path
from typing import Any

PANELS = (("ttft_ms", "TTFT (ms)", "ttft_ms"), ("tpot_ms", "TPOT (ms)", "tpot_ms"),
          ("itl_ms", "ITL (ms)", None), ("e2el_ms", "end-to-end latency (ms)", "e2el_ms"))


def _values(report: dict[str, Any], key: str) -> list[float]:
    rows = [r for r in report["requests"] if r["error_code"] is None]
    if key == "itl_ms":
        return sorted(g for r in rows for g in r["itl_ms"])
    return sorted(r[key] for r in rows if r[key] is not None)


def pyplot() -> Any:
    """matplotlib.pyplot on the Agg backend; a ValueError naming the extra when matplotlib is missing."""
    try:
        import matplotlib
    except ImportError:
        raise ValueError("--plot needs matplotlib: pip install 'pdserve[bench]'") from None
    matplotlib.use("Agg", force=True)
    import matplotlib.pyplot as plt

    return plt


def save_figure(fig: Any, path: str | Path) -> Path:
    """Write the figure as a PNG at path (its folder made if need be) and release it."""
    import matplotlib.pyplot as plt

    fig.tight_layout()
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=90)
    plt.close(fig)
    return path


def plot_reports(reports: Sequence[tuple[str, dict[str, Any]]], path: str | Path, title: str = "") -> Path:
    """Draw the reports (label, report) on one figure and save it as a PNG at path."""
    plt = pyplot()
    fig, axes = plt.subplots(3, 2, figsize=(12, 11))
    cdf_axes = [axes[0][0], axes[0][1], axes[1][0], axes[1][1]]
    for ax, (key, name, slo_key) in zip(cdf_axes, PANELS):
        for label, rep in reports:
            xs = _values(rep, key)
            if xs:
                ys = [(i + 1) / len(xs) for i in range(len(xs))]
                ax.step(xs, ys, where="post", label=f"{label} (n={len(xs)})")
            slo = rep["slo"].get(slo_key) if slo_key else None
            if slo is not None:
                ax.axvline(slo, linestyle="--", color="gray", linewidth=1)
        if key == "itl_ms":  # the tail (prefill stalls, KV hand-offs) is orders of magnitude above the body
            ax.set_xscale("log")
            name += ", log scale"
        ax.set_xlabel(name)
        ax.set_ylabel("fraction of " + ("tokens" if key == "itl_ms" else "requests"))
        ax.set_ylim(0, 1.02)
        ax.grid(alpha=0.3)
        ax.legend(fontsize=8, loc="lower right")
    tput, flight = axes[2][0], axes[2][1]
    for label, rep in reports:
        tl = rep["timeline"]
        mids = [s + tl["bin_s"] / 2 for s in tl["start_s"]]
        tput.plot(mids, tl["output_tokens_per_s"], label=label)
        flight.step(tl["start_s"], tl["in_flight"], where="post", label=label)
    tput.set_xlabel("time since start (s)")
    tput.set_ylabel("output tokens/s")
    tput.set_title("output throughput", fontsize=10)
    flight.set_xlabel("time since start (s)")
    flight.set_ylabel("requests in flight")
    flight.set_title("requests in flight (at each bin's start)", fontsize=10)
    for ax in (tput, flight):
        ax.grid(alpha=0.3)
        ax.legend(fontsize=8)
    fig.suptitle(title or "pdserve bench")
    return save_figure(fig, path)
