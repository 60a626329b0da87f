"""What a step and a KV hand-off cost: the performance model the planner plans with and the simulated
engine (pdserve.engine.sim_runner) keeps time by.

costs.py        a step's and a hand-off's time: fitted to a measured profile, or a roofline (tensor
                parallelism and mixtures of experts, expert parallelism, included)
hardware.py     datasheet peaks of the GPUs the roofline knows, and the efficiency factors it assumes
shapes.py       model shapes the roofline costs but pdserve does not serve (DeepSeek-V3's: latent
                attention, a shared expert)

May import pdserve.config, pdserve.parallel, pdserve.transfer (the wire's part sizes) and pdserve.model
(the shapes of the presets).
"""
