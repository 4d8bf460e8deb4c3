"""The policy simulation runs end to end on a short synthetic trace and a recorded one."""

from __future__ import annotations

import importlib.util
import json
import sys
from pathlib import Path

import pytest

SIM_PATH = Path(__file__).resolve().parents[2] / "benchmarks" / "scheduler_sim.py"


def load_sim():
    spec = importlib.util.spec_from_file_location("scheduler_sim", SIM_PATH)
    module = importlib.util.module_from_spec(spec)
    sys.modules["scheduler_sim"] = module  # dataclasses look their module up there
    spec.loader.exec_module(module)
    return module


def test_simulation_prints_json_per_policy(capsys: pytest.CaptureFixture[str]) -> None:
    sim = load_sim()
    assert sim.main(["--duration-s", "8", "--policies", "ema,bucketed,ceiling-only", "--json"]) == 0
    report = json.loads(capsys.readouterr().out)
    assert set(report["policies"]) == {"ema", "bucketed", "ceiling-only"}
    for row in report["policies"].values():
        assert row["requests"] == report["arrivals"] and row["output_tok_per_s"] > 0


def test_simulation_replays_a_recorded_trace(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    sim = load_sim()
    trace = tmp_path / "arrivals.jsonl"
    rows = [{"t": 0.0, "prompt_tokens": 9000, "max_tokens": 20}, {"t": 0.1, "prompt_tokens": 50, "max_tokens": 20}]
    trace.write_text("\n".join(json.dumps(row) for row in rows))
    assert sim.main(["--trace", str(trace), "--policies", "ema"]) == 0
    table = capsys.readouterr().out
    assert "| ema |" in table and "2 arrivals" in table


def test_padded_costs_run_a_chunk_as_its_query_bucket_in_row_tiles() -> None:
    """With `kv_bucket`, a 300-row chunk beside 8 decode lanes costs its 384-row bucket, the step's 392 rows run as
    seven 64-row tiles (448), and the prefill's fixed cost is paid; without, the seed's exact formula."""
    import random

    from scheduler import LaneKind, StepPlan
    from scheduler.plan import Lane

    sim = load_sim()
    decode = tuple(Lane(f"s{i}", LaneKind.DECODE, (1,), 100, (), True) for i in range(8))
    chunk = Lane("long", LaneKind.PREFILL, (1,) * 300, 1000, (), False)
    plan = StepPlan(1, (*decode, chunk), 300, "halved:2", None, True)
    fields = {"fixed_ms": 5.0, "row_ms": 0.01, "pair_ms": 1e-6, "decode_lane_ms": 0.2, "noise": 0.0}
    exact = sim.CostFunction(**fields, prefill_fixed_ms=6.0).step_ms(plan, random.Random(0))
    padded = sim.CostFunction(**fields, prefill_fixed_ms=6.0, kv_bucket=1024, row_tile=64).step_ms(plan, random.Random(0))
    decode_pairs = 8 * 100.5
    assert exact == pytest.approx(5.0 + 0.01 * 308 + 1e-6 * (decode_pairs + 300 * 1150) + 0.2 * 8 + 6.0)
    assert padded == pytest.approx(5.0 + 0.01 * 448 + 1e-6 * (decode_pairs + 384 * 1150) + 0.2 * 8 + 6.0)


def test_row_granules_price_a_chunk_in_whole_granules() -> None:
    """`row_granule`: 384 and 512 rows cost one time (two 256-row granules each, as the H100's 4-bit kernels ran
    them), 640 one granule more; 1 (the default) prices every row."""
    import random

    from scheduler import LaneKind, StepPlan
    from scheduler.plan import Lane

    sim = load_sim()
    decode = tuple(Lane(f"s{i}", LaneKind.DECODE, (1,), 100, (), True) for i in range(8))

    def cost(rows: int, granule: int) -> float:
        chunk = Lane("long", LaneKind.PREFILL, (1,) * rows, 0, (), False)
        plan = StepPlan(1, (*decode, chunk), rows, "halved:2", None, True)
        return sim.CostFunction(row_ms=0.04, pair_ms=0.0, noise=0.0, row_granule=granule).step_ms(plan, random.Random(0))

    assert cost(384, 256) == cost(512, 256) == pytest.approx(cost(512, 1))
    assert cost(640, 256) - cost(512, 256) == pytest.approx(0.04 * 256)
    assert cost(512, 1) - cost(384, 1) == pytest.approx(0.04 * 128)


def test_the_contended_trace_runs_with_the_checked_fill_policy(capsys: pytest.CaptureFixture[str]) -> None:
    sim = load_sim()
    trace = SIM_PATH.parent / "traces" / "contended_16k.jsonl"
    policies = ["affine-auto-target", "affine-auto-target-checked-fill", "affine-auto-target-checked-wide"]
    argv = ["--trace", str(trace), "--policies", ",".join(policies), "--json", "--kv-bucket", "1024", "--row-tile", "64",
            "--ms-prefill-fixed", "6", "--ms-row", "0.024"]
    assert sim.main(argv) == 0
    report = json.loads(capsys.readouterr().out)
    assert report["arrivals"] == 9 and report["cost"]["kv_bucket"] == 1024
    assert list(report["policies"]) == policies
    for row in report["policies"].values():
        assert row["requests"] == 9 and row["long_ttft_mean_s"] > 0


def test_the_unchecked_baseline_does_not_follow_the_schedulers_default() -> None:
    """The figures RESULTS gives for `affine-auto-target` were made with the fill unchecked: the policy names that
    itself, so the scheduler's default (checked since the thirtieth run) does not change what it means."""
    from dataclasses import replace

    from mlx_serve.engine_setup import CHECKED_FLOOR_SLACK
    from scheduler import SchedulerConfig

    sim = load_sim()
    base = SchedulerConfig(num_blocks=64)
    assert replace(base, **sim.POLICIES["affine-auto-target"]).checked_fill == "off"
    wide = replace(base, **sim.POLICIES["affine-auto-target-checked-wide"])
    assert (wide.checked_fill, wide.floor_slack) == ("on", CHECKED_FLOOR_SLACK)


def test_untraced_shapes_cost_more_until_a_pass_has_met_them() -> None:
    """With `eager_extra_ms`, a step of decode lanes and one chunk costs that much more until its shape (query bucket,
    history bucket) is traced, which a pass that met it makes so at `settle`; the scheduler sees the same shapes."""
    import random

    from scheduler import LaneKind, StepPlan
    from scheduler.cost_models import PrefillChunk
    from scheduler.plan import Lane

    sim = load_sim()
    decode = tuple(Lane(f"s{i}", LaneKind.DECODE, (1,), 100, (), True) for i in range(8))
    plan = StepPlan(1, (*decode, Lane("long", LaneKind.PREFILL, (1,) * 300, 1000, (), False)), 300, "halved:2", None, True)
    cost = sim.CostFunction(noise=0.0, kv_bucket=1024, eager_extra_ms=12.0)
    traces = sim.SimTraces(1024)
    eager = cost.step_ms(plan, random.Random(0), eager=traces.meet(plan) is False)
    assert eager == pytest.approx(cost.step_ms(plan, random.Random(0)) + 12.0)
    assert not traces.traced([PrefillChunk(rows=300, history=1000)], list(decode))
    traces.settle()
    assert traces.traced([PrefillChunk(rows=260, history=1100)], list(decode))  # the same buckets: 384, 2048
    assert cost.step_ms(plan, random.Random(0), eager=traces.meet(plan) is False) == pytest.approx(eager - 12.0)


def test_a_shapes_first_eager_run_costs_more_and_counts_as_run() -> None:
    """With `first_run_ms`, an eager step of a shape never run eager pays it once more; after it the shape has run
    (`SimTraces.met`), as it has once traced; steps the engine never compiles are not tracked (met)."""
    import random

    from scheduler import LaneKind, StepPlan
    from scheduler.cost_models import PrefillChunk
    from scheduler.plan import Lane

    sim = load_sim()
    decode = tuple(Lane(f"s{i}", LaneKind.DECODE, (1,), 100, (), True) for i in range(8))
    plan = StepPlan(1, (*decode, Lane("long", LaneKind.PREFILL, (1,) * 300, 1000, (), False)), 300, "halved:2", None, True)
    chunk, later = [PrefillChunk(rows=300, history=1000)], [PrefillChunk(rows=300, history=5000)]
    cost = sim.CostFunction(noise=0.0, kv_bucket=1024, eager_extra_ms=1.0, first_run_ms=10.0)
    traces = sim.SimTraces(1024)
    assert not traces.met(chunk, list(decode)) and traces.met(chunk + later, list(decode))
    times = []
    for _ in range(2):
        first = traces.meet(plan) is False and traces.first_eager_run(plan)
        times.append(cost.step_ms(plan, random.Random(0), eager=True, first_run=first))
    assert times[0] == pytest.approx(times[1] + 10.0)
    assert traces.met(chunk, list(decode)) and not traces.met(later, list(decode))
    traces.want(later, list(decode))
    traces.settle()
    assert traces.met(later, list(decode))


def test_warm_passes_leave_the_measured_pass_its_own_counts() -> None:
    sim = load_sim()
    arrivals = sim.load_trace(SIM_PATH.parent / "traces" / "contended_16k.jsonl")
    cost = sim.CostFunction(kv_bucket=1024, row_tile=64, eager_extra_ms=12.0, prefill_fixed_ms=6.0, row_ms=0.024)
    config = sim.SchedulerConfig(num_blocks=16_384, max_model_len=1 << 20, kv_bucket=1024, pads_history=False,
                                 row_quantum=64, cost_model="affine", step_target_factor=3.0)
    result = sim.simulate(config, arrivals, cost, seed=0, warm_passes=2)
    assert result["stats"]["prefill_rows"] == sum(a.prompt_tokens for a in arrivals)  # one pass's prompts, no hits
    assert len(result["tracked"]) == len(arrivals) and all(item.token_times for item in result["tracked"].values())
    assert min(item.arrival.t for item in result["tracked"].values()) > 1.0  # after the warm passes and a pause
    assert 0 < result["end"] < max(item.token_times[-1] for item in result["tracked"].values())  # its own duration


def test_contended_figures_use_the_gpu_benchs_window() -> None:
    """The streams' gaps from 16 tokens before the long prompt's arrival to 16 after its first token: a long gap
    earlier in the streams' lives is outside the window, the one while the prompt is read is its maximum."""
    sim = load_sim()
    long = sim.Tracked(sim.Arrival(0.5, 16_384, 1), [0.62])
    streams = []
    for _ in range(2):
        times = [0.0, 0.1] + [0.1 + 0.01 * k for k in range(1, 60)]  # a 100 ms gap at the start, then 10 ms steps
        times = [t if t < 0.55 else t + 0.04 for t in times]  # one 50 ms gap while the prompt is read
        streams.append(sim.Tracked(sim.Arrival(0.0, 512, 100), times))
    result = {"tracked": {"long": long, "s0": streams[0], "s1": streams[1]}}
    figures = sim.contended_figures(result, long_threshold=4096)
    assert figures["gap_max_ms"] == pytest.approx(50.0)
    assert figures["gap_p50_ms"] == pytest.approx(10.0)
    assert figures["gap_ratio"] == pytest.approx(5.0)
    assert figures["long_ttft_s"] == pytest.approx(0.12) and figures["long_arrival"] is long.arrival
    assert sim.contended_figures({"tracked": {"s0": streams[0]}}, long_threshold=4096) is None  # no long prompt


def test_a_step_with_prefill_takes_at_least_its_host_submission() -> None:
    import random

    from scheduler import LaneKind, StepPlan
    from scheduler.plan import Lane

    sim = load_sim()
    decode = tuple(Lane(f"s{i}", LaneKind.DECODE, (1,), 100, (), True) for i in range(8))
    mixed = StepPlan(1, (*decode, Lane("long", LaneKind.PREFILL, (1,) * 64, 0, (), False)), 64, "halved:5", None, True)
    decode_only = StepPlan(2, decode, 0, "contended", None, True)
    cost = sim.CostFunction(fixed_ms=3.0, row_ms=0.001, pair_ms=0.0, decode_lane_ms=0.1, noise=0.0,
                            prefill_host_ms=8.0)
    assert cost.step_ms(mixed, random.Random(0)) == pytest.approx(8.0)
    assert cost.step_ms(decode_only, random.Random(0)) == pytest.approx(3.0 + 0.001 * 8 + 0.1 * 8)  # no floor


def test_an_uncontended_prefill_step_pays_the_solo_extra() -> None:
    import random

    from scheduler import LaneKind, StepPlan
    from scheduler.plan import Lane

    sim = load_sim()
    chunk = Lane("long", LaneKind.PREFILL, (1,) * 64, 0, (), False)
    solo = StepPlan(1, (chunk,), 64, "uncontended", None, True)
    mixed = StepPlan(2, (Lane("s", LaneKind.DECODE, (1,), 100, (), True), chunk), 64, "halved:5", None, True)
    plain = sim.CostFunction(fixed_ms=3.0, row_ms=0.01, pair_ms=0.0, decode_lane_ms=0.1, noise=0.0)
    dearer = sim.CostFunction(fixed_ms=3.0, row_ms=0.01, pair_ms=0.0, decode_lane_ms=0.1, noise=0.0, solo_extra_ms=6.0)
    assert dearer.step_ms(solo, random.Random(0)) == pytest.approx(plain.step_ms(solo, random.Random(0)) + 6.0)
    assert dearer.step_ms(mixed, random.Random(0)) == pytest.approx(plain.step_ms(mixed, random.Random(0)))


def test_a_stalled_step_adds_its_stall_and_no_stall_draws_nothing() -> None:
    import random

    from scheduler import LaneKind, StepPlan
    from scheduler.plan import Lane

    sim = load_sim()
    decode_only = StepPlan(0, tuple(Lane(f"d{i}", LaneKind.DECODE, (1,), 10, (0,), True) for i in range(8)), 0, "t",
                           None, True)  # fmt: skip
    calm = sim.CostFunction(fixed_ms=3.0, noise=0.1)
    stalled = sim.CostFunction(fixed_ms=3.0, noise=0.1, stall_rate=1.0, stall_ms=35.0)
    assert stalled.step_ms(decode_only, random.Random(5)) > calm.step_ms(decode_only, random.Random(5)) + 30.0
    never = sim.CostFunction(fixed_ms=3.0, noise=0.1, stall_rate=0.0, stall_ms=35.0)
    assert never.step_ms(decode_only, random.Random(5)) == calm.step_ms(decode_only, random.Random(5))


def test_the_contended_trace_reports_the_gap_ratio_and_ttft_against_solo(capsys: pytest.CaptureFixture[str]) -> None:
    sim = load_sim()
    trace = SIM_PATH.parent / "traces" / "contended_16k.jsonl"
    argv = ["--trace", str(trace), "--policies", "affine-auto-target-checked-fill", "--kv-bucket", "1024",
            "--ms-fixed", "3.4", "--ms-decode-lane", "0.1", "--ms-row", "0.002", "--ms-pair", "7.6e-7",
            "--ms-prefill-host", "8", "--set", "step_target_floor_ms=12"]
    assert sim.main([*argv, "--json"]) == 0
    figures = json.loads(capsys.readouterr().out)["policies"]["affine-auto-target-checked-fill"]["contended"]
    assert figures["gap_max_ms"] >= 8.0  # no step with prefill under its host submission
    assert figures["gap_ratio"] == pytest.approx(figures["gap_max_ms"] / figures["gap_p50_ms"])
    assert figures["long_ttft_vs_solo"] >= 1.0  # beside 8 streams the prompt is read no faster than alone
    assert sim.main(argv) == 0
    assert "window gap max / median" in capsys.readouterr().out


def test_set_overrides_a_config_field_over_every_policy() -> None:
    sim = load_sim()
    args = sim.parse_args(["--set", "floor_slack=1.25", "--set", "budget_midpoints=off", "--set", "row_floor=32"])
    assert dict(args.set) == {"floor_slack": 1.25, "budget_midpoints": False, "row_floor": 32}
    for bad in ("no_such_field=1", "floor_slack=", "row_floor=many", "budget_midpoints=flase"):
        with pytest.raises(SystemExit):
            sim.parse_args(["--set", bad])


def test_an_untraced_step_stands_in_for_a_larger_trace_run_within_its_limit() -> None:
    """With stand-ins, an untraced step of decode lanes and one chunk replays the traced shape of the fewest rows
    (then the nearest history bucket) at or past its own whose last run was within the step's limit, costing that
    trace's rows; the scheduler is told the most rows such a trace carries (`SimTraces.stand_in`), cut where its
    history bucket ends."""
    import random
    from dataclasses import replace

    from scheduler import LaneKind, StepPlan
    from scheduler.cost_models import PrefillChunk
    from scheduler.plan import Lane
    from scheduler.traced_shapes import StandIn

    sim = load_sim()
    decode = tuple(Lane(f"s{i}", LaneKind.DECODE, (1,), 100, (), True) for i in range(8))
    plan = StepPlan(1, (*decode, Lane("long", LaneKind.PREFILL, (1,) * 100, 1000, (), False)), 100, "halved:4", None,
                    True, limit_ms=10.0)  # fmt: skip
    traces = sim.SimTraces(1024, stand_ins=True, shapes={(384, 16384), (512, 4096), (1024, 4096)},
                           runs={(384, 16384): 9.0, (512, 4096): 9.5, (1024, 4096): 14.0})  # fmt: skip
    assert traces.stand_in_run(plan) == (384, 16384)  # 128 rows at 2048: fewest rows first
    chunk = [PrefillChunk(rows=100, history=1000)]
    assert traces.stand_in(chunk, list(decode), 10.0) == StandIn(512, 9.5)  # the most rows carried
    assert traces.stand_in([PrefillChunk(rows=100, history=3800)], list(decode), 10.0) == StandIn(384, 9.0)
    assert traces.stand_in(chunk, list(decode), 8.0) is None and traces.stand_in_run(replace(plan, limit_ms=8.0)) is None
    assert sim.SimTraces(1024, shapes=set(traces.shapes), runs=dict(traces.runs)).stand_in(chunk, list(decode), 10.0) is None
    cost = sim.CostFunction(noise=0.0, kv_bucket=1024, eager_extra_ms=12.0)
    wide = replace(plan, lanes=(*decode, Lane("long", LaneKind.PREFILL, (1,) * 384, 1000, (), False)))
    padded = cost.step_ms(sim._padded_to(plan, 384), random.Random(0))  # as the trace's rows, compiled
    assert padded == pytest.approx(cost.step_ms(wide, random.Random(0))) and padded > cost.step_ms(plan, random.Random(0))


def test_the_measured_run_starts_with_the_traces_given() -> None:
    """`simulate(traced=...)`: whatever the warm runs traced, the measured run starts with exactly those traces and
    runs; with stand-ins and the fill on, some contended step carries a stand-in's rows (reason `+stand-in`)."""
    sim = load_sim()
    arrivals = sim.load_trace(SIM_PATH.parent / "traces" / "contended_16k.jsonl")
    cost = sim.CostFunction(fixed_ms=2.8, row_ms=0.0026, pair_ms=6.2e-7, decode_lane_ms=0.1, noise=0.05,
                            kv_bucket=1024, eager_extra_ms=4.0, prefill_host_ms=6.0)  # fmt: skip
    # the fill alone: priced at its stand-in's run (`price_stand_in_runs`) a budget is that trace's rows already
    config = sim.SchedulerConfig(num_blocks=16_384, max_model_len=1 << 20, kv_bucket=1024, pads_history=False,
                                 cost_model="affine", step_target_factor=3.0, step_target_floor_ms=11.0,
                                 price_stand_in_runs=False)  # fmt: skip
    traced = {(64, 1024): 6.57, (384, 16384): 9.78, (512, 12288): 9.13, (768, 1024): 8.72}
    filled = []
    original = sim.Scheduler.schedule

    def schedule(scheduler, now):
        plan = original(scheduler, now)
        filled.append("+stand-in" in plan.budget_reason and not plan.lanes[0].request_id.startswith("w"))
        return plan

    sim.Scheduler.schedule = schedule
    try:
        result = sim.simulate(config, arrivals, cost, seed=1, warm_passes=2, stand_ins=True, traced=traced)
    finally:
        sim.Scheduler.schedule = original
    assert any(filled) and all(item.token_times for item in result["tracked"].values())


def test_priced_stand_in_runs_keep_steps_off_traces_slower_than_their_limit() -> None:
    """With the engine's eager-build bound (`stand_in_build_ms`), a stand-in may be a trace whose last run is over the
    step's limit (here the 1,024-row trace at the 12k bucket, 12.5 ms against ~9.9): without `price_stand_in_runs`
    the budget, priced eager, lets steps replay it; with it, no step does."""
    sim = load_sim()
    arrivals = sim.load_trace(SIM_PATH.parent / "traces" / "contended_16k.jsonl")
    cost = sim.CostFunction(fixed_ms=2.8, row_ms=0.0026, pair_ms=6.2e-7, decode_lane_ms=0.1, noise=0.05,
                            kv_bucket=1024, eager_extra_ms=4.0, prefill_host_ms=6.0)  # fmt: skip
    traced = {(64, 1024): 6.57, (384, 16384): 9.78, (512, 12288): 9.13, (768, 1024): 8.72, (1024, 12288): 12.5}
    original = sim.SimTraces.stand_in_run
    for priced in (False, True):
        config = sim.SchedulerConfig(num_blocks=16_384, max_model_len=1 << 20, kv_bucket=1024, pads_history=False,
                                     cost_model="affine", step_target_factor=3.0, step_target_floor_ms=11.0,
                                     price_stand_in_runs=priced)  # fmt: skip
        over: list[float] = []

        def stand_in_run(traces, plan, over=over):
            replayed = original(traces, plan)
            if replayed is not None and traces.runs[replayed] > plan.limit_ms:
                over.append(traces.runs[replayed])
            return replayed

        sim.SimTraces.stand_in_run = stand_in_run
        try:
            result = sim.simulate(config, arrivals, cost, seed=1, warm_passes=2, stand_ins=True, traced=traced,
                                  eager_build_ms=30.0)  # fmt: skip
        finally:
            sim.SimTraces.stand_in_run = original
        assert all(item.token_times for item in result["tracked"].values())
        assert bool(over) is not priced, over


def test_a_stand_ins_run_prices_the_next_stand_in() -> None:
    """A stand-in runs its trace as the trace runs for its own steps, so its time becomes the trace's last run: a
    trace last timed fast (8 ms, here under the ~9.9 ms limit) whose replays cost ~14 ms stands in once, not for
    every step of the prompt's start (H100, 30B-A3B: one 68.9 ms run priced eight replays of 73-81 ms). Replays
    left unrecorded (the engine before this) let it stand in again and again."""
    sim = load_sim()
    arrivals = sim.load_trace(SIM_PATH.parent / "traces" / "contended_16k.jsonl")
    cost = sim.CostFunction(fixed_ms=2.8, row_ms=0.0026, pair_ms=6.2e-7, decode_lane_ms=0.1, noise=0.05,
                            kv_bucket=1024, eager_extra_ms=4.0, prefill_host_ms=6.0)  # fmt: skip
    traced = {(64, 1024): 6.57, (384, 16384): 9.78, (512, 12288): 9.13, (768, 1024): 8.72, (1024, 12288): 8.0}
    config = sim.SchedulerConfig(num_blocks=16_384, max_model_len=1 << 20, kv_bucket=1024, pads_history=False,
                                 cost_model="affine", step_target_factor=3.0, step_target_floor_ms=11.0)  # fmt: skip
    original_run, original_record = sim.SimTraces.stand_in_run, sim.SimTraces.record_run
    replays_by_recorded = {}
    for recorded in (True, False):
        replays: list[int] = []

        def stand_in_run(traces, plan, replays=replays):
            replayed = original_run(traces, plan)
            if replayed == (1024, 12288):
                replays.append(plan.step_id)
            return replayed

        def record_run(traces, plan, elapsed_ms, replayed=None, recorded=recorded):
            if replayed is None or recorded:
                original_record(traces, plan, elapsed_ms, replayed)

        sim.SimTraces.stand_in_run, sim.SimTraces.record_run = stand_in_run, record_run
        try:
            result = sim.simulate(config, arrivals, cost, seed=1, warm_passes=2, stand_ins=True, traced=traced)
        finally:
            sim.SimTraces.stand_in_run, sim.SimTraces.record_run = original_run, original_record
        assert all(item.token_times for item in result["tracked"].values())
        replays_by_recorded[recorded] = len(replays)
    assert replays_by_recorded[True] == 1 and replays_by_recorded[False] > 3, replays_by_recorded
