"""What fixes would give, by monkeypatching in this process only (pdserve's files untouched): the decode
forward replayed from a CUDA graph, and the chunked-prefill attention with torch's causal_lower_right bias."""
from __future__ import annotations

import random
import statistics
import traceback

import torch

from bench.gpu.core import add_requests, make_core, run_prefill_until_decoding
from bench.gpu.timing import event_time, section


def _lower_right_prefill_attention(orig):
    """_prefill_attention with the chunked-prefill mask expressed as torch's causal_lower_right bias
    (flash/cuDNN-eligible) instead of a dense boolean mask."""
    import torch.nn.functional as F
    from torch.nn.attention.bias import causal_lower_right

    def attn(q, k_new, v_new, kv_layer, blocks, ctx_len, scale):
        q_len = q.shape[0]
        if ctx_len == q_len:
            return orig(q, k_new, v_new, kv_layer, blocks, ctx_len, scale)
        kv_heads, _, block_size, head_dim = kv_layer.shape[1:]
        n = -(-ctx_len // block_size)
        k = kv_layer[0].index_select(1, blocks[:n]).view(kv_heads, n * block_size, head_dim)[:, :ctx_len]
        v = kv_layer[1].index_select(1, blocks[:n]).view(kv_heads, n * block_size, head_dim)[:, :ctx_len]
        rep = q.shape[1] // kv_heads
        k, v = k.repeat_interleave(rep, 0), v.repeat_interleave(rep, 0)  # [heads, ctx_len, head_dim]
        o = F.scaled_dot_product_attention(q.transpose(0, 1).unsqueeze(0), k.unsqueeze(0), v.unsqueeze(0),
                                           attn_mask=causal_lower_right(q_len, ctx_len), scale=scale)
        return o.squeeze(0).transpose(0, 1)
    return attn


@section("experiments")
def experiments(args, device: torch.device, peaks: dict | None) -> dict:
    import pdserve.model.attention as A

    res: dict = {}
    core = getattr(args, "_core", None) or make_core(args, device, args.prefill_tokens, prefix_caching=False)
    model, kv = core.runner.model, core.runner.kv_cache
    rng = random.Random(7)
    # x1: the decode forward (model only, no scheduling/sampling) eager vs replayed from a CUDA graph.
    rows = []
    for b in args.batches:
        try:
            reqs = add_requests(core, b, args.context, 4000, rng)
            run_prefill_until_decoding(core, reqs)
            core.step()
            st = core.scheduler.schedule()
            input_ids, positions, meta = core.runner._prepare(sorted(st.chunks, key=lambda c: c.start))
            with torch.inference_mode():
                fwd = lambda: model(input_ids, positions, meta, kv)  # noqa: E731 - rewrites the same slots
                eager = statistics.median(event_time(fwd, device, reps=10, warmup=3))
                row = dict(batch=b, eager_forward_s=eager)
                if device.type == "cuda":
                    side = torch.cuda.Stream()
                    side.wait_stream(torch.cuda.current_stream())
                    with torch.cuda.stream(side):
                        for _ in range(3):
                            fwd()
                    torch.cuda.current_stream().wait_stream(side)
                    graph = torch.cuda.CUDAGraph()
                    with torch.cuda.graph(graph):
                        fwd()
                    row["graph_forward_s"] = statistics.median(event_time(graph.replay, device, reps=20, warmup=3))
                    del graph
            rows.append(row)
            print(f"x1 batch {b}: decode forward eager {eager * 1e3:.2f} ms, CUDA graph replay "
                  f"{row.get('graph_forward_s', float('nan')) * 1e3:.2f} ms", flush=True)
        except Exception as e:  # noqa: BLE001
            print(traceback.format_exc(), flush=True)
            rows.append(dict(batch=b, error=f"{type(e).__name__}: {e}"))
        finally:
            core.cancel_all()
    res["cuda_graph_decode_forward"] = rows
    # x2: chunked prefill attention with causal_lower_right instead of a boolean mask.
    try:
        orig = A._prefill_attention
        new = _lower_right_prefill_attention(orig)
        cfg = core.model_config
        g = torch.Generator(device=device).manual_seed(0)
        q_len, ctx = (args.prefill_tokens - 192, 2 * args.prefill_tokens - 192)
        bs = core.config.cache.block_size
        nb = -(-ctx // bs)
        layer = torch.randn(2, cfg.num_kv_heads, nb + 3, bs, cfg.head_dim, device=device, generator=g,
                            dtype=core.config.torch_dtype)
        blocks = torch.randperm(nb + 3, device=device, generator=g)[:nb]
        q = torch.randn(q_len, cfg.num_heads, cfg.head_dim, device=device, generator=g, dtype=layer.dtype)
        scale = cfg.head_dim ** -0.5
        a = orig(q, None, None, layer, blocks, ctx, scale).float()
        b_ = new(q, None, None, layer, blocks, ctx, scale).float()
        rel = ((a - b_).norm() / a.norm()).item()
        t_orig = statistics.median(event_time(lambda: orig(q, None, None, layer, blocks, ctx, scale), device, 5))
        t_new = statistics.median(event_time(lambda: new(q, None, None, layer, blocks, ctx, scale), device, 5))
        res["lower_right_prefill_attention"] = dict(q_len=q_len, ctx_len=ctx, rel_err_vs_current=rel,
                                                    current_s_per_layer=t_orig, lower_right_s_per_layer=t_new)
        print(f"x2 chunked prefill attention {q_len} q x {ctx} ctx, one layer: current {t_orig * 1e3:.3f} ms, "
              f"causal_lower_right {t_new * 1e3:.3f} ms, rel diff {rel:.2e}", flush=True)
    except Exception as e:  # noqa: BLE001
        print(traceback.format_exc(), flush=True)
        res["lower_right_prefill_attention"] = dict(error=f"{type(e).__name__}: {e}")
    return res
