"""The contended table of recorded GPU bench runs: a row a run, and a summary by shape and setting that counts the
runs within issue 7's targets (gap ratio <= 3, TTFT <= 1.5x solo)."""

from __future__ import annotations

import gzip
import json

from benchmarks.gpu.contended_table import main


def _result(ratio: float, ttft_s: float, headroom: float, slack_steps: int = 0, shape: str = "0.6b") -> dict:
    budgets = [[1024, "halved:1+slack", 20.0]] * slack_steps + [[1024, "halved:1", 15.0], None]
    budgets += [[512, "halved:4+stand-in", 15.0]] * (slack_steps // 2) + [[512, "halved:2+first-run", 15.0]] * (
        slack_steps // 3)
    contended = {
        "gap_ratio": ratio, "gap_p50_ms": 5.0, "gap_max_ms": 5.0 * ratio, "gap_max_before_ms": 9.0,
        "gap_max_from_arrival_ms": 5.0 * ratio, "long_ttft_s": ttft_s,
        "steps": {"mixed_steps": 18, "mixed_rows_p50": 1024.0, "mixed_ms_p50": 13.2, "decode_only_ms_p50": 4.4,
                  "decode_only_steps": 22,
                  "prefill_budgets": budgets,
                  # an uncontended step (no decode lanes), two one-off steps, two others
                  "prefill_steps": [[2048, 0, 0, 30.0, 12.0, 4, True, False],
                                    [1024, 8, 0, 16.5, 9.4, 1, True, False, "stand-in 1024x2048"],
                                    [1024, 8, 1024, 12.0, 10.0, 1, True, True], [512, 8, 2048, 9.0, 9.1, 1, False, True],
                                    [512, 8, 2560, 11.0, 9.3, 1, False, True]]},
        "longest_gap": {"steps": [{"prefill_rows": 1024, "ms": 13.0, "compiled": True},
                                  {"prefill_rows": 1536, "ms": 5.0 * ratio, "compiled": False}]},
    }  # fmt: skip
    ours = {"contended": contended, "prefill": {"16384": {"ttft_s": 0.2}}, "step_target_ms": 15.0,
            "shared_prefix": {"warm_ttft_s": 0.008, "cold_ttft_s": 0.1}, "step_target_floor_ms": 15.0,
            "plan_headroom": headroom}  # fmt: skip
    return {"results": [{"shape": shape, "ours": ours}]}


def test_rows_and_the_summary_by_setting(tmp_path, capsys) -> None:
    runs = {"off_1": _result(2.5, 0.22, 1.0), "off_2": _result(4.2, 0.32, 1.0, slack_steps=3),
            "on_1": _result(2.9, 0.25, 0.9), "on_2": _result(2.1, 0.24, 0.9), "big": _result(1.5, 0.25, 1.0, shape="8b")}  # fmt: skip
    runs["on_1"]["results"][0]["ours"]["warm_passes"] = [{"long_ttft_s": 0.6}, {"long_ttft_s": 0.3}]
    runs["on_1"]["results"][0]["ours"]["contended"] |= {"cache_start_mb": 6512.2, "cache_end_mb": 6498.0,
                                                        "cache_limit_mb": 6500.0}
    paths = []
    for label, result in runs.items():
        folder = tmp_path / label
        folder.mkdir()
        path = folder / ("gpu_bench.json.gz" if label.startswith("on") else "gpu_bench.json")
        text = json.dumps(result)
        path.write_bytes(gzip.compress(text.encode())) if path.suffix == ".gz" else path.write_text(text)
        paths.append(str(path))
    assert main(paths) == 0
    out = capsys.readouterr().out.splitlines()
    rows = {line.split(" | ")[0].strip("| "): line for line in out if line.startswith("| ") and "_" in line[:8]}
    assert "| **2.50** |" in rows["off_1"] and "| 4.20 |" in rows["off_2"]  # bold: within 3
    # TTFT 0.22 / 0.2 s solo; no warm pass recorded; warm / cold prefix
    assert "| 1.10 (0.22 / 0.20) | - | 0.08 |" in rows["off_1"]
    assert "| 1.25 (0.25 / 0.20) | 3.00 | 0.08 |" in rows["on_1"]  # its first warm pass read the prompt in 0.6 s
    assert "| 18, 1,024, 13.2; 22, 4.40 |" in rows["off_1"]  # steps with prefill; decode-only steps
    # slack, stand-in and first-run steps; the slowest at the longest gap
    assert "| 3 / 1 / 1 | 1,536 eager, 21.0 |" in rows["off_2"]
    assert "| 0 / 0 / 0 |" in rows["off_1"]
    # one-off steps beside decode lanes, the slowest and why (logs from the fifty-seventh run's code on); 11.0 ms / 5.0
    assert rows["off_1"].endswith("| 2, 16.5 (stand-in 1024x2048); 2.20 | - / - / - |")
    # MLX's buffer cache at the pass's start and end, and the engine's cache limit, where the run recorded them
    assert rows["on_1"].endswith("| 6512 / 6498 / 6500 |")
    summary = [line for line in out if line.startswith("| 0.6b") or line.startswith("| 8b")]
    assert summary[-3:] == [
        "| 0.6b | 15.0 | 1.0 | 2 | 1 | 1 | 3.35 (2.50-4.20) | 1.60 |",
        "| 0.6b | 15.0 | 0.9 | 2 | 2 | 2 | 2.50 (2.10-2.90) | 1.25 |",
        "| 8b | 15.0 | 1.0 | 1 | 1 | 1 | 1.50 (1.50-1.50) | 1.25 |",
    ]


def test_files_without_a_contended_pass_are_refused(tmp_path, capsys) -> None:
    path = tmp_path / "gpu_bench.json"
    path.write_text(json.dumps({"results": [{"shape": "8b", "ours": {"decode": {}}}]}))
    assert main([str(path)]) == 1
    assert "no contended passes" in capsys.readouterr().err


def test_a_list_setting_groups_runs(tmp_path, capsys) -> None:
    """`kept_traces_at` is recorded as a list: runs group by it as by any setting, a run without it under None."""
    paths = []
    for label, kept in (("sparse_1", [1024, 16384]), ("sparse_2", [1024, 16384]), ("whole_1", None)):
        result = _result(2.5, 0.22, 1.0)
        if kept is not None:
            result["results"][0]["ours"]["kept_traces_at"] = kept
        (tmp_path / label).mkdir()
        (tmp_path / label / "gpu_bench.json").write_text(json.dumps(result))
        paths.append(str(tmp_path / label / "gpu_bench.json"))
    assert main([*paths, "--by", "kept_traces_at"]) == 0
    summary = [line for line in capsys.readouterr().out.splitlines() if line.startswith("| 0.6b")]
    assert summary == ["| 0.6b | (1024, 16384) | 2 | 2 | 2 | 2.50 (2.50-2.50) | 1.10 |",
                       "| 0.6b | None | 1 | 1 | 1 | 2.50 (2.50-2.50) | 1.10 |"]
