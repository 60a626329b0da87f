"""Measurements in one process, no cluster: the offline engine against transformers and llama.cpp on the
same weights, the CPU kernels (decode attention, the linear kernel's rows, a mixture of experts' step)
against torch's paths and the memory-read floor, and tensor parallelism's cost within one engine."""
