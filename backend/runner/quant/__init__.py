"""QUANT: weight-only int8 / int4 linears. formats.py (`QuantizedWeight`, `Tiles`, the
reference `dequantize`), gguf_blocks.py (a GGUF file's blocks as they are), apply.py
(`QuantSpec`, `quantize_model` at load) and matmul.py (`quant_linear`: which kernel of
backend.kernels multiplies a weight, by rows)."""
