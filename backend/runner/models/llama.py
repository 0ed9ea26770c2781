"""Our Llama-family forward: Llama 2/3, Mistral, Qwen2 (qkv bias), Qwen3 (q/k norm), SmolLM.

Weights are fused at load time (q|k|v into one matrix, gate|up into one) so a layer is
a handful of large ops; the per-token cost is the weights' memory traffic plus a small,
fixed number of torch dispatches per layer.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import TYPE_CHECKING

import torch
import torch.nn.functional as F

from backend.kernels import (
    EMPTY,
    KV_KERNEL_DTYPES,
    PAGED_HEAD_DIMS,
    dense_matmul,
    head_rms_norm_,
    native,
    rms_norm,
    rope_,
    silu_mul,
)
from backend.lora.batch import DOWN, GATE_UP, O_PROJ, QKV, add_lora
from backend.runner.attention import (
    AttentionPlan,
    PagedKv,
    QueryRows,
    build_attention_plan,
    paged_attention,
    paged_kv,
)
from backend.runner.forward_batch import ForwardBatch
from backend.runner.models.llama_weights import copy_weights, layer_targets
from backend.runner.models.rope import RopeTable, reorder_rotary_rows, rope_inv_freq
from backend.runner.quant.formats import QuantizedWeight
from backend.runner.quant.matmul import quant_linear
from backend.types.model_config import ModelConfig
from backend.vision.mrope import mrope_cos_sin

if TYPE_CHECKING:
    from backend.runner.models.mtp import MtpHead

Rope = tuple[torch.Tensor, torch.Tensor]  # (cos, sin), each [T, 1, head_dim]


def linear(x: torch.Tensor, weight_t: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """x: [M, in] @ weight_t: [in, out] (+ bias) -> [M, out].

    Weights are stored transposed ([in, out]) for the CPU's sake: in float32 on 2 cores
    (torch 2.13), MKL's GEMM on this layout measured fastest at every M the engine runs,
    in the model: 1.0x-1.25x oneDNN's linear for 1-144 rows (decode and verify steps),
    1.45x for a 512-token prefill chunk. Elsewhere F.linear on the view.
    """
    if isinstance(weight_t, QuantizedWeight):  # QUANT (backend/runner/quant)
        return quant_linear(x, weight_t, bias)
    if x.is_cpu and x.dtype == torch.float32:
        y = dense_matmul(x, weight_t, bias)  # each row's sums in one order (batch invariance)
        if y is not None:
            return y
        return torch.mm(x, weight_t) if bias is None else torch.addmm(bias, x, weight_t)
    return F.linear(x, weight_t.t(), bias)


def empty_param(*shape: int, dtype: torch.dtype, device: torch.device) -> torch.nn.Parameter:
    return torch.nn.Parameter(torch.empty(*shape, dtype=dtype, device=device), requires_grad=False)


class DecoderLayer(torch.nn.Module):
    gelu = False  # the MLP's gate: SiLU (Gemma's GELU: backend/runner/models/gemma.py)

    def __init__(self, cfg: ModelConfig, index: int, dtype: torch.dtype, device: torch.device):
        super().__init__()
        h, d = cfg.hidden_size, cfg.head_dim
        self.index = index
        self.num_heads, self.num_kv_heads, self.head_dim = cfg.num_heads, cfg.num_kv_heads, d
        self.eps, self.scale = cfg.rms_norm_eps, cfg.attention_scale or d**-0.5
        self.softcap = cfg.attn_logit_softcapping  # Gemma 2's (0: off)
        self.sliding_window = cfg.sliding_windows[index] if cfg.sliding_windows else None
        qkv_rows = (cfg.num_heads + 2 * cfg.num_kv_heads) * d
        self.input_norm = empty_param(h, dtype=dtype, device=device)
        # Matmul weights (suffix _t) are stored [in, out]; see `linear`.
        self.qkv_t = empty_param(h, qkv_rows, dtype=dtype, device=device)
        self.qkv_bias = empty_param(qkv_rows, dtype=dtype, device=device) if cfg.attention_bias else None
        # Qwen3's q_norm and k_norm weights, one row per q head then per k head.
        self.qk_norm = (
            empty_param(cfg.num_heads + cfg.num_kv_heads, d, dtype=dtype, device=device) if cfg.qk_norm else None
        )
        self.o_proj_t = empty_param(cfg.num_heads * d, h, dtype=dtype, device=device)
        self.o_bias = empty_param(h, dtype=dtype, device=device) if cfg.o_proj_bias else None
        self.post_norm = empty_param(h, dtype=dtype, device=device)
        self.init_mlp(cfg, dtype, device)
        self._decode_operands: list[torch.Tensor] | None = None  # `decode_operands`, once made

    def init_mlp(self, cfg: ModelConfig, dtype: torch.dtype, device: torch.device) -> None:
        """The MLP's weights (a routed block's instead: backend/runner/models/moe.py)."""
        self.gate_up_t = empty_param(cfg.hidden_size, 2 * cfg.intermediate_size, dtype=dtype, device=device)
        self.down_t = empty_param(cfg.intermediate_size, cfg.hidden_size, dtype=dtype, device=device)

    def decode_operands(self) -> list[torch.Tensor] | None:
        """The weights `decode` passes to decode_layer (decode_layer.cpp's order), made once;
        None where the layer cannot run as one call: a linear is not tiles (QUANT=none, or
        no native kernels)."""
        if self._decode_operands is None:
            linears = (self.qkv_t, self.o_proj_t, self.gate_up_t, self.down_t)
            if not all(getattr(w, "tiles", None) is not None for w in linears):
                self._decode_operands = []
            else:
                qkv, o, gate_up, down = (w.tiles for w in linears)
                qkv_bias = EMPTY if self.qkv_bias is None else self.qkv_bias
                o_bias = EMPTY if self.o_bias is None else self.o_bias
                self._decode_operands = [
                    self.input_norm, qkv.data, qkv.params, qkv_bias, o.data, o.params, o_bias,
                    self.post_norm, gate_up.data, gate_up.params, down.data, down.params,
                    EMPTY if self.qk_norm is None else self.qk_norm, *self.output_norms(),
                ]  # fmt: skip
        return self._decode_operands or None

    def output_norms(self) -> tuple[torch.Tensor, torch.Tensor]:
        """The norms of the attention's and the MLP's outputs before their residual adds: none
        here (Gemma's sandwich has them)."""
        return EMPTY, EMPTY

    def decode(self, x: torch.Tensor, rope: Rope, kv: PagedKv, rows: QueryRows, slots: torch.Tensor) -> torch.Tensor:
        """`forward` of a step (any rows: a decode's, a verify step's, prefill chunks') in one
        call of our kernel, attention by paged_attention_rows over `rows`; x is updated in
        place. The same kernels as `forward`'s on the CPU: the same numbers, bit for bit."""
        cos, sin = rope
        return native().decode_layer(
            x, self._decode_operands, cos, sin, kv.keys, kv.values, slots, rows.tables, rows.seq, rows.lens,
            kv.cache.shape[2], rows.window or 0, self.num_heads, self.num_kv_heads, self.scale, self.eps,
            self.qkv_t.tiles.activations == "int8", self.softcap or 0.0, self.gelu,
        )  # fmt: skip

    def forward(
        self, x: torch.Tensor, rope: Rope, kv_cache: torch.Tensor | PagedKv, batch: ForwardBatch, plan: AttentionPlan
    ):
        # x: [T, hidden]
        x = x + self._attention(rms_norm(x, self.input_norm, self.eps), rope, kv_cache, batch, plan)
        return x + self.mlp(rms_norm(x, self.post_norm, self.eps), batch)

    def mlp(self, h: torch.Tensor, batch: ForwardBatch) -> torch.Tensor:
        gate_up = linear(h, self.gate_up_t)
        if batch.lora is not None:
            add_lora(gate_up, h, batch.lora, self.index, GATE_UP)
        act = silu_mul(gate_up)  # decode_layer's arithmetic: a decode row's numbers whatever its step
        down = linear(act, self.down_t)
        if batch.lora is not None:
            add_lora(down, act, batch.lora, self.index, DOWN)
        return down

    def _attention(
        self, h: torch.Tensor, rope: Rope, kv_cache: torch.Tensor | PagedKv, batch: ForwardBatch, plan: AttentionPlan
    ):
        cos, sin = rope
        num_tokens, num_qk = h.shape[0], self.num_heads + self.num_kv_heads
        qkv = linear(h, self.qkv_t, self.qkv_bias)  # [T, (H + 2 KV) * D]
        if batch.lora is not None:
            add_lora(qkv, h, batch.lora, self.index, QKV)
        if self.qk_norm is not None:  # in place, decode_layer's arithmetic (q's weight row 0, k's row H)
            head_rms_norm_(qkv, 0, self.num_heads, self.qk_norm[0], self.eps)
            head_rms_norm_(qkv, self.num_heads, self.num_kv_heads, self.qk_norm[self.num_heads], self.eps)
        qk = qkv[:, : num_qk * self.head_dim].view(num_tokens, num_qk, self.head_dim)  # [T, H + KV, D]
        # RoPE on q and k at once: x * cos + rotate_half(x) * sin, where rotate_half is a
        # roll by D/2 and its sign flip lives in `sin` (see LlamaForCausalLM.rotary); on the CPU
        # in place by decode_layer's own arithmetic (a row's numbers the same in either path).
        if not rope_(qkv, num_qk, cos, sin):
            qk = torch.addcmul(qk * cos, qk.roll(self.head_dim // 2, dims=-1), sin)
        q, k = qk[:, : self.num_heads], qk[:, self.num_heads :]
        v = qkv[:, num_qk * self.head_dim :].view(num_tokens, self.num_kv_heads, self.head_dim)
        out = paged_attention(q, k, v, kv_cache, batch, self.scale, plan, self.softcap).reshape(num_tokens, -1)
        o = linear(out, self.o_proj_t, self.o_bias)
        if batch.lora is not None:
            add_lora(o, out, batch.lora, self.index, O_PROJ)
        return o


class LlamaForCausalLM(torch.nn.Module):
    layer_class = DecoderLayer  # a subclass's own layer (backend/runner/models/gemma.py)

    def __init__(self, cfg: ModelConfig, dtype: torch.dtype, device: torch.device):
        super().__init__()
        self.config = cfg
        self.layers = torch.nn.ModuleList(self.make_layer(cfg, i, dtype, device) for i in range(cfg.num_layers))
        self.norm = empty_param(cfg.hidden_size, dtype=dtype, device=device)
        self.lm_head_t = empty_param(cfg.hidden_size, cfg.vocab_size, dtype=dtype, device=device)
        # Tied: the embedding table is lm_head_t's [vocab, hidden] view, not a copy.
        self.embed_tokens = (
            None
            if cfg.tie_word_embeddings
            else empty_param(cfg.vocab_size, cfg.hidden_size, dtype=dtype, device=device)
        )
        self.register_buffer("inv_freq", rope_inv_freq(cfg).to(device), persistent=False)
        # QUANT's int8 lm_head (backend/runner/quant/apply.py); lm_head_t stays as the embedding table
        self.lm_head_q: QuantizedWeight | None = None
        # kept across steps: the KV caches' flat views (for the caches last passed to forward)
        # and the rotary table (dtype, cos, sin), grown as positions do
        self._paged_kvs: list[PagedKv] = []
        self._rope_table = RopeTable(cfg)
        self.mtp: MtpHead | None = None  # the checkpoint's MTP layers, when it ships them (the loader's)
        # a vision-language checkpoint's vision encoder (the loader's): (pixel_values, grids) -> embeds
        self.visual: torch.nn.Module | None = None

    @classmethod
    def make_layer(cls, cfg: ModelConfig, index: int, dtype: torch.dtype, device: torch.device) -> DecoderLayer:
        """Layer `index` (a mixture's routed ones: backend/runner/models/moe.py)."""
        return cls.layer_class(cfg, index, dtype, device)

    @torch.inference_mode()
    def forward(self, batch: ForwardBatch, kv_caches: list[torch.Tensor]) -> torch.Tensor:
        """Hidden states [T, hidden] of the batch's new tokens; writes their k/v into kv_caches."""
        table = self.lm_head_t.t() if self.embed_tokens is None else self.embed_tokens
        x = F.embedding(batch.input_ids, table)  # [T, hidden], a fresh tensor
        if batch.embeds_rows is not None:  # vision placeholders take the encoder's embeddings
            x[batch.embeds_rows] = batch.embeds.to(device=x.device, dtype=x.dtype)
        if self.config.mrope_section:
            rope = self.mrope_rotary(batch, x.dtype)
        else:
            rope = self.rotary(batch.positions, x.dtype, max(batch.context_lens) - 1)
        plans, kvs = self._step_operands(batch, kv_caches, x.dtype)
        fused = self._fused_decode(batch, plans, x)
        for layer, kv in zip(self.layers, kvs, strict=True):
            plan = plans[layer.sliding_window]
            if fused:
                x = layer.decode(x, rope, kv, plan.rows, batch.slot_mapping)
            else:
                x = layer(x, rope, kv, batch, plan)
        return rms_norm(x, self.norm, self.config.rms_norm_eps)

    def _step_operands(
        self, batch: ForwardBatch, kv_caches: list[torch.Tensor], dtype: torch.dtype
    ) -> tuple[dict[int | None, AttentionPlan], list[PagedKv]]:
        """The step's attention plans (one per sliding window) and the caches' flat views (made
        once for the caches the runner keeps passing)."""
        block_size, group = kv_caches[0].shape[2], self.config.num_heads // self.config.num_kv_heads
        windows = {layer.sliding_window for layer in self.layers}
        plans = {w: build_attention_plan(batch, block_size, dtype, w, group) for w in windows}
        kvs = self._paged_kvs
        if len(kvs) != len(kv_caches) or any(kv.cache is not c for kv, c in zip(kvs, kv_caches, strict=True)):
            self._paged_kvs = kvs = [paged_kv(cache) for cache in kv_caches]
        return plans, kvs

    def _fused_decode(self, batch: ForwardBatch, plans: dict[int | None, AttentionPlan], x: torch.Tensor) -> bool:
        """Whether this step's layers run as one decode_layer call each: float32 on the CPU
        where our kernels run (paged_attention_rows takes every row: `AttentionPlan.rows`), no
        adapters, a cache the kernel reads, every layer's linears tiles (`decode_operands`)."""
        if batch.lora is not None or x.dtype != torch.float32 or not x.is_cpu or native() is None:
            return False
        if self.config.head_dim not in PAGED_HEAD_DIMS or any(plan.rows is None for plan in plans.values()):
            return False
        if not self._paged_kvs or self._paged_kvs[0].keys.dtype not in KV_KERNEL_DTYPES:
            return False
        return all(layer.decode_operands() is not None for layer in self.layers)

    @torch.inference_mode()
    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """hidden: [N, hidden] -> logits [N, vocab] float32."""
        # The int8 lm_head at every row count (a step's sequences, a prefill's prompt logprobs):
        # one path, so a row's logits never depend on how many rows the step has (against the
        # float32 table's mm, 49152 x 576 on 2 cores, ms: 8 rows 3.3 / 13.1, 48 rows 22.3 / 29.4).
        if self.lm_head_q is not None:
            return quant_linear(hidden, self.lm_head_q).float()
        return linear(hidden, self.lm_head_t).float()

    def rotary(self, positions: torch.Tensor, dtype: torch.dtype, max_position: int | None = None) -> Rope:
        """cos, sin: [T, 1, D] at `positions` (the largest, when the caller knows it:
        `max_position`), rows of a table kept across steps and grown as positions do."""
        return self._rope_table.rows(self.inv_freq, positions, dtype, max_position)

    def mrope_rotary(self, batch: ForwardBatch, dtype: torch.dtype) -> Rope:
        """`rotary`'s tables for M-RoPE: each frequency pair turns by its section's (t, h, w) row
        of `batch.mrope_positions` (text-only batches: `positions` in all three rows)."""
        positions = batch.mrope_positions if batch.mrope_positions is not None else batch.positions.expand(3, -1)
        cos, sin = mrope_cos_sin(positions, self.inv_freq, self.config.mrope_section)  # [T, D] each
        half = self.config.head_dim // 2
        sin = torch.cat((-sin[:, :half], sin[:, half:]), dim=-1)  # rotate-half's sign, as in `rotary`
        return cos[:, None, :].to(dtype), sin[:, None, :].to(dtype)

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]], elsewhere: set[str] = frozenset()) -> None:
        """Copy Hugging Face checkpoint tensors (name, tensor) into the fused parameters; the
        names in `elsewhere` come otherwise (a GGUF file's blocks: backend/runner/gguf_weights.py)."""
        tied = self.config.tie_word_embeddings
        kept = ((n, t) for n, t in weights if not (n == "lm_head.weight" and tied))
        targets = {name: target for name, target in self._weight_targets().items() if name not in elsewhere}
        copy_weights(self, targets, kept, self.config.architecture)
        reorder_rotary_rows(self.config, self.layers)  # partial rotary (a file's blocks: gguf_weights)

    def _weight_targets(self) -> dict[str, tuple[str, slice]]:
        """Checkpoint name -> (our parameter, the checkpoint rows' place in it)."""
        tied = self.config.tie_word_embeddings
        targets = {
            "model.embed_tokens.weight": ("lm_head_t" if tied else "embed_tokens", slice(None)),
            "model.norm.weight": ("norm", slice(None)),
        }
        if not tied:
            targets["lm_head.weight"] = ("lm_head_t", slice(None))
        for suffix, (attr, rows) in layer_targets(self.config).items():
            for i in range(self.config.num_layers):
                targets[f"model.layers.{i}.{suffix}"] = (f"layers.{i}.{attr}", rows)
        return targets
