"""4-bit decode steps through the quantized GEMV: the CUDA kernel's reference (dequantize, then matmul) on the CPU
gives mlx-lm's tokens, eager and fused, whole and with weights split over K; which products take it; the switch."""

from __future__ import annotations

import pytest

from mlx_serve import quantized_rows
from mlx_serve.config import EngineConfig
from mlx_serve.engine import Engine
from mlx_serve.errors import InvalidRequest
from tests.engine.test_fused_decode import assert_fused_parity, assert_parity


@pytest.fixture
def counted_gemv(monkeypatch):
    """Products through the reference GEMV, counted by rows."""
    rows, reference = [], quantized_rows.REFERENCE_GEMV

    def matmul(x, *args):
        rows.append(x.shape[0])
        return reference.matmul(x, *args)

    counted = quantized_rows.QuantizedGemv(matmul, reference.most_rows, reference.fits)
    monkeypatch.setattr(quantized_rows, "REFERENCE_GEMV", counted)
    return rows


def test_eager_decode_steps_through_the_gemv_match_mlx_lm(tiny_qwen3_4bit, counted_gemv):
    assert_parity(tiny_qwen3_4bit, seed=141, compile_decode="off", quantized_gemv="on")
    assert counted_gemv and max(counted_gemv) <= quantized_rows.GEMV_MOST_ROWS
    assert 1 in counted_gemv, "no single-row product took the GEMV"


@pytest.mark.parametrize("split", ["off", "all"])
def test_fused_decode_steps_through_the_gemv_match_mlx_lm(tiny_qwen3_4bit, counted_gemv, narrow_k_splits, split):
    """The fused forward's q/k/v and gate/up, whole or split over K."""
    engine = assert_fused_parity(tiny_qwen3_4bit, seed=142, quantized_gemv="on", fuse_mixed="on",
                                 split_quantized_k=split)  # fmt: skip
    assert counted_gemv
    qkv = engine.runner.compiled.fused.layers[0].qkv
    assert (qkv.k_splits > 1) == (split == "all") and qkv.gemv is not None


def test_the_gemv_off_and_bad_values(tiny_qwen3_4bit, tiny_qwen3_8bit, counted_gemv):
    for path, setting in ((tiny_qwen3_4bit, "off"), (tiny_qwen3_8bit, "on")):  # 8-bit: the kernel takes 4-bit only
        engine = Engine.load(EngineConfig(model=str(path), quantized_gemv=setting))
        engine.shutdown()
        model = engine.runner.model
        linears = [m for _, m in model.named_modules() if isinstance(m, quantized_rows.RowsQuantizedLinear)]
        assert linears and all(m.gemv is None for m in linears)
    with pytest.raises(InvalidRequest, match="quantized_gemv must be auto, on or off"):
        Engine.load(EngineConfig(model=str(tiny_qwen3_4bit), quantized_gemv="kernel"))
