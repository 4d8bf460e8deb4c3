"""The 4-bit dequantize kernel (CUDA) against `mx.dequantize`, and the dense product it serves; on the CPU, a
numpy emulation of its two thread mappings (which words each thread takes, where they land, their groups)."""

from __future__ import annotations

import mlx.core as mx
import numpy as np
import pytest

from mlx_serve import quantized_rows
from mlx_serve.kernels import dequantize, quantized_tiles

on_cuda = pytest.mark.skipif(not mx.cuda.is_available(), reason="the dequantize kernel needs MLX's CUDA backend")


def _quantized(n: int, k: int, group_size: int, seed: int) -> tuple[mx.array, mx.array, mx.array]:
    rng = np.random.default_rng(seed)
    weight = mx.array((rng.standard_normal((n, k)) * 0.05).astype(np.float32)).astype(mx.bfloat16)
    return mx.quantize(weight, group_size=group_size, bits=4)


MAPPINGS = [(1, 0), (4, 0), (8, 0), (4, 1), (8, 1)]  # (WORDS_PER_THREAD, CONTIGUOUS)


def _emulate(slices: int, n: int, words: int, group_size: int, vec: int, contiguous: bool):
    """The kernel's index expressions for every thread of a launch: (slice, flat word, output element, group)
    of each word a thread turns into bf16."""
    threads, wg = dequantize.THREADS, group_size // 8
    total, groups, k = n * words, words // wg, slices * words * 8
    blocks = -(-n * words // (vec * threads))
    done = []
    for s in range(slices):
        for thread in range(blocks * threads):
            if contiguous:
                f = thread * vec
                if f >= total:
                    continue
                row, word = divmod(f, words)
                for v in range(vec // 4):
                    group = (s * n + row) * groups + (word + 4 * v) // wg
                    for i in range(4):
                        done.append((s, f + 4 * v + i, row * k + s * words * 8 + (word + 4 * v + i) * 8, group))
            else:
                base = (thread & ~31) * vec + (thread & 31)
                row, word = divmod(base, words)
                for j in range(vec):
                    if j > 0:
                        word += 32
                        while word >= words:
                            word, row = word - words, row + 1
                    if base + 32 * j < total:
                        done.append((s, base + 32 * j, row * k + s * words * 8 + word * 8, (s * n + row) * groups + word // wg))
    return done


@pytest.mark.parametrize(("vec", "contiguous"), MAPPINGS)
@pytest.mark.parametrize(("slices", "n", "k", "group_size"),
                         [(1, 8, 4096, 64), (8, 16, 4096, 128), (3, 5, 96 * 3, 32), (2, 7, 256, 64), (1, 3, 64, 32)])  # fmt: skip
def test_every_word_lands_once_where_mx_dequantize_puts_it(vec, contiguous, slices, n, k, group_size) -> None:
    """Each packed word of each slice is taken by exactly one thread, written at row n, column slice * Ks + 8 *
    word of the `[N, K]` output, with its own row's group; slice rows of any length (3 words, 12, 64, 512)."""
    words = k // slices // 8
    if contiguous and words % vec:
        pytest.skip("the launcher takes the interleaved mapping here (`mapping`)")
    done = _emulate(slices, n, words, group_size, vec, bool(contiguous))
    taken = sorted((s, f) for s, f, _, _ in done)
    assert taken == [(s, f) for s in range(slices) for f in range(n * words)]
    for s, f, at, group in done:
        row, word = divmod(f, words)
        assert at == row * k + s * words * 8 + word * 8
        assert group == (s * n + row) * (k // slices // group_size) + word * 8 // group_size


def test_the_contiguous_mapping_falls_back_where_rows_do_not_divide(monkeypatch) -> None:
    monkeypatch.setattr(dequantize, "CONTIGUOUS", 1)
    monkeypatch.setattr(dequantize, "WORDS_PER_THREAD", 8)
    assert dequantize.mapping(512) == (8, True)
    assert dequantize.mapping(12) == (8, False)  # K of 96 a slice: 12 words, not a multiple of 8
    monkeypatch.setattr(dequantize, "WORDS_PER_THREAD", 1)
    assert dequantize.mapping(512) == (1, False)
    monkeypatch.setattr(dequantize, "CONTIGUOUS", 0)
    monkeypatch.setattr(dequantize, "WORDS_PER_THREAD", 8)
    assert dequantize.mapping(512) == (8, False)


@pytest.mark.device
@on_cuda
@pytest.mark.parametrize("n,k", [(128, 128), (4096, 4096), (1024, 12288)])
@pytest.mark.parametrize("group_size", dequantize.GROUP_SIZES)
def test_equals_mlx_dequantize_bit_for_bit(n, k, group_size) -> None:
    weight, scales, biases = _quantized(n, k, group_size, seed=n + k + group_size)
    got = dequantize.dequantize_4bit(weight, scales, biases, group_size)
    want = mx.dequantize(weight, scales, biases, group_size, 4)
    assert got.shape == (n, k) and got.dtype == mx.bfloat16
    assert mx.array_equal(got, want).item()


@pytest.mark.device
@on_cuda
@pytest.mark.parametrize("splits", [2, 8])
def test_weights_split_over_k_come_out_whole(splits) -> None:
    """`quantized_rows.split_k`'s `[S, N, K/S]` layout gives the whole weight's `[N, K]`."""
    weight, scales, biases = _quantized(512, 4096, 64, seed=splits)
    parts = [mx.contiguous(a.reshape(a.shape[0], splits, -1).swapaxes(0, 1)) for a in (weight, scales, biases)]
    got = dequantize.dequantize_4bit(*parts, 64)
    assert mx.array_equal(got, mx.dequantize(weight, scales, biases, 64, 4)).item()


@pytest.mark.device
@on_cuda
@pytest.mark.parametrize("rows", [quantized_tiles.DENSE_FROM_ROWS, 1000])
def test_many_rows_run_dense_and_equal_dequantize_then_matmul(rows) -> None:
    weight, scales, biases = _quantized(4096, 4096, 64, seed=rows)
    x = mx.random.normal((rows, 4096), key=mx.random.key(rows)).astype(mx.bfloat16)
    got = quantized_tiles.many_rows_matmul(x, weight, scales, biases, 64)
    want = quantized_rows.reference_matmul(x, weight, scales, biases, 64, 4)
    assert mx.array_equal(got, want).item()


@pytest.mark.device
@on_cuda
@pytest.mark.parametrize(("vec", "contiguous"), MAPPINGS)
@pytest.mark.parametrize("group_size", dequantize.GROUP_SIZES)
@pytest.mark.parametrize("splits", [1, 2, 8])
def test_every_mapping_equals_mlx_dequantize_bit_for_bit(monkeypatch, vec, contiguous, group_size, splits) -> None:
    """Whole and split layouts of 8B-like rows (K 4,096, 1,000 rows: a ragged last block)."""
    monkeypatch.setattr(dequantize, "WORDS_PER_THREAD", vec)
    monkeypatch.setattr(dequantize, "CONTIGUOUS", contiguous)
    weight, scales, biases = _quantized(1000, 4096, group_size, seed=vec + group_size + splits)
    parts = [mx.contiguous(a.reshape(a.shape[0], splits, -1).swapaxes(0, 1)) for a in (weight, scales, biases)]
    got = dequantize.dequantize_4bit(*(parts if splits > 1 else (weight, scales, biases)), group_size)
    assert mx.array_equal(got, mx.dequantize(weight, scales, biases, group_size, 4)).item()


@pytest.mark.device
@on_cuda
@pytest.mark.parametrize(("vec", "contiguous"), MAPPINGS)
@pytest.mark.parametrize(("n", "k", "group_size", "splits"),
                         [(3, 64, 32, 1), (5, 96, 32, 1), (7, 288, 32, 3), (129, 192, 64, 1), (33, 1536, 128, 3)])  # fmt: skip
def test_odd_shapes_equal_mlx_dequantize(monkeypatch, vec, contiguous, n, k, group_size, splits) -> None:
    """Rows of 8 to 192 words, slices of 96 columns, row counts no block divides; the contiguous mapping falls
    back to the interleaved one where a slice row's words are not a multiple of its width."""
    monkeypatch.setattr(dequantize, "WORDS_PER_THREAD", vec)
    monkeypatch.setattr(dequantize, "CONTIGUOUS", contiguous)
    weight, scales, biases = _quantized(n, k, group_size, seed=n + k)
    parts = [mx.contiguous(a.reshape(a.shape[0], splits, -1).swapaxes(0, 1)) for a in (weight, scales, biases)]
    got = dequantize.dequantize_4bit(*(parts if splits > 1 else (weight, scales, biases)), group_size)
    assert mx.array_equal(got, mx.dequantize(weight, scales, biases, group_size, 4)).item()


@pytest.mark.device
@on_cuda
@pytest.mark.parametrize("contiguous", [0, 1])
def test_a_view_at_an_odd_offset_dequantizes_as_its_copy(monkeypatch, contiguous) -> None:
    """Packed words that start 4 bytes into their buffer (a row-contiguous view, passed without a copy): the
    contiguous mapping's 16-byte loads would be misaligned, so it reads 4 bytes at a time there."""
    monkeypatch.setattr(dequantize, "CONTIGUOUS", contiguous)
    weight, scales, biases = _quantized(256, 1024, 64, seed=5)
    flat = mx.concatenate([mx.zeros((1,), mx.uint32), weight.reshape(-1)])
    shifted = flat[1:].reshape(weight.shape)  # the same words, 4 bytes past the buffer's start
    got = dequantize.dequantize_4bit(shifted, scales, biases, 64)
    assert mx.array_equal(got, mx.dequantize(weight, scales, biases, 64, 4)).item()
