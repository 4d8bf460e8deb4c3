"""`bench`: run a named workload (mlx_serve/workloads.py) against a model and print its figures as a table."""

from __future__ import annotations

import argparse
import dataclasses
import json
import sys
from typing import Any

from mlx_serve.commands.serve import step_target_arg

HELP = "run a named benchmark workload (offline, contended, prefix) against a model and print a table"

# kept here rather than imported from mlx_serve.workloads so that `--help` does not import MLX
WORKLOAD_NAMES = ("offline", "contended", "prefix")


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("workload", choices=WORKLOAD_NAMES,
                        help="offline: N requests at once; contended: a long prompt arrives while streams decode; "
                             "prefix: cold vs warm TTFT over a shared prefix")
    parser.add_argument("--model", default=None, metavar="DIR_OR_ID",
                        help="model directory or hub id (default: the built-in tiny dummy model)")
    parser.add_argument("--json", action="store_true", help="also print one JSON object on the last line")
    engine = parser.add_argument_group("engine")
    engine.add_argument("--memory-budget-gb", type=float, default=None, metavar="GB",
                        help="weights + KV pool budget (default: a share of the machine)")
    engine.add_argument("--kv-blocks", type=int, default=None, metavar="N", help="exact KV pool size in blocks")
    engine.add_argument("--max-running", type=int, default=64, help="most requests holding KV at once (default 64)")
    engine.add_argument("--step-target-ms", type=step_target_arg, default=500.0, metavar="MS|auto",
                        help="contended steps are cut to fit this time; auto: 4x the decode step (default 500)")
    engine.add_argument("--prefill-cost-model", choices=("ema", "bucketed", "affine"), default="ema",
                        help="step-time predictor for row budgets (default ema)")
    engine.add_argument("--row-ceiling", type=int, default=2048, help="most rows per step (default 2048)")
    engine.add_argument("--decode-attention", choices=("auto", "reference", "batched", "kernel"), default="auto",
                        help="attention of single-row lanes (default auto)")
    knobs = parser.add_argument_group("workload (defaults depend on the workload)")
    knobs.add_argument("--requests", type=int, default=None, metavar="N", help="offline: requests submitted at once")
    knobs.add_argument("--prompt-len", type=int, default=None, metavar="N",
                       help="prompt tokens per request; prefix: the shared prefix length")
    knobs.add_argument("--max-tokens", type=int, default=None, metavar="N", help="tokens generated per request")
    knobs.add_argument("--long-prompt", type=int, default=None, metavar="N", help="contended: the long prompt's tokens")
    knobs.add_argument("--streams", type=int, default=None, metavar="N", help="contended: decoding streams")


def run(args: argparse.Namespace) -> int:
    from mlx_serve.workloads import DEFAULTS, WORKLOADS

    params = dataclasses.replace(DEFAULTS[args.workload], **_knob_overrides(args))
    engine = _load(args)
    try:
        figures = WORKLOADS[args.workload](engine, params)
    finally:
        engine.shutdown()
    print(f"bench {args.workload} on {engine.model_id}: {_describe(params, args.workload)}\n")
    print(format_table(figures))
    if args.json:
        print(json.dumps({"workload": args.workload, "model": engine.model_id,
                          "params": dataclasses.asdict(params), "figures": dataclasses.asdict(figures)}))
    return 0


def _knob_overrides(args: argparse.Namespace) -> dict[str, int]:
    """The workload knobs given on the command line; the rest keep the workload's defaults."""
    from mlx_serve.errors import InvalidRequest

    given = {name: getattr(args, name) for name in ("requests", "prompt_len", "max_tokens", "long_prompt", "streams")}
    given = {name: value for name, value in given.items() if value is not None}
    for name, value in given.items():
        if value < 1:
            raise InvalidRequest(f"--{name.replace('_', '-')} must be at least 1, got {value}", param=name)
    return given


def _load(args: argparse.Namespace) -> Any:
    """Engine.load with a trace held in memory, so the workloads can read step times and host overhead."""
    from mlx_serve.engine import Engine, EngineConfig
    from mlx_serve.errors import InvalidRequest
    from tracing.sink import MemorySink

    config = EngineConfig(
        model=args.model, memory_budget_gb=args.memory_budget_gb, kv_blocks=args.kv_blocks,
        max_running=args.max_running, step_target_ms=args.step_target_ms, cost_model=args.prefill_cost_model,
        row_ceiling=args.row_ceiling, decode_attention=args.decode_attention, trace=MemorySink(),
    )
    try:
        engine = Engine.load(config)
    except ValueError as exc:  # e.g. the decode-attention kernel asked for without a CUDA GPU
        raise InvalidRequest(str(exc)) from exc
    print(engine.allocation_summary(), file=sys.stderr)
    return engine


def _describe(params: Any, workload: str) -> str:
    used = {
        "offline": ("requests", "prompt_len", "max_tokens"),
        "contended": ("streams", "prompt_len", "long_prompt", "max_tokens"),
        "prefix": ("prompt_len", "max_tokens"),
    }[workload]
    return ", ".join(f"{name}={getattr(params, name)}" for name in used)


def format_table(figures: Any) -> str:
    """A markdown table of a figures dataclass, one row per field."""
    lines = ["| figure | value |", "|---|---|"]
    for f in dataclasses.fields(figures):
        lines.append(f"| {f.name} | {_format_value(getattr(figures, f.name))} |")
    return "\n".join(lines)


def _format_value(value: Any) -> str:
    if value is None:
        return "-"
    if isinstance(value, float):
        return f"{value:.1f}" if abs(value) >= 100 else f"{value:.4g}"
    return str(value)
