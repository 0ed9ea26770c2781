"""Engine settings. Environment variables override the defaults (`from_env`)."""

from __future__ import annotations

import os
from dataclasses import dataclass


@dataclass(slots=True)
class EngineConfig:
    model_path: str
    # which forward runs the model: auto (ours where it takes the architecture, else
    # transformers' modeling code with our paged attention) | native | transformers
    model_impl: str = "auto"
    dtype: str | None = None  # None: float32 on the CPU, bfloat16 on CUDA
    device: str | None = None  # None: cuda when present, else cpu
    block_size: int = 16  # tokens per KV block
    kv_cache_bytes: int = 1 << 30  # memory for the KV block pool
    num_blocks: int | None = None  # overrides kv_cache_bytes: the pool's size in blocks
    max_num_seqs: int = 64  # sequences in one step at most
    max_num_batched_tokens: int = 512  # token budget of one step (prefill chunks + decodes)
    max_model_len: int | None = None  # None: the model's max_position_embeddings
    enable_prefix_caching: bool = True
    num_threads: int | None = None  # torch CPU threads; None: torch's default
    speculative: str = "auto"  # auto | off | ngram | draft | mtp (backend.speculation.speculator)
    spec_tokens: int = 4  # drafts per sequence and step at most
    spec_draft_model: str | None = None  # a smaller model folder with the same tokenizer (SPECULATIVE=draft)
    # LoRA (backend.lora): adapters in one step at most (0: none served), their largest
    # rank, versions kept in host memory (None: max_loras), `name=path,...` loaded at
    # start, and the adapter adapter_slot -1 follows
    max_loras: int = 4
    max_lora_rank: int = 64
    max_cpu_loras: int | None = None
    max_lora_file_bytes: int | None = None  # an adapter's weights file; None: what rank max_lora_rank needs
    lora_modules: str = ""
    active_lora: str = ""
    max_beams: int = 8  # num_beams a request may ask for
    scheduling_policy: str = "fcfs"  # fcfs | priority (requests' `priority`, lower sooner)
    # weight-only quantization of the decoder's linears (backend/runner/quant): none | int8 | int4
    # | auto (what a server without QUANT gets: a model converted from a GGUF file in that file's
    # own blocks where our CPU kernels run, else none), in groups of quant_group inputs, with zero
    # points unless quant_symmetric
    quant: str = "none"
    quant_group: int = 32
    quant_symmetric: bool = False
    # how the quantized weights multiply (backend/runner/quant/matmul.py): the activations they
    # meet, auto | float32 | int8 (auto: int8 for int4 weights where the CPU has AVX-512 VNNI,
    # else float32); the GEMM past the GEMV's rows, float32 | bf16; that crossover in rows
    # (None: the one measured for each kind, int4 48, int8 12)
    quant_activations: str = "auto"
    quant_gemm: str = "float32"
    quant_gemv_max_rows: int | None = None
    encoder_cache_tokens: int = 16384  # a vision model's encoder outputs kept (backend.vision.encoder_cache)
    # the KV cache's element type: float16 (half the bytes a step reads past the weights;
    # attention still computes in the model's dtype) | float32 | auto (float16 for weights
    # quantized on the CPU, else the model's dtype: model_runner.resolve_kv_dtype)
    kv_cache_dtype: str = "auto"
    # grammar compilation (backend.sampling.grammar_compiler): seconds one may take (a slot's
    # wait included; then killed), worker processes (compilations at once), compilations of
    # one tenant at once, and the largest spec: JSON values of a json_schema / structural_tag,
    # characters of a regex / ebnf
    grammar_compile_timeout_s: float = 10.0
    grammar_compile_workers: int = 2
    grammar_compiles_per_tenant: int = 1
    grammar_max_spec_nodes: int = 30_000
    grammar_max_spec_chars: int = 65_536

    @classmethod
    def from_env(cls, model_path: str | None = None) -> EngineConfig:
        env = os.environ

        def opt_int(name):
            return int(env[name]) if env.get(name) else None

        cfg = cls(model_path=model_path or env["LLM_MODEL_PATH"])
        cfg.model_impl = env.get("MODEL_IMPL") or cfg.model_impl
        cfg.dtype = env.get("DTYPE") or None
        cfg.device = env.get("DEVICE") or None
        for name, attr in (
            ("KV_CACHE_MB", None),
            ("BLOCK_SIZE", "block_size"),
            ("MAX_NUM_SEQS", "max_num_seqs"),
            ("MAX_NUM_BATCHED_TOKENS", "max_num_batched_tokens"),
            ("MAX_MODEL_LEN", "max_model_len"),
            ("NUM_THREADS", "num_threads"),
            ("SPEC_TOKENS", "spec_tokens"),
            ("MAX_LORAS", "max_loras"),
            ("MAX_LORA_RANK", "max_lora_rank"),
            ("MAX_CPU_LORAS", "max_cpu_loras"),
            ("MAX_LORA_FILE_BYTES", "max_lora_file_bytes"),
            ("MAX_BEAMS", "max_beams"),
            ("ENCODER_CACHE_TOKENS", "encoder_cache_tokens"),
            ("QUANT_GROUP_SIZE", "quant_group"),
            ("QUANT_GEMV_MAX_ROWS", "quant_gemv_max_rows"),
            ("GRAMMAR_COMPILE_WORKERS", "grammar_compile_workers"),
            ("GRAMMAR_COMPILES_PER_TENANT", "grammar_compiles_per_tenant"),
            ("GRAMMAR_MAX_SPEC_NODES", "grammar_max_spec_nodes"),
            ("GRAMMAR_MAX_SPEC_CHARS", "grammar_max_spec_chars"),
        ):
            value = opt_int(name)
            if value is None:
                continue
            if attr is None:
                cfg.kv_cache_bytes = value << 20
            else:
                setattr(cfg, attr, value)
        if env.get("GRAMMAR_COMPILE_TIMEOUT_S"):
            cfg.grammar_compile_timeout_s = float(env["GRAMMAR_COMPILE_TIMEOUT_S"])
        cfg.speculative = env.get("SPECULATIVE") or cfg.speculative
        cfg.quant = env.get("QUANT") or "auto"
        cfg.quant_symmetric = env.get("QUANT_SYMMETRIC", "0") not in ("0", "false", "no", "")
        cfg.quant_activations = env.get("QUANT_ACTIVATIONS") or cfg.quant_activations
        cfg.quant_gemm = env.get("QUANT_GEMM") or cfg.quant_gemm
        cfg.scheduling_policy = env.get("SCHEDULING_POLICY") or cfg.scheduling_policy
        cfg.kv_cache_dtype = env.get("KV_CACHE_DTYPE") or cfg.kv_cache_dtype
        cfg.spec_draft_model = env.get("SPEC_DRAFT_MODEL") or None
        cfg.lora_modules = env.get("LORA_MODULES", "").strip()
        cfg.active_lora = env.get("ACTIVE_LORA", "").strip()
        if env.get("ENABLE_PREFIX_CACHING"):
            cfg.enable_prefix_caching = env["ENABLE_PREFIX_CACHING"] not in ("0", "false", "no")
        return cfg
