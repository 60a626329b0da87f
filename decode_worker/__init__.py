"""The decode worker's Ray actor (actor.py, and the fast lane's): the engine in the DECODE role,
reservations, KV intake, one output per step. Imports pdserve/ alone."""
