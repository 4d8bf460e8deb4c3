"""LoRA adapters chosen per request: many fine-tunes of one base model served side by side in one batch.

Each adapted linear holds every adapter's `lora_a` / `lora_b` stacked (slot 0: zeros, the base model) and adds
`scale * (x @ lora_a) @ lora_b` per row, each row through its own request's slot (`mx.gather_mm`): the ragged
`[T, 1]` step makes every row its own batch element, so rows of different adapters share one step. The sum is
mlx-lm's `LoRALinear` forward, so a request's tokens are those of `mlx_lm.load(base, adapter_path=...)`.

Steps where no row has an adapter run the base model alone (compiled and fused forwards included); steps with
adapted rows run eager through the model's modules.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import mlx.core as mx
import mlx.nn as nn
from mlx.utils import tree_unflatten

from mlx_serve.adapter_specs import AdapterSpec, adapter_files
from mlx_serve.errors import InvalidRequest, UnsupportedModel

ADAPTER_LEAVES = ("lora_a", "lora_b")


@dataclass(frozen=True, slots=True)
class _Adapter:
    name: str
    scale: float
    weights: dict[str, mx.array]  # "<module path>.lora_a" / ".lora_b", as mlx_lm.lora saved them


def read_adapter(spec: AdapterSpec) -> _Adapter:
    """An adapter's scale and LoRA matrices; UnsupportedModel for kinds served only merged (DoRA, full)."""
    config_path, weights_path = adapter_files(spec)
    try:
        config = json.loads(config_path.read_text())
    except json.JSONDecodeError as exc:
        raise InvalidRequest(f"adapter {spec.name!r}: {config_path} is not JSON: {exc}", param="lora") from None
    kind = config.get("fine_tune_type", "lora")
    if kind != "lora":
        raise UnsupportedModel(f"adapter {spec.name!r} is a {kind!r} fine-tune; per-request adapters are LoRA only "
                               "(serve it merged into the base model with --adapter-path)", param="lora")  # fmt: skip
    scale = (config.get("lora_parameters") or {}).get("scale")
    if not isinstance(scale, (int, float)) or isinstance(scale, bool):
        raise InvalidRequest(f"adapter {spec.name!r}: lora_parameters.scale is missing or not a number",
                             param="lora")  # fmt: skip
    weights = mx.load(str(weights_path))
    strays = sorted(name for name in weights if name.rsplit(".", 1)[-1] not in ADAPTER_LEAVES)
    if strays:
        raise UnsupportedModel(f"adapter {spec.name!r} holds tensors other than LoRA matrices: {strays[:3]}",
                               param="lora")  # fmt: skip
    return _Adapter(spec.name, float(scale), weights)


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


@dataclass(slots=True)
class AdapterSet:
    """The adapters installed in a model: names in slot order (slot 0 is the base model) and the step's rows."""

    names: tuple[str, ...]
    modules: int  # linears that carry at least one adapter
    selection: AdapterRows = field(default_factory=AdapterRows)

    def slot(self, name: str | None) -> int:
        return 0 if name is None else self.names.index(name) + 1


def install_adapters(model: Any, specs: Sequence[AdapterSpec]) -> AdapterSet | None:
    """Read every adapter and wrap each linear one of them adapts; None when `specs` is empty."""
    if not specs:
        return None
    adapters = [read_adapter(spec) for spec in specs]
    modules = dict(model.named_modules())
    paths = sorted({name.rsplit(".", 1)[0] for adapter in adapters for name in adapter.weights})
    selection = AdapterRows()
    wrapped = []
    for path in paths:
        own = path.removeprefix("language_model.")  # a multimodal checkpoint's text half is served alone
        if not own.startswith("model.layers."):  # the output head runs after the step's rows are read
            raise UnsupportedModel(f"adapters {_users(adapters, path)} adapt {path}; per-request adapters take "
                                   "the decoder layers' linears only", param="lora")  # fmt: skip
        module = modules.get(own)
        if module is None:
            raise InvalidRequest(f"adapters {_users(adapters, path)} adapt {path}, which this model has not",
                                 param="lora")  # fmt: skip
        lora_a, lora_b, scales = _stacked(module, path, adapters)
        wrapped.append((own, AdaptedLinear(module, lora_a, lora_b, scales, selection)))
    model.update_modules(tree_unflatten(wrapped))
    mx.eval(model.parameters())
    return AdapterSet(tuple(spec.name for spec in specs), len(wrapped), selection)


def _users(adapters: list[_Adapter], path: str) -> list[str]:
    return [a.name for a in adapters if f"{path}.lora_a" in a.weights]


def _stacked(module: Any, path: str, adapters: list[_Adapter]) -> tuple[mx.array, mx.array, mx.array]:
    """The module's adapter matrices stacked by slot, ranks zero-padded to the largest (exact: the pad adds 0s)."""
    if not isinstance(module, (nn.Linear, nn.QuantizedLinear)):
        raise UnsupportedModel(f"adapters {_users(adapters, path)} adapt {path}, a {type(module).__name__}; "
                               "per-request adapters take linear layers only", param="lora")  # fmt: skip
    outputs, inputs = _dims(module)
    pairs = []
    for adapter in adapters:
        a, b = adapter.weights.get(f"{path}.lora_a"), adapter.weights.get(f"{path}.lora_b")
        if (a is None) != (b is None):
            raise InvalidRequest(f"adapter {adapter.name!r} has one of {path}'s two LoRA matrices", param="lora")
        if a is not None and (a.ndim != 2 or b.ndim != 2 or a.shape[0] != inputs or b.shape[1] != outputs
                              or a.shape[1] != b.shape[0]):  # fmt: skip
            raise InvalidRequest(f"adapter {adapter.name!r}: {path} lora_a {tuple(a.shape)} / lora_b "
                                 f"{tuple(b.shape)} do not fit a {inputs} -> {outputs} linear", param="lora")
        pairs.append((a, b, adapter.scale))
    rank = max(a.shape[1] for a, _, _ in pairs if a is not None)
    dtype = _widest([array for a, b, _ in pairs if a is not None for array in (a, b)])
    stack_a, stack_b, scales = [mx.zeros((inputs, rank), dtype)], [mx.zeros((rank, outputs), dtype)], [0.0]
    for a, b, scale in pairs:
        if a is None:
            a, b, scale = mx.zeros((inputs, rank), dtype), mx.zeros((rank, outputs), dtype), 0.0
        pad = rank - a.shape[1]
        stack_a.append(mx.pad(a.astype(dtype), [(0, 0), (0, pad)]))
        stack_b.append(mx.pad(b.astype(dtype), [(0, pad), (0, 0)]))
        scales.append(scale)
    return mx.stack(stack_a), mx.stack(stack_b), mx.array(scales, dtype=dtype)


def _dims(module: Any) -> tuple[int, int]:
    """(output, input) features of a linear, packed or not."""
    out, width = module.weight.shape
    return (out, width * 32 // module.bits) if isinstance(module, nn.QuantizedLinear) else (out, width)


def _widest(arrays: list[mx.array]) -> mx.Dtype:
    """The adapters' one dtype (float32 where they differ: mixed adapters round as the widest would)."""
    dtypes = {array.dtype for array in arrays}
    return dtypes.pop() if len(dtypes) == 1 else mx.float32
