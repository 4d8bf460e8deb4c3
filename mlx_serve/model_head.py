"""A model's own output head over hidden states the engine computed (after the final norm).

Families differ after their last norm: Granite divides the logits by `logits_scaling`, MiniCPM scales the hidden
states, Cohere multiplies by `logit_scale`, Gemma always ties its embeddings. Rather than copy each, the head runs
the model class's own `__call__` with its inner transformer stood in for by the hidden states.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import mlx.core as mx

# families whose head is the LM head or the tied embedding, nothing else (the runner's fast path; mistral loads
# through llama)
PLAIN_HEADS = ("mlx_lm.models.llama", "mlx_lm.models.qwen2", "mlx_lm.models.qwen3", "mlx_lm.models.qwen3_moe")


class _GivenHidden:
    """Stands in for the inner transformer: calling it returns the given hidden states; anything else (embeddings,
    args) is the real one's."""

    def __init__(self, inner: Any, hidden: mx.array) -> None:
        self._inner = inner
        self._hidden = hidden

    def __call__(self, *args: Any, **kwargs: Any) -> mx.array:
        return self._hidden

    def __getattr__(self, name: str) -> Any:
        return getattr(self._inner, name)


class _HeadView:
    """The model as its `__call__` sees it, with `model` (the inner transformer; Nemotron-H's `backbone`) given."""

    def __init__(self, model: Any, hidden: mx.array) -> None:
        self._model = model
        self._inner = _GivenHidden(model.model, hidden)

    def __getattr__(self, name: str) -> Any:
        return self._inner if name in ("model", "backbone", "transformer") else getattr(self._model, name)


class HiddenStates:
    """`model.model` for a family whose forward ends in its head (Gemma 3n, GPT-NeoX): that forward run over
    `without_head(model)`, a view whose head passes the normed hidden states through; attributes are the model's."""

    def __init__(self, model: Any, without_head: Callable[[Any], Any]) -> None:
        self._model = model
        self._without_head = without_head

    def __call__(self, inputs: mx.array, cache: Any = None) -> mx.array:
        return type(self._model).__call__(self._without_head(self._model), inputs, cache=cache)

    def __getattr__(self, name: str) -> Any:
        return getattr(self._model, name)

    def __contains__(self, name: str) -> bool:
        return name in self._model

    def __getitem__(self, name: str) -> Any:
        return self._model[name]


def plain_head(model: Any) -> bool:
    return type(model).__module__ in PLAIN_HEADS


def family_head(model: Any) -> Callable[[mx.array], mx.array]:
    """`hidden` `[T, hidden]` -> the model's logits `[T, V]`, exactly as its own forward makes them."""
    from mlx_serve import gemma3n, gpt_neox

    if gemma3n.is_gemma3n(model):  # its forward is not an inner model and a head: the head, as it ends
        return lambda hidden: gemma3n.head(model, hidden)
    if gpt_neox.is_gpt_neox(model):  # its inner model ends in the head
        return lambda hidden: gpt_neox.head(model, hidden)
    call = type(model).__call__

    def head(hidden: mx.array) -> mx.array:
        return call(_HeadView(model, hidden), hidden)

    return head
