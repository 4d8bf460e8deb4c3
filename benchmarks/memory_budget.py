"""Does the process stay inside `--memory-budget-gb`? One long prompt read in chunks on a dummy checkpoint, then
MLX's own counters: peak, active and cached (freed buffers kept for reuse) memory against the budget, with the
engine holding MLX to the budget (`mlx_serve.memory_limits`) and, for comparison, with MLX's default limits put back
(the engine before it did this). MLX's CPU backend keeps only 32 MiB of freed buffers by default, its GPU backends as
much as their memory limit; the script sets the CPU's cache limit to its memory limit first, as on a GPU.

    python benchmarks/memory_budget.py --preset tiny --prompt 8192 --budget-gb 0.5
"""

from __future__ import annotations

import argparse
import tempfile
from pathlib import Path

import mlx.core as mx


def run(path: Path, prompt: int, budget_gb: float, hold: bool) -> dict:
    from mlx_serve.engine import Engine, EngineConfig
    from mlx_serve.types import GenerationRequest

    memory = mx.set_memory_limit(1 << 30)
    mx.set_memory_limit(memory)
    mx.set_cache_limit(memory)  # MLX's GPU backends' default
    engine = Engine.load(EngineConfig(model=str(path), memory_budget_gb=budget_gb, max_running=2,
                                      max_model_len=prompt + 64))  # fmt: skip
    if not hold:  # MLX's defaults, as before the engine set any limit
        engine.memory_limits.restore()
    mx.clear_cache()
    mx.reset_peak_memory()
    try:
        ids = tuple(10 + (i * 7919) % 1000 for i in range(prompt))
        engine.generate([GenerationRequest(prompt_ids=ids, max_tokens=8)])
        out = {"held": hold, "peak_gib": mx.get_peak_memory() / 2**30, "active_gib": mx.get_active_memory() / 2**30,
               "cache_gib": mx.get_cache_memory() / 2**30, "pool_gib": engine.pool.nbytes / 2**30}  # fmt: skip
    finally:
        engine.shutdown()
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--preset", default="tiny")
    parser.add_argument("--prompt", type=int, default=8192)
    parser.add_argument("--budget-gb", type=float, default=0.5)
    args = parser.parse_args()
    from mlx_serve.checkpoints import make_checkpoint

    with tempfile.TemporaryDirectory() as tmp:
        path = make_checkpoint(Path(tmp) / "m", arch="qwen3", preset=args.preset, seed=0)
        rows = [run(path, args.prompt, args.budget_gb, hold) for hold in (False, True)]
    print(f"qwen3 {args.preset}, one {args.prompt}-token prompt, budget {args.budget_gb:.2f} GiB")
    print(f"{'MLX held to the budget':24} {'peak':>8} {'active':>8} {'cache':>8} {'KV pool':>8}  (GiB)")
    for r in rows:
        print(f"{str(r['held']):24} {r['peak_gib']:8.3f} {r['active_gib']:8.3f} {r['cache_gib']:8.3f} {r['pool_gib']:8.3f}")


if __name__ == "__main__":
    main()
