"""The `pdserve` command line: the client-side commands (`pdserve serve` is router/cli.py's)."""
from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Callable, Sequence
from typing import Any

from pdserve.loadgen.cli import add_bench_parser
from pdserve.client.grpc_client import add_connection_args, connection_from_args
from pdserve.engine.args import add_model_args
from pdserve.engine.sampling import SamplingParams
from pdserve.planner.cli import add_plan_parser, add_profile_parser


def build_parser(commands: Sequence[Callable[[Any], None]] = ()) -> argparse.ArgumentParser:
    """The client-side commands (generate, status, bench), and any others that `commands` add to the
    subparsers: `pdserve serve` is added by the composition root, router/cli.py (pdserve/ imports no service)."""
    parser = argparse.ArgumentParser(prog="pdserve", description="Disaggregated prefill/decode LLM serving.")
    sub = parser.add_subparsers(dest="command", required=True)
    for add in commands:
        add(sub)

    gen = sub.add_parser("generate", help="generate a completion for one prompt and stream it to stdout (--n: n "
                                          "samples of it, each printed once all have finished)")
    gen.add_argument("prompt", help="prompt text (tokenized as given unless --chat)")
    add_connection_args(gen)
    gen.add_argument("--offline", action="store_true", help="run the model in this process instead (no cluster)")
    add_model_args(gen)
    add_sampling_args(gen)
    gen.add_argument("--chat", action="store_true", help="render the prompt as one user message with the chat template")
    gen.add_argument("--json", action="store_true",
                     help="print one JSON object at the end (text, token_ids, finish_reason, usage; with --n > 1 "
                          "choices, one such object per sample, and the usage) instead of streaming")
    gen.add_argument("--timeout", type=float, default=None, help="deadline in seconds (remote only)")
    gen.add_argument("--service-tier", default="auto", choices=["auto", "default", "priority", "flex"],
                     help="the tier asked for (remote only); the tier served is printed on stderr (or in --json)")
    gen.set_defaults(func=cmd_generate)

    status = sub.add_parser("status", help="print the cluster's pools and workers")
    add_connection_args(status)
    status.add_argument("--json", action="store_true",
                        help="print the ClusterStatus message as JSON (every field, zeros included)")
    status.set_defaults(func=cmd_status)
    add_weights_parser(sub)
    add_bench_parser(sub)
    add_profile_parser(sub)
    add_plan_parser(sub)
    return parser


def add_sampling_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--max-tokens", type=int, default=128)
    p.add_argument("--temperature", type=float, default=1.0, help="0 for greedy")
    p.add_argument("--top-p", type=float, default=1.0)
    p.add_argument("--top-k", type=int, default=0, help="0 disables")
    p.add_argument("--seed", type=int, default=None)
    p.add_argument("--stop", action="append", default=[], help="stop string (repeatable)")
    p.add_argument("--ignore-eos", action="store_true")
    p.add_argument("--presence-penalty", type=float, default=0.0,
                   help="in [-2, 2]: subtracted once from every token the output holds (OpenAI's)")
    p.add_argument("--frequency-penalty", type=float, default=0.0,
                   help="in [-2, 2]: subtracted per occurrence of a token in the output (OpenAI's)")
    p.add_argument("--repetition-penalty", type=float, default=1.0,
                   help="> 0, 1 is off: the prompt's and the output's tokens' positive logits divided by it, "
                        "negative ones multiplied")
    p.add_argument("--min-tokens", type=int, default=0, help="EOS and stop ids are held back until this many tokens")
    p.add_argument("--n", type=int, default=1,
                   help="samples of the prompt (1..128), its KV computed once; sample i is seeded --seed + i, so it is "
                        "the --n 1 answer of that seed")
    p.add_argument("--logprobs", type=int, default=None, metavar="K",
                   help="print each generated token's logprob, rank and the K most likely tokens (K in 0..20)")
    p.add_argument("--prompt-logprobs", type=int, default=None, metavar="K",
                   help="print each prompt token's logprob given the prompt before it, and the K most likely")
    p.add_argument("--logprobs-mode", default=None, choices=["raw", "processed"],
                   help="generated tokens' logprobs from the model's distribution (raw) or the one sampled from, "
                        "after penalties, temperature, top-k and top-p (processed); default: the server's (raw "
                        "offline)")


