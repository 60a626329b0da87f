"""The prefill worker's Ray actor (actor.py): the engine in the PREFILL role, held KV, the pushes. Imports
pdserve/ alone."""
