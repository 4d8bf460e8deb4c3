"""`CompiledMixed`: decode lanes and one prefill chunk through a compiled trace of the fused forward, with every
dimension padded to a bucket. On the CPU with the CUDA layout (history in buckets read through the block table by
the kernel's plain-MLX twin): the same tokens and log-probabilities as the eager steps, and mlx-lm's greedy tokens
through the engine."""

from __future__ import annotations

import time
from dataclasses import replace
from types import SimpleNamespace

import mlx.core as mx
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from mlx_lm import load

from mlx_serve import engine_setup
from mlx_serve.compiled_mixed import EAGER_BUILDS_KEPT, CompiledMixed, TracedMixedShapes, neighbour_shapes
from mlx_serve.engine import Engine, EngineConfig
from mlx_serve.errors import InvalidRequest
from mlx_serve.kernels.paged_attention import select_decode_attention
from mlx_serve.kernels.paged_gather import table_gather
from mlx_serve.kv_pool import KVLayout, KVPool
from mlx_serve.runner import ModelRunner
from mlx_serve.types import GenerationRequest, SamplingParams
from scheduler.buckets import history_bucket, query_bucket, query_buckets
from scheduler.cost_models import PrefillChunk
from scheduler.plan import PENDING_TOKEN, Lane, LaneKind, StepOutcome, StepPlan
from scheduler.traced_shapes import StandIn
from tests.engine.reference import generate_in_cuda_layout, prompt_of, reference_tokens
from tracing.events import StepExecuted
from tracing.sink import MemorySink

DECODE = ("a", "b", "c")  # three decode lanes: padded to four


def _blocks(index: int) -> tuple[int, ...]:
    return tuple(range(8 * index, 8 * index + 8))  # 128 tokens a request


def _prefill_decode_lanes(runner: ModelRunner, others: tuple[str, ...]):
    """Add the decode lanes' requests and `others` (greedy, 2 log-probabilities) and prefill the decode lanes' short
    prompts in one step: its output, and each decode lane's end."""
    prompts = {rid: prompt_of(9 + 4 * i, seed=160 + i) for i, rid in enumerate(DECODE)}
    for rid in (*DECODE, *others):
        runner.add_request(rid, SamplingParams(temperature=0.0, logprobs=2))
    first = StepPlan(0, tuple(Lane(rid, LaneKind.PREFILL, tuple(p), 0, _blocks(i), True)
                              for i, (rid, p) in enumerate(prompts.items())), 40, "t", None, False)  # fmt: skip
    return runner.execute(first), {rid: len(p) for rid, p in prompts.items()}


def _steps(runner: ModelRunner, outcomes: list[StepOutcome] | None = None) -> list[tuple[str, int, float]]:
    """Prefill the decode lanes, then a 100-token prompt in chunks of 30 (the last one samples) beside them, a step
    queued while the previous one is in flight (pending tokens), then a chunk alone; every sample, in order.
    `outcomes` collects each chunk step's outcome (`auxiliary`: it traced a shape; `compiled`: it replayed one)."""
    samples: list[tuple[str, int, float]] = []

    def record(out) -> None:
        samples.extend((rid, s.token_id, s.logprob) for rid, s in sorted(out.samples.items()))
        if outcomes is not None and out is not first_out:
            outcomes.append(out.outcome)

    first_out = None

    long_prompt, alone = prompt_of(100, seed=170), prompt_of(40, seed=171)
    out, ends = _prefill_decode_lanes(runner, ("p", "q"))
    first_out = out
    record(out)
    tokens = {rid: out.samples[rid].token_id for rid in DECODE}
    in_flight = None
    for step, start in enumerate(range(0, 100, 30), start=1):
        chunk = tuple(long_prompt[start : start + 30])
        pending = in_flight is not None
        lanes = tuple(Lane(rid, LaneKind.DECODE, (PENDING_TOKEN if pending else tokens[rid],), ends[rid], _blocks(i), True)
                      for i, rid in enumerate(DECODE))  # fmt: skip
        plan = StepPlan(step, (*lanes, Lane("p", LaneKind.PREFILL, chunk, start, _blocks(3), start + 30 >= 100)),
                        30, "t", None, True)  # fmt: skip
        current = runner.submit(plan, in_flight)
        if in_flight is not None:
            record(runner.collect(in_flight))
        if step % 2:  # every other step waits: its tokens feed the next plan directly
            out = runner.collect(current)
            record(out)
            tokens.update({rid: out.samples[rid].token_id for rid in DECODE})
            in_flight = None
        else:
            in_flight = current
        ends = {rid: end + 1 for rid, end in ends.items()}
    if in_flight is not None:
        record(runner.collect(in_flight))
    out = runner.execute(StepPlan(9, (Lane("q", LaneKind.PREFILL, tuple(alone), 0, _blocks(4), True),), 40, "t", None,
                                  False))  # fmt: skip
    record(out)
    return samples


def _runner(
    model, compile_mixed: bool, fuse_mixed: bool = True, defer: bool = False, chunk=None, blocks: int = 48
) -> ModelRunner:
    args = model.args
    layout = KVLayout(args.num_hidden_layers, args.num_key_value_heads, args.head_dim, mx.float32)
    return ModelRunner(model, KVPool(layout, blocks, 16), select_decode_attention("auto"), kv_bucket=32,
                       compile_decode=True, fuse_decode=True, fuse_mixed=fuse_mixed, compile_mixed=compile_mixed,
                       defer_mixed_traces=defer, prefill_gather=table_gather, chunk_attention=chunk)  # fmt: skip


def test_compiled_and_eager_steps_with_paged_chunk_attention_equal_the_gathered_ones(tiny_qwen3):
    """Chunks attending through the paged reference (the pool read through the table, causal by each row's
    position: traced positions in the compiled step, padded query positions in the eager one) give the logits of
    the gathered, masked attention, compiled and eager."""
    model, _ = load(str(tiny_qwen3))
    reference = engine_setup.chunk_attention("paged")
    calls = []

    def attend(q, *args, **kwargs):
        calls.append(q.shape[2])
        return reference.attend(q, *args, **kwargs)

    paged = replace(reference, attend=attend)
    gathered = _steps(_runner(model, compile_mixed=False))
    for compile_mixed in (True, False):
        calls.clear()
        steps = _steps(_runner(model, compile_mixed=compile_mixed, chunk=paged))
        assert calls, "no chunk read the pool itself"
        assert [s[:2] for s in steps] == [s[:2] for s in gathered]
        for a, b in zip(steps, gathered):
            assert abs(a[2] - b[2]) < 1e-4, (compile_mixed, a, b)


