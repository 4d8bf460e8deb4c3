"""The fp16 RMSNorm pitfall (ARCHITECTURE.md), checked on our own interpreter: squaring |x| > 256 overflows
fp16, rsqrt(inf) = 0, and a naive norm silently zeroes the row. The builder's norm scales first."""

from __future__ import annotations

import coremltools as ct
import numpy as np
import pytest
from coremltools.converters.mil import Builder as mb
from coremltools.converters.mil.mil import types

from mlx_serve.ane.interpreter import Interpreter
from mlx_serve.ane.mil_layers import rms_norm

CHANNELS = 64


def _program(norm):
    @mb.program(
        input_specs=[mb.TensorSpec((1, CHANNELS, 1, 4), dtype=types.fp16)], opset_version=ct.target.iOS18
    )
    def prog(x):
        return norm(x)

    return prog


def _naive(x):
    mean_square = mb.reduce_mean(x=mb.mul(x=x, y=x), axes=[1], keep_dims=True)
    return mb.mul(x=x, y=mb.rsqrt(x=mb.add(x=mean_square, y=np.float16(1e-6))))


def _expected(x: np.ndarray) -> np.ndarray:
    x = x.astype(np.float32)
    return x / np.sqrt((x * x).mean(axis=1, keepdims=True) + 1e-6)


@pytest.mark.filterwarnings("ignore:overflow encountered:RuntimeWarning")  # the naive norm's, on purpose
def test_scaled_norm_survives_large_activations() -> None:
    rng = np.random.default_rng(0)
    x = (rng.standard_normal((1, CHANNELS, 1, 4)) * np.array([0.01, 1.0, 300.0, 3000.0])).astype(np.float16)
    ones = np.ones(CHANNELS, np.float32)
    safe = Interpreter(_program(lambda v: rms_norm(v, ones, 1e-6, axis=1, name="out"))).run("main", {"x": x})
    naive = Interpreter(_program(_naive)).run("main", {"x": x})
    expected = _expected(x)
    (safe_out,) = safe.values()
    (naive_out,) = naive.values()
    np.testing.assert_allclose(safe_out.astype(np.float32), expected, atol=2e-2)
    # the naive form is right for small rows and collapses for the rows beyond fp16's square range
    np.testing.assert_allclose(naive_out[..., :2].astype(np.float32), expected[..., :2], atol=2e-2)
    assert not np.allclose(naive_out[..., 2:].astype(np.float32), expected[..., 2:], atol=0.1)
