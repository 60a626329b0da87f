"""Sizing the pools: `pdserve profile` and `pdserve plan`.

profile.py    `pdserve profile`: step times and KV transfers measured on this device
simulator.py  a discrete-event simulator of the cluster (router, prefill, hand-off, decode, colocated, tiers,
              autoscaling): simulate() and its clock; its parts in sim/ (shapes, result, the workers' records,
              and the router, prefill, decode, colocated and scaling parts; sim/__init__.py lists them)
autoscale.py  how many workers each pool needs now, by the cost model: the policy the router and the
              simulator both run
pricing.py    what each service tier costs: the fast lane's size and batch cap, device time per token
parallel.py   tensor-parallel sizes (a mixture of experts: each with its experts sliced or split) compared: which
              fit a GPU, which wins for prefill and for decode
plan.py       candidate configurations, their predicted serving statistics, the ranking and the plot
kv_tiers.py   a multi-turn workload's hit rates by KV tier size: how much host memory the session pool wants
cli.py        the `profile` and `plan` commands

The cost model it plans with (what a step and a KV hand-off cost, and the GPUs the roofline knows) is
pdserve.perf.costs and pdserve.perf.hardware: the simulated engine runs on it too.

May import pdserve.config, pdserve.tiers, pdserve.parallel, pdserve.model, pdserve.transfer, pdserve.perf, pdserve.engine
(what a step and a hand-off cost, measured or modelled) and pdserve.loadgen (the workloads it plans for).
"""
