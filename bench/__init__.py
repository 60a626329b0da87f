"""Benchmark scripts: what pdserve's claims rest on, each measured in one run and recorded with its command in
docs/benchmarks.md. Not part of the product (nothing in pdserve, router or the workers imports them); run
from the checkout's root as modules, `python -m bench.<folder>.<script> --help` for what each does:

    gpu/        the one-GPU check (`python -m bench.gpu`; bench/gpu_check.sh runs it with the CUDA tests)
    engine/     one process, no cluster: the offline engine and the CPU kernels against transformers,
                llama.cpp and their own floors, tensor parallelism within one engine
    cluster/    real workers on a local Ray cluster: the serving path, disaggregated against colocated, the
                hand-off, autoscaling, tiers, faults, weight updates and an RL loop
    router/     the router's own costs (the floors under its hot path, its scale, its CPU a request) and the
                load generator's schedule, with scripted servers or simulated workers
    simulated/  GPUs at scale without a GPU: the planner's roofline and simulator, and clusters of simulated
                workers (`--load-format sim`) checked against it

common.py holds what two scripts share; no script imports another.
"""
