"""Moving a request's KV blocks from a prefill worker to a decode worker.

channel.py   a pair channel: a two-rank gloo or NCCL group of its own, with bounded sends and receives,
             and the block gather/scatter on each side
handoff.py   the hand-off protocol on top: announcements in the sender's order, the prefill side's pusher
             (layer-wise, tier-ordered), the decode side's intake, and tensor-parallel shares rank to rank

May import pdserve.config, pdserve.faults and pdserve.parallel (the hand-off plan); never the engine:
the workers hand it caches and block ids.
"""
