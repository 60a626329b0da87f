"""`pdserve profile` and `pdserve plan`."""
from __future__ import annotations

import argparse
import json
from pathlib import Path
from typing import Any


def add_profile_parser(sub: argparse._SubParsersAction) -> argparse.ArgumentParser:
    from pdserve.engine.args import add_model_args

    p = sub.add_parser("profile", help="measure step times and KV transfers on this device for `pdserve plan`",
                       description="Measure prefill and decode step times and KV transfers on this device with "
                                   "the threads one worker gets, fit the cost model, and write it as JSON.")
    add_model_args(p, simulated=False)
    p.add_argument("--threads", type=int, default=None,
                   help="torch threads (default: half the cores, what each of two workers gets from pdserve serve)")
    p.add_argument("--neighbours", type=int, default=None,
                   help="processes that load the other cores as the cluster's other workers would while steps are "
                        "timed (default on CPU: enough to fill the cores; on GPU: 0)")
    p.add_argument("--kv-cache-mib", type=int, default=1024, help="KV cache, MiB (bounds the decode batches measured)")
    p.add_argument("--block-size", type=int, default=16)
    p.add_argument("--quick", action="store_true", help="a few points only (~15 s): for a smoke test, not a plan")
    p.add_argument("--output", required=True, metavar="PROFILE.json")
    p.set_defaults(func=cmd_profile)
    return p


def cmd_profile(args: argparse.Namespace) -> int:
    from pdserve.planner.profile import profile_config, run_profile

    if args.threads is not None and args.threads < 1:
        raise ValueError(f"--threads must be >= 1, got {args.threads}")
    config = profile_config(args.model, args.load_format, args.dtype, args.quantization, args.device,
                            args.kv_cache_mib, args.block_size)
    if args.neighbours is not None and args.neighbours < 0:
        raise ValueError(f"--neighbours must be >= 0, got {args.neighbours}")
    prof = run_profile(config, args.threads, quick=args.quick, neighbours=args.neighbours,
                       log=lambda s: print(s, flush=True))
    Path(args.output).parent.mkdir(parents=True, exist_ok=True)
    Path(args.output).write_text(json.dumps(prof, indent=1) + "\n")
    print(f"profile: {args.output}")
    return 0


