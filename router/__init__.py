"""The router: the gRPC and OpenAI doors, admission, the line and placement, each request's attempts, the
pools on Ray, the autoscaler, /metrics, and `pdserve serve` (router/cli.py, the composition root). It
imports pdserve/ and both worker packages; docs/architecture.md lists its modules and the request's path.
"""
