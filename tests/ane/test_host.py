"""Host-side RoPE tables: taken from the model's own RoPE module, so scaled variants come out exact."""

from __future__ import annotations

from types import SimpleNamespace

import mlx.core as mx
import mlx.nn as nn
import numpy as np
import pytest
from mlx_lm.models.rope_utils import initialize_rope

from mlx_serve.ane import host

HEAD_DIM = 32


def _fake_model(rope) -> SimpleNamespace:
    attention = SimpleNamespace(rope=rope, scale=HEAD_DIM**-0.5)
    return SimpleNamespace(layers=[SimpleNamespace(self_attn=attention)])


def _rotate_with_tables(x: np.ndarray, cos: np.ndarray, sin: np.ndarray) -> np.ndarray:
    """What the program does, on (rows, D): x * cos + rotate_half(x) * sin."""
    first, second = np.split(x, 2, axis=-1)
    rotated = np.concatenate([-second, first], axis=-1)
    return x * cos[0, 0].T + rotated * sin[0, 0].T


@pytest.mark.parametrize(
    "scaling",
    [
        None,
        {"rope_type": "linear", "factor": 2.0},
        {
            "rope_type": "llama3",
            "factor": 8.0,
            "low_freq_factor": 1.0,
            "high_freq_factor": 4.0,
            "original_max_position_embeddings": 64,
        },
    ],
)
def test_tables_reproduce_the_models_rope(scaling) -> None:
    rope = initialize_rope(
        HEAD_DIM, base=10000.0, traditional=False, scaling_config=scaling, max_position_embeddings=4096
    )
    start, rows = 37, 8
    cos, sin = host.rope_tables(_fake_model(rope), start, rows)
    x = np.random.default_rng(0).standard_normal((rows, HEAD_DIM)).astype(np.float32)
    expected = np.array(rope(mx.array(x)[None, None], offset=start))[0, 0]
    actual = _rotate_with_tables(x, cos.astype(np.float32), sin.astype(np.float32))
    np.testing.assert_allclose(actual, expected, atol=2e-3)  # the tables are fp16


def test_traditional_rope_is_refused() -> None:
    from mlx_serve.ane.spec import _check_supported
    from mlx_serve.errors import UnsupportedModel

    model = _fake_model(nn.RoPE(HEAD_DIM, traditional=True))
    model.args = SimpleNamespace(model_type="llama")
    with pytest.raises(UnsupportedModel, match="traditional"):
        _check_supported(model)
