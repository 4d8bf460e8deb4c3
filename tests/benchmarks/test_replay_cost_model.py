"""The cost-model replay of recorded GPU bench runs scores what the scheduler's own affine model would predict."""

from __future__ import annotations

import gzip
import json

from benchmarks.gpu.replay_cost_model import main, observations, recorded_runs, signed_errors
from scheduler.buckets import history_bucket, query_bucket
from scheduler.plan import Path


def padded_ms(rows: int, decode_lanes: int, history: int) -> float:
    """A step timed as the engine runs it on CUDA: its rows padded to a query bucket, its KV to a history bucket."""
    padded = query_bucket(rows)
    return 4 + 0.01 * padded + 1e-6 * padded * history_bucket(history + rows, 1024) + 0.2 * decode_lanes


def test_padded_counts_predict_padded_steps_better_and_the_table_prints(tmp_path, capsys) -> None:
    steps = [[2048, 0, 0, 60.0, None, 4]]  # uncontended: trained on (as live), not scored
    for index in range(120):
        rows, history = (200, 312, 700, 1100, 1552)[index % 5], (index * 733) % 15_000
        steps.append([rows, 8, history, round(padded_ms(rows, 8, history), 2), None, 1])
    steps.append([1920, 4, 26, 40.0, 16.6, 4])  # a multi-prompt start-up step: four lanes of 480
    result = {"results": [{"shape": "0.6b", "ours": {"contended": {"steps": {"prefill_steps": steps}}}}]}
    path = tmp_path / "gpu_bench.json"
    path.write_text(json.dumps(result))
    ((shape, found, pads_history, live),) = recorded_runs([path])
    assert shape == "0.6b" and pads_history and not live  # not recorded: padded, as before the paged kernel
    assert len(found) == 122 and [c.rows for c in found[-1].shape.chunks] == [480] * 4
    assert not found[0].contended and all(o.contended for o in found[1:])
    exact, padded = (signed_errors(found[:-1], bucket)[20:] for bucket in (0, 1024))
    assert len(exact) == len(padded) == 100  # 120 contended steps, each predicted (the solo step came first)
    assert sum(map(abs, padded)) < 0.2 * sum(map(abs, exact))
    assert main([str(path)]) == 0
    assert "| 0.6b | 1 | 121 |" in capsys.readouterr().out  # 121 contended steps, all predicted


def test_gzipped_logs_replay_as_the_plain_file(tmp_path) -> None:
    """`benchmarks/gpu/logs` keeps its results gzipped: read back, they are the same runs."""
    steps = [[2048, 0, 0, 60.0, None, 4]] + [[512, 8, 1000 * i, 9.0 + i, None, 1] for i in range(12)]
    text = json.dumps({"results": [{"shape": "0.6b", "ours": {"contended": {"steps": {"prefill_steps": steps}}}}]})
    plain, packed = tmp_path / "gpu_bench.json", tmp_path / "gpu_bench.json.gz"
    plain.write_text(text)
    packed.write_bytes(gzip.compress(text.encode()))
    ((_, from_plain, _, _),) = recorded_runs([plain])
    ((_, from_packed, _, _),) = recorded_runs([packed])
    assert len(from_packed) == 13 and from_packed == from_plain


def test_files_without_recorded_steps_are_refused(tmp_path, capsys) -> None:
    path = tmp_path / "gpu_bench.json"
    path.write_text(json.dumps({"results": [{"shape": "8b", "ours": {}}]}))
    assert main([str(path)]) == 1
    assert "no recorded contended steps" in capsys.readouterr().err


def test_steps_that_traced_a_shape_teach_the_replay_nothing(tmp_path) -> None:
    """A recorded step flagged auxiliary (its compiled shape was traced during it) is neither trained on nor
    scored, as live: the replayed predictions after it are those of the run without it."""
    steps = []
    for index in range(60):
        rows, history = (256, 512, 1024)[index % 3], (index * 911) % 12_000
        steps.append([rows, 8, history, round(padded_ms(rows, 8, history), 2), None, 1, False])
    traced = [1024, 8, 3000, 400.0, None, 1, True]  # a trace's hundreds of ms, flagged
    result = {"results": [{"shape": "0.6b", "ours": {"contended": {"steps": {"prefill_steps": steps[:30] + [traced] + steps[30:]}}}}]}
    path = tmp_path / "gpu_bench.json"
    path.write_text(json.dumps(result))
    ((_, found, _, _),) = recorded_runs([path])
    assert found[30].shape.auxiliary
    with_trace = signed_errors(found, 1024)
    unflagged = signed_errors(observations([(*step[:4], 1, False, step[6]) for step in steps[:30] + [traced] + steps[30:]]), 1024)
    assert with_trace == signed_errors(found[:30] + found[31:], 1024)  # as if it had not run
    assert max(map(abs, unflagged[31:])) > 2 * max(map(abs, with_trace[30:]))  # learned, the trace would mislead


def test_steps_that_replayed_a_trace_are_replayed_as_compiled(tmp_path) -> None:
    """The eighth field (since the twentieth run) says a step replayed a compiled trace: the replay fits it apart
    from the eager steps, as live; older records (seven fields) are eager."""
    steps = [[512, 8, 1000 * i, 20.0, None, 1, False, i % 2 == 1] for i in range(4)] + [[512, 8, 0, 20.0, None, 1, False]]
    path = tmp_path / "gpu_bench.json"
    path.write_text(json.dumps({"results": [{"shape": "8b", "ours": {"contended": {"steps": {"prefill_steps": steps}}}}]}))
    ((_, found, _, _),) = recorded_runs([path])
    assert [o.shape.compiled for o in found] == [False, True, False, True, False]


