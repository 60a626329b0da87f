"""The two ceilings the other sections are measured against: copy bandwidth and bf16 matmul FLOP/s."""
from __future__ import annotations

import statistics

import torch

from bench.gpu.timing import GiB, event_time, free_memory, section


@section("peaks")
def measure_peaks(device: torch.device, small: bool) -> dict:
    n = (64 << 20) if small else (2 * GiB)  # bytes of the copy's source
    src = torch.randn(n // 2, dtype=torch.bfloat16, device=device)
    dst = torch.empty_like(src)
    t = event_time(lambda: dst.copy_(src), device, reps=5 if small else 20, warmup=3)
    copy_s = statistics.median(t)
    bw = 2 * src.nbytes / copy_s  # read + write
    src = dst = None  # free before the matmul
    m = 1024 if small else 8192
    dt = torch.float32 if (small and device.type == "cpu") else torch.bfloat16
    g = torch.Generator(device=device).manual_seed(0)
    mats = [torch.randn(m, m, dtype=dt, device=device, generator=g) for _ in range(4)]
    c = torch.empty(m, m, dtype=dt, device=device)
    i = [0]

    def mm():  # rotate inputs so repeated products do not reuse one pair
        torch.mm(mats[i[0] % 4], mats[(i[0] + 1) % 4], out=c)
        i[0] += 1
    t = event_time(mm, device, reps=3 if small else 20, warmup=1 if small else 5)
    mm_s = statistics.median(t)
    flops = 2 * m ** 3 / mm_s
    mats = c = None
    free_memory()
    res = dict(copy_bytes=2 * (n // 2) * 2, copy_s=copy_s, copy_bw_read_plus_write=bw,
               matmul_n=m, matmul_dtype=str(dt), matmul_s=mm_s, matmul_flops=flops)
    print(f"copy {n / GiB:.2f} GiB src: {copy_s * 1e3:.3f} ms -> {bw / 1e12:.3f} TB/s (read+write);  "
          f"{m}^3 {dt} matmul {mm_s * 1e3:.3f} ms -> {flops / 1e12:.1f} TFLOP/s", flush=True)
    return res