@pytest.mark.parametrize("fixture", ["tiny_qwen3", "tiny_qwen3_moe"])
def test_compiled_mixed_steps_equal_the_eager_steps(fixture, request):
    model, _ = load(str(request.getfixturevalue(fixture)))
    compiled_runner = _runner(model, compile_mixed=True)
    outcomes: list[StepOutcome] = []
    compiled = _steps(compiled_runner, outcomes)
    eager = _steps(_runner(model, compile_mixed=False))
    modules = _steps(_runner(model, compile_mixed=False, fuse_mixed=False))
    assert [s[:2] for s in compiled] == [s[:2] for s in eager] == [s[:2] for s in modules]
    for a, b in zip(compiled, eager):
        assert abs(a[2] - b[2]) < 1e-4, (a, b)
    shapes = compiled_runner.compiled_mixed.shapes
    # 3 lanes padded to 4 (2 blocks each), 30-row chunks to 64 rows, histories of 32-128 tokens; the chunk alone
    assert (4, 2, 64, 32) in shapes and (4, 2, 64, 128) in shapes and (0, 1, 64, 64) in shapes
    assert len(shapes) < 6  # four chunk steps and the lone chunk: shapes repeat
    one_offs = [o.auxiliary for o in outcomes]
    assert sum(one_offs) == len(shapes) and one_offs[0]  # the steps that traced (and first ran) a shape say so
    assert all(o.compiled for o in outcomes)  # traced at first use: every chunk step ran compiled


def test_deferred_shapes_run_eager_until_traced_then_replay(tiny_qwen3):
    """With traces deferred, a shape's steps take the eager forward until `trace_deferred` traces each shape met,
    without evaluating anything; the same steps then replay the traces with the eager steps' tokens. An eager step
    on a padded shape met for the first time is one-off (its time holds first-use builds: the cost model does not
    learn it); the next of that shape is an ordinary step. So is a traced shape's first real run: the trace
    evaluated nothing, so the first step that replays it may pay first-use work."""
    model, _ = load(str(tiny_qwen3))
    runner = _runner(model, compile_mixed=True, defer=True)
    eager_outcomes: list[StepOutcome] = []
    eager = _steps(runner, eager_outcomes)
    mixed = runner.compiled_mixed
    assert not mixed.shapes and len(eager_outcomes) == 5
    assert not any(o.compiled for o in eager_outcomes)
    # chunks ending at 30, 60, 90, 100 tokens: history buckets 32, 64, 128, 128; then the chunk alone
    assert [o.auxiliary for o in eager_outcomes] == [True, True, True, False, True]
    traced = 0
    while runner.trace_deferred():
        traced += 1
    assert traced == len(mixed.shapes) == 4  # (4, 2, 64, h) for h = 32, 64, 128 and the lone chunk's (0, 1, 64, 64)
    replays = []
    submit = runner._submit_compiled_mixed
    runner._submit_compiled_mixed = lambda *args: replays.append(1) or submit(*args)
    replayed_outcomes: list[StepOutcome] = []
    replayed = _steps(runner, replayed_outcomes)
    assert len(replays) == 5 and len(mixed.shapes) == traced  # every chunk step found its trace
    assert all(o.compiled for o in replayed_outcomes)
    assert [o.auxiliary for o in replayed_outcomes] == [True, True, True, False, True]  # each shape's first run
    again: list[StepOutcome] = []
    _steps(runner, again)
    assert all(o.compiled and not o.auxiliary for o in again)
    assert [s[:2] for s in replayed] == [s[:2] for s in eager]
    for a, b in zip(replayed, eager):
        assert abs(a[2] - b[2]) < 1e-4, (a, b)


def test_an_untraced_shape_runs_eager_again_until_traced_anew(tiny_qwen3):
    """`untrace` (how the GPU bench makes a sparse trace set) leaves the shape as if never traced: its steps run
    eager and queue it for `trace_deferred`, which traces it again; other shapes keep replaying."""
    model, _ = load(str(tiny_qwen3))
    runner = _runner(model, compile_mixed=True, defer=True)
    eager = _steps(runner)
    while runner.trace_deferred():
        pass
    mixed = runner.compiled_mixed
    _steps(runner)  # every trace's first run
    dropped = max(mixed.shapes, key=lambda shape: shape[3])  # the longest history bucket: two of the chunk steps
    mixed.record_run(dropped, 3.0)
    mixed.untrace([dropped])
    assert dropped not in mixed.shapes and mixed.last_run_ms(dropped) is None and not mixed.deferred
    outcomes: list[StepOutcome] = []
    again = _steps(runner, outcomes)
    assert [o.compiled for o in outcomes] == [True, True, False, False, True]
    assert mixed.deferred == 1 and runner.trace_deferred() and dropped in mixed.shapes
    for a, b in zip(again, eager):
        assert a[:2] == b[:2] and abs(a[2] - b[2]) < 1e-4, (a, b)


def test_the_scheduler_sees_which_steps_run_compiled_and_its_wants_are_traced(tiny_qwen3):
    """`runner.traced_shapes()`: a step of decode lanes and one chunk runs compiled once its padded shape has a
    trace; a shape the scheduler wants is traced by `trace_deferred` like a met one, and a step of it replays."""
    model, _ = load(str(tiny_qwen3))
    runner = _runner(model, compile_mixed=True, defer=True)
    shapes = runner.traced_shapes()
    decode = [Lane(rid, LaneKind.DECODE, (1,), 17 + i, _blocks(i), True) for i, rid in enumerate(DECODE)]  # 2 blocks
    chunk = (PrefillChunk(30, 30),)  # 30 rows over 30 of history: (4 lanes, 2 blocks, 64 rows, 64 of history)
    assert not shapes.traced(chunk, decode)
    assert not shapes.traced((PrefillChunk(30, 0), PrefillChunk(20, 0)), decode)  # two chunks: never compiled
    shapes.want((PrefillChunk(30, 0), PrefillChunk(20, 0)), decode)  # ... so never wanted
    shapes.want((PrefillChunk(1, 40),), decode)  # nor a one-row chunk
    assert runner.compiled_mixed.deferred == 0
    shapes.want(chunk, decode)
    assert runner.compiled_mixed.deferred == 1 and runner.trace_deferred() and not runner.trace_deferred()
    assert shapes.traced(chunk, decode) and shapes.traced((PrefillChunk(40, 20),), decode)  # same buckets
    assert not shapes.traced((PrefillChunk(30, 70),), decode)  # a history of 128: another bucket
    outcomes: list[StepOutcome] = []
    _steps(runner, outcomes)
    # the chunk steps at histories 0-30 (bucket 32), 30-60 (64), 60-90 and 90-100 (128), then the lone chunk: only
    # the second replays the wanted trace
    assert [o.compiled for o in outcomes] == [False, True, False, False, False]
    assert runner.traced_shapes() is not None and _runner(model, compile_mixed=False).traced_shapes() is None


