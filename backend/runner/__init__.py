"""The model runner: builds each step's flat batch, runs the forward (`models/`) over the
paged KV cache (attention.py) and hands the logits to the sampler; loads model folders
(loader.py, weights.py), converts the default model's GGUF (convert.py) and quantizes its
weights (`quant/`), on the kernels of backend.kernels."""
