"""GPT-NeoX (Pythia and its kin) on ragged steps. mlx-lm's GPT-NeoX inner model ends in its head (`embed_out`, after
the final norm), where the engine reads hidden states and applies the head itself, only to the rows it samples. The
text model it is given has `model` aliased to `model_head.HiddenStates`: the inner forward run over a view whose `embed_out`
passes the normed hidden states through. Its head is `head`.
"""

from __future__ import annotations

from typing import Any

import mlx.core as mx

from mlx_serve.model_head import HiddenStates

GPT_NEOX_MODULE = "mlx_lm.models.gpt_neox"  # checked against mlx-lm 0.32.2


def is_gpt_neox(model: Any) -> bool:
    return type(model).__module__ == GPT_NEOX_MODULE and type(model).__name__ == "Model"


class _WithoutHead:
    """The inner model as its forward sees it for hidden states: `embed_out` passes them; the rest is the model's."""

    def __init__(self, inner: Any) -> None:
        self._inner = inner

    @staticmethod
    def embed_out(hidden: mx.array) -> mx.array:
        return hidden

    def __getattr__(self, name: str) -> Any:
        return getattr(self._inner, name)


def text_model(model: Any) -> Any:
    """The model with `model` read as hidden states and its layers (`h`) also under `layers`: aliases, not children
    (the parameters stay listed once, under their own names)."""
    inner = model.model
    if isinstance(inner, HiddenStates):  # asked again of a model already seen so
        return model
    object.__setattr__(inner, "layers", inner["h"])
    object.__setattr__(model, "model", HiddenStates(inner, _WithoutHead))
    return model


def head(model: Any, hidden: mx.array) -> mx.array:
    """Its head over hidden states after the final norm, as its forward ends."""
    return model.model.embed_out(hidden)
