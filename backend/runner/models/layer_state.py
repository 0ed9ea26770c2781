"""Layers that keep state besides attention's keys and values, on the generic path: short
convolutions (LFM2), linear attention (Qwen3.5's and Qwen3-Next's gated delta net, Kimi
Linear) and state-space mixers (Mamba and the hybrids built on it: Granite 4.0-H, Falcon-H1,
Jamba, Nemotron-H ...).

transformers' own code computes them, through its cache interface (`get_conv_state`,
`update_conv_state`, `get_recurrent_state`, `update_recurrent_state`). Our step is one flat row
of every sequence's new tokens, which such a layer would read as one sequence, so each is
wrapped (`wrap_state_layers`): the sequences that decode (one new token and a state from
earlier steps) run together as a batch of one-token rows over their stacked states; every
other one (a prompt, or a chunk of one, continuing its own state) runs alone. A sequence's
states live in `ForwardBatch.layer_states` (the runner keeps one dict a sequence, empty again
when it starts over: a new request, or one preempted), so the prefix cache and speculative
steps, which would need a state per position, are off for such a model (the engine's)."""

from __future__ import annotations

import inspect
from collections.abc import Callable
from dataclasses import dataclass, field

import torch

_STATE_CALLS = ("update_conv_state", "update_recurrent_state")  # transformers' cache interface
_CACHE_ARGS = ("cache", "cache_params", "past_key_values")  # what the layers' forward calls it
_STATES = 8  # state indices a layer may use (Kimi Linear: one convolution each for q, k, v)


@dataclass(slots=True)
class LayerState:
    """One sequence's state in one layer, as transformers' linear-attention cache layer holds it
    (by state index): the convolution's last inputs, the recurrent state, and which are set."""

    conv: dict[int, torch.Tensor] = field(default_factory=dict)
    recurrent: dict[int, torch.Tensor] = field(default_factory=dict)
    previous: dict[int, bool] = field(default_factory=dict)
    kernel: dict[int, int] = field(default_factory=dict)


def state_layer_classes(model: torch.nn.Module) -> list[type]:
    """The classes of `model`'s modules whose code updates a conv or recurrent state."""
    found = []
    for cls in {type(m) for m in model.modules()}:
        try:
            source = inspect.getsource(cls)
        except (OSError, TypeError):
            continue
        if any(call in source for call in _STATE_CALLS) and _cache_arg(cls) is not None:
            found.append(cls)
    return found


def _cache_arg(cls: type) -> str | None:
    params = inspect.signature(cls.forward).parameters
    return next((name for name in _CACHE_ARGS if name in params), None)


def wrap_state_layers(model: torch.nn.Module, current: Callable[[], object | None]) -> list[int]:
    """Wrap every state layer's forward (see the module's doc); the indices of their decoder
    layers. `current()` is the step in progress (its `batch` and `states`), or None."""
    classes = tuple(state_layer_classes(model))
    layers = []
    for module in model.modules():
        if classes and isinstance(module, classes):
            index = getattr(module, "layer_idx", None)
            if index is None:
                raise ValueError(f"{type(module).__name__} keeps state but names no layer_idx")
            module.forward = _StateForward(module.forward, index, _cache_arg(type(module)), current)
            layers.append(index)
    return sorted(layers)


