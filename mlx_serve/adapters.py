"""LoRA adapters chosen per request: many fine-tunes of one base model served side by side in one batch.

Each adapted linear holds every adapter's `lora_a` / `lora_b` stacked (slot 0: zeros, the base model) and adds
`scale * (x @ lora_a) @ lora_b` per row, each row through its own request's slot (`mx.gather_mm`): the ragged
`[T, 1]` step makes every row its own batch element, so rows of different adapters share one step. The sum is
mlx-lm's `LoRALinear` forward, so a request's tokens are those of `mlx_lm.load(base, adapter_path=...)`.

Steps where no row has an adapter run the base model alone (compiled and fused forwards included: the fused forward
reads the linears under the wrappers); decode steps with adapter rows replay compiled traces of their own through the
model's modules (`compiled_step`), other steps with adapter rows run eager through them.
"""

from __future__ import annotations

import io
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import mlx.core as mx
import mlx.nn as nn
from mlx.utils import tree_unflatten

from mlx_serve.adapter_specs import AdapterSource, AdapterSpec, read_adapter_source
from mlx_serve.errors import InvalidRequest, UnsupportedModel

ADAPTER_LEAVES = ("lora_a", "lora_b")


@dataclass(frozen=True, slots=True)
class _Adapter:
    name: str
    scale: float
    weights: dict[str, mx.array]  # "<module path>.lora_a" / ".lora_b", as mlx_lm.lora saved them


def read_adapter(spec: AdapterSpec) -> _Adapter:
    """An adapter's scale and LoRA matrices; UnsupportedModel for kinds served only merged (DoRA, full)."""
    return parse_adapter(read_adapter_source(spec))


def parse_adapter(source: AdapterSource) -> _Adapter:
    """The LoRA matrices of an adapter whose files were read (`read_adapter_source`)."""
    try:
        weights = mx.load(io.BytesIO(source.weights), format="safetensors")
    except (ValueError, RuntimeError) as exc:
        raise InvalidRequest(f"adapter {source.name!r}: adapters.safetensors cannot be read: {exc}",
                             param="lora") from None  # fmt: skip
    strays = sorted(name for name in weights if name.rsplit(".", 1)[-1] not in ADAPTER_LEAVES)
    if strays:
        raise UnsupportedModel(f"adapter {source.name!r} holds tensors other than LoRA matrices: {strays[:3]}",
                               param="lora")  # fmt: skip
    return _Adapter(source.name, source.scale, weights)


@dataclass(slots=True)
class AdapterRows:
    """Each row's adapter slot (0: none) for the step whose graph is being built; None: no row has an adapter."""

    rows: mx.array | None = None


class AdaptedLinear(nn.Module):
    """A linear plus each row's own adapter: `base(x) + (scale * (x @ lora_a) @ lora_b)` in mlx-lm's op order."""

    def __init__(self, base: nn.Module, lora_a: mx.array, lora_b: mx.array, scales: mx.array,
                 selection: AdapterRows) -> None:  # fmt: skip
        super().__init__()
        self.base = base
        self.lora_a = lora_a  # [adapters + 1, input, rank]
        self.lora_b = lora_b  # [adapters + 1, rank, output]
        self.scales = scales  # [adapters + 1]
        self.selection = selection

    def __call__(self, x: mx.array) -> mx.array:
        y = self.base(x)
        rows = self.selection.rows
        if rows is None:
            return y
        flat = x.reshape(-1, 1, x.shape[-1])  # the step's rows, each its own product
        z = mx.gather_mm(mx.gather_mm(flat, self.lora_a, rhs_indices=rows), self.lora_b, rhs_indices=rows)
        z = self.scales[rows][:, None, None] * z
        return y + z.reshape(*y.shape[:-1], z.shape[-1]).astype(x.dtype)


def unadapted(linear: nn.Module) -> nn.Module:
    """The linear under a LoRA adapter's wrapper (`AdaptedLinear`), or the linear itself."""
    return linear.base if isinstance(linear, AdaptedLinear) else linear


Entry = tuple[mx.array, mx.array, float]  # one adapter's lora_a, lora_b and scale for one linear


