"""The kernels the model calls where they pay, each with a torch reference elsewhere in the model.

cpu_kernels.py       builds and loads the C++ extension (csrc/*.cpp) once per machine: paged decode
                     attention, int8/fp linear, fused layer ops, as torch.ops.pdserve.*
cpu_attention.py     decode attention over the paged KV cache on CPU (the extension's kernel)
triton_attention.py  decode and prefill attention over the paged KV cache on the GPU (Triton; runs in
                     Triton's interpreter on CPU tensors for the tests)
triton_moe.py        a mixture-of-experts block's experts on the GPU, grouped by expert on the device
                     (Triton; tested in the interpreter only)

Imports only pdserve.cache (where the built extension is kept): kernels know tensors, not models.
"""
