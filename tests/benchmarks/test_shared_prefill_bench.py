"""`benchmarks/shared_prefill.py` on a small burst: with the wait for a running prefill on, the system prompt's whole
blocks are computed once; off, once per request (all three are admitted in the same step)."""

from __future__ import annotations

from mlx_lm import load

from benchmarks.shared_prefill import burst, run_ours


def test_the_burst_computes_the_system_prompt_once_only_with_the_wait_on(tiny_qwen3):
    model, _ = load(str(tiny_qwen3))
    prompts = burst(300, 20, 3, model.args.vocab_size)
    assert len({tuple(p[:300]) for p in prompts}) == 1 and len({tuple(p[300:]) for p in prompts}) == 3
    on = run_ours(tiny_qwen3, prompts, 4, 256)
    off = run_ours(tiny_qwen3, prompts, 4, 0)
    assert on["prompt_rows"] == 320 + 2 * (320 - 288) and on["waits"] == 2  # 288: the prompt's 18 whole blocks
    assert off["prompt_rows"] == 3 * 320 and off["waits"] == 0
    assert 0 < on["ttft_mean_s"] <= on["ttft_max_s"] <= on["total_s"]
