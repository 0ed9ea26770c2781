"""Any decoder-only `*ForCausalLM` transformers implements, run by our engine (the generic path).

transformers' own modeling code computes everything but attention and the linears: norms,
rotary (partial, NoPE layers, M-RoPE-less variants), residual layouts (parallel, sandwich),
embedding scales and multipliers (Gemma, Granite), mixture-of-experts routing. Attention is
`paged_attention_forward` below, registered through transformers' `AttentionInterface` under
ATTENTION: it writes each layer's new keys and values into our paged KV cache and attends each
query row over its own sequence (backend/runner/attention.py), so continuous batching, chunked
prefill, the prefix cache, preemption and speculative verify steps work as for our own
forward. A KV-shared layer (Gemma 3n's and Gemma 4's last ones) is given the keys and values
of the layer it shares from and keeps a copy in its own cache. Keys and values are fitted to
the cache's layout (`_fitted`: head sizes padded, KV heads repeated). A layer's sliding
window, logit soft-capping (Gemma 2) and attention sinks (gpt-oss) come in as the interface's
arguments. Every `nn.Linear` becomes a `RowLinear`: our float32 matmul (dense.cpp: a row's
sums in one order whatever the batch) or, with QUANT, our quantized kernels. The logits are
the model's own head (soft-capping, logit scales included): its `forward` runs over given
hidden states (`_GivenHidden` stands in for the base model).
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from backend.runner.attention import AttentionPlan, PagedKv, build_attention_plan, paged_attention, paged_kv, write_kv
from backend.runner.eager_attention import eager_attention
from backend.runner.forward_batch import ForwardBatch
from backend.runner.models.layer_state import wrap_state_layers
from backend.runner.models.llama import linear
from backend.runner.quant.formats import QuantizedWeight, dequantize
from backend.types.model_config import ModelConfig

ATTENTION = "engine_paged_kv"  # our attn_implementation's name in transformers' AttentionInterface


@dataclass(slots=True)
class _Step:
    """What the attention calls of one forward share: the batch, the layers' cache views and
    one attention plan per sliding window (built by the first layer that needs it)."""

    batch: ForwardBatch
    kvs: list[PagedKv]
    query_group: int
    calls: list[int] | None = None  # where set, each attention call's layer (the load's probe)
    # where set, each layer's (query heads, KV heads, key size, value size), and no attention
    # computed (the load's first forward: the cache is sized by them)
    shapes: dict[int, tuple[int, int, int, int]] | None = None
    plans: dict[int | None, AttentionPlan] = field(default_factory=dict)
    states: list[dict] | None = None  # each sequence's layer states (ForwardBatch.layer_states)
    # where set, each state layer's output at the step's last row (the load's probe)
    state_outputs: dict[int, torch.Tensor] | None = None

    def plan(self, window: int | None) -> AttentionPlan:
        if window not in self.plans:
            block_size = self.kvs[0].cache.shape[2]
            dtype = self.kvs[0].keys.dtype if self.kvs[0].keys.dtype != torch.float16 else torch.float32
            self.plans[window] = build_attention_plan(self.batch, block_size, dtype, window, self.query_group)
        return self.plans[window]


_STEP: list[_Step] = []  # the forward in progress (the engine runs one step at a time)


def _current_step() -> _Step | None:
    return _STEP[-1] if _STEP else None


def paged_attention_forward(
    module: torch.nn.Module,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attention_mask: torch.Tensor | None,
    scaling: float | None = None,
    dropout: float = 0.0,
    sliding_window: int | None = None,
    softcap: float | None = None,
    s_aux: torch.Tensor | None = None,
    **kwargs,
) -> tuple[torch.Tensor, None]:
    """transformers' attention signature: query [1, H, T, D], key / value [1, KV, T, D] (the
    step's flat batch as one row) -> ([1, T, H, D], no weights). The mask is ours to make."""
    if not _STEP:
        raise RuntimeError(f"{ATTENTION} attention runs inside the engine's forward only")
    step = _STEP[-1]
    if step.calls is not None:
        step.calls.append(module.layer_idx)
    if step.shapes is not None:
        step.shapes[module.layer_idx] = (query.shape[1], key.shape[1], key.shape[-1], value.shape[-1])
        return query.new_zeros(1, query.shape[2], query.shape[1], value.shape[-1]), None
    kv = step.kvs[module.layer_idx]
    q, k, v = (x[0].transpose(0, 1) for x in (query, key, value))  # [T, heads, D]
    value_size = v.shape[-1]
    q, k, v = _fitted(q, k, v, *kv.keys.shape[1:])
    if k.shape[1:] != kv.keys.shape[1:]:
        cache = tuple(kv.keys.shape[1:])
        raise ValueError(f"layer {module.layer_idx}: keys {tuple(k.shape[1:])} do not fit the cache's {cache}")
    scale = scaling if scaling is not None else query.shape[-1] ** -0.5
    window = sliding_window or None
    if softcap is None and s_aux is None:
        out = paged_attention(q, k, v, kv, step.batch, scale, step.plan(window))
    else:
        write_kv(kv, k, v, step.batch.slot_mapping)
        out = eager_attention(q, kv, step.batch, scale, window, softcap, s_aux)
    return out[..., :value_size].unsqueeze(0), None


