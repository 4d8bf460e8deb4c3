"""Recurrent layers: the gated delta nets of Qwen3-Next, Qwen3.5 and OLMo Hybrid, LFM2's short convolutions, the Mamba
mixers of Granite 4, Nemotron-H, Jamba and Falcon-H1 (beside attention), and Mamba's, Mamba-2's and RWKV-7's (alone).

A recurrence reads its rows in order, so the ragged step's `[T, 1]` rows (every row its own sequence) cannot reach
it as they are. Each such layer's mixer (the one module of the layer that takes mlx-lm's `ArraysCache`; where two do,
as RWKV-7's time and channel mixing, the layer itself) is called
once per group of the step's lanes instead: the single-row lanes together as `[lanes, 1]`, each prefill chunk as
`[1, rows]` (consecutive chunks of as many rows together), exactly as mlx-lm's own generation calls it. Every running request keeps its layers' state (what
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
from mlx_serve.model_source import cache_layers
from scheduler.plan import Lane


@dataclass(frozen=True, slots=True)
class StateGroup:
    """Lanes a mixer reads in one call: `lanes` requests of `rows` rows each, from row `row_start` of the step."""

    row_start: int
    lanes: int
    rows: int
    slots: mx.array  # [lanes] int32: each lane's state slot
    # lanes whose state after this group is also copied to a snapshot slot: their index in the group, and the slots
    snapshot_lanes: mx.array | None = None
    snapshot_slots: mx.array | None = None


@dataclass(frozen=True, slots=True)
class StateEntry:
    """One array of a request's state in a layer, as mlx-lm's mixer leaves it (without the batch axis)."""

    shape: tuple[int, ...]
    dtype: mx.Dtype


@dataclass(frozen=True, slots=True)
class StateRows:
    """The step's rows as the recurrent layers read them."""

    groups: tuple[StateGroup, ...]
    fresh: mx.array | None  # slots of lanes that start at position 0 (their state is zeroed first); None: none
    # slots of lanes that start from a snapshot (a prefix hit), and the snapshot slots they copy; None: none
    restore_to: mx.array | None = None
    restore_from: mx.array | None = None


def recurrent_layers(model: Any) -> tuple[int, ...]:
    """The layers whose mlx-lm cache is an `ArraysCache` (a recurrent state, no K/V)."""
    from mlx_lm.models.cache import ArraysCache

    caches = model.make_cache() if hasattr(model, "make_cache") else []
    return tuple(i for i, cache in enumerate(caches) if type(cache) is ArraysCache)


def state_layers(model: Any) -> tuple[int, ...]:
    """The layers that keep a recurrent state: an `ArraysCache`, alone or beside a `KVCache` in a `CacheList`
    (Falcon-H1: a Mamba mixer and attention side by side, `is_state_and_kv`)."""
    caches = model.make_cache() if hasattr(model, "make_cache") else []
    return tuple(i for i, cache in enumerate(caches) if _state_part(cache) is not None)


def _state_part(cache: Any) -> Any:
    from mlx_lm.models.cache import ArraysCache, CacheList

    if type(cache) is ArraysCache:
        return cache
    return cache.caches[0] if type(cache) is CacheList and is_state_and_kv(cache) else None


def is_state_and_kv(cache: Any) -> bool:
    """A `CacheList` of a state and then K/V, the one form of two caches a layer the engine serves (`LayerCaches`)."""
    from mlx_lm.models.cache import ArraysCache, KVCache

    parts = getattr(cache, "caches", ())
    return len(parts) == 2 and type(parts[0]) is ArraysCache and type(parts[1]) is KVCache


class LayerCaches:
    """mlx-lm's `CacheList` protocol for a layer with a state and K/V: `[0]` the state's cache, `[1]` the K/V's."""

    def __init__(self, state: RecurrentLayerCache, kv: Any) -> None:
        self.caches = (state, kv)

    def __getitem__(self, index: int) -> Any:
        return self.caches[index]


def layer_mixer(layer: Any, index: int) -> tuple[str, Any]:
    """The one module of a recurrent layer whose call takes a `cache` (its mixer), with its path in the layer; raises
    UnsupportedModel where there is not exactly one."""
    found = [(name, module) for name, module in layer.named_modules()
             if module is not layer and "cache" in inspect.signature(_original_call(module)).parameters]  # fmt: skip
    if len(found) > 1:  # beside attention (Falcon-H1): the state's reader is the module that is not attention
        found = [(name, module) for name, module in found if not hasattr(module, "q_proj")]
    if len(found) > 1 and "cache" in inspect.signature(_original_call(layer)).parameters:
        found = [("", layer)]  # several modules read one state (RWKV-7's time and channel mixing): the whole layer
    if len(found) != 1:
        names = ", ".join(name for name, _ in found) or "none"
        raise UnsupportedModel(
            f"layer {index} keeps a recurrent state, but the engine finds no single module of it that reads one "
            f"(modules taking a cache: {names})", param="model",
        )
    return found[0]