class _StateForward:
    """A state layer's forward over the step's flat row (see the module's doc)."""

    def __init__(self, forward: Callable, layer: int, cache_arg: str, current: Callable[[], object | None]):
        self.forward, self.layer, self.cache_arg, self.current = forward, layer, cache_arg, current

    def __call__(self, *args, **kwargs):
        step = self.current()
        if step is None or step.states is None:  # the load's shape forward: no state kept
            return self.forward(*args, **kwargs)
        hidden, key = (args[0], None) if args else (kwargs.pop("hidden_states"), "hidden_states")
        args = args[1:]
        kwargs.pop(self.cache_arg, None)
        if "attention_mask" in kwargs:
            kwargs["attention_mask"] = None  # each call's rows are whole: no padding
        batch, states = step.batch, step.states
        decoding = [i for i, n in enumerate(batch.query_lens) if n == 1 and self.layer in states[i]]
        groups = [decoding] if decoding else []
        groups += [[i] for i in range(batch.num_seqs) if i not in set(decoding)]
        out, rest = None, ()
        for group in groups:
            rows = _rows(batch, group)
            x = hidden[0, rows].unsqueeze(1) if group is decoding else hidden[:, rows]
            cache = _GroupCache(self.layer, [states[i] for i in group], batch.context_lens[group[0]] - len(rows))
            kw = {self.cache_arg: cache, **kwargs, **({key: x} if key else {})}
            result = self.forward(*((x,) if key is None else ()), *args, **kw)
            y, rest = (result[0], result[1:]) if isinstance(result, tuple) else (result, ())
            cache.save([states[i] for i in group])
            if out is None:
                out = y.new_empty(1, hidden.shape[1], *y.shape[2:])
            out[0, rows] = y.reshape(len(rows), *y.shape[2:]) if group is decoding else y[0]
        if step.state_outputs is not None:
            step.state_outputs[self.layer] = out[0, -1].float().clone()
        return (out, *rest) if rest else out


def _rows(batch, group: list[int]) -> list[int]:
    return [r for i in group for r in range(batch.query_start[i], batch.query_start[i + 1])]


class _GroupCache:
    """transformers' cache interface over one layer's states of a group of sequences (stacked
    on the batch dimension); `save` puts each sequence's back."""

    def __init__(self, layer: int, states: list[dict[int, LayerState]], past: int):
        from transformers.cache_utils import LinearAttentionLayer

        self.layer, self.past = layer, past
        held = LinearAttentionLayer(number_of_states=_STATES)
        saved = [s[layer] for s in states if layer in s]
        if saved:
            first = saved[0]
            for i in first.conv:
                held.conv_states[i] = torch.stack([s.conv[i] for s in saved])
                held.is_conv_states_initialized[i] = True
            for i in first.recurrent:
                held.recurrent_states[i] = torch.stack([s.recurrent[i] for s in saved])
                held.is_recurrent_states_initialized[i] = True
            held.has_previous_state.update(first.previous)
            held.conv_kernel_size.update(first.kernel)
        self.layers = {layer: held}

    def save(self, states: list[dict[int, LayerState]]) -> None:
        held = self.layers[self.layer]
        for j, state in enumerate(states):
            state[self.layer] = LayerState(
                conv={i: t[j] for i, t in held.conv_states.items() if t is not None},
                recurrent={i: t[j] for i, t in held.recurrent_states.items() if t is not None},
                previous={i: v for i, v in held.has_previous_state.items() if v},
                kernel={i: k for i, k in held.conv_kernel_size.items() if k is not None},
            )

    def get_conv_state(self, layer_idx: int, state_idx: int = 0) -> torch.Tensor | None:
        held = self.layers[layer_idx]
        return held.conv_states[state_idx] if held.has_previous_state[state_idx] else None

    def get_recurrent_state(self, layer_idx: int, state_idx: int = 0) -> torch.Tensor | None:
        held = self.layers[layer_idx]
        return held.recurrent_states[state_idx] if held.has_previous_state[state_idx] else None

    def update_conv_state(self, conv_states: torch.Tensor, layer_idx: int, state_idx: int = 0, **kwargs):
        return self.layers[layer_idx].update_conv_state(conv_states, state_idx, **kwargs)

    def update_recurrent_state(self, recurrent_states: torch.Tensor, layer_idx: int, state_idx: int = 0, **kwargs):
        return self.layers[layer_idx].update_recurrent_state(recurrent_states, state_idx, **kwargs)

    def has_previous_state(self, layer_idx: int | None = None, state_idx: int | None = None) -> bool:
        held = self.layers[self.layer if layer_idx is None else layer_idx]
        return held.has_previous_state[state_idx or 0]

    def is_recording_past(self, layer_idx: int) -> bool:
        return False

    def get_seq_length(self, layer_idx: int | None = 0) -> int:
        return self.past