def sampling_params_from_args(args: argparse.Namespace) -> SamplingParams:
    return SamplingParams(max_tokens=args.max_tokens, temperature=args.temperature, top_p=args.top_p,
                          top_k=args.top_k, seed=args.seed, stop=tuple(args.stop), ignore_eos=args.ignore_eos,
                          presence_penalty=args.presence_penalty, frequency_penalty=args.frequency_penalty,
                          repetition_penalty=args.repetition_penalty, min_tokens=args.min_tokens,
                          logprobs=args.logprobs, prompt_logprobs=args.prompt_logprobs,
                          logprobs_mode=args.logprobs_mode or "raw", n=args.n)


def cmd_generate(args: argparse.Namespace) -> int:
    return generate_offline(args) if args.offline else generate_remote(args)


def generate_offline(args: argparse.Namespace) -> int:
    from pdserve.config import EngineConfig
    from pdserve.engine.llm_engine import LLMEngine

    params = sampling_params_from_args(args)
    engine = LLMEngine(EngineConfig(model=args.model, load_format=args.load_format, dtype=args.dtype,
                                    quantization=args.quantization, device=args.device,
                                    cuda_graphs=False if args.enforce_eager else None,
                                    pipelined_decode=args.pipelined_decode,
                                    tensor_parallel_size=args.tensor_parallel_size,
                                    expert_parallel_size=args.expert_parallel_size, sim_gpu=args.sim_gpu,
                                    sim_kv_scale=args.sim_kv_scale, sim_time_scale=args.sim_time_scale))
    try:
        return _generate_offline(engine, params, args)
    finally:
        engine.close()  # a tensor-parallel engine's other ranks


def _generate_offline(engine, params: SamplingParams, args: argparse.Namespace) -> int:
    from pdserve.client.grpc_client import Sample

    tok = engine.tokenizer
    if tok is None:
        print("pdserve generate: this model has no tokenizer; text prompts need one", file=sys.stderr)
        return 2
    prompt = tok.apply_chat_template([{"role": "user", "content": args.prompt}]) if args.chat \
        else tok.encode(args.prompt)
    engine.add_request(prompt, params)
    samples = [Sample(i) for i in range(params.n)]
    prompt_logprobs = []
    for out in engine.stream():
        s = samples[out.index]
        s.token_ids.extend(out.new_token_ids)
        s.text += out.new_text
        s.logprobs += out.logprobs or ()
        prompt_logprobs = list(out.prompt_logprobs or prompt_logprobs)
        if params.n == 1 and not args.json and out.new_text:
            sys.stdout.write(out.new_text)
            sys.stdout.flush()
        if out.finish_reason is not None:
            s.finish_reason = out.finish_reason.value
    usage = {"prompt_tokens": len(prompt), "completion_tokens": sum(len(s.token_ids) for s in samples)}
    finish(args.json, samples, usage, logprobs=params.logprobs is not None,
           prompt_logprobs=(prompt, prompt_logprobs) if params.prompt_logprobs is not None else None,
           token_text=lambda t: tok.decode([t], skip_special_tokens=False))
    return 0


def generate_remote(args: argparse.Namespace) -> int:
    import grpc

    from pdserve.client.grpc_client import Client, Completion

    sampling_params_from_args(args)  # same validation, same messages as offline, before any network call
    kwargs = dict(max_tokens=args.max_tokens, temperature=args.temperature, top_p=args.top_p, top_k=args.top_k,
                  seed=args.seed, stop=args.stop, ignore_eos=args.ignore_eos, service_tier=args.service_tier,
                  presence_penalty=args.presence_penalty, frequency_penalty=args.frequency_penalty,
                  repetition_penalty=args.repetition_penalty, min_tokens=args.min_tokens, logprobs=args.logprobs,
                  prompt_logprobs=args.prompt_logprobs, logprobs_mode=args.logprobs_mode or "",
                  n=args.n if args.n != 1 else None)  # a request of one sample is the one sent before n existed
    if args.chat:
        kwargs["messages"] = [{"role": "user", "content": args.prompt}]
    else:
        kwargs["prompt"] = args.prompt
    out = Completion()
    try:
        with Client(connection_from_args(args)) as client:
            for r in client.generate(timeout=args.timeout, **kwargs):
                out.add(r)
                if args.n == 1 and not args.json and r.text:
                    sys.stdout.write(r.text)
                    sys.stdout.flush()
    except grpc.RpcError as e:
        print(f"\npdserve generate: {e.code().name}: {e.details()}", file=sys.stderr)
        return 1
    if not args.json:
        print(f"\n[service tier: {out.service_tier}]", file=sys.stderr)
    finish(args.json, out.choices, {k: out.usage[k] for k in ("prompt_tokens", "completion_tokens")},
           service_tier=out.service_tier, logprobs=args.logprobs is not None,
           prompt_logprobs=(None, out.prompt_logprobs) if args.prompt_logprobs is not None else None)
    return 0


