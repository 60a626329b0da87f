"""What runs inside a worker actor of the cluster, and what crosses between it and the router.

worker.py        the worker-actor base: the engine in its role, the step thread, outputs, stats, failure
weight_calls.py  its weight-update calls: stage, commit, a trainer's group, pause and resume (a mixin)
cancels.py       its cancels: a request ended wherever it stands, tombstones, the record (a mixin)
fault_calls.py   the calls a test makes to put a worker in a fault (a mixin)
router_links.py  its links to the routers, and which one each output goes on
colocated.py     the colocated worker (one engine, both phases)
tp_ranks.py      ranks 1..n-1 of a tensor-parallel worker as Ray actors in the worker's placement group
messages.py      the plain dataclasses router and workers exchange
link.py          each worker's connection to the router: per-request calls in, step outputs and replies out
calls.py         the router's calls on that link, defined once: names, arguments, results (WorkerCalls, Call)

The prefill and decode actors (prefill_worker/, decode_worker/) build on worker.py. May import every
package before it (pdserve.engine, pdserve.transfer, pdserve.model, pdserve.parallel); never the planner,
router/ or a worker package. The metrics a worker reports travel in WorkerStats (messages.py); the router
exports them (router/metrics.py).
"""
