"""Runs one scheduled step on the model: builds the flat batch, forwards, samples.

Owns the model weights and the KV cache tensors (one per layer,
[2, num_blocks, block_size, num_kv_heads, head_dim]).
"""

from __future__ import annotations

from functools import partial

import torch

from backend.core.config import EngineConfig
from backend.core.step import ScheduledSeq, StepResult
from backend.runner.forward_batch import ForwardBatch
from backend.runner.loader import load_model
from backend.sampling import logprobs as lp
from backend.sampling.sampler import SamplingRow, sample

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


class ModelRunner:
    def __init__(self, config: EngineConfig):
        if config.num_threads:
            torch.set_num_threads(config.num_threads)
        self.device = resolve_device(config)
        self.dtype = resolve_dtype(config, self.device)
        self.block_size = config.block_size
        self.model = load_model(config.model_path, self.dtype, self.device)
        self.model_config = self.model.config
        self.num_blocks = config.num_blocks or self._num_blocks_for(config.kv_cache_bytes)
        self.kv_caches = self._allocate_kv_caches()

    def _block_bytes(self) -> int:
        mc = self.model_config
        elem = torch.empty((), dtype=self.dtype).element_size()
        return 2 * self.block_size * mc.num_kv_heads * mc.head_dim * elem

    def _num_blocks_for(self, kv_cache_bytes: int) -> int:
        per_block_all_layers = self._block_bytes() * self.model_config.num_layers
        num_blocks = kv_cache_bytes // per_block_all_layers
        if num_blocks < 2:
            raise ValueError(f"KV cache of {kv_cache_bytes} bytes holds fewer than 2 blocks; raise KV_CACHE_MB")
        return int(num_blocks)

    def _allocate_kv_caches(self) -> list[torch.Tensor]:
        mc = self.model_config
        shape = (2, self.num_blocks, self.block_size, mc.num_kv_heads, mc.head_dim)
        return [torch.zeros(shape, dtype=self.dtype, device=self.device) for _ in range(mc.num_layers)]

    def build_batch(self, scheduled: list[ScheduledSeq]) -> ForwardBatch:
        bs = self.block_size
        input_ids, positions, slots, query_lens, context_lens = [], [], [], [], []
        query_start, logits_indices = [0], []
        for item in scheduled:
            seq, start, n = item.seq, item.seq.num_computed_tokens, item.num_new_tokens
            table = seq.block_table
            drafts = item.draft_tokens
            input_ids.extend(seq.token_ids[start : start + n - len(drafts)])
            input_ids.extend(drafts)  # speculative tokens sit after the sequence's own
            span = range(start, start + n)
            positions.extend(span)
            slots.extend(table[p // bs] * bs + p % bs for p in span)
            query_lens.append(n)
            context_lens.append(start + n)
            query_start.append(query_start[-1] + n)
            if item.completes:  # the last real token's logits, then each draft's
                end = query_start[-1]
                logits_indices.extend(range(end - 1 - len(drafts), end))
        max_blocks = max(len(item.seq.block_table) for item in scheduled)
        tables = [item.seq.block_table + [0] * (max_blocks - len(item.seq.block_table)) for item in scheduled]

        def as_tensor(values):
            return torch.tensor(values, dtype=torch.int64).to(self.device, non_blocking=True)

        return ForwardBatch(
            input_ids=as_tensor(input_ids),
            positions=as_tensor(positions),
            slot_mapping=as_tensor(slots),
            query_lens=query_lens,
            context_lens=context_lens,
            query_start=query_start,
            block_tables=as_tensor(tables),
            logits_indices=as_tensor(logits_indices),
        )

    @torch.inference_mode()
    def execute(self, scheduled: list[ScheduledSeq]) -> StepResult:
        """Forward the step: the logits rows of the completing sequences (one, plus one per
        draft) and the prompt logprobs asked for; the rows are sampled on demand."""
        batch = self.build_batch(scheduled)
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
        return StepResult(partial(_sample_rows, logits), first_rows, prompt_logprobs)


@torch.inference_mode()
def _sample_rows(logits: torch.Tensor, indices: list[int], rows: list[SamplingRow]) -> tuple[list, list]:
    """A token per row of `logits[indices]`, and its raw logprob when the row asks."""
    whole = len(indices) == logits.shape[0] and indices == list(range(len(indices)))
    chosen = logits if whole else logits[indices]  # a copy: the sampler edits its logits in place
    wanted, raw = lp.raw_logprobs(chosen, rows)  # before sampling
    tokens = sample(chosen, rows)
    return tokens, lp.token_logprobs(wanted, raw, rows, tokens)