def finish(as_json: bool, samples: Sequence[Any], usage: dict[str, int], service_tier: str | None = None,
           logprobs: bool = False, prompt_logprobs: tuple[Sequence[int] | None, Sequence[Any]] | None = None,
           token_text: Callable[[int], str] | None = None) -> None:
    """The end of `pdserve generate`: samples, by index (pdserve.client.Sample: index, text, token_ids,
    finish_reason, logprobs), one unless --n; one sample's text has been streamed already, several are
    printed here, each under a line that names it. logprobs: whether each generated token's are shown;
    prompt_logprobs: (the prompt's ids if known, one per prompt token, the first None), if asked. Either kind
    of TokenLogprob (the engine's or the client's): they have the same fields. token_text: a token's text,
    where a tokenizer is at hand (offline); else ids alone."""
    if as_json:
        extra = {} if service_tier is None else {"service_tier": service_tier}
        if prompt_logprobs is not None:
            extra["prompt_logprobs"] = [_logprob_json(lp) if lp is not None else None for lp in prompt_logprobs[1]]
        answers = [{"text": s.text, "token_ids": s.token_ids, "finish_reason": s.finish_reason,
                    **({"logprobs": [_logprob_json(lp) for lp in s.logprobs]} if logprobs else {})} for s in samples]
        # One sample: the object it has always been; n of them: each its own, by index, in choices.
        body = answers[0] if len(answers) == 1 else {"choices": [{"index": s.index, **a}
                                                                 for s, a in zip(samples, answers)]}
        print(json.dumps({**body, "usage": usage, **extra}))
        return
    sys.stdout.write("\n")
    if prompt_logprobs is not None:
        ids, entries = prompt_logprobs
        print("prompt logprobs (position, token, logprob, rank, most likely):")
        for i, lp in enumerate(entries):
            print(format_logprob(i, lp, token_text, ids[i] if ids is not None else None))
    for s in samples:
        if len(samples) > 1:
            print(f"--- sample {s.index} ({s.finish_reason}) ---")
            print(s.text)
        if logprobs:
            print("logprobs (position, token, logprob, rank, most likely):")
            for i, lp in enumerate(s.logprobs):
                print(format_logprob(i, lp, token_text))


def _logprob_json(lp: Any) -> dict[str, Any]:
    # -inf (a token the processed distribution masked out) is written as -Infinity, as Python's json reads it.
    return {"token_id": lp.token_id, "logprob": lp.logprob, "rank": lp.rank, "top": [list(t) for t in lp.top]}


def format_logprob(position: int, lp: Any, token_text: Callable[[int], str] | None = None,
                   token_id: int | None = None) -> str:
    """One line: position, the token, its logprob and rank, then the most likely tokens with theirs. lp None
    (the prompt's first token, which has no logprob): the token alone, if token_id is given."""
    def name(t: int) -> str:
        return f"{t}:{token_text(t)!r}" if token_text is not None else str(t)

    if lp is None:
        return f"{position:5d}  {name(token_id) if token_id is not None else '':24}  {'-':>9}"
    top = "  ".join(f"{name(t)} {v:.4f}" for t, v in lp.top)
    return f"{position:5d}  {name(lp.token_id):24}  {lp.logprob:9.4f}  #{lp.rank:<6d}  {top}"


def cmd_status(args: argparse.Namespace) -> int:
    import grpc

    from pdserve.client.grpc_client import Client

    try:
        with Client(connection_from_args(args)) as client:
            st = client.cluster_status(timeout=10)
    except grpc.RpcError as e:
        print(f"pdserve status: {e.code().name}: {e.details()}", file=sys.stderr)
        return 1
    if args.json:
        print_message(st)
        return 0
    print(f"mode {st.mode}  serving {st.serving}  running {st.requests_running}  "
          f"queued {st.requests_queued}/{st.queue_capacity}")
    for pool in st.pools:
        ranks = f" of TP {pool.tensor_parallel_size}" if pool.tensor_parallel_size > 1 else ""
        print(f"{pool.name} pool: {pool.current_workers} workers{ranks}, desired {pool.desired_workers} "
              f"(range {pool.min_workers}:{pool.max_workers})")
    header = (f"{'pool':10} {'worker':14} {'state':9} {'waiting':>8} {'wait tok':>9} {'running':>8} {'KV used':>14} "
              f"{'busy':>6} {'steps':>8} {'tokens':>10} {'weights':>8}")
    print(header)
    for pool in st.pools:
        for w in pool.workers:
            kv = f"{w.kv_blocks_used}/{w.kv_blocks_total}"
            print(f"{pool.name:10} {w.worker_id:14} {w.state:9} {w.waiting_requests:8d} {w.waiting_tokens:9d} "
                  f"{w.running_requests:8d} {kv:>14} {w.busy_fraction:6.1%} {w.steps:8d} {w.tokens_processed:10d} "
                  f"{'v' + str(w.weight_version):>8}")
        print(f"{pool.name:10} {'(pool)':14} {'':9} {pool.waiting_requests:8d} {'':9} {'':8} {pool.kv_usage:14.1%} "
              f"{pool.busy_fraction:6.1%}")
    return 0


