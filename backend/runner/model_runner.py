"""Runs one scheduled step on the model: builds the flat batch, forwards, samples.

Owns the model weights and the KV cache tensors (one per layer,
[2, num_blocks, block_size, num_kv_heads, head_dim]), and the drafters of speculative
decoding that have weights: the checkpoint's MTP layers, SPEC_DRAFT_MODEL's model.
"""

from __future__ import annotations

import sys
from functools import partial

import torch

from backend.lora.lanes import LoraLanes, lora_batch
from backend.runner.drafters import DraftModelRunner, MtpRunner, allocate_kv, kv_block_bytes
from backend.runner.forward_batch import ForwardBatch, Span, build_forward_batch
from backend.runner.loader import load_model
from backend.runner.models.m2m100_cross import CrossPlan, build_cross_plan, cross_slots
from backend.runner.models.transformers_lm import TransformersCausalLM
from backend.runner.quant.apply import QuantSpec
from backend.runner.vision_inputs import mrope_ids, vision_embeds
from backend.sampling import logprobs as lp
from backend.sampling.sampler import sample
from backend.settings.engine import EngineConfig
from backend.types.sampling_row import SamplingRow
from backend.types.sequence import Sequence
from backend.types.step import ScheduledSeq, StepResult
from backend.vision.encoder_cache import EncoderCache

_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def resolve_device(config: EngineConfig) -> torch.device:
    if config.device:
        return torch.device(config.device)
    return torch.device("cuda" if torch.cuda.is_available() else "cpu")


def resolve_dtype(config: EngineConfig, device: torch.device) -> torch.dtype:
    if config.dtype:
        if config.dtype not in _DTYPES:
            raise ValueError(f"DTYPE must be one of {sorted(_DTYPES)}, got {config.dtype!r}")
        return _DTYPES[config.dtype]
    # bfloat16 matmuls measured slower than float32 on these CPUs, even at batch 32
    return torch.bfloat16 if device.type == "cuda" else torch.float32


KV_CACHE_DTYPES = ("auto", "float16", "float32")


def check_kv_cache_dtype(config: EngineConfig) -> None:
    """KV_CACHE_DTYPE's value, refused before the weights load."""
    if config.kv_cache_dtype not in KV_CACHE_DTYPES:
        raise ValueError(f"KV_CACHE_DTYPE must be one of {', '.join(KV_CACHE_DTYPES)}, got {config.kv_cache_dtype!r}")


def resolve_kv_dtype(config: EngineConfig, dtype: torch.dtype, device: torch.device, quantized: bool) -> torch.dtype:
    """The KV cache's element type. auto: float16 where the decoder's weights run in our
    quantized CPU kernels (llama.cpp's default cache too; perplexity within 0.01%:
    docs/kv-cache.md), else the model's dtype; float16 and float32 as named."""
    check_kv_cache_dtype(config)
    if config.kv_cache_dtype == "auto":
        return torch.float16 if quantized and device.type == "cpu" else dtype
    return _DTYPES[config.kv_cache_dtype]


