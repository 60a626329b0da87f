"""GPUs at scale, without one: the planner's roofline (a mixture of experts' step against its dense twin),
its simulator with the router's autoscaler (GPU-hours of autoscaled pools, of shared and separate tiers),
and clusters of simulated workers (`--load-format sim`, a step sleeping the roofline's time) against that
simulator and as `pdserve plan` picks them."""