def test_budgets_may_price_a_step_a_stand_in_would_replay_as_compiled(tiny_qwen3):
    """`traced_shapes(price_stand_ins=True)`: a step with no trace of its own counts as compiled where a larger
    trace would stand in for it, within what eager steps take to build (its limit is not known while budgets are
    chosen); without it, or with stand-ins off, only its own trace counts."""
    model, _ = load(str(tiny_qwen3))
    runner = _runner(model, compile_mixed=True, defer=True)
    mixed = runner.compiled_mixed
    mixed.stand_ins = True
    priced, plain = runner.traced_shapes(price_stand_ins=True), runner.traced_shapes()
    decode = [Lane(rid, LaneKind.DECODE, (1,), 17 + i, _blocks(i), True) for i, rid in enumerate(DECODE)]  # 2 blocks
    chunk = (PrefillChunk(30, 30),)  # (4 lanes, 2 blocks, 64 rows, 64 of history)
    own, longer = (4, 2, 64, 64), (4, 2, 64, 128)
    assert mixed.shape_of(decode, 30, 60, runner.kv_bucket) == own
    mixed.record_run(longer, 5.0)  # a traced shape of a longer history bucket ran in 5 ms
    assert not priced.traced(chunk, decode)  # no eager build timed yet: no bound
    mixed.record_eager_build(own, 8.0)
    assert priced.traced(chunk, decode) and not plain.traced(chunk, decode)
    mixed.stand_ins = False
    assert not priced.traced(chunk, decode)
    mixed.stand_ins = True
    mixed.record_run(longer, 9.0)  # its last run now takes longer than an eager build
    assert not priced.traced(chunk, decode)


def test_the_scheduler_sees_which_step_shapes_have_run(tiny_qwen3):
    """`traced_shapes().met`: a step's shape has run once a step ran it eager (no trace yet) or, once traced, once
    its trace ran (on real inputs, or over the scratch block when idle): a trace made on zero inputs ran nothing, so
    its first step is a first run again. Steps the compiled forward never takes (two chunks) are not tracked."""
    model, _ = load(str(tiny_qwen3))
    runner = _runner(model, compile_mixed=True, defer=True)
    shapes, mixed = runner.traced_shapes(), runner.compiled_mixed
    decode = [Lane(rid, LaneKind.DECODE, (1,), 17 + i, _blocks(i), True) for i, rid in enumerate(DECODE)]  # 2 blocks
    first, later = (PrefillChunk(30, 0),), (PrefillChunk(30, 200),)  # history buckets 32 and 256
    assert not shapes.met(first, decode) and not shapes.met(later, decode)
    assert shapes.met((PrefillChunk(30, 0), PrefillChunk(20, 0)), decode)
    _steps(runner)  # eager: the shapes are deferred
    assert shapes.met(first, decode) and not shapes.traced(first, decode) and not shapes.met(later, decode)
    while runner.trace_deferred():  # traced on zero inputs only (`run_traces` off)
        pass
    assert shapes.traced(first, decode) and not shapes.met(first, decode)
    _steps(runner)
    assert shapes.met(first, decode)
    shapes.want(later, decode)
    mixed.run_traces = True
    assert runner.trace_deferred() and shapes.traced(later, decode) and shapes.met(later, decode)  # ran over scratch


def test_continuation_shapes_are_traced_before_serving(tiny_qwen3):
    """`warm_continuation_traces`: a short prompt alone at every history bucket (32-token unit up to 128: 32, 64,
    128) and query bucket 64 or 128 that fits it is traced before a request meets it, so the lone chunk replays.
    Traced only, even where idle traces also run: nothing reaches the device at start-up, not even the scratch
    block (running them there did not move a continuation's TTFT on the H200)."""
    model, _ = load(str(tiny_qwen3))
    runner = _runner(model, compile_mixed=True, defer=True)
    runner.compiled_mixed.run_traces = True
    assert runner.warm_continuation_traces(128) == 3
    assert runner.compiled_mixed.shapes == {(0, 1, 64, 64), (0, 1, 64, 128), (0, 1, 128, 128)}
    assert not any(mx.any(k).item() or mx.any(v).item() for k, v in zip(runner.pool.keys, runner.pool.values))
    outcomes: list[StepOutcome] = []
    _steps(runner, outcomes)
    assert [o.compiled for o in outcomes] == [False, False, False, False, True]  # only the lone 40-row chunk
    assert _runner(model, compile_mixed=True).warm_continuation_traces(128) == 0  # traced at first use anyway
    assert _runner(model, compile_mixed=False).warm_continuation_traces(128) == 0


def test_neighbour_shapes_are_the_next_budgets_and_histories():
    # a query bucket either side (never past the largest met), the next history bucket
    assert neighbour_shapes((8, 4, 1024, 8192), 1024, 2048) == [
        (8, 4, 768, 8192), (8, 4, 1536, 8192), (8, 4, 1024, 12288)]  # fmt: skip
    assert neighbour_shapes((8, 4, 1024, 8192), 1024, 1024) == [(8, 4, 768, 8192), (8, 4, 1024, 12288)]
    # a chunk alone also has the smallest chunk at its history: a cached prefix's continuation
    assert (0, 1, 64, 8192) in neighbour_shapes((0, 1, 2048, 8192), 1024, 2048)
    # never more rows than history: nothing below the smallest bucket, nothing over the padded history
    assert neighbour_shapes((4, 2, 64, 128), 32, 64) == [(4, 2, 64, 256)]


