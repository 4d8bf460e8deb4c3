"""What the engine reports about itself: `/v1/status`, the `/metrics` numbers, the allocation at start."""

from __future__ import annotations

from typing import Any

from scheduler import Request, RequestState, Scheduler

_PHASES = {
    RequestState.WAITING: "waiting",
    RequestState.PREFILLING: "prefilling",
    RequestState.DECODING: "decoding",
    RequestState.PREEMPTED: "preempted",
}


def request_status(r: Request) -> dict:
    return {
        "id": r.request_id,
        "phase": _PHASES.get(r.state, "finished"),
        "priority": int(r.priority),
        "prompt_tokens": r.num_prompt_tokens,
        "computed_tokens": min(r.num_computed, r.num_prompt_tokens),
        "output_tokens": len(r.output_ids),
        "cached_tokens": r.num_cached_tokens,
        "arrival_s": r.arrival_time,
    }


def status(scheduler: Scheduler, model_id: str, block_size: int) -> dict:
    stats, blocks = scheduler.stats, scheduler.blocks
    return {
        "model": model_id,
        "requests": [request_status(r) for r in scheduler.requests()],
        "counters": {
            "steps": stats.steps,
            "prefill_rows": stats.prefill_rows,
            "decode_rows": stats.decode_rows,
            "contended_prefill_rows": stats.contended_prefill_rows,
            "preemptions": stats.preemptions,
            "budget_halvings": stats.budget_halvings,
            "traces_wanted": stats.traces_wanted,
            "prefix_hit_tokens": stats.prefix_hit_tokens,
            "recalled_hash_blocks": stats.recalled_hash_blocks,
            "shared_prefill_waits": stats.shared_prefill_waits,
            "draft_tokens": stats.draft_tokens,
            "accepted_draft_tokens": stats.accepted_draft_tokens,
        },
        "step_target_ms": round(scheduler.step_target.ms, 2),  # the one contended steps are cut to now
        "kv": {
            "blocks_total": blocks.num_blocks,
            "blocks_used": blocks.num_used_blocks,
            "blocks_cached": blocks.num_cached_blocks,
            "block_size": block_size,
        }
        | _window_space(scheduler),
    }


def _window_space(scheduler: Scheduler) -> dict:
    """The window space's blocks (sliding-window layers), where the pool has one."""
    windows = scheduler.window_space
    if windows is None:
        return {}
    return {"window_blocks_total": windows.num_blocks, "window_blocks_used": windows.num_used_blocks,
            "window_blocks_cached": windows.num_cached_blocks, "window_tokens": scheduler.config.window_tokens}


def stats(scheduler: Scheduler, prompt_tokens: int, generation_tokens: int) -> dict:
    s, blocks = scheduler.stats, scheduler.blocks
    return {
        "queue_depth": scheduler.num_waiting,
        "running": scheduler.num_running,
        "kv_blocks_total": blocks.num_blocks,
        "kv_blocks_used": blocks.num_used_blocks,
        "kv_blocks_cached": blocks.num_cached_blocks,
        **{key: value for key, value in _window_space(scheduler).items() if key != "window_tokens"},
        "prefix_hit_tokens_total": s.prefix_hit_tokens,
        "prefix_hashes_recalled_total": s.recalled_hash_blocks,
        "shared_prefill_waits_total": s.shared_prefill_waits,
        "prompt_tokens_total": prompt_tokens,
        "generation_tokens_total": generation_tokens,
        "steps_total": s.steps,
        "budget_halvings_total": s.budget_halvings,
        "traces_wanted_total": s.traces_wanted,
        "preemptions_total": s.preemptions,
        "draft_tokens_total": s.draft_tokens,
        "accepted_draft_tokens_total": s.accepted_draft_tokens,
    }


def allocation_summary(model_id: str, weight_bytes: int, pool: Any, context: int) -> str:
    """Weights and the KV pool, in real bytes (quantized weights included); a token's bytes are its full-attention
    layers' where a window space holds the others."""
    tokens = pool.num_blocks * pool.block_size
    bytes_per_token, windows = pool.layout.bytes_per_token(), ""
    kind = "chunked-attention" if pool.layout.chunked else "sliding-window"
    if pool.window_blocks:
        windowed = pool.layout.windowed_bytes_per_token()
        bytes_per_token -= windowed
        windows = (f"; {kind} layers {pool.window_blocks} blocks ({pool.window_blocks * pool.block_size} "
                   f"tokens, {windowed} bytes/token)")  # fmt: skip
    elif pool.layout.num_windowed:  # auto found no split that costs no mix of requests anything (or it was turned off)
        windows = f"; {kind} layers keep every token's KV (--window-kv-tokens N holds them to N tokens)"
    quantized = f", {pool.layout.bits}-bit KV" if pool.layout.quantized else ""
    return (
        f"{model_id}: weights {size_text(weight_bytes)}; KV pool {size_text(pool.nbytes)} = {pool.num_blocks} blocks x "
        f"{pool.block_size} tokens ({tokens} tokens, {bytes_per_token} bytes/token{quantized}){windows}; context "
        f"{context} tokens"
    )


def size_text(nbytes: int) -> str:
    return f"{nbytes / (1 << 30):.2f} GiB" if nbytes >= 1 << 30 else f"{nbytes / (1 << 20):.1f} MiB"
