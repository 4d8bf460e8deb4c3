"""Recurrent layers beside attention: Qwen3-Next's and Qwen3.5's gated delta nets, LFM2's short convolutions, the
Mamba-2 mixers of Nemotron-H and Granite 4.

A recurrence reads its rows in order, so the ragged step's `[T, 1]` rows (every row its own sequence) cannot reach
it as they are. Each such layer's mixer (the one module of the layer that takes mlx-lm's `ArraysCache`) is called
once per group of the step's lanes instead: the single-row lanes together as `[lanes, 1]`, each prefill chunk as
`[1, rows]`, exactly as mlx-lm's own generation calls it. Every running request keeps its layers' state (what
mlx-lm's `ArraysCache` holds for it) in a slot of a `StatePool`; a lane that starts at position 0 starts from zeros,
as a fresh `ArraysCache` does. The rest of the model (attention, MLPs, norms) runs over the ragged rows as usual.
"""

from __future__ import annotations

import inspect
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import mlx.core as mx

from mlx_serve.errors import UnsupportedModel


@dataclass(frozen=True, slots=True)
class StateGroup:
    """Lanes a mixer reads in one call: `lanes` requests of `rows` rows each, from row `row_start` of the step."""

    row_start: int
    lanes: int
    rows: int
    slots: mx.array  # [lanes] int32: each lane's state slot


@dataclass(frozen=True, slots=True)
class StateRows:
    """The step's rows as the recurrent layers read them."""

    groups: tuple[StateGroup, ...]
    fresh: mx.array | None  # slots of lanes that start at position 0 (their state is zeroed first); None: none


def recurrent_layers(model: Any) -> tuple[int, ...]:
    """The layers whose mlx-lm cache is an `ArraysCache` (a recurrent state, not K/V)."""
    from mlx_lm.models.cache import ArraysCache

    caches = model.make_cache() if hasattr(model, "make_cache") else []
    return tuple(i for i, cache in enumerate(caches) if type(cache) is ArraysCache)


def layer_mixer(layer: Any, index: int) -> tuple[str, Any]:
    """The one module of a recurrent layer whose call takes a `cache` (its mixer), with its path in the layer; raises
    UnsupportedModel where there is not exactly one."""
    found = [(name, module) for name, module in layer.named_modules()
             if module is not layer and "cache" in inspect.signature(_original_call(module)).parameters]  # fmt: skip
    if len(found) != 1:
        names = ", ".join(name for name, _ in found) or "none"
        raise UnsupportedModel(
            f"layer {index} keeps a recurrent state, but the engine finds no single module of it that reads one "
            f"(modules taking a cache: {names})", param="model",
        )
    return found[0]


class StatePool:
    """Each recurrent layer's state arrays, `[slots, ...]` each (the shapes and dtypes mlx-lm's mixer gives them),
    and which request holds which slot."""

    def __init__(self, model: Any, layers: Sequence[int], slots: int) -> None:
        self.layers = tuple(layers)
        self.slots = slots
        shapes = state_shapes(model, self.layers)
        self.states: dict[int, list[mx.array | None]] = {
            layer: [None if s is None else mx.zeros((slots, *s[0]), s[1]) for s in shapes[layer]] for layer in self.layers
        }
        mx.eval([a for arrays in self.states.values() for a in arrays if a is not None])
        self._free = list(range(slots - 1, -1, -1))
        self._slot_of: dict[str, int] = {}

    @property
    def nbytes(self) -> int:
        return sum(a.nbytes for arrays in self.states.values() for a in arrays if a is not None)

    @property
    def in_use(self) -> int:
        return len(self._slot_of)

    def slot(self, request_id: str, start: int) -> int:
        """The request's slot; a lane that starts at position 0 takes one (its state is zeroed by the step)."""
        slot = self._slot_of.get(request_id)
        if slot is not None:
            return slot
        if start != 0:
            raise RuntimeError(f"request {request_id} continues at position {start} with no recurrent state")
        if not self._free:
            raise RuntimeError(f"every one of the {self.slots} recurrent state slots is taken")
        slot = self._slot_of[request_id] = self._free.pop()
        return slot

    def release(self, request_id: str) -> None:
        slot = self._slot_of.pop(request_id, None)
        if slot is not None:
            self._free.append(slot)

    def rows(self, lanes: Sequence[tuple[str, int, int]], num_single: int) -> StateRows:
        """Groups for the step's lanes, as (request id, start, rows) in row order, the first `num_single` of one row."""
        slots = [self.slot(request_id, start) for request_id, start, _ in lanes]
        fresh = [slot for slot, (_, start, _) in zip(slots, lanes) if start == 0]
        groups = []
        if num_single:
            groups.append(StateGroup(0, num_single, 1, mx.array(slots[:num_single], dtype=mx.int32)))
        row_start = num_single
        for slot, (_, _, rows) in list(zip(slots, lanes))[num_single:]:
            groups.append(StateGroup(row_start, 1, rows, mx.array([slot], dtype=mx.int32)))
            row_start += rows
        return StateRows(tuple(groups), mx.array(fresh, dtype=mx.int32) if fresh else None)


