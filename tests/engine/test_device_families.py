"""On MLX's CUDA backend (the device machine): families whose layers step around the CUDA fast paths (recurrent layers
through regrouped mixers, multi-head latent attention per lane group) give mlx-lm's tokens with every auto setting as
it resolves there (KV buckets, the paged kernels for their attention layers, the table gather, compiled steps where
they apply). Their CPU counterparts are `test_recurrent.py` and `test_mla_attention.py`.

    python -m pytest -q -m device tests/engine/test_device_families.py
"""

from __future__ import annotations

import mlx.core as mx
import pytest

from mlx_serve.checkpoints import make_checkpoint
from mlx_serve.engine import Engine, EngineConfig
from mlx_serve.types import GenerationRequest
from tests.engine.reference import prompt_of, reference_tokens, run_staggered

pytestmark = [
    pytest.mark.device,
    pytest.mark.skipif(not mx.cuda.is_available(), reason="needs MLX's CUDA backend (the device machine)"),
]


@pytest.mark.parametrize("family", ["qwen3_next", "qwen3_5", "lfm2", "granitemoehybrid", "nemotron_h", "falcon_h1", "jamba",
                                    "deepseek_v3", "glm4_moe_lite", "llama4", "deepseek_v2", "mistral4", "gemma4"])  # fmt: skip
def test_a_family_beside_the_cuda_fast_paths_gives_mlx_lms_tokens(tmp_path, family):
    path = make_checkpoint(tmp_path / family, arch=family, seed=6)
    prompts = [prompt_of(n, seed=800 + i) for i, n in enumerate((9, 300, 40, 1))]
    engine = Engine.load(EngineConfig(model=str(path), row_ceiling=128, row_floor=16))
    try:
        tokens = run_staggered(engine, prompts, first=1, max_tokens=12)
        follow = prompts[1] + prompt_of(20, seed=810)  # a prefix hit (a snapshot, for a recurrent model)
        [again] = engine.generate([GenerationRequest(prompt_ids=tuple(follow), max_tokens=8)])
    finally:
        engine.shutdown()
    for i, prompt in enumerate(prompts):
        assert tokens[i] == reference_tokens(path, prompt, 12), f"prompt {i}"
    assert list(again.token_ids) == reference_tokens(path, follow, 8)
