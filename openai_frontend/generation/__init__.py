"""One generation and its streaming: the engine client (Triton gRPC), the outputs as
text deltas (detokenizer, stop strings), n choices together, the tokenizer."""