@dataclass(slots=True)
class AdapterSet:
    """The adapters installed in a model: each one's slot (slot 0 is the base model; a removed adapter's slot is
    free for the next), the LoRA matrices of every adapted linear by slot, and the step's rows. Changed only on the
    engine thread (`Engine.load_adapter`), between steps."""

    model: Any
    slots: list[str | None] = field(default_factory=list)  # slot i + 1's adapter name; None: free
    entries: dict[str, list[Entry | None]] = field(default_factory=dict)  # linear's path -> its matrices by slot - 1
    selection: AdapterRows = field(default_factory=AdapterRows)

    @property
    def names(self) -> tuple[str, ...]:
        return tuple(name for name in self.slots if name is not None)

    def slot(self, name: str | None) -> int:
        return 0 if name is None else self.slots.index(name) + 1

    @property
    def stack_bytes(self) -> int:
        """Bytes the stacked matrices of every adapted linear hold (a freed slot's zeros included)."""
        modules = dict(self.model.named_modules())
        return sum(_stack_bytes(_base(modules[path]), entries) for path, entries in self.entries.items())

    def add(self, adapter: _Adapter, limit_bytes: int | None = None) -> None:
        """Serve `adapter` in a free slot (or a new one); every check, the stacks' bytes within `limit_bytes`
        included, passes before anything changes."""
        if adapter.name in self.slots:
            raise InvalidRequest(f"adapter {adapter.name!r} is already served", param="lora")
        modules = dict(self.model.named_modules())
        found = {path: _entry(modules, path, adapter) for path in _paths(adapter)}
        slot = self.slots.index(None) if None in self.slots else len(self.slots)
        grown = slot == len(self.slots)
        slots = len(self.slots) + grown
        planned = {path: _placed(self.entries.get(path, []), slots, slot, found.get(path))
                   for path in {*self.entries, *found}}  # fmt: skip
        if limit_bytes is not None:
            needed = sum(_stack_bytes(_base(modules[path]), entries) for path, entries in planned.items())
            if needed > limit_bytes:
                raise InvalidRequest(f"adapter {adapter.name!r} would bring the adapters' matrices to "
                                     f"{needed / 2**20:.1f} MiB, over the {limit_bytes / 2**20:.1f} MiB kept for "
                                     "them (raise --adapter-memory-gb)", param="lora")  # fmt: skip
        self.slots[slot : slot + 1] = [adapter.name]
        for path in sorted(planned):
            self.entries[path] = planned[path]
            if grown or path in found:  # a freed slot's matrices are zeros already
                self._restack(modules, path)

    def remove(self, name: str) -> None:
        """Stop serving `name`: its slot's matrices become zeros (its requests must be done) and the slot free."""
        slot = self.slot(name) - 1
        self.slots[slot] = None
        modules = dict(self.model.named_modules())
        for path, entries in self.entries.items():
            if entries[slot] is not None:
                entries[slot] = None
                self._restack(modules, path)

    def _restack(self, modules: dict[str, Any], path: str) -> None:
        """The linear at `path` as an `AdaptedLinear` whose stacks hold every slot's matrices (zeros where none)."""
        current = modules[path]
        base = _base(current)
        lora_a, lora_b, scales = _stacked(base, self.entries[path])
        if isinstance(current, AdaptedLinear):
            current.lora_a, current.lora_b, current.scales = lora_a, lora_b, scales
        else:
            self.model.update_modules(tree_unflatten([(path, AdaptedLinear(base, lora_a, lora_b, scales,
                                                                           self.selection))]))  # fmt: skip
        mx.eval(lora_a, lora_b, scales)


def install_adapters(model: Any, specs: Sequence[AdapterSpec]) -> AdapterSet | None:
    """Read every adapter and wrap each linear one of them adapts; None when `specs` is empty."""
    if not specs:
        return None
    adapters = AdapterSet(model)
    for spec in specs:
        adapters.add(read_adapter(spec))
    return adapters


def _paths(adapter: _Adapter) -> list[str]:
    """The linears `adapter` adapts, as paths in the served (text) model."""
    return sorted({name.rsplit(".", 1)[0].removeprefix("language_model.") for name in adapter.weights})