def test_neighbours_of_met_shapes_trace_after_them_within_the_budget(tiny_qwen3):
    """After the met shapes, `trace_deferred` traces their neighbours while `neighbour_traces` lasts; a step that
    then meets one may replay it at once."""
    model, _ = load(str(tiny_qwen3))
    met = {(4, 2, 64, 32), (4, 2, 64, 64), (4, 2, 64, 128), (0, 1, 64, 64)}  # what `_steps` meets (32-token unit)
    for budget, traced_neighbours in ((1, 1), (5, 2)):
        runner = _runner(model, compile_mixed=True, defer=True)
        mixed = runner.compiled_mixed
        mixed.neighbour_traces = budget
        _steps(runner)
        assert mixed.deferred == len(met) and mixed.speculative == 0  # neighbours are found as met shapes trace
        while runner.trace_deferred():
            pass
        assert met <= mixed.shapes and len(mixed.shapes) == len(met) + traced_neighbours
        assert mixed.neighbour_traces == budget - traced_neighbours and not mixed.speculative
    # the two: the next history bucket of the longest (64 rows is the largest met: no bigger bucket), and a lone
    # chunk's at its next history (its smallest-chunk neighbour is itself)
    assert mixed.shapes - met == {(4, 2, 64, 256), (0, 1, 64, 128)}
    alone = Lane("q", LaneKind.PREFILL, tuple(range(30)), 70, _blocks(5), True)  # rows 70-100: history 128
    assert mixed.ready([], alone, 32, table_gather) and not mixed.deferred


def _chunks_beside_decode(
    runner: ModelRunner, chunks: list[tuple[str, int, int, int]], before=None, limit_ms: float | None = None
) -> tuple:
    """Prefill the decode lanes, then one step each of decode lanes and a chunk `(request, block index, start,
    rows)` of that request's 128-token prompt, every step waited for (`before(step)` runs before each), each
    planned to take at most `limit_ms`. Returns every sample in order and the chunk steps' outcomes."""
    long_prompts = {rid: prompt_of(128, seed=180 + index) for rid, index, *_ in chunks}
    out, ends = _prefill_decode_lanes(runner, tuple(long_prompts))
    samples = [(rid, s.token_id, s.logprob) for rid, s in sorted(out.samples.items())]
    tokens = {rid: out.samples[rid].token_id for rid in DECODE}
    outcomes = []
    for step, (rid, index, start, rows) in enumerate(chunks, start=1):
        if before is not None:
            before(step)
        lanes = tuple(Lane(d, LaneKind.DECODE, (tokens[d],), ends[d], _blocks(i), True) for i, d in enumerate(DECODE))
        chunk = Lane(rid, LaneKind.PREFILL, tuple(long_prompts[rid][start : start + rows]), start, _blocks(index), True)
        out = runner.execute(StepPlan(step, (*lanes, chunk), rows, "t", None, True, limit_ms=limit_ms))
        samples += [(r, s.token_id, s.logprob) for r, s in sorted(out.samples.items())]
        outcomes.append(out.outcome)
        tokens.update({d: out.samples[d].token_id for d in DECODE})
        ends = {d: end + 1 for d, end in ends.items()}
    return samples, outcomes


def _stand_in_pass(model, chunks, eager, builds_ms: list[float], limit_ms: float | None) -> tuple:
    """`chunks` beside the decode lanes with stand-ins on: the first 80-row shape traced after step 1 (ordinary from
    step 3), eager builds timed at `builds_ms` from step 4 on (empty: none counted), each step planned to take at most
    `limit_ms`. Asserts the eager pass's tokens and log-probabilities; returns the outcomes, why each step was one-off
    (`RunnerOutput.one_off`) and `CompiledMixed`."""
    runner = _runner(model, compile_mixed=True, defer=True, blocks=64)
    runner.compiled_mixed.stand_ins = True
    mixed = runner.compiled_mixed
    reasons, collect = [], runner.collect
    runner.collect = lambda step: (output := collect(step), reasons.append(output.one_off))[0]

    def before(step: int) -> None:
        if step == 2:
            assert runner.trace_deferred() and mixed.shapes == {(4, 2, 96, 128)}
        if step >= 4:  # as if eager steps (first of their shape or not) had been timed building this long
            for builds in mixed._eager_builds.values():
                builds.clear()
                builds.extend(builds_ms)

    samples, outcomes = _chunks_beside_decode(runner, chunks, before, limit_ms)
    assert [s[:2] for s in samples] == [s[:2] for s in eager]
    for a, b in zip(samples, eager):
        assert abs(a[2] - b[2]) < 1e-4, (a, b)
    return outcomes, reasons[1:], mixed  # the decode lanes' prefill step first


def test_an_untraced_step_replays_a_larger_traced_shape_padded(tiny_qwen3):
    """With stand-ins, a step whose shape has no trace replays the traced shape of its lanes and history bucket
    with the fewest rows past its own, its chunk padded (pad rows write the scratch block), once that shape's last
    ordinary run took no longer than eager steps' builds: the eager step's tokens and log-probabilities, the KV
    it wrote read back by the next step of its request, and a one-off outcome (the scheduler planned the step's
    own shape, whose trace is still wanted) whose time is the trace's last run. With eager builds timed faster, the
    same step runs eager."""
    model, _ = load(str(tiny_qwen3))
    # 80 rows (query bucket 96 at history bucket 128) three times: eager (deferred), a first run, an ordinary run;
    # then 30 rows over 80 (query bucket 64, history bucket 128: no trace), then its last 18 rows (the same shape)
    chunks = [("p", 3, 0, 80), ("p2", 4, 0, 80), ("p3", 5, 0, 80), ("p3", 5, 80, 30), ("p3", 5, 110, 18)]
    eager, _ = _chunks_beside_decode(_runner(model, compile_mixed=False, blocks=64), chunks)
    for build_ms, stands_in in ((1e9, True), (0.0, False)):
        outcomes, reasons, mixed = _stand_in_pass(model, chunks, eager, [build_ms], None)
        # the last two steps meet the same untraced shape: both stand in, or both run eager (the first one-off)
        assert [o.compiled for o in outcomes] == [False, True, True, stands_in, stands_in]
        assert [o.auxiliary for o in outcomes] == [True, True, False, True, stands_in]
        # first runs (a build rode along) teach `price_first_runs`; a stand-in is one-off but no first run
        assert [o.first_run for o in outcomes] == [True, True, False, not stands_in, False]
        # and why: a log names the trace a stand-in replayed (its rows and history bucket)
        last = ["stand-in 96x128"] * 2 if stands_in else ["first-eager", ""]
        assert reasons == ["first-eager", "first-run", "", *last]
        assert mixed.stand_ins_run == 2 * stands_in and (4, 2, 64, 128) not in mixed.shapes
        assert mixed.deferred == 1  # the stood-in shape still waits for its own trace
        # a stand-in ran the trace as an ordinary run does: its time is the trace's last run (an eager step's is not)
        ordinary = outcomes[-1] if stands_in else outcomes[2]
        assert mixed.last_run_ms((4, 2, 96, 128)) == ordinary.elapsed_ms > 0
    assert mixed.stand_in((4, 2, 128, 128)) is None and mixed.stand_in((4, 2, 64, 64)) is None  # none past them


