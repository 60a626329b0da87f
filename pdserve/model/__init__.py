"""The network, and everything that turns a checkpoint into it.

llama.py        the Llama-family decoder (Llama 2/3, Mistral, Qwen2, Qwen3): forward(ids, positions,
                attention metadata, KV cache) -> hidden states; it never sees a request
attention.py    attention metadata and attention over the paged KV cache (torch reference; dispatches to
                pdserve.kernels on CPU and GPU)
linear.py       linear layers in the model's dtype or weight-only int8
layer_ops.py    the decoder's per-layer ops (norms, rotary, residuals), fused on CPU where it pays
loader.py       checkpoints to a model: Hugging Face safetensors, GGUF, dummy weights, the default model
gguf_loader.py  GGUF files read into Hugging Face names and config fields
tokenizer.py    the tokenizer and the per-request streaming detokenizer

May import pdserve.config, pdserve.derived, pdserve.parallel (a rank's share) and pdserve.kernels.
"""
