"""The metrics object on its own: observer calls fill histograms, engine stats are read at scrape time,
and each instance has its own registry (two servers in one process do not collide)."""

from __future__ import annotations

from prometheus_client.parser import text_string_to_metric_families

from mlx_serve.server.metrics import ServerMetrics


def _samples(metrics: ServerMetrics) -> dict[str, float]:
    text = metrics.exposition().decode()
    return {s.name + str(sorted(s.labels.items())): s.value
            for f in text_string_to_metric_families(text) for s in f.samples}


def test_observer_calls_and_stats_show_up_in_the_exposition():
    stats = {"queue_depth": 3, "running": 2, "kv_blocks_total": 100, "kv_blocks_used": 40, "kv_blocks_cached": 7,
             "prefix_hit_tokens_total": 30, "prompt_tokens_total": 90, "generation_tokens_total": 12,
             "steps_total": 9, "budget_halvings_total": 2, "preemptions_total": 1}
    metrics = ServerMetrics()
    metrics.watch(lambda: stats)
    metrics.on_step(elapsed_ms=120.0, rows=70, prefill_rows=64, decode_lanes=6, budget_halvings=1)
    metrics.on_first_token(0.25)
    metrics.on_token_gap(0.02)
    metrics.on_finish("stop", prompt_tokens=5, completion_tokens=3, cached_tokens=0)
    samples = _samples(metrics)
    assert samples["mlx_serve_queue_depth[]"] == 3
    assert samples["mlx_serve_kv_blocks_used[]"] == 40
    assert samples["mlx_serve_budget_halvings_total[]"] == 2
    assert samples["mlx_serve_prefix_hit_rate[]"] == 30 / 120
    assert samples["mlx_serve_step_seconds_sum[]"] == 0.12
    assert samples["mlx_serve_prefill_rows_total[]"] == 64
    assert samples["mlx_serve_time_to_first_token_seconds_count[]"] == 1
    assert samples["mlx_serve_inter_token_seconds_count[]"] == 1
    assert samples["mlx_serve_requests_finished_total[('reason', 'stop')]"] == 1
    stats["queue_depth"] = 0  # read again at the next scrape
    assert _samples(metrics)["mlx_serve_queue_depth[]"] == 0


def test_two_instances_keep_separate_registries():
    first, second = ServerMetrics(), ServerMetrics()
    first.watch(lambda: {"running": 1})
    second.watch(lambda: {"running": 5})
    first.on_first_token(1.0)
    assert _samples(first)["mlx_serve_running_requests[]"] == 1
    assert _samples(second)["mlx_serve_running_requests[]"] == 5
    assert _samples(second)["mlx_serve_time_to_first_token_seconds_count[]"] == 0
