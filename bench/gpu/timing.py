"""What every section of the GPU check uses: timing a call (CUDA events on a GPU, perf_counter on a CPU),
freeing memory between sections, the GPU kernels of a torch.profiler run, and the section registry, whose
results and failures gather in RESULTS for the final table and the JSON."""
from __future__ import annotations

import gc
import time
import traceback

import torch

GiB = 1 << 30
RESULTS: dict = {"sections": {}, "errors": {}}


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def event_time(fn, device: torch.device, reps: int, warmup: int = 2) -> list[float]:
    """Seconds per call, one value per repetition (CUDA events on GPU, perf_counter on CPU)."""
    for _ in range(warmup):
        fn()
    sync(device)
    out = []
    for _ in range(reps):
        if device.type == "cuda":
            a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            a.record()
            fn()
            b.record()
            b.synchronize()
            out.append(a.elapsed_time(b) / 1e3)
        else:
            t = time.perf_counter()
            fn()
            out.append(time.perf_counter() - t)
    return out


def section(name: str):
    def wrap(fn):
        def run(*a, **kw):
            print(f"\n=== {name} ===", flush=True)
            t = time.perf_counter()
            try:
                res = fn(*a, **kw)
                RESULTS["sections"][name] = res
                return res
            except Exception as e:  # noqa: BLE001 - report and go on with the next section
                tb = traceback.format_exc()
                print(tb, flush=True)
                RESULTS["errors"][name] = f"{type(e).__name__}: {e}"
                RESULTS.setdefault("tracebacks", {})[name] = tb
                return None
            finally:
                print(f"[{name}: {time.perf_counter() - t:.1f} s]", flush=True)
        return run
    return wrap


def free_memory() -> None:
    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()


def kernel_stats(prof, top: int = 8) -> dict:
    """GPU kernel/memcpy events of a profile: summed time, union of intervals, top kernels by time."""
    from torch.autograd import DeviceType

    ivs, by_name = [], {}
    for e in prof.events():
        if getattr(e, "device_type", None) != DeviceType.CUDA:
            continue
        s, t = e.time_range.start, e.time_range.end
        ivs.append((s, t))
        by_name[e.name] = by_name.get(e.name, 0.0) + (t - s)
    ivs.sort()
    union, cur_s, cur_e = 0.0, None, None
    for s, t in ivs:
        if cur_e is None or s > cur_e:
            if cur_e is not None:
                union += cur_e - cur_s
            cur_s, cur_e = s, t
        else:
            cur_e = max(cur_e, t)
    if cur_e is not None:
        union += cur_e - cur_s
    tops = sorted(by_name.items(), key=lambda kv: -kv[1])[:top]
    return dict(num_events=len(ivs), sum_s=sum(t - s for s, t in ivs) / 1e6, union_s=union / 1e6,
                top=[(n[:90], us / 1e6) for n, us in tops])