def add_plan_parser(sub: argparse._SubParsersAction) -> argparse.ArgumentParser:
    from pdserve.loadgen.cli import add_workload_args

    p = sub.add_parser("plan", help="size the pools: simulate every configuration of up to N workers on a workload",
                       description="Simulate colocated and every xPyD configuration of at most --max-workers workers "
                                   "on the workload that `pdserve bench` would send with the same flags, and rank "
                                   "them by goodput per worker.")
    src = p.add_argument_group("costs (one of)")
    src.add_argument("--profile", default=None, metavar="PROFILE.json", help="measured by `pdserve profile`")
    src.add_argument("--gpu", default=None, help="a roofline of this GPU's datasheet: H100, H200, A100, L40S, L4")
    src.add_argument("--model", default=None,
                     help="with --gpu: a preset (llama-3-8b, llama-3-70b, smollm2-135m, qwen3-30b-a3b; for the "
                          "roofline only, deepseek-v3-shape), config.json, HF directory or .gguf; one worker is one "
                          "GPU unless --tensor-parallel-sizes splits it (a model that fits no single GPU, like "
                          "llama-3-70b in bf16, and a mixture of experts, with its experts sliced or split, are "
                          "compared at TP 1, 2, 4 and 8 by themselves)")
    src.add_argument("--dtype-bytes", type=int, default=2, help="with --gpu: bytes per weight and KV value (2: bf16)")
    src.add_argument("--tensor-parallel-sizes", type=_sizes, default=None, metavar="1,2,4,8",
                     help="with --gpu: compare these tensor-parallel sizes (which fit, prefill time, decode tokens/s "
                          "per GPU; a mixture of experts at EP 1 and EP = TP each) and simulate with every worker at "
                          "the smallest that fits (give one to simulate it)")
    add_workload_args(p)
    g = p.add_argument_group("SLOs (goodput counts requests that meet every one given)")
    g.add_argument("--slo-ttft-ms", type=float, default=None)
    g.add_argument("--slo-tpot-ms", type=float, default=None)
    g.add_argument("--slo-e2el-ms", type=float, default=None)
    g.add_argument("--min-attainment", type=float, default=0.9,
                   help="share of requests within the SLOs a recommended configuration must keep (default 0.9)")
    g = p.add_argument_group("cluster")
    g.add_argument("--max-workers", type=int, required=True, help="workers (devices) at most")
    g.add_argument("--max-num-seqs", type=int, nargs="+", default=[64],
                   help="running-batch caps of the decode and colocated pools to try (default 64)")
    g.add_argument("--prefill-token-budget", type=int, default=2048, help="tokens per prefill (and colocated) step")
    g.add_argument("--kv-cache-mib", type=int, default=None,
                   help="KV cache per worker (default: the profile's; with --gpu, what the GPU holds beside the weights)")
    g.add_argument("--block-size", type=int, default=None, help="KV block size (default: the profile's; 16)")
    g.add_argument("--reservation-headroom-blocks", type=int, default=1,
                   help="free KV blocks a decode worker keeps per running request when it reserves room")
    g.add_argument("--max-running", type=int, default=256)
    g.add_argument("--max-queued", type=int, default=1024)
    g.add_argument("--first-token-latency-ms", type=float, default=None,
                   help="worker -> client hops of the first token (default: measured on the local CPU cluster)")
    g.add_argument("--token-latency-ms", type=float, default=None, help="the same for later tokens")
    g = p.add_argument_group("speculative decoding (pdserve.perf.speculation): the decode and colocated pools "
                             "speculate")
    g.add_argument("--speculative-acceptance", type=float, default=None, metavar="A",
                   help="the rate at which drafted tokens are accepted, in [0, 1] (a verification of k drafts emits "
                        "(1 - A^(k+1)) / (1 - A) tokens on average)")
    g.add_argument("--speculative-metrics", default=None, metavar="METRICS.txt",
                   help="read the rate (and k, the mean drafts per verification) from a scrape of a speculating "
                        "cluster's router /metrics (pdserve_worker_spec_*)")
    g.add_argument("--speculative-tokens", type=int, default=None, metavar="K",
                   help="num_speculative_tokens, drafts per verification (default: the metrics' mean, else 4)")
    g.add_argument("--speculative-max-batch", type=int, default=None, metavar="N",
                   help="no request drafts while more than N run (disable_by_batch_size; default: wherever the cost "
                        "model says verification pays)")
    g = p.add_argument_group("service tiers (pdserve.tiers): the fast lane's size and batch cap, each tier's price")
    g.add_argument("--tier-mix", default=None, metavar="priority=0.1,default=0.6,flex=0.3",
                   help="shares of the requests by tier; prints the fast lane's max running and workers and each "
                        "tier's device time per output token against default's (and, with no --slo-*, ranks the "
                        "configurations by default's SLO)")
    g.add_argument("--tier-slo", action="append", default=[], metavar="TIER=TTFT_MS:TPOT_MS",
                   help="a tier's SLO (repeatable; default: the serve defaults, priority=1000:50, default=4000:150, "
                        "flex=120000:1000)")
    g = p.add_argument_group("output")
    g.add_argument("--output", default=None, metavar="PLAN.json")
    g.add_argument("--plot", default=None, metavar="PLAN.png", help="predicted goodput against request rate")
    p.set_defaults(func=cmd_plan)
    return p


def _sizes(text: str) -> list[int]:
    try:
        sizes = [int(x) for x in text.split(",")]
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected sizes separated by commas (1,2,4,8), got {text!r}") from None
    if min(sizes) < 1:
        raise argparse.ArgumentTypeError(f"tensor-parallel sizes must be >= 1, got {text!r}")
    return sorted(set(sizes))


def _costs_and_model(args: argparse.Namespace, tp: int = 1,
                     ep: int = 1) -> tuple[Any, dict[str, Any], int | None, int]:
    """(costs, model facts, default KV cache bytes, block size) from --profile or --gpu/--model; with --gpu, of
    workers of tp GPUs each, a mixture of experts' experts split over them when ep = tp (costs and KV cache
    one GPU's)."""
    if (args.profile is None) == (args.gpu is None):
        raise ValueError("give --profile FILE, or --gpu NAME with --model M")
    if args.profile:
        from pdserve.planner.profile import read_profile

        if args.model:
            raise ValueError("--model goes with --gpu; a profile names its own model")
        return read_profile(args.profile)
    from pdserve.perf.hardware import gpu, kv_budget_bytes, resolve_model, roofline

    if not args.model:
        raise ValueError("--gpu needs --model (a preset, config.json, HF directory or .gguf)")
    device = gpu(args.gpu)
    name, cfg = resolve_model(args.model)
    costs = roofline(cfg, device, args.dtype_bytes, tp, ep)
    model = {"name": name, "path": None, "vocab_size": cfg.vocab_size, "eos_token_ids": list(cfg.eos_token_ids),
             "max_model_len": cfg.max_position_embeddings, "num_params": cfg.num_params}
    return costs, model, kv_budget_bytes(device, costs.resident_weight_bytes), args.block_size or 16