def state_shapes(model: Any, layers: Sequence[int]) -> dict[int, list[tuple[tuple[int, ...], mx.Dtype] | None]]:
    """One request's state per recurrent layer, as the mixer leaves it after a first token: each entry's shape
    (without the batch axis) and dtype, None for an entry it leaves unset."""
    from mlx_lm.models.cache import ArraysCache

    caches = model.make_cache()
    from mlx_serve.model_loading import activation_dtype

    hidden = int(model.args.hidden_size) if hasattr(model.args, "hidden_size") else None
    dtype = activation_dtype(model)
    shapes = {}
    for index in layers:
        _, mixer = layer_mixer(model.model.layers[index], index)
        width = hidden or int(model.model.embed_tokens.weight.shape[-1])
        cache = ArraysCache(len(caches[index].cache))
        _original_call(mixer)(mixer, **_arguments(mixer, mx.zeros((1, 1, width), dtype), cache))
        mx.eval([c for c in cache.cache if c is not None])
        shapes[index] = [None if c is None else (tuple(c.shape[1:]), c.dtype) for c in cache.cache]
    return shapes


class RecurrentLayerCache:
    """mlx-lm's cache protocol for one recurrent layer of one ragged step: the regrouped mixer call reads it."""

    def __init__(self, pool: StatePool, layer: int, rows: StateRows) -> None:
        self.pool = pool
        self.layer = layer
        self.rows = rows

    def make_mask(self, *args: Any, **kwargs: Any) -> None:
        return None

    def run(self, mixer: Callable[[mx.array, Any], mx.array], x: mx.array) -> mx.array:
        """`mixer(x_group, cache_group)` over each group of the step's rows `x` `[T, 1, D]`, each group's lanes
        reading and leaving their states in the pool; the outputs in row order, `[T, 1, D']`."""
        from mlx_lm.models.cache import ArraysCache

        states = self.pool.states[self.layer]
        if self.rows.fresh is not None:
            for state in states:
                if state is not None:
                    state[self.rows.fresh] = 0
        outputs = []
        for group in self.rows.groups:
            cache = ArraysCache(len(states))
            cache.cache = [None if state is None else state[group.slots] for state in states]
            rows = x[group.row_start : group.row_start + group.lanes * group.rows]
            out = mixer(rows.reshape(group.lanes, group.rows, -1), cache)
            outputs.append(out.reshape(group.lanes * group.rows, 1, -1))
            for state, value in zip(states, cache.cache):
                if state is not None and value is not None:
                    state[group.slots] = value
        return outputs[0] if len(outputs) == 1 else mx.concatenate(outputs, axis=0)


def install_regrouped_mixers(model: Any, layers: Sequence[int]) -> None:
    """Make each recurrent layer's mixer read a `RecurrentLayerCache` group by group (any other cache, or none, goes
    to mlx-lm's own call unchanged). Per instance: the mixer's class becomes a subclass with that call."""
    for index in layers:
        _, mixer = layer_mixer(model.model.layers[index], index)
        if not getattr(type(mixer), "regrouped", False):
            mixer.__class__ = _regrouped_class(type(mixer))


_REGROUPED: dict[type, type] = {}


def _regrouped_class(cls: type) -> type:
    if cls not in _REGROUPED:
        original = cls.__call__
        signature = inspect.signature(original)

        def __call__(self, *args: Any, **kwargs: Any) -> mx.array:
            bound = signature.bind(self, *args, **kwargs)
            cache = bound.arguments.get("cache")
            if not isinstance(cache, RecurrentLayerCache):
                return original(self, *args, **kwargs)
            x = bound.arguments[_input_name(signature)]
            return cache.run(lambda rows, group: original(self, **_arguments(self, rows, group, signature)), x)

        _REGROUPED[cls] = type(f"Regrouped{cls.__name__}", (cls,), {"__call__": __call__, "regrouped": True})
    return _REGROUPED[cls]


def _original_call(mixer: Any) -> Callable:
    cls = type(mixer)
    return cls.__mro__[1].__call__ if getattr(cls, "regrouped", False) else cls.__call__


def _input_name(signature: inspect.Signature) -> str:
    return list(signature.parameters)[1]  # the first after self


def _arguments(mixer: Any, x: mx.array, cache: Any, signature: inspect.Signature | None = None) -> dict[str, Any]:
    """Keyword arguments for the mixer's own call: its input, its cache, and no mask (every row is real)."""
    signature = signature or inspect.signature(_original_call(mixer))
    arguments = {_input_name(signature): x, "cache": cache}
    if "mask" in signature.parameters:
        arguments["mask"] = None
    return arguments