class ModelRunner:
    def __init__(self, config: EngineConfig):
        if config.num_threads:
            torch.set_num_threads(config.num_threads)
        self.device = resolve_device(config)
        self.dtype = resolve_dtype(config, self.device)
        check_kv_cache_dtype(config)
        self.block_size = config.block_size
        quant = QuantSpec(config.quant, config.quant_group, config.quant_symmetric,
                          activations=config.quant_activations, gemm=config.quant_gemm,
                          gemv_max_rows=config.quant_gemv_max_rows)  # fmt: skip
        self.model = load_model(
            config.model_path, self.dtype, self.device, quant, config.model_impl, config.max_model_len
        )
        quantized = getattr(self.model, "lm_head_q", None) is not None
        self.kv_dtype = resolve_kv_dtype(config, self.dtype, self.device, quantized)  # the target's; MTP, drafts: dtype
        self.model_config = self.model.config
        self.native = not isinstance(self.model, TransformersCausalLM)  # False: the generic path
        # layers keeping state besides attention's KV (backend/runner/models/layer_state.py)
        self.keeps_state = bool(getattr(self.model, "state_layers", None))
        self.whole_prompts = bool(getattr(self.model, "whole_prompts", False))  # each prompt in one step
        self.draft = self._load_draft(config)  # SPEC_DRAFT_MODEL's forward, when it drafts
        self.num_blocks = config.num_blocks or self._num_blocks_for(config)
        mc = self.model_config
        self.kv_caches = allocate_kv(mc, mc.num_layers, self.num_blocks, self.block_size, self.kv_dtype, self.device,
                                     empty=mc.kv_free_layers)  # fmt: skip
        dtype_name = str(self.kv_dtype).removeprefix("torch.")
        free = len(mc.kv_free_layers)
        free = f"; {free} of {mc.num_layers} layers never attend and hold none" if free else ""
        print(f"KV cache: {self.num_blocks} blocks of {self.block_size} tokens in {dtype_name} "
              f"(KV_CACHE_DTYPE={config.kv_cache_dtype}){free}", file=sys.stderr)  # fmt: skip
        self.mtp = MtpRunner(self.model, self.num_blocks, self.block_size) if self.model.mtp is not None else None
        if self.draft is not None:
            self.draft.allocate(self.num_blocks, self.block_size)
        # a translation model (M2M100): its requests' encoders run in the step that admits them
        self.encoder_decoder = bool(getattr(mc, "is_encoder_decoder", False))
        # the adapters' lanes (backend.lora.lanes), when the server serves adapters (decoder-only
        # models on our own forward)
        serves_lora = config.max_loras and not self.encoder_decoder and self.native
        self.lora = LoraLanes(config.max_loras, mc, self.dtype, self.device) if serves_lora else None
        # a vision-language model (backend.vision): M-RoPE ids for every step, and the
        # encoder's outputs of recent items (the engine's EncoderCache, which it sets)
        self.mrope = bool(getattr(mc, "mrope_section", ()))
        self.encoder_cache: EncoderCache | None = None

    def _load_draft(self, config: EngineConfig) -> DraftModelRunner | None:
        if not config.spec_draft_model or config.speculative == "off":
            return None
        if config.speculative not in ("auto", "draft"):
            raise ValueError(f"SPEC_DRAFT_MODEL is set, but SPECULATIVE={config.speculative} does not draft with it")
        return DraftModelRunner(config.spec_draft_model, config.model_path, self.model_config, self.dtype, self.device)

    def _num_blocks_for(self, config: EngineConfig) -> int:
        """Blocks the pool holds: each block's keys in every layer that attends, the MTP
        layers' and the draft model's included. A model no layer of which attends (Mamba)
        holds no keys: its blocks only count each sequence's tokens, MAX_NUM_SEQS sequences
        of the longest context (at most 2^16 blocks)."""
        mc, bs = self.model_config, self.block_size
        per_block = kv_block_bytes(mc, mc.num_layers - len(mc.kv_free_layers), bs, self.kv_dtype) + kv_block_bytes(
            mc, mc.num_mtp_layers, bs, self.dtype
        )
        if self.draft is not None:
            per_block += self.draft.block_bytes(bs, self.dtype)
        if not per_block:
            return min(config.max_num_seqs * -(-(config.max_model_len or mc.max_position_embeddings) // bs), 1 << 16)
        num_blocks = config.kv_cache_bytes // per_block
        if num_blocks < 2:
            raise ValueError(f"KV cache of {config.kv_cache_bytes} bytes holds fewer than 2 blocks; raise KV_CACHE_MB")
        return int(num_blocks)

    @torch.inference_mode()
    def copy_blocks(self, copies: list[tuple[int, int]]) -> None:
        """KV of block `source` into block `destination`, in every layer (a forked beam's
        partial last block: BlockManager.fork)."""
        if not copies:
            return
        sources = torch.tensor([s for s, _ in copies], device=self.device)
        destinations = torch.tensor([d for _, d in copies], device=self.device)
        for cache in self.kv_caches:
            for half in cache:  # keys, then values: indexing a contiguous [num_blocks, ...] is a small copy
                half[destinations] = half[sources]  # (indexing dim 1 of the whole cache rewrote all of it)

    def build_batch(self, scheduled: list[ScheduledSeq]) -> ForwardBatch:
        spans = []
        for item in scheduled:
            seq, start, drafts = item.seq, item.seq.num_computed_tokens, item.draft_tokens
            own = seq.token_ids[start : start + item.num_new_tokens - len(drafts)]
            # speculative tokens sit after the sequence's own; a completing sequence wants
            # the logits of its last real token, then each draft's
            spans.append(Span(own + drafts, start, seq.block_table, 1 + len(drafts) if item.completes else 0))
        batch = build_forward_batch(spans, self.block_size, self.device)
        if self.keeps_state:
            batch.layer_states = [_layer_states(item.seq) for item in scheduled]
        if self.lora is not None:
            batch.lora = lora_batch(scheduled, batch.query_start, self.lora, self.device)
        if self.mrope:
            batch.mrope_positions = mrope_ids(scheduled, batch.positions)
        if self.encoder_cache is not None:
            spliced = vision_embeds(scheduled, batch.query_start, self.model.visual, self.encoder_cache,
                                    self.model_config.vision.merge_size)  # fmt: skip
            if spliced is not None:
                batch.embeds_rows, batch.embeds = spliced
        return batch

    @torch.inference_mode()
    def execute(self, scheduled: list[ScheduledSeq]) -> StepResult:
        """Forward the step: the logits rows of the completing sequences (one, plus one per
        draft) and the prompt logprobs asked for; the rows are sampled on demand."""
        batch = self.build_batch(scheduled)
        if self.encoder_decoder:
            hidden = self.model(batch, self.kv_caches, self._encode(scheduled, batch))
        else:
            hidden = self.model(batch, self.kv_caches)
        spans = lp.prompt_logprob_spans(scheduled, batch.query_start)
        prompt = lp.prompt_logprobs(hidden, spans, self.model.compute_logits) if spans else []
        prompt_logprobs = [(s.seq, s.start, v) for s, v in zip(spans, prompt, strict=True)]
        logits = self.model.compute_logits(hidden[batch.logits_indices]) if len(batch.logits_indices) else None
        first_rows, row = [], 0
        for item in scheduled:
            if item.completes:
                first_rows.append(row)
                row += 1 + len(item.draft_tokens)
        return StepResult(partial(_sample_rows, logits), partial(_log_probs, logits), first_rows, prompt_logprobs,
                          hidden, batch.query_start)  # fmt: skip

    def _encode(self, scheduled: list[ScheduledSeq], batch: ForwardBatch) -> CrossPlan:
        """Run the encoder of each source new this step (a beam request's rows share one),
        then the step's cross-attention plan over every sequence's encoder states."""
        for encoder in {id(item.seq.encoder): item.seq.encoder for item in scheduled}.values():
            if not encoder.encoded:
                slots = cross_slots(encoder.blocks, len(encoder.tokens), self.block_size, self.device)
                self.model.encode(encoder.tokens, slots, self.kv_caches)
        tables = [item.seq.encoder.blocks for item in scheduled]
        lengths = [len(item.seq.encoder.tokens) for item in scheduled]
        return build_cross_plan(batch, tables, lengths, self.block_size, self.dtype)


def _layer_states(seq: Sequence) -> dict:
    """The sequence's layer states: empty where it starts over (new, or preempted)."""
    if seq.layer_states is None or seq.num_computed_tokens == 0:
        seq.layer_states = {}
    return seq.layer_states


@torch.inference_mode()
def _log_probs(logits: torch.Tensor, indices: list[int]) -> torch.Tensor:
    return torch.log_softmax(logits[indices].float(), dim=-1)


@torch.inference_mode()
def _sample_rows(logits: torch.Tensor, indices: list[int], rows: list[SamplingRow]) -> tuple[list, list]:
    """A token per row of `logits[indices]`, and its raw logprob when the row asks."""
    whole = len(indices) == logits.shape[0] and indices == list(range(len(indices)))
    chosen = logits if whole else logits[indices]  # a copy: the sampler edits its logits in place
    wanted, raw = lp.raw_logprobs(chosen, rows)  # before sampling
    tokens = sample(chosen, rows)
    return tokens, lp.token_logprobs(wanted, raw, rows, tokens)
