"""How a model is cut over the ranks of one worker, and how KV moves between two different cuts.

layout.py   tensor parallelism: which attention heads, KV heads, MLP columns and vocabulary rows each rank
            holds (`TPLayout`, `rank_config`, `shard_weights`), and the hand-off plan from a prefill worker
            of TP A to a decode worker of TP B (`handoff_plan`, `pair_plan`)

Pure arithmetic on the model's shape: imports only pdserve.config (and torch for the weights it slices).
Who runs the ranks is not decided here: processes of the offline engine (pdserve.engine.tp_runner) or Ray
actors in a cluster (pdserve.serving.tp_ranks).
"""
