"""Moving a request's KV blocks from a prefill worker to a decode worker.

channel.py    a pair channel: a two-rank gloo or NCCL group of its own, with bounded sends and receives,
              and the block gather/scatter on each side
protocol.py   the hand-off protocol on top (its overview): what both sides agree on, the announcements in
              the sender's order, a transfer's parts, trailer and checksum, the hand-off's histogram
shares.py     one rank's share of a transfer on one channel, and tensor-parallel shares rank to rank
sender.py     the prefill side: the pusher (layer-wise, tier-ordered) and its jobs
receiver.py   the decode side: the table of reserved blocks and the intake
store.py      TCPStores bound to the address given (torch's bind every interface): the rendezvous stores

May import pdserve.config, pdserve.faults and pdserve.parallel (the hand-off plan); never the engine:
the workers hand it caches and block ids.
"""