def _fitted(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, heads: int, size: int) -> tuple[torch.Tensor, ...]:
    """q, k and v as the cache holds them: zero-padded to its head size where theirs is smaller
    (multi-head latent attention: keys of 192, values of 128; zeros add nothing to q . k and
    the output's padded channels are cut off), each KV head repeated where the layer has fewer
    than the cache (Gemma 4's global layers: grouped-query attention sharing them)."""
    if k.shape[1] < heads and heads % k.shape[1] == 0:
        k, v = (x.repeat_interleave(heads // x.shape[1], dim=1) for x in (k, v))
    if q.shape[-1] == k.shape[-1] == v.shape[-1] == size:
        return q, k, v
    return tuple(torch.nn.functional.pad(x, (0, size - x.shape[-1])) for x in (q, k, v))


class RowLinear(torch.nn.Module):
    """An `nn.Linear` as our engine multiplies: weights stored [in, out] (float32: our dense
    kernel) or as a QuantizedWeight (QUANT, GGUF blocks); any leading dimensions."""

    def __init__(self, weight_t: torch.Tensor | QuantizedWeight, bias: torch.Tensor | None):
        super().__init__()
        self.weight_t = weight_t
        self.bias = bias
        self.dequantized: torch.Tensor | None = None  # a quantized weight_t's, once read (`weight`)

    @property
    def weight(self) -> torch.Tensor:
        """nn.Linear's [out, in] (a view), for modeling code that reads it (Mamba's time step,
        `self.dt_proj.weight @ ...`, its head's `self.lm_head.weight.dtype`); a quantized one's
        dequantized at its first read and kept (the forward still multiplies the blocks)."""
        if not isinstance(self.weight_t, QuantizedWeight):
            return self.weight_t.t()
        if self.dequantized is None:
            self.dequantized = dequantize(self.weight_t)
        return self.dequantized

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = linear(x.reshape(-1, x.shape[-1]), self.weight_t, self.bias)
        return y.reshape(*x.shape[:-1], y.shape[-1])


def row_linears(model: torch.nn.Module, kept: dict[str, QuantizedWeight] | None = None) -> list[tuple[str, RowLinear]]:
    """Replace every nn.Linear of `model` by a RowLinear holding its weights transposed, or
    the blocks `kept` holds for its weight (by parameter name: a GGUF file's, read as is)."""
    replaced = []
    for name, module in list(model.named_modules()):
        for child_name, child in list(module.named_children()):
            if type(child) is torch.nn.Linear:
                full = f"{name}.{child_name}" if name else child_name
                blocks = (kept or {}).get(f"{full}.weight")
                weight_t = blocks if blocks is not None else child.weight.detach().t().contiguous()
                row = RowLinear(weight_t, None if child.bias is None else child.bias.detach())
                setattr(module, child_name, row)
                replaced.append((full, row))
    return replaced


class _HiddenOutput:
    """A base model's output holding only the hidden states: what the head's forward reads of it
    (an attribute it does not have, router logits or caches, reads as None)."""

    def __init__(self, hidden: torch.Tensor):
        self.last_hidden_state = hidden

    def __getattr__(self, name: str) -> None:  # only for attributes not set
        return None

    def __getitem__(self, index: int) -> torch.Tensor:
        return (self.last_hidden_state,)[index]


class _GivenHidden(torch.nn.Module):
    """The base model's stand-in while the head's `forward` makes logits of given hidden states
    (also where the head calls a part of the base: OPT's `model.decoder(...)`); what else the
    head reads of the base is the base's (Falcon-H1's `lm_head_multiplier`)."""

    _PARTS = ("decoder", "language_model", "transformer")  # what heads call of their base model

    def __init__(self, base: torch.nn.Module):
        super().__init__()
        self.hidden: torch.Tensor | None = None
        self.__dict__["_base"] = base  # not a submodule: its weights stay the base's alone

    def __getattr__(self, name: str):
        if name in _GivenHidden._PARTS:
            return self
        try:
            return super().__getattr__(name)
        except AttributeError:
            return getattr(self.__dict__["_base"], name)

    def forward(self, *args, **kwargs) -> _HiddenOutput:
        return _HiddenOutput(self.hidden)


class TransformersCausalLM(torch.nn.Module):
    """A transformers `*ForCausalLM` behind our model interface: forward(batch, kv_caches) ->
    hidden [T, hidden], compute_logits(hidden) -> [N, vocab] float32."""

    mtp = None  # no MTP layers, vision tower or quantized lm_head of our own on this path
    visual = None
    lm_head_q = None

    def __init__(self, hf_model: torch.nn.Module, config: ModelConfig):
        super().__init__()
        self.config = config
        self.hf = hf_model
        prefix = hf_model.base_model_prefix
        self.base = getattr(hf_model, prefix)
        self._given = _GivenHidden(self.base)
        setattr(hf_model, prefix, self._given)  # hf_model(...) now runs the head alone
        self._kvs: list[PagedKv] = []
        self.attention_calls: list[int] | None = None  # set: each attention call's layer is added
        self.attention_shapes: dict[int, tuple[int, int, int, int]] | None = None  # set: _Step.shapes
        self.state_outputs: dict[int, torch.Tensor] | None = None  # set: _Step.state_outputs
        # True: each prompt computed in one step (the load's probe: state layers that continue a
        # state over one new token but not over several, as Mamba's and Jamba's)
        self.whole_prompts = False
        # the layers keeping state besides attention's KV (convolution, linear attention, state space)
        self.state_layers = wrap_state_layers(self.base, _current_step)

    @torch.inference_mode()
    def forward(self, batch: ForwardBatch, kv_caches: list[torch.Tensor]) -> torch.Tensor:
        if len(self._kvs) != len(kv_caches) or any(
            kv.cache is not c for kv, c in zip(self._kvs, kv_caches, strict=True)
        ):
            self._kvs = [paged_kv(cache) for cache in kv_caches]
        cfg = self.config
        group = max(1, cfg.num_heads // cfg.num_kv_heads)
        _STEP.append(_Step(batch, self._kvs, group, self.attention_calls, self.attention_shapes,
                           states=batch.layer_states, state_outputs=self.state_outputs))  # fmt: skip
        try:
            out = self.base(input_ids=batch.input_ids[None], position_ids=batch.positions[None], use_cache=False)
        finally:
            _STEP.pop()
        return out.last_hidden_state[0]

    @torch.inference_mode()
    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        self._given.hidden = hidden[None]
        try:
            dummy = torch.zeros(1, hidden.shape[0], dtype=torch.int64, device=hidden.device)
            logits = self.hf(input_ids=dummy, logits_to_keep=0, use_cache=False).logits
        finally:
            self._given.hidden = None
        return logits[0].float()


def register_attention() -> None:
    """ATTENTION in transformers' AttentionInterface (its masks: none, ours are made inside)."""
    from transformers import AttentionInterface

    AttentionInterface.register(ATTENTION, paged_attention_forward)
