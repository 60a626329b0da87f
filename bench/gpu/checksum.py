"""The KV checksum (--kv-checksum) against moving the same bytes on the device and to the host."""
from __future__ import annotations

import statistics

import torch

from bench.gpu.timing import event_time, section


@section("checksum")
def bench_checksum(args, device: torch.device) -> dict:
    """The KV checksum (pdserve.transfer.protocol.KVMac, --kv-checksum) against moving the same bytes: a
    transfer computes it on both ends, so the cost is twice one sum. Default off unless this is < 5 %."""
    from pdserve.transfer.protocol import KVMac

    kv_checksum = KVMac(b"a key of the bench's own").checksum

    layers, kv_heads, head_dim, block = (30, 3, 64, 16) if args.small else (32, 8, 128, 16)
    out = {}
    for tokens in (512, 2048):
        kv = torch.randn(layers, 2, kv_heads, tokens // block, block, head_dim, device=device).to(torch.bfloat16)
        dst = torch.empty_like(kv)
        host = torch.empty(kv.shape, dtype=kv.dtype, pin_memory=device.type == "cuda")
        reps = 5 if args.small else 20
        sum_s = statistics.median(event_time(lambda: kv_checksum(kv), device, reps))
        copy_s = statistics.median(event_time(lambda: dst.copy_(kv), device, reps))
        d2h_s = statistics.median(event_time(lambda: host.copy_(kv, non_blocking=True), device, reps))
        row = dict(mb=kv.nbytes / 1e6, sum_ms=sum_s * 1e3, d2d_copy_ms=copy_s * 1e3, d2h_copy_ms=d2h_s * 1e3,
                   two_sums_over_d2h=2 * sum_s / d2h_s)
        print(f"{tokens:>6} tokens {row['mb']:8.1f} MB: sum {row['sum_ms']:.3f} ms, device copy "
              f"{row['d2d_copy_ms']:.3f} ms, to host {row['d2h_copy_ms']:.3f} ms; two sums / host copy "
              f"{row['two_sums_over_d2h']:.1%}", flush=True)
        out[tokens] = row
    return out
