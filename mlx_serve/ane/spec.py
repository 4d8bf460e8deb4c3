"""What the ANE builder needs from a loaded mlx-lm model: shapes and per-layer weights as NumPy.

Only dense llama-family decoders qualify (llama, qwen2, qwen3, mistral): pre-norm blocks of
attention (GQA, optional q/k RMSNorm, optional q/k/v biases) and a SwiGLU MLP, non-traditional RoPE.
Anything else is refused with `UnsupportedModel` rather than built wrong.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from mlx_serve.errors import UnsupportedModel

SUPPORTED_MODEL_TYPES = ("llama", "mistral", "qwen2", "qwen3")


@dataclass(frozen=True, slots=True)
class Linear:
    weight: np.ndarray  # (out, in)
    bias: np.ndarray | None


@dataclass(frozen=True, slots=True)
class LayerWeights:
    input_norm: np.ndarray  # (hidden,)
    q: Linear
    k: Linear
    v: Linear
    o: Linear
    q_norm: np.ndarray | None  # (head_dim,) qwen3 only
    k_norm: np.ndarray | None
    post_attention_norm: np.ndarray
    gate: Linear
    up: Linear
    down: Linear


@dataclass(frozen=True, slots=True)
class DenseSpec:
    """Shapes and weights of the decoder stack that goes into the Core ML program."""

    model_type: str
    hidden_size: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rms_norm_eps: float
    layers: tuple[LayerWeights, ...]
    final_norm: np.ndarray  # applied inside the program: the host only runs the LM head

    @property
    def num_layers(self) -> int:
        return len(self.layers)


def _to_numpy(array) -> np.ndarray:
    import mlx.core as mx

    return np.array(array.astype(mx.float32))


def _linear(module) -> Linear:
    import mlx.core as mx

    weight = module.weight
    if hasattr(module, "scales"):  # QuantizedLinear: unpack to dense before Core ML re-compresses it
        weight = mx.dequantize(
            module.weight,
            module.scales,
            module.get("biases"),
            group_size=module.group_size,
            bits=module.bits,
            mode=getattr(module, "mode", "affine"),
        )
    bias = module.get("bias") if hasattr(module, "get") else None
    return Linear(weight=_to_numpy(weight), bias=None if bias is None else _to_numpy(bias))


def _norm_weight(module) -> np.ndarray | None:
    return None if module is None else _to_numpy(module.weight)


def _check_supported(model) -> str:
    args = getattr(model, "args", None)
    model_type = getattr(args, "model_type", None)
    if model_type not in SUPPORTED_MODEL_TYPES:
        raise UnsupportedModel(
            f"the ANE lane builds dense llama/qwen2/qwen3 models only, not model_type={model_type!r}"
        )
    rope = model.layers[0].self_attn.rope
    if getattr(rope, "traditional", False):
        raise UnsupportedModel("the ANE lane supports non-traditional (rotate-half) RoPE only")
    if getattr(args, "sliding_window", None) and getattr(args, "use_sliding_window", False):
        raise UnsupportedModel("sliding-window attention is not supported by the ANE lane")
    return model_type


def _layer_weights(layer) -> LayerWeights:
    attn, mlp = layer.self_attn, layer.mlp
    return LayerWeights(
        input_norm=_norm_weight(layer.input_layernorm),
        q=_linear(attn.q_proj),
        k=_linear(attn.k_proj),
        v=_linear(attn.v_proj),
        o=_linear(attn.o_proj),
        q_norm=_norm_weight(getattr(attn, "q_norm", None)),
        k_norm=_norm_weight(getattr(attn, "k_norm", None)),
        post_attention_norm=_norm_weight(layer.post_attention_layernorm),
        gate=_linear(mlp.gate_proj),
        up=_linear(mlp.up_proj),
        down=_linear(mlp.down_proj),
    )


def dense_spec(model) -> DenseSpec:
    """Read a loaded mlx-lm model (the object `mlx_lm.load` returns first) into a `DenseSpec`."""
    model_type = _check_supported(model)
    args = model.args
    attn = model.layers[0].self_attn
    num_heads = attn.n_heads
    num_kv_heads = attn.n_kv_heads
    head_dim = round(attn.scale**-2)  # every supported family sets scale = head_dim ** -0.5
    return DenseSpec(
        model_type=model_type,
        hidden_size=args.hidden_size,
        num_heads=num_heads,
        num_kv_heads=num_kv_heads,
        head_dim=head_dim,
        rms_norm_eps=float(args.rms_norm_eps),
        layers=tuple(_layer_weights(layer) for layer in model.layers),
        final_norm=_to_numpy(model.model.norm.weight),
    )
