"""Decode steps write the KV pool in place while a step is in flight.

MLX donates an array to the scatter that writes it only where no queued work still holds it; a step left in flight
holds every pool layer it read, so the next step's writes, queued behind it, would copy each layer instead (GPT-2 on
the CPU: decode steps 5x slower, a layer's K and V above the budget). The runner queues such a step once the one in
flight is done (`ModelRunner._queue`); these tests hold the memory that proves the writes stayed in place."""

from __future__ import annotations

from pathlib import Path

import mlx.core as mx
import pytest

from mlx_serve.engine import Engine, EngineConfig
from mlx_serve.types import GenerationRequest
from tests.engine.reference import prompt_of, reference_tokens

BLOCKS = 4096  # a pool layer's K: 4,096 x 16 tokens x 4 heads x 32 x 4 bytes = 32 MiB


@pytest.fixture(scope="module")
def tiny_gpt2(tmp_path_factory: pytest.TempPathFactory) -> Path:
    from mlx_serve.checkpoints import make_checkpoint

    # GPT-2 in float32 is where the copies showed: its steps fell behind the host every time
    return make_checkpoint(tmp_path_factory.mktemp("gpt2") / "gpt2", arch="gpt2", preset="tiny", seed=3,
                           dtype="float32")  # fmt: skip


def peak_above_loaded(engine: Engine, requests: list[GenerationRequest]) -> tuple[int, list]:
    """Bytes the generation held above the weights and the pool, and its completions."""
    engine.generate(requests[:2])  # the shapes' first builds
    loaded = mx.get_active_memory()
    mx.reset_peak_memory()
    done = engine.generate(requests)
    return mx.get_peak_memory() - loaded, done


@pytest.mark.parametrize("pipeline", [True, False])
def test_pipelined_decode_steps_write_the_pool_in_place(tiny_gpt2, pipeline):
    engine = Engine.load(EngineConfig(model=str(tiny_gpt2), kv_blocks=BLOCKS, max_running=16, pipeline=pipeline))
    prompts = [prompt_of(40 + i, seed=700 + i) for i in range(16)]
    requests = [GenerationRequest(prompt_ids=tuple(p), max_tokens=24) for p in prompts]
    try:
        layer_bytes = engine.pool.keys[0].nbytes
        above, done = peak_above_loaded(engine, requests)
    finally:
        engine.shutdown()
    assert layer_bytes == BLOCKS * 16 * 4 * 32 * 4 + 16 * 4 * 32 * 4  # the blocks and the scratch block
    # a copied layer would hold its K (or V) twice: the step's own arrays are far below one
    assert above < layer_bytes // 2, f"{above / 2**20:.1f} MiB above the pool: a layer was copied"
    for prompt, completion in zip(prompts[:3], done[:3]):
        assert list(completion.token_ids) == reference_tokens(tiny_gpt2, prompt, 24)