def test_a_step_stands_in_within_its_limit_with_a_longer_history_bucket(tiny_qwen3):
    """A chunk of 40 rows over no history (query bucket 64, history bucket 64) replays the traced shape of 96 rows
    at history bucket 128, its table padded with the scratch block, where that trace ran within the step's planned
    limit (no eager build is counted); then its next 30 rows (history bucket 128) stand in too. Tokens,
    log-probabilities and the KV the first wrote (read by the second) are the eager steps'; with a limit below the
    trace's run, both run eager."""
    model, _ = load(str(tiny_qwen3))
    chunks = [("p", 3, 0, 80), ("p2", 4, 0, 80), ("p3", 5, 0, 80), ("p4", 6, 0, 40), ("p4", 6, 40, 30)]
    eager, _ = _chunks_beside_decode(_runner(model, compile_mixed=False, blocks=64), chunks)
    for limit_ms, stands_in in ((1e9, True), (0.0, False)):
        outcomes, reasons, mixed = _stand_in_pass(model, chunks, eager, [], limit_ms)
        assert [o.compiled for o in outcomes] == [False, True, True, stands_in, stands_in]
        assert reasons[3:] == (["stand-in 96x128"] * 2 if stands_in else ["first-eager"] * 2)  # two eager shapes
        assert mixed.stand_ins_run == 2 * stands_in
        assert not mixed.shapes & {(4, 2, 64, 64), (4, 2, 64, 128)}  # their own traces still wait


def test_stand_ins_need_a_timed_eager_build_and_a_measured_run():
    """`stand_in`: only traced shapes of the same lanes, width and history bucket with more rows, whose last
    ordinary run took no longer than eager steps like this one take to build (the median of recent builds, first
    of their shape or not); the fewest rows among them."""
    mixed = CompiledMixed(None, None, None, None, defer_traces=True, stand_ins=True)
    mixed.record_run((8, 4, 768, 16384), 14.9)
    tail, other = (8, 4, 64, 16384), (8, 4, 128, 16384)
    assert mixed.stand_in(tail) is None  # no eager build timed yet
    for shape, ms in ((other, 2400.0), ((8, 4, 64, 8192), 26.0), ((8, 4, 96, 8192), 30.0)):
        mixed.record_eager_build(shape, ms)  # first builds: one with one-off kernel builds does not hold them up
    assert mixed.eager_build_ms(tail) == 30.0
    assert mixed.eager_build_ms(other) == 30.0  # none later than its first timed: the first builds stand for them
    for ms in (12.0, 13.0, 11.0):  # `other` again: builds of seen shapes are cheaper
        mixed.record_eager_build(other, ms)
    assert mixed.eager_build_ms(other) == 12.0 and mixed.eager_build_ms(tail) == 30.0
    assert mixed.stand_in(tail) == (8, 4, 768, 16384) and mixed.stand_in(other) is None  # 14.9 ms > 12
    for i in range(EAGER_BUILDS_KEPT):  # only the latest count
        mixed.record_eager_build((8, 4, 64, 1024 * i), 29.0)
    assert mixed.eager_build_ms(tail) == 29.0
    mixed.record_run((8, 4, 1024, 16384), 18.0)
    mixed.record_run((8, 4, 256, 16384), 40.0)  # slower than a build: never
    mixed.record_run((8, 4, 128, 12288), 5.0)  # another history bucket
    mixed.record_run((16, 4, 128, 16384), 5.0)  # other lanes
    assert mixed.stand_in(tail) == (8, 4, 768, 16384)
    assert mixed.stand_in((8, 4, 768, 16384)) == (8, 4, 1024, 16384) and mixed.stand_in((8, 4, 1024, 16384)) is None
    mixed.record_run((8, 4, 768, 16384), 31.0)  # its last run: now slower than a build
    assert mixed.stand_in(tail) == (8, 4, 1024, 16384)


def test_the_scheduler_sees_the_rows_a_stand_in_would_carry():
    """`TracedMixedShapes.stand_in`: for a step whose shape has no trace, of the traces `stand_in` may choose, the
    one that carries the most of its chunk's rows (a trace's rows, cut where its history bucket ends), and the last
    run of the trace a step of those rows replays; None where the step has its own trace, stand-ins are off, none
    ran within the bounds, or the step has two chunks."""
    mixed = CompiledMixed(SimpleNamespace(block_size=16), None, None, None, defer_traces=True, stand_ins=True)
    shapes = TracedMixedShapes(mixed, 1024, table_gather)
    decode = [Lane(f"d{i}", LaneKind.DECODE, (1,), 900 + i, tuple(range(57)), True) for i in range(8)]
    count, width, *_ = mixed.shape_of(decode, 128, 1152, 1024)
    for rows, history, ms in ((384, 16384, 9.8), (512, 12288, 9.1), (1024, 12288, 13.9), (512, 4096, 8.5)):
        mixed.shapes.add((count, width, rows, history))  # traced, then run
        mixed.record_run((count, width, rows, history), ms)
    chunk = (PrefillChunk(128, 1024),)  # (128 rows, history bucket 2048): no trace
    assert shapes.stand_in(chunk, decode, 11.0) == StandIn(512, 8.5)  # 512 rows replay the 4k-history trace
    assert shapes.stand_in(chunk, decode, 14.0) == StandIn(1024, 13.9)
    assert shapes.stand_in(chunk, decode, 8.0) is None  # no eager build timed, every trace over the limit
    late = (PrefillChunk(128, 12000),)  # 512 rows would pass 12,288 of history: the 16k trace carries 384
    assert shapes.stand_in(late, decode, 11.0) == StandIn(384, 9.8)
    assert shapes.stand_in((PrefillChunk(64, 1024), PrefillChunk(64, 0)), decode, 11.0) is None
    mixed.shapes.add((count, width, 128, 2048))  # its own trace: it replays that
    assert shapes.stand_in(chunk, decode, 11.0) is None
    mixed.shapes.discard((count, width, 128, 2048))
    mixed.stand_ins = False
    assert shapes.stand_in(chunk, decode, 11.0) is None


HISTORY_BUCKETS = (1024, 2048, 4096, 8192, 12288, 16384)


# traces that ran ((rows, history bucket): ms) and eager builds timed (rows, history bucket, ms)
TRACES_RUN = st.dictionaries(st.tuples(st.sampled_from(query_buckets(2048)), st.sampled_from(HISTORY_BUCKETS)),
                             st.floats(2.0, 20.0), max_size=10)
EAGER_BUILDS = st.lists(st.tuples(st.sampled_from(query_buckets(2048)), st.sampled_from(HISTORY_BUCKETS),
                                  st.floats(2.0, 30.0)), max_size=6)