def test_a_run_whose_attention_read_the_pool_is_replayed_with_exact_history(tmp_path) -> None:
    """Runs record `pads_history` (False where the paged chunk kernel read the pool): their steps cost the exact
    history, and the replay counts them so, as the live model did."""

    def exact_ms(rows: int, history: int) -> float:
        padded = query_bucket(rows)
        return 4 + 0.01 * padded + 1e-6 * padded * (history + rows / 2)

    steps = []
    for index in range(120):
        rows, history = (200, 312, 700, 1100)[index % 4], (index * 733) % 15_000
        steps.append([rows, 8, history, round(exact_ms(rows, history), 3), None, 1, False, False])
    result = {"results": [{"shape": "8b", "ours": {"pads_history": False, "contended": {"steps": {"prefill_steps": steps}}}}]}
    path = tmp_path / "gpu_bench.json"
    path.write_text(json.dumps(result))
    ((_, found, pads_history, _),) = recorded_runs([path])
    assert pads_history is False
    as_recorded, as_padded = (signed_errors(found, 1024, pads)[40:] for pads in (False, True))
    assert sum(map(abs, as_recorded)) < 0.5 * sum(map(abs, as_padded))


def test_the_fit_at_a_run_end_is_printed_with_its_coefficients(tmp_path, capsys) -> None:
    """`--coefficients`: the GPU fit once a run is replayed, by feature; a run whose costs are affine in the features
    (every direction excited) gives its coefficients back."""

    def cost(rows: int, lanes: int, history: int) -> float:
        padded = query_bucket(rows)
        return 4 + 10 * padded / 1e3 + 1.0 * padded * (history + rows / 2) / 1e6 + 0.5 * lanes

    steps = []
    for index in range(300):
        rows, lanes, history = (200, 312, 700, 1100)[index % 4], (2, 4, 8, 16, 32)[index % 5], (index * 733) % 15_000
        steps.append([rows, lanes, history, cost(rows, lanes, history), None, 1, False, False])
    result = {"results": [{"shape": "8b", "ours": {"pads_history": False, "contended": {"steps": {"prefill_steps": steps}}}}]}
    path = tmp_path / "gpu_bench.json"
    path.write_text(json.dumps(result))
    assert main([str(path), "--coefficients"]) == 0
    printed = json.loads(capsys.readouterr().out.splitlines()[0])
    assert printed["shape"] == "8b"
    fitted = printed["coefficients"]
    for name, value in {"fixed": 4.0, "rows_k": 10.0, "pairs_m": 1.0, "decode_lane": 0.5}.items():
        assert abs(fitted[name] - value) < 0.05 * max(value, 1.0), (name, fitted)


def test_a_run_that_recorded_its_cost_observations_is_replayed_from_them(tmp_path) -> None:
    """Since the twenty-fourth run the bench records every step the live cost model was shown (both warm passes,
    each chunk at its own history): the replay trains on all of them, as live, and scores the measured pass's."""
    shown = []
    for index in range(90):
        rows, history = (256, 512, 768)[index % 3], (index * 733) % 15_000
        chunks = [[rows, history]] if index % 10 else [[rows // 2, 0], [rows // 2, history]]
        shown.append([chunks, 8, "gpu", index == 5, index % 2 == 1, 20.0 + rows / 100])
    result = {"results": [{"shape": "8b", "ours": {"pads_history": False, "cost_observations": shown,
                                                   "contended": {"cost_observations_from": 60, "steps": {}}}}]}
    path = tmp_path / "gpu_bench.json"
    path.write_text(json.dumps(result))
    ((shape, found, pads_history, live),) = recorded_runs([path])
    assert (shape, pads_history, live, len(found)) == ("8b", False, True, 90)
    assert [o.contended for o in found] == [i >= 60 for i in range(90)]
    assert found[10].shape.width == 2 and found[10].shape.chunks[1].history == 7330 and found[5].shape.auxiliary
    assert found[1].shape.compiled and found[1].shape.path is Path.GPU
    assert len(signed_errors(found, 1024, pads_history)) == 30


def test_by_rows_shows_a_bucket_the_fit_misprices_and_the_correction_narrows_it(tmp_path, capsys) -> None:
    """`--by-rows`: errors by the rows' query bucket. Where 512 rows cost what 384 do (the H100's 4-bit kernels), the
    fit over-prices 512; replayed with `--residual-weight 0.3` that bucket's error shrinks."""

    def tiled_ms(rows: int, history: int) -> float:
        return 6.0 + 0.04 * min(rows, 384) + 0.04 * max(rows - 512, 0) + 1e-6 * rows * history

    steps = []
    for index in range(160):
        rows, history = (256, 384, 512, 768)[index % 4], 128 * index
        steps.append([rows, 8, history, round(tiled_ms(rows, history), 3), None, 1, False, False])
    result = {"results": [{"shape": "8b-4bit", "ours": {"pads_history": False,
                                                         "contended": {"steps": {"prefill_steps": steps}}}}]}
    path = tmp_path / "gpu_bench.json"
    path.write_text(json.dumps(result))

    def bucket_512(argv: list[str]) -> float:
        assert main([str(path), "--by-rows", *argv]) == 0
        row = next(line for line in capsys.readouterr().out.splitlines() if line.startswith("| 8b-4bit | 512 |"))
        return float(row.split("|")[4].split("/")[0].strip().rstrip("%"))

    plain, corrected = bucket_512([]), bucket_512(["--residual-weight", "0.3"])
    assert plain > 5.0 and corrected < 0.5 * plain
