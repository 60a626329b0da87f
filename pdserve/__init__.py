"""pdserve: a disaggregated prefill/decode LLM serving cluster. This package is the library that the
workers (prefill_worker/, decode_worker/) and the router (router/) import; it imports none of them.

Packages, lowest first; each may import only those before it (tests/test_layering.py holds the table):

    config, tiers, faults, cache   shared vocabulary: configuration, service tiers, fault points, the disk cache
    parallel/   how a model is cut over the ranks of a worker, and the hand-off plan between two such cuts
    kernels/    the CPU extension (C++ sources in kernels/csrc) and the CPU and Triton attention kernels
    model/      the network: the Llama family, its layers, the loaders (safetensors, GGUF, dummy), the tokenizer
    transfer/   moving KV blocks between a prefill and a decode worker: the pair channel and the hand-off
    engine/     requests, sampling, the paged KV cache and its block pool, the scheduler, the runner, CUDA
                graphs, the step loop and the offline engine (`from pdserve.engine import LLMEngine`)
    client/     the Python gRPC client (`from pdserve.client import Client`)
    loadgen/    `pdserve bench`, the load generator
    planner/    `pdserve profile` and `pdserve plan`: costs, rooflines, the cluster simulator, the autoscaling policy
    serving/    what runs inside a worker actor: the actor base, the colocated worker, TP rank actors, the
                messages workers and router exchange, and every metric
    cli         the client-side `pdserve` commands (`pdserve serve` is router/cli.py's)
"""