def _traced_beside_eight_lanes(
    runs: dict[tuple[int, int], float], builds: list[tuple[int, int, float]]
) -> tuple[CompiledMixed, TracedMixedShapes, list[Lane]]:
    """Deferred traces with stand-ins beside 8 decode lanes: `runs` traced and run ((rows, history bucket): ms),
    `builds` eager builds timed (rows, history bucket, ms; first and later builds: the two kinds' bounds differ)."""
    mixed = CompiledMixed(SimpleNamespace(block_size=16), None, None, None, defer_traces=True, stand_ins=True)
    shapes = TracedMixedShapes(mixed, 1024, table_gather)
    decode = [Lane(f"d{i}", LaneKind.DECODE, (1,), 900 + i, tuple(range(57)), True) for i in range(8)]
    count, width, *_ = mixed.shape_of(decode, 64, 64, 1024)
    for (bucket, history_padded), ms in runs.items():
        mixed.shapes.add((count, width, bucket, history_padded))
        mixed.record_run((count, width, bucket, history_padded), ms)
    for bucket, history_padded, ms in builds:
        mixed.record_eager_build((count, width, bucket, history_padded), ms)
    return mixed, shapes, decode


@settings(max_examples=200)
@given(
    runs=TRACES_RUN, builds=EAGER_BUILDS,
    limit_ms=st.floats(2.0, 20.0),
    history=st.integers(0, 16000), rows=st.integers(2, 1024), demand=st.integers(0, 4000),
)  # fmt: skip
def test_a_step_grown_to_its_stand_ins_rows_replays_a_trace(runs, builds, limit_ms, history, rows, demand):
    """Whatever traces have run and whatever the bounds: where `stand_in` names rows for a step, they are at least the
    step's own, and a step of those rows (or fewer, down to the step's own: the chunk's demand may cut it) replays a
    trace, never eager, one that ran within the step's limit and whose last run is the one named."""
    rows = min(rows, 16384 - history)
    mixed, shapes, decode = _traced_beside_eight_lanes(runs, builds)
    carried = shapes.stand_in((PrefillChunk(rows, history),), decode, limit_ms)
    if carried is None:
        return
    assert carried.rows >= rows
    for grown in {carried.rows, max(rows, min(carried.rows, rows + demand))}:
        chunk = Lane("p", LaneKind.PREFILL, (1,) * grown, history, (), False)
        replayed = mixed.ready(decode, chunk, 1024, table_gather, limit_ms)
        assert replayed is not None
        assert replayed[2] >= query_bucket(grown) and replayed[3] >= history_bucket(history + grown, 1024)
        if grown == carried.rows:
            assert carried.last_run_ms == mixed.last_run_ms(replayed) <= limit_ms


@settings(max_examples=200)
@given(
    runs=TRACES_RUN, builds=EAGER_BUILDS,
    limit_ms=st.floats(2.0, 20.0), history=st.integers(0, 16000), rows=st.integers(2, 1024),
)  # fmt: skip
def test_a_step_is_priced_at_the_run_of_the_trace_the_runner_replays_for_it(runs, builds, limit_ms, history, rows):
    """`TracedMixedShapes.stand_in_run_ms` agrees with the runner (`CompiledMixed.ready`): where a step replays a
    trace other than its own, that trace's last run, which may be over the step's limit (an eager build bounds it
    too); None where it replays its own trace or runs eager."""
    rows = min(rows, 16384 - history)
    mixed, shapes, decode = _traced_beside_eight_lanes(runs, builds)
    priced = shapes.stand_in_run_ms((PrefillChunk(rows, history),), decode, limit_ms)
    chunk = Lane("p", LaneKind.PREFILL, (1,) * rows, history, (), False)
    own = mixed.shape(decode, chunk, 1024)
    replayed = mixed.ready(decode, chunk, 1024, table_gather, limit_ms)
    if replayed is None or replayed == own:
        assert priced is None
    else:
        assert priced == mixed.last_run_ms(replayed) is not None


def test_a_stand_in_past_the_step_limit_is_priced_at_its_run():
    """30B-A3B on an H100 (fifty-seventh run): a 1,024-row step at 1.5k of history had no trace; the runner replayed
    the 68 ms 1,024-row trace at the 12k bucket (within the 73 ms eager builds) against a 67 ms limit. Its price is
    that run; with its own trace, or stand-ins off, there is none."""
    mixed, shapes, decode = _traced_beside_eight_lanes({(1024, 12288): 68.4}, [])
    count, width, *_ = mixed.shape_of(decode, 64, 64, 1024)
    step = (PrefillChunk(1024, 1536),)
    assert shapes.stand_in_run_ms(step, decode, 67.4) is None  # no eager build timed: the limit alone bounds it
    mixed.record_eager_build((count, width, 512, 4096), 72.8)
    assert shapes.stand_in_run_ms(step, decode, 67.4) == 68.4
    assert shapes.stand_in(step, decode, 67.4) is None  # nothing to grow into: that trace is over the limit
    as_compiled = TracedMixedShapes(mixed, 1024, table_gather, price_stand_ins=True)
    assert as_compiled.traced(step, decode) and as_compiled.stand_in_run_ms(step, decode, 67.4) == 68.4
    mixed.stand_ins = False
    assert shapes.stand_in_run_ms(step, decode, 67.4) is None
    mixed.stand_ins = True
    mixed.shapes.add((count, width, 1024, 4096))
    assert shapes.stand_in_run_ms(step, decode, 67.4) is None


def test_a_stand_in_may_run_within_the_step_limit_and_over_a_longer_history():
    """`stand_in` with `limit_ms`: a trace that ran within what the step was planned to take stands in with no
    eager build timed; traces of a longer history bucket count (the fewest rows, then the nearest bucket), shorter
    ones never, nor the shape itself."""
    mixed = CompiledMixed(None, None, None, None, defer_traces=True, stand_ins=True)
    tail = (8, 4, 64, 8192)
    mixed.record_run((8, 4, 768, 16384), 19.0)
    assert mixed.stand_in(tail) is None  # no build timed, no limit
    assert mixed.stand_in(tail, limit_ms=20.0) == (8, 4, 768, 16384)
    assert mixed.stand_in(tail, limit_ms=18.0) is None
    mixed.record_run((8, 4, 64, 12288), 9.0)
    mixed.record_run((8, 4, 64, 6144), 5.0)  # a shorter history bucket
    mixed.record_run((8, 4, 64, 8192), 5.0)  # the shape itself (its own trace replays without a stand-in)
    assert mixed.stand_in(tail, limit_ms=20.0) == (8, 4, 64, 12288)
    mixed.record_run((8, 4, 64, 12288), 30.0)
    assert mixed.stand_in(tail, limit_ms=20.0) == (8, 4, 768, 16384)
    mixed.record_eager_build((8, 4, 96, 8192), 35.0)  # either bound: a first build's 35 ms
    assert mixed.stand_in(tail, limit_ms=5.0) == (8, 4, 64, 12288)
    summary = mixed.summary()  # what the GPU bench reports
    assert summary["runs_ms"][:2] == [[8, 4, 64, 6144, 5.0], [8, 4, 64, 8192, 5.0]]
    assert summary["eager_build_ms"] == {"first": 35.0, "later": None} and summary["stand_ins"] == 0


