"""The table printed at the end of the GPU check, from RESULTS: one block per section that ran, then every
failure."""
from __future__ import annotations

from bench.gpu.decode import BUSY_MODES, TORCH_OPS_MODE
from bench.gpu.timing import GiB, RESULTS


def table() -> str:
    s, lines = RESULTS["sections"], []
    env = RESULTS.get("env", {})
    lines.append(f"device: {env.get('device_name')}  torch {env.get('torch')}  cuda {env.get('cuda')}  "
                 f"transformers {env.get('transformers')}")
    p = s.get("peaks")
    if p:
        lines.append(f"copy bandwidth (read+write, {p['copy_bytes'] / GiB:.1f} GiB moved): "
                     f"{p['copy_bw_read_plus_write'] / 1e12:.3f} TB/s;  {p['matmul_n']}^3 {p['matmul_dtype']} matmul: "
                     f"{p['matmul_flops'] / 1e12:.1f} TFLOP/s")
    d = s.get("decode")
    if d:
        lines.append(f"(a) decode, {d['model']} {d['dtype']} dummy weights, EngineCore.step(); weights read/step "
                     f"{d['weight_bytes'] / 1e9:.2f} GB, KV {d['kv_bytes_per_token'] / 1024:.0f} KiB/token")
        lines.append(f"    {'batch':>5} {'ctx':>5} {'step ms':>9} {'floor ms':>9} {'floor/step':>10} "
                     f"{'tok/s':>9} {'KV GB/step':>10} {'prep ms':>8} {'GPU ms':>7} {'busy':>6}")
        for r in d["rows"]:
            lines.append(f"    {r['batch']:5d} {r['context_mid']:5d} {r['step_s'] * 1e3:9.2f} {r['floor_s'] * 1e3:9.2f} "
                         f"{r['floor_over_step']:10.1%} {r['tokens_per_s']:9.1f} {r['kv_bytes'] / 1e9:10.3f} "
                         f"{r['host_prep_s'] * 1e3:8.2f} "
                         + (f"{r['busy']['gpu_s_per_step'] * 1e3:7.2f} {r['busy']['busy_vs_unprofiled']:6.1%}"
                            if r.get("busy") else f"{'-':>7} {'-':>6}"))
        lines.append("    prep ms: scheduler.schedule() + ModelRunner._prepare() alone (host). GPU ms: union of GPU "
                     "kernel/memcpy intervals per step (torch.profiler); busy = GPU ms / step ms.")
        for r in d["rows"]:
            b = r.get("busy")
            if b:
                lines.append(f"(b) GPU busy at batch {r['batch']}: kernels {b['gpu_s_per_step'] * 1e3:.2f} ms/step "
                             f"(union of GPU op intervals, torch.profiler) / profiled wall "
                             f"{b['profiled_wall_s'] / b['steps'] * 1e3:.2f} ms/step = {b['busy_profiled']:.1%}; "
                             f"/ unprofiled step {r['step_s'] * 1e3:.2f} ms = {b['busy_vs_unprofiled']:.1%}")
        hf = {r["batch"]: r for r in (s.get("hf_decode") or {}).get("rows", [])}
        lines.append(f"    by mode (step ms; x floor = step / weight+KV read floor): {'batch':>5} "
                     + " ".join(f"{n:>22}" for n, _, _ in BUSY_MODES) + f" {'transformers':>22}")
        for r in d["rows"]:
            cells = []
            for name, _, _ in BUSY_MODES:
                m = (r.get("modes") or {}).get(name, {})
                cells.append(f"{m['step_s'] * 1e3:9.2f} ({m['step_s'] / r['floor_s']:5.2f}x fl)" if "step_s" in m
                             else f"{m.get('skipped', m.get('error', '-'))[:22]:>22}")
            h = hf.get(r["batch"])
            cells.append(f"{h['step_s'] * 1e3:9.2f} ({h['step_s'] / r['floor_s']:5.2f}x fl)" if h else f"{'-':>22}")
            lines.append(f"    {'':58}{r['batch']:5d} " + " ".join(f"{c:>22}" for c in cells))
            m = (r.get("modes") or {}).get(TORCH_OPS_MODE)
            if m and "step_s" in m:
                lines.append(f"    {'':58}{r['batch']:5d} {TORCH_OPS_MODE}: {m['step_s'] * 1e3:.2f} ms "
                             f"({m['step_s'] / r['floor_s']:.2f}x floor)")
            for name, m in (r.get("modes") or {}).items():
                if "busy_vs_unprofiled" in m:
                    lines.append(f"    busy at batch {r['batch']}, {name:17}: GPU {m['gpu_s_per_step'] * 1e3:7.2f} ms/step of "
                                 f"{m['step_s'] * 1e3:7.2f} = {m['busy_vs_unprofiled']:6.1%} "
                                 f"(profiled wall: {m['busy_profiled']:6.1%})")
    pf = s.get("prefill")
    if pf:
        lines.append(f"(c) prefill {pf['tokens']} tokens: {pf['step_s'] * 1e3:.2f} ms, {pf['model_flops'] / 1e12:.2f} "
                     f"TFLOP (step_flops) -> {pf['achieved_flops'] / 1e12:.1f} TFLOP/s = MFU {pf['mfu_vs_matmul']:.1%} "
                     f"of the measured matmul ({pf['matmul_flops'] / 1e12:.1f} TFLOP/s)")
        sc = pf.get("second_chunk")
        if sc:
            lines.append(f"    second chunk of a {sc['start'] + sc['tokens']}-token prompt ({sc['tokens']} tokens after "
                         f"{sc['start']} cached, masked SDPA): {sc['step_s'] * 1e3:.2f} ms -> "
                         f"{sc['achieved_flops'] / 1e12:.1f} TFLOP/s = {sc['mfu_vs_matmul']:.1%}")
    o = s.get("offline")
    if o:
        lines.append(f"(d) offline, {o['checkpoint']}, bf16, {o['num_prompts']} prompts "
                     f"({o['prompt_tokens']} prompt tokens) x {o['output_len']} output tokens, greedy:")
        lines.append(f"    pdserve LLMEngine {o['pdserve_s']:.2f} s = {o['pdserve_tok_s']:.0f} output tok/s;  "
                     f"transformers generate {o['hf_s']:.2f} s = {o['hf_tok_s']:.0f} tok/s;  "
                     f"pdserve/HF {o['speedup']:.2f}x")
        for k, e in o["equality"].items():
            if k == "prefill_logits_vs_hf_fp32":
                lines.append("    last-position prefill logits vs HF fp32 (rel. L2 error median/max, argmax agree): " + "; ".join(
                    f"{n} {v['median_rel_err']:.2e}/{v['max_rel_err']:.2e} {v['argmax_agree']}/{o['equality']['bfloat16']['prompts']}"
                    for n, v in e.items() if isinstance(v, dict))
                    + f"; HF fp32 top-1 margin median {e['hf_fp32_top1_margin_median']:.3f}, logit std "
                      f"{e['hf_fp32_logit_std_median']:.3f}")
                continue
            lines.append(f"    greedy equality {k}: {e['identical_sequences']}/{e['prompts']} sequences identical "
                         f"over {e['tokens_each']} tokens; positional match {e['positional_match']:.1%}; "
                         f"first divergence {e['first_divergence']}")
    x = s.get("experiments")
    if x:
        for r in x.get("cuda_graph_decode_forward", []):
            if "error" in r:
                lines.append(f"(x1) batch {r['batch']}: CUDA graph experiment FAILED {r['error']}")
            else:
                lines.append(f"(x1) decode forward only (model, no scheduler/sampler), batch {r['batch']}: eager "
                             f"{r['eager_forward_s'] * 1e3:.2f} ms, CUDA-graph replay "
                             f"{r.get('graph_forward_s', float('nan')) * 1e3:.2f} ms")
        r = x.get("lower_right_prefill_attention", {})
        if "error" in r:
            lines.append(f"(x2) causal_lower_right prefill attention FAILED {r['error']}")
        elif r:
            lines.append(f"(x2) chunked-prefill attention, one layer, {r['q_len']} q x {r['ctx_len']} ctx: boolean mask "
                         f"{r['current_s_per_layer'] * 1e3:.3f} ms vs causal_lower_right "
                         f"{r['lower_right_s_per_layer'] * 1e3:.3f} ms (rel diff {r['rel_err_vs_current']:.1e})")
    c = s.get("cluster")
    if c:
        for mode in ("colocated", "disaggregated", "tokens"):
            r = c.get(mode)
            if not r:
                continue
            if "exception" in r:
                lines.append(f"(e) cluster {mode} on one GPU: FAILED {r['exception']}")
                continue
            lines.append(f"(e) cluster {mode} on one GPU (tiny fp32, 4 prompts x 12 tokens): start {r['start_s']:.1f} s; "
                         f"tokens equal to offline {sum(r['equal'])}/{len(r['equal'])}; errors: {r['errors'][:2]}")
            if "handoff_count" in r:
                lines.append(f"    hand-off (first token sampled on P -> KV usable on D): count {r['handoff_count']}, "
                             f"mean {r['handoff_mean_s'] * 1e3:.2f} ms (sum/count)")
        h = c.get("handoff")
        if h and "exception" in h:
            lines.append(f"(f) hand-off vs prefill, disaggregated 1P1D on one GPU: FAILED {h['exception']}")
        elif h:
            lines.append(f"(f) hand-off vs prefill, disaggregated 1P1D on one GPU, {h['checkpoint']}, {h['dtype']}, one "
                         f"request at a time, max_tokens {h['max_tokens']}:")
            lines.append(f"    {'prompt':>6} {'reqs':>4} {'hand-off ms':>11} {'prefill step ms':>15} {'hand-off/step':>13} "
                         f"{'KV MiB/req':>10}  errors")
            for r in h["rows"]:
                if "handoff_mean_s" in r:
                    lines.append(f"    {r['prompt_tokens']:6d} {r['requests']:4d} {r['handoff_mean_s'] * 1e3:11.2f} "
                                 f"{r['prefill_step_mean_s'] * 1e3:15.2f} {r['handoff_over_step']:13.2f} "
                                 f"{r['kv_bytes_per_request'] / 2**20:10.1f}  {r['errors'][:2]}")
                else:
                    lines.append(f"    {r['prompt_tokens']:6d} {0:4d} {'-':>11} {'-':>15} {'-':>13} {'-':>10}  {r['errors'][:2]}")
            lines.append("    hand-off: delta of the decode worker's WorkerStats.handoff sum per request (mean over "
                         "requests); prefill step: delta of the prefill worker's busy_seconds per request.")
    for k, v in RESULTS["errors"].items():
        lines.append(f"FAILED {k}: {v}")
    return "\n".join(lines)
