"""Sizing the pools: `pdserve profile` and `pdserve plan`.

costs.py      what a step and a KV hand-off cost: fitted to a measured profile, or a roofline
hardware.py   datasheet peaks of the GPUs the roofline knows, and the efficiency factors it assumes
profile.py    `pdserve profile`: step times and KV transfers measured on this device
simulator.py  a discrete-event simulator of the cluster (router, prefill, hand-off, decode, colocated)
plan.py       candidate configurations, their predicted serving statistics, the ranking and the plot
cli.py        the `profile` and `plan` commands
"""
