"""Measurements of real workers on a local Ray cluster (router.cluster, the gRPC router in the script's
process or `pdserve serve` beside it): the serving path against the offline engine, disaggregated against
colocated and `pdserve plan`'s predictions of both, the KV hand-off (also between TP sizes), autoscaling
on bursts, service tiers, a decode worker killed, n samples a request, weight updates and an RL loop."""
