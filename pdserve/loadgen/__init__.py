"""The load generator `pdserve bench` runs against a router, with the serving statistics of the field. (The
repository's bench/ holds benchmark scripts; this package is the product's load generator.)

workload.py  length distributions, arrival schedules, JSONL traces (pure, seeded)
stats.py     per-request records and the aggregate report (pure functions)
runner.py    the asyncio driver over pdserve.client.grpc_client.AsyncClient
sessions.py  multi-turn sessions (--sessions): each turn the conversation so far, with its key; TTFT by turn
plot.py      latency CDFs and the throughput timeline (matplotlib, optional `bench` extra)
cli.py       `pdserve bench` flags and the printed summary

May import pdserve.client and pdserve.tiers: a load generator needs no torch.
"""
