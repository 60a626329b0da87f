"""Sizing the pools: `pdserve profile` and `pdserve plan`.

costs.py      what a step and a KV hand-off cost: fitted to a measured profile, or a roofline (tensor
              parallelism included: per-rank weights, KV and FLOPs, the all-reduces)
hardware.py   datasheet peaks of the GPUs the roofline knows, and the efficiency factors it assumes
profile.py    `pdserve profile`: step times and KV transfers measured on this device
simulator.py  a discrete-event simulator of the cluster (router, prefill, hand-off, decode, colocated)
parallel.py   tensor-parallel sizes compared: which fit a GPU, which wins for prefill and for decode
plan.py       candidate configurations, their predicted serving statistics, the ranking and the plot
cli.py        the `profile` and `plan` commands

May import pdserve.config, pdserve.tiers, pdserve.parallel, pdserve.model, pdserve.transfer, pdserve.engine
(what a step and a hand-off cost, measured or modelled) and pdserve.bench (the workloads it plans for).
"""
