"""Host-side arrays of the prefill contract."""

from __future__ import annotations

import numpy as np
import pytest

from mlx_serve.ane import contract
from mlx_serve.ane.pieces import pick_rows


def test_mask_sees_the_past_and_causal_chunk() -> None:
    mask = contract.attention_mask(start=3, rows=4, max_context=8)[0, 0]
    assert mask.shape == (4, 12) and mask.dtype == np.float16
    allowed = mask == 0
    assert allowed[:, :3].all() and not allowed[:, 3:8].any()  # past slots 0..2 only
    assert (allowed[:, 8:] == np.tril(np.ones((4, 4), bool))).all()


def test_pad_past_refuses_more_than_max_context() -> None:
    past = np.ones((1, 2, 5, 4), np.float16)
    padded = contract.pad_past(past, 8)
    assert padded.shape == (1, 2, 8, 4) and padded[:, :, :5].all() and not padded[:, :, 5:].any()
    with pytest.raises(ValueError):
        contract.pad_past(past, 4)


def test_channels_first_round_trip() -> None:
    rows = np.arange(12, dtype=np.float16).reshape(3, 4)
    packed = contract.channels_first(rows, 8)
    assert packed.shape == (1, 4, 1, 8)
    assert (contract.rows_last(packed, 3) == rows).all()


def test_pick_rows_prefers_the_smallest_that_fits() -> None:
    sizes = {16: None, 64: None}
    assert pick_rows(sizes, 5) == 16
    assert pick_rows(sizes, 17) == 64
    assert pick_rows(sizes, 100) == 64
