"""The OpenAI-compatible HTTP frontend: tokenize, stream from Triton, detokenize."""