# The sizes compared when a model's weights do not fit one GPU, or it is a mixture of experts, and no
# --tensor-parallel-sizes is given.
AUTO_TP_SIZES = (1, 2, 4, 8)


def _auto_tp_sizes(args: argparse.Namespace) -> tuple[list[int], str] | None:
    """With --gpu and --model and no --tensor-parallel-sizes: None for a dense model whose weights fit one
    GPU; else the sizes of AUTO_TP_SIZES the model's shape allows, and why they are compared. A mixture of
    experts is compared even when it fits one GPU: whether to split its experts is the question."""
    from pdserve.perf.hardware import gpu, kv_budget_bytes, resolve_model, roofline
    from pdserve.planner.parallel import parallel_choices

    device = gpu(args.gpu)
    _, cfg = resolve_model(args.model)
    try:
        kv_budget_bytes(device, roofline(cfg, device, args.dtype_bytes).resident_weight_bytes)
        if not cfg.is_moe:
            return None
        why = "is a mixture of experts"
    except ValueError:
        why = f"does not fit one {args.gpu}"
    sizes = []
    for tp in AUTO_TP_SIZES:
        try:
            parallel_choices(cfg, [tp])
            sizes.append(tp)
        except ValueError:
            pass
    return sizes, why


def _compare_tp(args: argparse.Namespace) -> dict[str, Any]:
    """--tensor-parallel-sizes compared on the workload's lengths: its mean prompt for prefill, the decode pool's
    batch cap at the mean context (prompt + half the output) for decode, its longest request for the fit."""
    from pdserve.perf.hardware import gpu, resolve_model
    from pdserve.planner.parallel import compare_tp
    from pdserve.planner.plan import workload_from_args

    if args.gpu is None or not args.model:
        raise ValueError("--tensor-parallel-sizes goes with --gpu NAME and --model M (the roofline)")
    device = gpu(args.gpu)
    _, cfg = resolve_model(args.model)
    w = workload_from_args(args, cfg.vocab_size, list(cfg.eos_token_ids), cfg.max_position_embeddings)
    prompt = round(float(w.input_len.mean()))
    context = round(float(w.input_len.mean() + w.output_len.mean() / 2))
    table = compare_tp(cfg, device, args.tensor_parallel_sizes, prompt, args.prefill_token_budget,
                       max(args.max_num_seqs), context, int((w.input_len + w.output_len).max()), args.dtype_bytes)
    if not table["fitting"]:
        from pdserve.planner.parallel import format_tp

        print(format_tp(table))
        raise ValueError(f"no tensor-parallel size of {args.tensor_parallel_sizes} fits a {device.name}: give larger "
                         f"ones (the weights alone need {table['gpus_for_weights']} GPUs), or fewer bytes a value "
                         "(--dtype-bytes)")
    return table


def parse_tier_slos(items: list[str]) -> dict[str, Any]:
    """--tier-slo TIER=TTFT_MS:TPOT_MS, repeatable -> every tier's SLO (TiersConfig's defaults for the rest)."""
    from pdserve.tiers import TiersConfig
    from pdserve.tiers import parse_tier_slos as parse

    return TiersConfig(slo=parse(items)).slo


