"""Live weight updates: new weights pushed into running workers.

The package owns validating named tensors and staging them into a worker's model in its own format, then
committing them in place (update.py), the trainer's broadcast group (group.py), and weight versions.
"""