@pytest.mark.parametrize("defer", [True, False])
def test_compiled_mixed_steps_through_the_engine_match_mlx_lm(tiny_qwen3, defer):
    """Staggered requests with prefill cut into 7-row chunks beside decoding streams: mlx-lm's greedy tokens, with
    shapes traced at first use or deferred to the engine's idle moments. The steps that traced a shape or met an
    eager shape first (and only those) are traced as auxiliary: the cost model does not learn one-off work as its
    shape's cost."""
    prompts = [prompt_of(n, seed=180 + i) for i, n in enumerate((45, 12, 70, 9, 33))]
    sink = MemorySink()
    engine = Engine.load(EngineConfig(model=str(tiny_qwen3), row_ceiling=7, row_floor=1, compile_decode="on",
                                      fuse_decode="on", fuse_mixed="on", compile_mixed="on", warm_up=False,
                                      defer_mixed_traces=defer, trace=sink))  # fmt: skip
    completions = generate_in_cuda_layout(engine, prompts, 8, table_gather)
    runner = engine.runner
    if not defer:  # deferred, the shapes wait for a quiet engine (the next test) and these steps run eager
        assert runner.compiled_mixed.shapes, "no step took the compiled mixed forward"
    one_offs = [e for e in sink.events if isinstance(e, StepExecuted) and e.auxiliary]
    traced = len(runner.compiled.shapes) + len(runner.compiled_mixed.shapes)
    assert len(one_offs) == traced + len(runner.eager_shapes) > 0
    for prompt, tokens in zip(prompts, completions):
        assert tokens == reference_tokens(tiny_qwen3, prompt, 8)


def test_the_engine_traces_deferred_shapes_when_idle(tiny_qwen3):
    """A batch meets shapes and runs them eager; the engine, quiet for `TRACE_AFTER_IDLE_S`, traces them; the same
    batch again replays them, with mlx-lm's tokens both times."""
    prompts = [prompt_of(n, seed=190 + i) for i, n in enumerate((40, 11, 66))]
    engine = Engine.load(EngineConfig(model=str(tiny_qwen3), row_ceiling=7, row_floor=1, compile_decode="on",
                                      fuse_decode="on", fuse_mixed="on", compile_mixed="on", warm_up=False,
                                      trace_neighbour_shapes=2))  # fmt: skip
    engine.runner.kv_bucket, engine.runner.prefill_gather = 32, table_gather
    mixed = engine.runner.compiled_mixed
    def requests(salt: str) -> list[GenerationRequest]:  # salted apart: no prefix hit changes the second's shapes
        return [GenerationRequest(prompt_ids=tuple(p), max_tokens=6, cache_salt=salt) for p in prompts]

    try:
        first = [list(c.token_ids) for c in engine.generate(requests("first"))]
        met = engine.status()["compiled_shapes"]
        assert met["decode"] > 0 and met["mixed_waiting"] + met["mixed"] > 0  # /v1/status shows what waits
        deadline = time.monotonic() + 30
        while (mixed.deferred or mixed.speculative or not mixed.shapes) and time.monotonic() < deadline:
            time.sleep(0.01)
        assert mixed.neighbour_traces < 2  # the quiet engine traced neighbours of the met shapes too
        assert mixed.shapes and not mixed.deferred
        traced = engine.status()["compiled_shapes"]
        assert traced["mixed"] == len(mixed.shapes) and traced["mixed_waiting"] == 0
        assert engine.stats()["compiled_shapes"] == traced["decode"] + traced["mixed"]
        replays = []
        submit = engine.runner._submit_compiled_mixed
        engine.runner._submit_compiled_mixed = lambda *args: replays.append(1) or submit(*args)
        second = [list(c.token_ids) for c in engine.generate(requests("second"))]
    finally:
        engine.shutdown()
    assert replays  # the second batch replayed shapes the first met (which ones depends on the threads' timing)
    for prompt, a, b in zip(prompts, first, second):
        assert a == b == reference_tokens(tiny_qwen3, prompt, 6)


def test_compile_mixed_settings(tiny_qwen3):
    with pytest.raises(InvalidRequest, match="compile_mixed on needs fuse_mixed"):
        Engine.load(EngineConfig(model=str(tiny_qwen3), fuse_mixed="off", compile_mixed="on"))
    with pytest.raises(InvalidRequest, match="compile_mixed must be auto, on or off"):
        Engine.load(EngineConfig(model=str(tiny_qwen3), compile_mixed="yes"))
    from mlx_serve import engine_setup

    assert engine_setup.compile_mixed("auto", True) is mx.cuda.is_available()  # on with MLX's CUDA backend
    assert engine_setup.compile_mixed("auto", False) is False  # it replays the fused forward
    assert engine_setup.compile_mixed("on", True) is True
    for stand_in in (False, True):  # stand-ins reach the engine's compiled steps (on by default)
        config = EngineConfig(model=str(tiny_qwen3), compile_decode="on", fuse_decode="on", fuse_mixed="on",
                              compile_mixed="on", warm_up=False,
                              **({} if stand_in else {"stand_in_traces": False}))  # fmt: skip
        engine = Engine.load(config)
        try:
            assert engine.runner.compiled_mixed.stand_ins is stand_in
        finally:
            engine.shutdown()


@pytest.mark.parametrize("priced", [False, True])
def test_the_engine_asks_its_runner_for_shapes_priced_as_configured(tiny_qwen3, monkeypatch, priced):
    """`price_stand_ins` reaches the scheduler's view of compiled steps (off by default; on the CPU the runner
    compiles no prefill, so the request is what can be seen)."""
    asked = []
    monkeypatch.setattr(ModelRunner, "traced_shapes", lambda runner, price_stand_ins=False: asked.append(price_stand_ins))
    engine = Engine.load(EngineConfig(model=str(tiny_qwen3), warm_up=False,
                                      **({"price_stand_ins": True} if priced else {})))  # fmt: skip
    engine.shutdown()
    assert asked == [priced]


