"""The one-GPU check, `python -m bench.gpu` (`--help`: its sections; bench/gpu_check.sh runs it with the CUDA
tests): pdserve's decode against its bandwidth floor and transformers, the GPU's busy fraction, prefill MFU,
the offline engine against transformers, the one-GPU cluster, the KV checksum's cost, and experiments.

    timing       timing a call, the profiler's kernels, the section registry and RESULTS
    core         the dummy-weight engine core the sections share, and the random transformers checkpoint
    peaks        copy bandwidth and matmul FLOP/s, measured in the run
    decode       decode steps by batch and mode, GPU busy, transformers' decode step (hf_decode)
    prefill      a prompt in one step and a second chunk, MFU
    offline      LLMEngine against transformers generate(), greedy equality
    cluster      colocated and disaggregated 1P1D on one GPU (needs Ray), hand-off against prefill
    checksum     the KV checksum against the copies it rides on
    experiments  CUDA-graph decode forward, causal_lower_right prefill attention
    table        the table printed at the end
    __main__     the flags, the sections in order, the JSON and the exit status

Every section but cluster needs only torch and transformers; cluster needs Ray.
"""
