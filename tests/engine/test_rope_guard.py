"""`rope_guard`: MLX's CUDA RoPE launch kept inside CUDA's 64-thread block z, the results unchanged.

On the device a 128-row ragged step of a model with under 32 rotated dims failed in MLX's launch (session 41); here
the guard's pieces must give MLX's own rope exactly, offsets a row and all."""

from __future__ import annotations

import mlx.core as mx
import numpy as np
import pytest

from mlx_serve.rope_guard import SAFE_ROTATED_DIMS, block_dims, guarded, install_rope_guard, piece_rows

on_cuda = pytest.mark.skipif(not mx.cuda.is_available(), reason="needs MLX's CUDA backend")


def test_the_block_is_mlxs_pick():
    # MLX's get_block_dims_common, worked by hand: 16 rotated dims x 128 batch rows gives a z of 128, past CUDA's 64
    assert block_dims(4, 1, 128) == (4, 1, 128)
    assert block_dims(16, 1, 128) == (16, 1, 64)
    assert block_dims(64, 1, 512) == (32, 1, 32)
    assert block_dims(1024, 1, 1) == (1024, 1, 1)


@pytest.mark.parametrize(("shape", "dims", "pieces"), [
    ((128, 4, 1, 32), 16, True),  # the device's failure: 128 rows, 16 rotated dims
    ((128, 4, 1, 32), 32, False),  # 32 rotated dims: z stops at 64
    ((127, 4, 1, 32), 16, False),
    ((64, 16, 1, 32), 8, True),  # 4 groups of 4 heads a row
    ((1, 4, 300, 32), 16, False),  # one lane of many rows: the batch is 1
])  # fmt: skip
def test_only_launches_past_the_limit_are_split(shape, dims, pieces):
    rows = piece_rows(shape, dims)
    assert (rows is not None) == pieces
    if rows is not None:
        heads = shape[1]
        assert block_dims(dims // 2, 1, rows * -(-heads // 4))[2] <= 64


@pytest.mark.parametrize("traditional", [False, True])
@pytest.mark.parametrize("offsets", ["rows", "scalar", "one"])
def test_pieces_give_mlxs_rope_exactly(traditional, offsets):
    rng = np.random.default_rng(0)
    x = mx.array(rng.standard_normal((300, 4, 1, 32)).astype(np.float32))
    offset = {"rows": mx.array(rng.integers(0, 5000, 300).astype(np.int32)), "scalar": 17,
              "one": mx.array([23], dtype=mx.int32)}[offsets]  # fmt: skip
    calls = []

    def counted(*args, **kwargs):
        calls.append(args[0].shape[0])
        return mx.fast.rope(*args, **kwargs)

    kwargs = dict(traditional=traditional, base=10000.0, scale=1.0, offset=offset)
    ours = guarded(counted)(x, 16, **kwargs)
    assert calls == [127, 127, 46]
    assert mx.array_equal(ours, mx.fast.rope(x, 16, **kwargs)).item()


def test_freqs_and_fitting_calls_pass_through():
    x = mx.random.normal((300, 4, 1, 32), key=mx.random.key(1))
    freqs = mx.arange(1, 9, dtype=mx.float32) * 3.0
    offset = mx.arange(300, dtype=mx.int32)
    kwargs = dict(traditional=False, base=None, scale=1.0, offset=offset, freqs=freqs)
    assert mx.array_equal(guarded(mx.fast.rope)(x, 16, **kwargs), mx.fast.rope(x, 16, **kwargs)).item()
    calls = []
    guarded(lambda *a, **k: calls.append(a[0].shape) or a[0])(x, 64, **kwargs)
    assert calls == [(300, 4, 1, 32)]  # 64 rotated dims: one call, as given


def test_the_guard_is_installed_only_on_cuda():
    original = mx.fast.rope
    try:
        assert install_rope_guard() == (mx.cuda.is_available() and mx.default_device().type == mx.gpu)
        assert getattr(mx.fast.rope, "rope_guard", False) == install_rope_guard()
        once = mx.fast.rope
        install_rope_guard()
        assert mx.fast.rope is once  # idempotent
    finally:
        mx.fast.rope = original


@on_cuda
@pytest.mark.device
def test_a_128_row_ragged_step_with_a_small_rotary_part_runs_on_cuda():
    x = mx.random.normal((128, 4, 1, 32), key=mx.random.key(2))
    offset = mx.arange(128, dtype=mx.int32) * 7
    kwargs = dict(traditional=False, base=10000.0, scale=1.0)
    ours = guarded(mx.fast.rope)(x, 16, offset=offset, **kwargs)
    rows = [mx.fast.rope(x[i : i + 1], 16, offset=offset[i : i + 1], **kwargs) for i in range(128)]
    one_by_one = mx.concatenate(rows)
    assert mx.allclose(ours, one_by_one, atol=1e-6).item()


def test_from_32_rotated_dims_no_launch_needs_pieces():
    """`piece_rows` skips its arithmetic from `SAFE_ROTATED_DIMS` on: MLX's pick never passes a z of 64 there."""
    for rotated in (SAFE_ROTATED_DIMS, 48, 64, 128, 256):
        for sequence in (1, 2, 7):
            for groups in range(1, 5000, 37):
                assert block_dims(rotated // 2, sequence, groups)[2] <= 64
    assert block_dims((SAFE_ROTATED_DIMS - 2) // 2, 1, 128)[2] > 64  # and just under it, some do