def test_shapes_traced_idle_can_also_run_there_over_the_scratch_block_only(tiny_qwen3):
    """`run_idle_traces`: each shape `trace_deferred` traces also runs once on the device, every lane over the
    pool's scratch block: no request's KV changes, and the real steps that replay those shapes are not first runs
    (none is one-off) and sample what the eager steps sampled."""
    model, _ = load(str(tiny_qwen3))
    runner = _runner(model, compile_mixed=True, defer=True)
    runner.compiled_mixed.run_traces = True
    eager = _steps(runner)
    pool = runner.pool
    used = pool.scratch_block * pool.block_size
    before = [(mx.array(k[:used]), mx.array(v[:used])) for k, v in zip(pool.keys, pool.values)]
    scratch_before = [mx.array(k[used:]) for k in pool.keys]
    mx.eval(before, scratch_before)
    traced = 0
    while runner.trace_deferred():
        traced += 1
    assert traced == 4
    assert all(mx.array_equal(k[:used], kb).item() and mx.array_equal(v[:used], vb).item()
               for (k, v), (kb, vb) in zip(zip(pool.keys, pool.values), before))  # fmt: skip
    assert any(not mx.array_equal(k[used:], kb).item() for k, kb in zip(pool.keys, scratch_before))  # they ran
    outcomes: list[StepOutcome] = []
    replayed = _steps(runner, outcomes)
    assert all(o.compiled and not o.auxiliary for o in outcomes)
    assert [s[:2] for s in replayed] == [s[:2] for s in eager]


@pytest.mark.parametrize("timed", [True, False])
def test_a_trace_timed_on_the_scratch_block_may_stand_in_before_a_real_step_ran_it(tiny_qwen3, timed):
    """`time_idle_traces`: after its scratch run, each shape traced idle runs once more there, timed, and that time
    is its run until a real one replaces it, so it may stand in at once; untimed, a trace no real step has run
    stands in for nothing. Either way the real steps replay with the eager steps' tokens."""
    model, _ = load(str(tiny_qwen3))
    runner = _runner(model, compile_mixed=True, defer=True)
    mixed = runner.compiled_mixed
    mixed.run_traces, mixed.time_traces = True, timed
    eager = _steps(runner)
    while runner.trace_deferred():
        pass
    chunked = sorted(shape for shape in mixed.shapes if shape[0])  # (4, 2, 64, h), h = 32, 64, 128
    assert len(chunked) == 3
    times = [mixed.last_run_ms(shape) for shape in chunked]
    assert all(ms is not None and ms > 0 for ms in times) if timed else times == [None] * 3
    shortest = chunked[0]
    assert mixed.stand_in(shortest, limit_ms=1e6) == (chunked[1] if timed else None)
    replayed = _steps(runner)
    assert [s[:2] for s in replayed] == [s[:2] for s in eager]
    mixed.record_run(chunked[1], 0.5)  # a real run's time replaces the scratch one's
    assert mixed.last_run_ms(chunked[1]) == 0.5


def test_scratch_runs_route_an_moe_models_rows_over_its_experts(tiny_qwen3_moe, monkeypatch):
    """A timed scratch run stands for real steps of its shape (`stand_in` takes its time), so it must read what they
    read. Its rows carry distinct token ids within the vocabulary, and an MoE model's router spreads them over more
    experts than one row's top-k (on one repeated token every row chose the same ones)."""
    model, _ = load(str(tiny_qwen3_moe))
    runner = _runner(model, compile_mixed=True, defer=True)
    mixed = runner.compiled_mixed
    mixed.run_traces, mixed.time_traces = True, True
    _steps(runner)
    mlp = model.model.layers[0].mlp
    gate, scratch_run, call = mlp.gate, CompiledMixed._run_on_scratch, CompiledMixed.__call__
    handed, routed, recording = [], [], []

    def recorded_gate(x):
        scores = gate(x)
        if recording:  # each row's top-k experts, as the block picks them
            routed.append(set(mx.argpartition(-scores, kth=mlp.top_k - 1, axis=-1)[..., : mlp.top_k].flatten().tolist()))
        return scores

    def recorded_run(self, *args):
        recording.append(True)
        try:
            return scratch_run(self, *args)
        finally:
            recording.clear()

    def recorded_call(self, decode, chunk, tokens, *args, **kwargs):
        if recording:
            handed.append(tokens.tolist())
        return call(self, decode, chunk, tokens, *args, **kwargs)

    monkeypatch.setattr(mlp, "gate", recorded_gate)
    monkeypatch.setattr(CompiledMixed, "_run_on_scratch", recorded_run)
    monkeypatch.setattr(CompiledMixed, "__call__", recorded_call)
    mx.disable_compile()  # the traces run their Python each call, so the router's choices can be read
    try:
        while runner.trace_deferred():
            pass
    finally:
        mx.enable_compile()
    vocab = model.args.vocab_size
    assert handed and all(len(set(tokens)) == len(tokens) and all(0 <= t < vocab for t in tokens) for tokens in handed)
    assert max(len(experts) for experts in routed) > mlp.top_k


def test_chunk_rows_warmed_before_serving_leave_every_request_block_untouched(tiny_qwen3):
    """`warm_chunk_rows`: one eager step of decode lanes beside a chunk of each query bucket, every lane over the
    scratch block, so a rows bucket's first real step pays no first-load work. No request's block is written, and
    the steps after it give the tokens and log-probabilities of a runner that never warmed."""
    model, _ = load(str(tiny_qwen3))
    cold = _steps(_runner(model, compile_mixed=False))
    runner = _runner(model, compile_mixed=False)
    assert runner.warm_chunk_rows(200, 2) == len(query_buckets(200)) == 5  # 64, 96, 128, 192, 256 rows
    size, scratch = runner.pool.block_size, runner.pool.scratch_block
    for keys, values in zip(runner.pool.keys, runner.pool.values):  # slots [block * size, (block + 1) * size)
        assert not mx.any(keys[: scratch * size]).item() and not mx.any(values[: scratch * size]).item()
        assert mx.any(keys[scratch * size : (scratch + 1) * size]).item()  # the warm-up wrote there
    assert _steps(runner) == cold
    assert _runner(model, compile_mixed=False).warm_chunk_rows(200, 0) == 5  # a chunk alone
    unbucketed = ModelRunner(model, runner.pool, kv_bucket=0)
    assert unbucketed.warm_chunk_rows(200, 2) == 0