class StatePool:
    """Each recurrent layer's state arrays (the shapes and dtypes mlx-lm's mixer gives them): `slots` running
    requests' states, which request holds which, then `snapshots` slots the scheduler hands out (`Lane.snapshot`,
    `Lane.restore_slot`: scheduler/state_snapshots.py)."""

    def __init__(self, shapes: dict[int, list[StateEntry | None]], slots: int, snapshots: int = 0) -> None:
        self.layers = tuple(shapes)
        self.slots = slots
        self.snapshots = snapshots
        total = slots + snapshots
        self.states: dict[int, list[mx.array | None]] = {
            layer: [None if e is None else mx.zeros((total, *e.shape), e.dtype) for e in shapes[layer]] for layer in self.layers
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

    def slot(self, request_id: str, start: int, restoring: bool = False) -> int:
        """The request's slot; a lane that starts at position 0 (its state is zeroed by the step) or from a snapshot
        takes one."""
        slot = self._slot_of.get(request_id)
        if slot is not None:
            return slot
        if start != 0 and not restoring:
            raise RuntimeError(f"request {request_id} continues at position {start} with no recurrent state")
        if not self._free:
            raise RuntimeError(f"every one of the {self.slots} recurrent state slots is taken")
        slot = self._slot_of[request_id] = self._free.pop()
        return slot

    def release(self, request_id: str) -> None:
        slot = self._slot_of.pop(request_id, None)
        if slot is not None:
            self._free.append(slot)

    def rows(self, lanes: Sequence[Lane], num_single: int) -> StateRows:
        """Groups for the step's lanes in row order, the first `num_single` of one row. A lane that leaves a snapshot
        before its last row is read in two calls, split there."""
        slots = [self.slot(lane.request_id, lane.start, lane.restore_slot is not None) for lane in lanes]
        fresh = [slot for slot, lane in zip(slots, lanes) if lane.start == 0]
        restoring = [(slot, lane.restore_slot) for slot, lane in zip(slots, lanes) if lane.restore_slot is not None]
        groups: list[_Calls] = []
        if num_single:
            marked = [(i, lane.snapshot.slot) for i, lane in enumerate(lanes[:num_single]) if lane.snapshot is not None]
            groups.append(_Calls(0, num_single, 1, slots[:num_single], marked))
        row_start = num_single
        for slot, lane in list(zip(slots, lanes))[num_single:]:
            cut = lane.snapshot.position - lane.start if lane.snapshot is not None else lane.rows
            _add_lane(groups, _Calls(row_start, 1, cut, [slot], [(0, lane.snapshot.slot)] if lane.snapshot else []))
            if cut < lane.rows:
                _add_lane(groups, _Calls(row_start + cut, 1, lane.rows - cut, [slot], []))
            row_start += lane.rows
        return StateRows(
            tuple(self._group(g.row_start, g.lanes, g.rows, g.slots, g.marked) for g in groups), _indices(fresh),
            _indices([to for to, _ in restoring]), _indices([self.slots + source for _, source in restoring]),
        )

    def _group(self, row_start: int, lanes: int, rows: int, slots: list[int], marked: list[tuple[int, int]]) -> StateGroup:
        """`marked`: (lane index in the group, snapshot slot) of the lanes that leave a snapshot after it."""
        return StateGroup(row_start, lanes, rows, mx.array(slots, dtype=mx.int32),
                          _indices([i for i, _ in marked]), _indices([self.slots + s for _, s in marked]))  # fmt: skip


@dataclass(slots=False)
class _Calls:
    """A group being built: lanes of `rows` rows each from `row_start`, their slots and (index, snapshot slot) marks."""

    row_start: int
    lanes: int
    rows: int
    slots: list[int]
    marked: list[tuple[int, int]]


def _add_lane(groups: list[_Calls], lane: _Calls) -> None:
    """Append a prefill lane's call, or widen the last group with it where that one's lanes have as many rows and end
    where it starts: equal chunks of several prompts go through a mixer as one batch, as mlx-lm's batched prefill
    reads them. A lane read in two calls (split at its snapshot) is never joined to its own first part."""
    last = groups[-1] if groups else None
    if (last is not None and last.rows == lane.rows and last.row_start + last.lanes * last.rows == lane.row_start
            and lane.slots[0] not in last.slots):
        last.marked += [(last.lanes + i, slot) for i, slot in lane.marked]
        last.slots += lane.slots
        last.lanes += lane.lanes
    else:
        groups.append(lane)


def _indices(values: list[int]) -> mx.array | None:
    return mx.array(values, dtype=mx.int32) if values else None


def state_shapes(model: Any, layers: Sequence[int]) -> dict[int, list[StateEntry | None]]:
    """One request's state per recurrent layer, as mlx-lm's own forward over one token leaves its caches (None for
    an entry a layer leaves unset)."""
    caches = model.make_cache()
    model.model(mx.zeros((1, 1), dtype=mx.int32), cache=caches)
    states = {index: _state_part(caches[index]).cache for index in layers}
    mx.eval([c for entries in states.values() for c in entries if c is not None])
    return {index: [None if c is None else StateEntry(tuple(c.shape[1:]), c.dtype) for c in entries]
            for index, entries in states.items()}  # fmt: skip


class RecurrentLayerCache:
    """mlx-lm's cache protocol for one recurrent layer of one ragged step: the regrouped mixer call reads it."""

    def __init__(self, pool: StatePool, layer: int, rows: StateRows) -> None:
        self.pool = pool
        self.layer = layer
        self.rows = rows

    def make_mask(self, *args: Any, **kwargs: Any) -> None:
        return None

    def run(self, mixer: Callable[..., Any], x: mx.array, rows_in: dict[str, Any] | None = None) -> Any:
        """`mixer(x_group, cache_group, rows_in_group)` over each group of the step's rows `x` `[T, 1, D]`, each
        group's lanes reading and leaving their states in the pool; the outputs in row order, `[T, 1, ...]` (each of
        them where the mixer gives several: RWKV-7's layers also pass on `v_first`). `rows_in`: other inputs of one
        row each, `[T, 1, ...]` (None passes as None), cut to each group as `x` is."""
        from mlx_lm.models.cache import ArraysCache

        states = self.pool.states[self.layer]
        step = self.rows
        for state in filter(lambda s: s is not None, states):
            if step.fresh is not None:
                state[step.fresh] = 0
            if step.restore_to is not None:
                state[step.restore_to] = state[step.restore_from]
        outputs = []
        for group in step.groups:
            cache = ArraysCache(len(states))
            cache.cache = [None if state is None else state[group.slots] for state in states]
            start, end = group.row_start, group.row_start + group.lanes * group.rows

            def grouped(rows: Any, group: StateGroup = group, start: int = start, end: int = end) -> Any:
                return None if rows is None else rows[start:end].reshape(group.lanes, group.rows, *rows.shape[2:])

            out = mixer(grouped(x), cache, {name: grouped(value) for name, value in (rows_in or {}).items()})
            outputs.append(_as_rows(out, group.lanes * group.rows))
            for state, value in zip(states, cache.cache):
                if state is not None and value is not None:
                    state[group.slots] = value
                    if group.snapshot_slots is not None:
                        state[group.snapshot_slots] = value[group.snapshot_lanes]
        if len(outputs) == 1:
            return outputs[0]
        if isinstance(outputs[0], tuple):
            return tuple(_joined(parts) for parts in zip(*outputs))
        return mx.concatenate(outputs, axis=0)


def _as_rows(out: Any, count: int) -> Any:
    """A group's output(s) `[lanes, rows, ...]` as `[count, 1, ...]`."""
    if isinstance(out, tuple):
        return tuple(_as_rows(part, count) for part in out)
    return None if out is None else out.reshape(count, 1, *out.shape[2:])


def _joined(parts: tuple[Any, ...]) -> Any:
    return None if parts[0] is None else mx.concatenate(parts, axis=0)


def install_regrouped_mixers(model: Any, layers: Sequence[int]) -> None:
    """Make each recurrent layer's mixer read a `RecurrentLayerCache` group by group (any other cache, or none, goes
    to mlx-lm's own call unchanged). Per instance: the mixer's class becomes a subclass with that call."""
    owners = cache_layers(model)
    for index in layers:
        _, mixer = layer_mixer(model.model.layers[owners[index]], index)
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
            name = _input_name(signature)
            x = bound.arguments[name]
            # other inputs of one row each (RWKV-7's v_first, or None for its first layer) are cut as x is
            rows_in = {key: value for key, value in bound.arguments.items()
                       if key not in (name, "self", "cache", "mask") and _one_per_row(value, x)}  # fmt: skip
            others = {key: value for key, value in bound.arguments.items()
                      if key not in (name, "self", "cache", "mask") and key not in rows_in}  # fmt: skip

            def call(rows: mx.array, group: Any, group_rows: dict[str, Any]) -> Any:
                return original(self, **_arguments(self, rows, group, signature), **others, **group_rows)

            return cache.run(call, x, rows_in)

        _REGROUPED[cls] = type(f"Regrouped{cls.__name__}", (cls,), {"__call__": __call__, "regrouped": True})
    return _REGROUPED[cls]


def _one_per_row(value: Any, x: mx.array) -> bool:
    """An input of one row each beside `x` `[T, 1, D]` (`[T, 1, ...]`), or None in such an input's place."""
    if value is None:
        return True
    return isinstance(value, mx.array) and value.ndim >= 2 and value.shape[:2] == x.shape[:2]


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
