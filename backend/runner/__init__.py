"""The model runner: builds each step's flat batch, runs the forward (`models/`) over the
paged KV cache, and samples; plus loading and converting model folders."""