def cmd_plan(args: argparse.Namespace) -> int:
    from pdserve.planner.parallel import format_tp
    from pdserve.planner.plan import candidates, format_plan, make_plan, plot_plan, workload_from_args

    mix, tier_slos, slo = _check_plan_args(args)
    tp, ep, tp_table = _parallel_sizes(args)
    costs, model, kv_default, block_size = _costs_and_model(args, tp, ep)
    tokenizer = None
    if args.trace and model.get("path"):
        from pdserve.model.tokenizer import Tokenizer

        try:
            tokenizer = Tokenizer.from_pretrained(model["path"])
        except Exception:  # only text traces need it; they say so
            tokenizer = None
    workload = workload_from_args(args, model["vocab_size"], model["eos_token_ids"], model["max_model_len"], tokenizer)
    if tp_table:
        print(format_tp(tp_table))
        label = f"TP {tp} EP {ep}" if tp_table["expert_parallel"] else f"TP {tp}"
        print(f"simulated below: every worker is {label} ({tp} GPUs; KV figures per GPU)\n")
    settings = _pool_settings(args, kv_default, block_size)
    plan = make_plan(costs, workload, slo, args.max_workers, sorted(set(args.max_num_seqs)), settings,
                     args.min_attainment)
    plan.update(model=model["name"], costs=args.profile or f"roofline of {args.gpu}", tensor_parallel_size=tp,
                expert_parallel_size=ep)
    if tp_table:
        plan["tensor_parallel"] = tp_table
    print(f"{plan['requests']} requests: {workload.description['workload']}; model {model['name']}; costs: "
          f"{plan['costs']}")
    print(format_plan(plan))
    if "speculation" in plan:
        from pdserve.planner.plan import format_speculation

        print(format_speculation(plan["speculation"]))
    print(f"simulated {plan['requests']} requests through {len(plan['candidates'])} configurations in "
          f"{plan['simulation_seconds']:.2f} s")
    if mix:
        _tier_prices(args, plan, costs, settings, workload, mix, tier_slos)
    if getattr(args, "sessions", 0):
        _kv_tiers(args, plan, costs, settings, model)
    if args.output:
        Path(args.output).parent.mkdir(parents=True, exist_ok=True)
        Path(args.output).write_text(json.dumps(plan, indent=1) + "\n")
        print(f"plan: {args.output}")
    if args.plot:
        shapes = candidates(args.max_workers, sorted(set(args.max_num_seqs)), settings, costs.kv_bytes_per_token)
        plot_plan(shapes, costs, workload, slo, args.plot)
        print(f"plot: {args.plot}")
    return 0


def _check_plan_args(args: argparse.Namespace):
    """The tier mix and its SLOs (None without --tier-mix) and the SLO the plan is judged by; every bound on the
    flags checked (ValueError says which)."""
    from pdserve.loadgen.cli import check_args
    from pdserve.loadgen.stats import Slo
    from pdserve.tiers import parse_mix

    mix = parse_mix(args.tier_mix) if args.tier_mix else None
    if args.tier_slo and mix is None:
        raise ValueError("--tier-slo goes with --tier-mix")
    tier_slos = parse_tier_slos(args.tier_slo) if mix else None
    if mix and args.slo_ttft_ms is None and args.slo_tpot_ms is None and args.slo_e2el_ms is None:
        default = tier_slos["default"]
        args.slo_ttft_ms, args.slo_tpot_ms = default.ttft_s * 1e3, default.tpot_s * 1e3
    slo = Slo(args.slo_ttft_ms, args.slo_tpot_ms, args.slo_e2el_ms)
    check_args(args)
    if args.num_prompts is None and args.duration is None and args.trace is None:
        args.num_prompts = 1000
    if not 0 < args.min_attainment <= 1:
        raise ValueError(f"--min-attainment must be in (0, 1], got {args.min_attainment}")
    for name in ("max_workers", "prefill_token_budget", "max_running", "dtype_bytes", "kv_cache_mib", "block_size"):
        v = getattr(args, name)
        if v is not None and v < 1:
            raise ValueError(f"--{name.replace('_', '-')} must be >= 1, got {v}")
    if min(args.max_num_seqs) < 1:
        raise ValueError(f"--max-num-seqs must be >= 1, got {min(args.max_num_seqs)}")
    for name in ("max_queued", "reservation_headroom_blocks", "first_token_latency_ms", "token_latency_ms"):
        v = getattr(args, name)
        if v is not None and v < 0:
            raise ValueError(f"--{name.replace('_', '-')} must be >= 0, got {v}")
    if args.num_prompts is None and args.trace is None and (args.concurrency is not None or args.arrival == "closed"):
        # bench ends such a run by its clock, which a simulation does not have before it runs
        raise ValueError("pdserve plan needs --num-prompts with --concurrency or --arrival closed")
    return mix, tier_slos, slo


def _parallel_sizes(args: argparse.Namespace) -> tuple[int, int, dict | None]:
    """(TP, EP, the table comparing tensor-parallel sizes, if any): the smallest size that fits; of a mixture of
    experts' two choices there, the faster decode."""
    if args.gpu and args.model:
        from pdserve.perf.hardware import resolve_model
        from pdserve.perf.shapes import LatentAttentionShape

        shape = resolve_model(args.model)[1]
        if isinstance(shape, LatentAttentionShape):
            print(f"{args.model}: {shape.note}\n")
        auto = None if args.tensor_parallel_sizes else _auto_tp_sizes(args)
        if auto:
            args.tensor_parallel_sizes, why = auto
            experts = ", each with its experts sliced (EP 1) and split whole (EP = TP)" if shape.is_moe else ""
            print(f"{args.model} {why}: comparing tensor-parallel sizes "
                  f"{','.join(map(str, args.tensor_parallel_sizes))}{experts} (--tensor-parallel-sizes chooses)\n")
    if not args.tensor_parallel_sizes:
        return 1, 1, None
    tp_table = _compare_tp(args)
    tp = tp_table["fitting"][0]
    ep = max((r for r in tp_table["sizes"] if r["fits"] and r["tp"] == tp),
             key=lambda r: (r["decode_tokens_per_s_per_gpu"], -r["ep"]))["ep"]
    return tp, ep, tp_table


