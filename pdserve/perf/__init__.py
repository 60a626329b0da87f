"""What a step and a KV hand-off cost: the performance model the planner plans with and the simulated
engine (pdserve.engine.sim_runner) keeps time by.

costs.py        a step's and a hand-off's time: fitted to a measured profile, or a roofline (tensor
                parallelism included)
hardware.py     datasheet peaks of the GPUs the roofline knows, and the efficiency factors it assumes

May import pdserve.config, pdserve.parallel, pdserve.transfer (the wire's part sizes) and pdserve.model
(the shapes of the presets).
"""
