"""Gemma 3n on ragged steps. mlx-lm's Gemma 3n language model has no inner model of its own: one forward runs the
per-layer inputs, AltUp and the layers, and ends in its head (the tied embedding, then a soft cap). The engine reads
hidden states and applies the head itself (only to the rows it samples), so the text model it is given is that
language model with `model` aliased to `model_head.HiddenStates`: the same forward, run over a view whose embedding's
`as_linear` passes the normed hidden states through and whose soft cap is off. Its head is `head`.

Its last `num_kv_shared_layers` layers read the K/V of the last earlier layer of their kind through
`cache.keys_and_values()`; mlx-lm hands them their owner's cache, so here the owner's `RaggedLayerCache`, whose
attention reads the owner's pool (written earlier in the step).
"""

from __future__ import annotations

from typing import Any

import mlx.core as mx

from mlx_serve.model_head import HiddenStates

GEMMA3N_MODULE = "mlx_lm.models.gemma3n"  # checked against mlx-lm 0.32.2


def is_gemma3n(model: Any) -> bool:
    return type(model).__module__ == GEMMA3N_MODULE and type(model).__name__ == "LanguageModel"


class _PassThrough:
    """The embedding as the forward sees it: looked up as usual, but `as_linear` (the head) passes hidden states."""

    def __init__(self, embedding: Any) -> None:
        self._embedding = embedding

    def __call__(self, tokens: mx.array) -> mx.array:
        return self._embedding(tokens)

    def as_linear(self, hidden: mx.array) -> mx.array:
        return hidden

    def __getattr__(self, name: str) -> Any:
        return getattr(self._embedding, name)


class _WithoutHead:
    """The language model as its forward sees it for hidden states: no head, no cap; anything else is the model's."""

    def __init__(self, model: Any) -> None:
        self._model = model
        self.embed_tokens = _PassThrough(model.embed_tokens)
        self.final_logit_softcapping = None

    def __getattr__(self, name: str) -> Any:
        value = getattr(self._model, name)
        bound = getattr(value, "__func__", None)  # methods run against this view
        return bound.__get__(self) if bound is not None else value


def text_model(model: Any) -> Any:
    """The language model of a Gemma 3n checkpoint, given `model` (hidden states), `args` and `model_type`."""
    language_model = model.model.language_model
    object.__setattr__(language_model, "model", HiddenStates(language_model, _WithoutHead))
    object.__setattr__(language_model, "args", language_model.config)
    object.__setattr__(language_model, "model_type", language_model.config.model_type)
    return language_model


def head(model: Any, hidden: mx.array) -> mx.array:
    """Its head over hidden states after the final norm: the tied embedding, then the soft cap, as its forward ends."""
    from mlx_lm.models.gemma3n import logit_softcap

    logits = model.embed_tokens.as_linear(hidden)
    cap = model.final_logit_softcapping
    return logit_softcap(cap, logits) if cap is not None else logits