def add_weights_parser(sub) -> None:
    """`pdserve weights ...`: the operator's side of weight updates (the router's Weights service)."""
    weights = sub.add_parser("weights", help="weight versions: update from a checkpoint, show, pause, resume")
    wsub = weights.add_subparsers(dest="weights_command", required=True)
    update = wsub.add_parser("update", help="load a checkpoint (readable by every worker) as a new weight version")
    update.add_argument("path",
                        help="a Hugging Face directory (safetensors) or a .gguf file of the served model's shape")
    update.add_argument("--version", type=int, required=True, help="the new version: greater than the one served")
    update.add_argument("--mode", default="pause", choices=["pause", "rolling"],
                        help="pause: every worker stops at a step boundary and all switch together; rolling: each "
                             "switches as soon as it has read the checkpoint")
    update.add_argument("--pause-mode", default="keep", choices=["keep", "wait", "abort"],
                        help="with --mode pause, requests in flight: keep (go on after the switch, by their "
                             "version policy), wait (the update waits for them) or abort (they end now)")
    versions = wsub.add_parser("versions", help="the version the cluster and each worker serve")
    pause = wsub.add_parser("pause", help="hold new requests until resume")
    pause.add_argument("--mode", default="keep", choices=["keep", "wait", "abort"],
                       help="requests in flight: keep (frozen where they are), wait (run to their end) or abort")
    resume = wsub.add_parser("resume", help="end a pause")
    for p in (update, versions, pause, resume):
        add_connection_args(p, admin=True)
        p.add_argument("--json", action="store_true", help="print the response message as JSON")
        p.add_argument("--timeout", type=float, default=600.0, help="deadline in seconds")
        p.set_defaults(func=cmd_weights)


def print_message(msg) -> None:
    """A protobuf message as JSON, every field (zeros included), by the .proto's names."""
    from google.protobuf.json_format import MessageToDict

    print(json.dumps(MessageToDict(msg, preserving_proto_field_name=True, always_print_fields_with_no_presence=True),
                     indent=1))


def cmd_weights(args: argparse.Namespace) -> int:
    import grpc

    from pdserve.client.grpc_client import Client

    try:
        with Client(connection_from_args(args, admin=True)) as client:
            if args.weights_command == "update":
                r = client.update_weights(args.path, args.version, args.mode, args.pause_mode, timeout=args.timeout)
            elif args.weights_command == "pause":
                r = client.pause(args.mode, timeout=args.timeout)
            elif args.weights_command == "resume":
                r = client.resume(timeout=args.timeout)
            else:
                r = client.weight_versions(timeout=args.timeout)
    except grpc.RpcError as e:
        print(f"pdserve weights {args.weights_command}: {e.code().name}: {e.details()}", file=sys.stderr)
        return 1
    if args.json:
        print_message(r)
    elif args.weights_command == "update":
        print(f"weight version {r.version} on {len(r.workers)} workers in {r.seconds:.2f} s")
        for w in r.workers:
            print(f"  {w.worker_id:14} staged {w.stage_seconds:7.3f} s  committed {w.commit_seconds:7.3f} s  "
                  f"{w.bytes / 1e6:9.1f} MB")
    else:
        print(f"weight version {r.version}{'  (paused: new requests wait)' if r.paused else ''}")
        for w in r.workers:
            print(f"  {w.pool:10} {w.worker_id:14} v{w.version}{'  paused' if w.paused else ''}")
    return 0


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        return args.func(args)
    except (ValueError, FileNotFoundError) as e:
        print(f"pdserve: error: {e}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