def _entry(modules: dict[str, Any], path: str, adapter: _Adapter) -> Entry:
    """`adapter`'s matrices for the linear at `path`, checked against it."""
    if not path.startswith("model.layers."):  # the output head runs after the step's rows are read
        raise UnsupportedModel(f"adapter {adapter.name!r} adapts {path}; per-request adapters take the decoder "
                               "layers' linears only", param="lora")  # fmt: skip
    module = modules.get(path)
    if module is None:
        raise InvalidRequest(f"adapter {adapter.name!r} adapts {path}, which this model has not", param="lora")
    base = _base(module)
    if not isinstance(base, (nn.Linear, nn.QuantizedLinear)):
        raise UnsupportedModel(f"adapter {adapter.name!r} adapts {path}, a {type(base).__name__}; per-request "
                               "adapters take linear layers only", param="lora")  # fmt: skip
    prefix = next(p for p in (path, f"language_model.{path}") if f"{p}.lora_a" in adapter.weights
                  or f"{p}.lora_b" in adapter.weights)  # fmt: skip
    a, b = adapter.weights.get(f"{prefix}.lora_a"), adapter.weights.get(f"{prefix}.lora_b")
    if a is None or b is None:
        raise InvalidRequest(f"adapter {adapter.name!r} has one of {path}'s two LoRA matrices", param="lora")
    outputs, inputs = _dims(base)
    if a.ndim != 2 or b.ndim != 2 or a.shape[0] != inputs or b.shape[1] != outputs or a.shape[1] != b.shape[0]:
        raise InvalidRequest(f"adapter {adapter.name!r}: {path} lora_a {tuple(a.shape)} / lora_b {tuple(b.shape)} "
                             f"do not fit a {inputs} -> {outputs} linear", param="lora")  # fmt: skip
    return a, b, adapter.scale


def _base(module: Any) -> Any:
    return module.base if isinstance(module, AdaptedLinear) else module


def _placed(entries: list[Entry | None], slots: int, slot: int, entry: Entry | None) -> list[Entry | None]:
    """A linear's matrices by slot once `entry` takes `slot` of `slots`."""
    placed = [*entries, *[None] * (slots - len(entries))]
    placed[slot] = entry
    return placed


def _stack_form(entries: list[Entry | None]) -> tuple[int, mx.Dtype]:
    """The rank and dtype a linear's stacks take: the largest rank, the adapters' one dtype."""
    present = [entry for entry in entries if entry is not None]
    rank = max((a.shape[1] for a, _, _ in present), default=1)
    return rank, _widest([array for a, b, _ in present for array in (a, b)]) if present else mx.float32


def _stack_bytes(base: Any, entries: list[Entry | None]) -> int:
    """What `_stacked(base, entries)` holds, worked out without building it."""
    outputs, inputs = _dims(base)
    rank, dtype = _stack_form(entries)
    return (len(entries) + 1) * (inputs * rank + rank * outputs + 1) * dtype.size


def _stacked(base: Any, entries: list[Entry | None]) -> tuple[mx.array, mx.array, mx.array]:
    """A linear's matrices stacked by slot (slot 0 and empty slots zeros), ranks zero-padded to the largest (exact:
    the pad adds zeros)."""
    outputs, inputs = _dims(base)
    rank, dtype = _stack_form(entries)
    stack_a, stack_b, scales = [mx.zeros((inputs, rank), dtype)], [mx.zeros((rank, outputs), dtype)], [0.0]
    for entry in entries:
        a, b, scale = entry or (mx.zeros((inputs, rank), dtype), mx.zeros((rank, outputs), dtype), 0.0)
        pad = rank - a.shape[1]
        stack_a.append(mx.pad(a.astype(dtype), [(0, 0), (0, pad)]))
        stack_b.append(mx.pad(b.astype(dtype), [(0, pad), (0, 0)]))
        scales.append(scale)
    return mx.stack(stack_a), mx.stack(stack_b), mx.array(scales, dtype=dtype)


def _dims(module: Any) -> tuple[int, int]:
    """(output, input) features of a linear, packed or not (a split-K one holds its K in slices:
    `quantized_rows.split_k`)."""
    if isinstance(module, nn.QuantizedLinear):
        scales = module.scales
        return scales.shape[-2], scales.shape[-1] * module.group_size * getattr(module, "k_splits", 1)
    return tuple(module.weight.shape)


def _widest(arrays: list[mx.array]) -> mx.Dtype:
    """The adapters' one dtype (float32 where they differ: mixed adapters round as the widest would)."""
    dtypes = {array.dtype for array in arrays}
    return dtypes.pop() if len(dtypes) == 1 else mx.float32
