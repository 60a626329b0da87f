"""The planner's discrete-event simulator of a pdserve cluster (the "simulated engine" is another thing:
`--load-format sim`, pdserve.engine.sim_runner). Import from here: simulate, ClusterShape, PoolShape, SimResult.

core.py       simulate(): the event loop and the simulation the parts below make up
shapes.py     what it simulates: PoolShape (a pool's workers and batching), ClusterShape (the deployment)
result.py     what it gives back: SimResult, each request's times, the workers' peaks, statistics per tier
state.py      the records: the line queues serve by (tier, arrival), a step's prompt chunks, the event
              kinds, and each worker's state (prefill; decode, fast lane or colocated)
router.py     Routing: admission, the router's lines, placement on prefill and decode workers
prefill.py    Prefilling: a prefill worker's token-budget steps and the hand-off of its KV
decode.py     Decoding: a decode worker's reservations, continuous batching, flex preemption and resume
colocated.py  Colocating: a colocated worker's steps, decodes first and prompt chunks in the rest
scaling.py    Scaling: the autoscaler asked every interval, workers started and drained

The parts are mixins of one class (core._Simulation): each reads and writes the state it sets up,
and calls the others' methods through it, so no part imports another.
"""
from __future__ import annotations

from pdserve.planner.simulator.core import simulate
from pdserve.planner.simulator.result import SimResult
from pdserve.planner.simulator.shapes import ClusterShape, PoolShape

__all__ = ["ClusterShape", "PoolShape", "SimResult", "simulate"]