def _pool_settings(args: argparse.Namespace, kv_default: int, block_size: int):
    from pdserve.planner.plan import FIRST_TOKEN_LATENCY_S, TOKEN_LATENCY_S, PoolSettings

    kv_bytes = (args.kv_cache_mib << 20) if args.kv_cache_mib is not None else kv_default
    return PoolSettings(speculation=_speculation(args),
        kv_cache_bytes=kv_bytes, block_size=args.block_size or block_size, token_budget=args.prefill_token_budget,
        headroom_blocks=args.reservation_headroom_blocks, max_running=args.max_running, max_queued=args.max_queued,
        first_token_latency_s=FIRST_TOKEN_LATENCY_S if args.first_token_latency_ms is None
        else args.first_token_latency_ms / 1e3,
        token_latency_s=TOKEN_LATENCY_S if args.token_latency_ms is None else args.token_latency_ms / 1e3)


def _speculation(args: argparse.Namespace):
    """The pools' speculation from --speculative-* (None without a rate); ValueError names a bad flag."""
    from pdserve.perf.speculation import SpeculationModel, measured_speculation

    if args.speculative_acceptance is not None and args.speculative_metrics is not None:
        raise ValueError("give --speculative-acceptance or --speculative-metrics, not both")
    k = args.speculative_tokens
    if args.speculative_metrics is not None:
        acceptance, mean_k = measured_speculation(Path(args.speculative_metrics).read_text())
        k = k if k is not None else max(1, round(mean_k))
    elif args.speculative_acceptance is not None:
        acceptance = args.speculative_acceptance
        if not 0.0 <= acceptance <= 1.0:
            raise ValueError(f"--speculative-acceptance must be in [0, 1], got {acceptance}")
    else:
        if k is not None or args.speculative_max_batch is not None:
            raise ValueError("--speculative-tokens and --speculative-max-batch go with --speculative-acceptance or "
                             "--speculative-metrics")
        return None
    try:
        return SpeculationModel(4 if k is None else k, acceptance, args.speculative_max_batch)
    except ValueError as e:
        raise ValueError(f"--speculative-*: {e}") from None


def _tier_prices(args: argparse.Namespace, plan: dict, costs, settings, workload, mix, tier_slos) -> None:
    """The service tiers' prices for the mix (plan["tiers"]), printed."""
    from pdserve.planner.autoscale import PoolLimits
    from pdserve.planner.pricing import format_prices, tier_prices
    from pdserve.tiers import ServiceTier

    bsize = settings.block_size
    limits = PoolLimits(settings.kv_cache_bytes // (costs.kv_bytes_per_token * bsize), bsize, max(args.max_num_seqs),
                        args.prefill_token_budget)
    if settings.speculation is not None:  # the decode pools' steps at the speculating rate
        from pdserve.perf.speculation import SpeculativeCosts

        costs = SpeculativeCosts(costs, settings.speculation)
    plan["tiers"] = tier_prices(costs, limits, float(workload.input_len.mean()), float(workload.output_len.mean()),
                                {t: tier_slos[t.value] for t in ServiceTier}, mix, workload.mean_rate)
    print()
    print(format_prices(plan["tiers"]))



def _kv_tiers(args: argparse.Namespace, plan: dict, costs, settings, model: dict) -> None:
    """A multi-turn workload: the host tier the recommended configuration's session-holding pool (decode, or
    colocated) should have (plan["kv_tiers"]), printed."""
    from pdserve.loadgen.cli import build_workload, session_spec_from_args
    from pdserve.loadgen.workload import LengthSampler
    from pdserve.planner.kv_tiers import format_tiers, tier_table

    arrivals = build_workload(args, model["vocab_size"], model["eos_token_ids"], model["max_model_len"],
                              LengthSampler)[1]
    plan["kv_tiers"] = tier_table(session_spec_from_args(args), arrivals, args.concurrency,
                                  plan["recommended"]["decode_workers"], settings.kv_cache_bytes,
                                  costs.kv_bytes_per_token)
    print()
    print(format_tiers(plan["kv_tiers"]))
