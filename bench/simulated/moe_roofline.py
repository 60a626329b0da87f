"""A mixture of experts' decode step on the roofline against a dense model of the same active size.

    .venv/bin/python -m bench.simulated.moe_roofline [--gpu H100] [--model qwen3-30b-a3b] [--context 1024]
                                                     [--batches 1 8 32 64 256]

Computed, not measured (pdserve.perf.costs.RooflineCosts at TP 1, bf16). For each batch: the experts a
layer's tokens touch (E (1 - (1 - k/E)^B), uniform routing), the weight bytes the step reads, its time and
tokens/s, each request reading --context tokens of KV; then the same for the dense twin: the model's shape
with a dense MLP k experts wide (intermediate k x moe_intermediate: the same active parameters but for the
router), which reads all its weights at every batch.
"""
from __future__ import annotations

from dataclasses import replace

from bench.common import Table, parser


def main() -> None:
    ap = parser(__doc__)
    ap.add_argument("--gpu", default="H100")
    ap.add_argument("--model", default="qwen3-30b-a3b")
    ap.add_argument("--context", type=int, default=1024)
    ap.add_argument("--batches", type=int, nargs="+", default=[1, 8, 32, 64, 256])
    args = ap.parse_args()

    from pdserve.perf.costs import expected_experts
    from pdserve.perf.hardware import gpu, resolve_model, roofline

    name, moe = resolve_model(args.model)
    if not moe.is_moe:
        raise SystemExit(f"{name} is dense")
    dense = replace(moe, intermediate_size=moe.num_experts_per_tok * moe.moe_intermediate_size, num_experts=0,
                    num_experts_per_tok=0, moe_intermediate_size=0, moe_layers=())
    device = gpu(args.gpu)
    m, d = roofline(moe, device), roofline(dense, device)
    print(f"{name} on {device.name} (roofline, TP 1, bf16): {moe.num_params / 1e9:.1f}B parameters, "
          f"{moe.num_active_params / 1e9:.2f}B active; {len(moe.moe_layers)} MoE layers of {moe.num_experts} experts, "
          f"top {moe.num_experts_per_tok}; dense twin: MLP {dense.intermediate_size}, {dense.num_params / 1e9:.2f}B; "
          f"{args.context} tokens of context a request")
    t = Table(("batch", 5, "d"), ("experts/layer", 13, ".1f"), ("MoE GB read", 11, ".2f"), ("MoE ms", 7, ".2f"),
              ("MoE tok/s", 9, ",.0f"), ("dense GB read", 13, ".2f"), ("dense ms", 8, ".2f"),
              ("dense tok/s", 11, ",.0f"), ("MoE/dense", 9, ".2f"))
    print(t.header())
    for b in args.batches:
        ms, ds = m.step_time(0, 0, 0, b, b * args.context), d.step_time(0, 0, 0, b, b * args.context)
        print(t.row(b, expected_experts(moe.num_experts, moe.num_experts_per_tok, b), m.step_weight_bytes(b) / 1e9,
                    ms * 1e3, b / ms, d.step_weight_bytes(b) / 1e9, ds * 1e3, b / ds, ms / ds))


if __name__ == "__main__":
    main()
