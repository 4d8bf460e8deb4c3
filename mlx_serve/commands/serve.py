"""`serve`: the OpenAI- and Anthropic-compatible HTTP server (starlette on hypercorn)."""

from __future__ import annotations

import argparse
import math
import os
import socket
import sys
from typing import Any

from mlx_serve.config import AUTO_STEP_FACTOR, AUTO_STEP_FLOOR_MS

HELP = "Serve a model over an OpenAI- and Anthropic-compatible HTTP API."


def _number(text: str, expected: str) -> float:
    """A finite number: float() also reads "inf" and "nan", which no flag means (inf GiB crashed the KV sizing)."""
    try:
        value = float(text)
    except ValueError:
        value = math.nan
    if not math.isfinite(value):
        raise argparse.ArgumentTypeError(f"expected {expected}, not {text!r}")
    return value


def positive_float_arg(text: str, expected: str = "a number") -> float:
    """A number > 0 (`--step-target-factor`)."""
    value = _number(text, expected)
    if not value > 0:
        raise argparse.ArgumentTypeError(f"must be > 0, not {text}")
    return value


def whole_number_arg(low: int, high: int | None = None, expected: str = "a whole number") -> Any:
    """An argparse type: a whole number in [low, high] written as digits (`--port`, `--kv-blocks`, ...)."""

    def parse(text: str) -> int:
        if not text.removeprefix("-").isdigit():  # int() would also take "+5", " 5" and "5_000"
            raise argparse.ArgumentTypeError(f"expected {expected}, not {text!r}")
        value = int(text)
        if value < low or (high is not None and value > high):
            bounds = f">= {low}" if high is None else f"from {low} to {high}"
            raise argparse.ArgumentTypeError(f"must be {bounds}, not {text}")
        return value

    return parse


def nonnegative_float_arg(text: str) -> float:
    """A number >= 0 (`--drain-timeout`, `--step-target-floor-ms`)."""
    value = _number(text, "a number")
    if not value >= 0:
        raise argparse.ArgumentTypeError(f"must be >= 0, not {text}")
    return value


def step_target_arg(text: str) -> float | str:
    """`--step-target-ms`: milliseconds > 0, or auto."""
    return text if text == "auto" else positive_float_arg(text, "milliseconds or auto")


def _headroom(text: str) -> float:
    value = positive_float_arg(text, "a fraction")
    if value > 1:
        raise argparse.ArgumentTypeError(f"must be at most 1, not {text}")
    return value


def weight_arg(text: str) -> float:
    """A weight in [0, 1] (`--cost-residual-weight`)."""
    if not 0 <= (value := _number(text, "a weight")) <= 1:
        raise argparse.ArgumentTypeError(f"must be in [0, 1], not {text}")
    return value


def floor_slack_arg(text: str) -> float | str:
    """`--floor-slack`: a factor >= 1, or auto."""
    if text == "auto":
        return text
    if not (value := _number(text, "a factor or auto")) >= 1:
        raise argparse.ArgumentTypeError(f"must be at least 1, not {text}")
    return value


def factor_arg(text: str) -> float:
    """A factor of at least 1."""
    if not (value := _number(text, "a factor")) >= 1:
        raise argparse.ArgumentTypeError(f"must be at least 1, not {text}")
    return value


def _factor_or_off(text: str) -> float:
    if not ((value := _number(text, "a factor")) == 0 or value >= 1):
        raise argparse.ArgumentTypeError(f"must be 0 (off) or at least 1, not {text}")
    return value


def row_quantum_arg(text: str) -> int | str:
    """`--row-quantum`: a whole number >= 1, or auto."""
    return text if text == "auto" else whole_number_arg(1, expected="a whole number or auto")(text)


def lora_arg(text: str) -> Any:
    """`--lora NAME=DIR`: an `AdapterSpec`."""
    from mlx_serve.adapter_specs import parse_adapter_spec
    from mlx_serve.errors import InvalidRequest

    try:
        return parse_adapter_spec(text)
    except InvalidRequest as exc:
        raise argparse.ArgumentTypeError(exc.message) from None


def add_arguments(parser: argparse.ArgumentParser) -> None:
    add_engine_arguments(parser)
    http = parser.add_argument_group("HTTP")
    http.add_argument("--host", default="127.0.0.1", help="address to listen on (default: %(default)s)")
    http.add_argument("--port", type=whole_number_arg(0, 65535), default=8080,
                      help="port to listen on (default: %(default)s)")
    add_answer_arguments(http)
    http.add_argument("--api-key", default=os.environ.get("MLX_SERVE_API_KEY"), metavar="KEY",
                      help="every /v1 route asks for this key (Authorization: Bearer KEY, or x-api-key); /health and "
                           "/metrics stay open (default: $MLX_SERVE_API_KEY, else none)")
    http.add_argument("--allowed-origins", action="append", default=[], metavar="ORIGIN",
                      help="a browser origin allowed to call the server (CORS; repeatable; * for any)")
    http.add_argument("--ssl-certfile", default=None, metavar="FILE", help="serve HTTPS with this certificate")
    http.add_argument("--ssl-keyfile", default=None, metavar="FILE", help="the certificate's private key")
    http.add_argument("--allow-adapter-loading", action="store_true",
                      help="add vLLM's POST /v1/load_lora_adapter and /v1/unload_lora_adapter (they read adapter "
                           "directories named by the client: only on a trusted network)")
    http.add_argument("--drain-timeout", type=nonnegative_float_arg, default=10.0, metavar="SECONDS",
                      help="on Ctrl-C/SIGTERM, stop accepting and let open requests finish for this long, then "
                           "cancel the rest (default: %(default)s)")
    http.add_argument("--access-log", action="store_true", help="log every HTTP request")
    http.add_argument("--log-level", default="info", choices=["debug", "info", "warning", "error"],
                      help="logging level (default: %(default)s)")


def add_answer_arguments(group: Any) -> None:
    """How the routes name the model and shape answers (`serve` and `run-batch`)."""
    group.add_argument("--served-model-name", action="append", default=[], metavar="NAME",
                       help="extra name clients may use in the `model` field (repeatable); the model id, "
                            "its folder name and \"default\" are always accepted")
    group.add_argument("--reasoning", choices=("split", "raw"), default="split",
                       help="a thinking model's reasoning (between its think markers) in chat answers: split puts it in "
                            "reasoning_content (as mlx-lm's and vLLM's servers do), raw leaves it in content "
                            "(default: %(default)s)")
    group.add_argument("--pooling", choices=("last", "mean"), default="last",
                       help="how /v1/embeddings pools a prompt's final hidden states: the last token's (decoder "
                            "embedding models: Qwen3-Embedding, e5-mistral) or the mean (default: %(default)s)")


def add_engine_arguments(parser: argparse.ArgumentParser) -> None:
    """Engine and scheduler flags, one per `EngineConfig` field (shared with `chat`)."""
    model = parser.add_argument_group("model and engine")
    _add_model_arguments(model)
    _add_runtime_arguments(model)
    _add_scheduler_arguments(parser.add_argument_group("scheduler"))
    _add_step_arguments(parser.add_argument_group("steps and kernels (the defaults suit each backend)"))


def _add_model_arguments(g: Any) -> None:
    """The model, its adapters and the memory its KV pool may take."""
    g.add_argument("--model", default=None, metavar="DIR_OR_ID",
                   help="model directory or Hugging Face id (default: the built-in tiny dummy model)")
    g.add_argument("--adapter-path", default=None, metavar="DIR",
                   help="an mlx_lm.lora adapter (LoRA, DoRA or full) applied to the model itself, as mlx_lm.load "
                        "applies it")
    g.add_argument("--lora", action="append", type=lora_arg, default=[], metavar="NAME=DIR",
                   help="a LoRA adapter requests choose by giving NAME as `model` (repeatable): rows of every "
                        "adapter and of the base model share each step")
    g.add_argument("--adapter-memory-gb", type=nonnegative_float_arg, default=None, metavar="GB",
                   help="memory kept from the KV pool for adapters loaded while serving; a load that would need more "
                        "is refused (default: 1 with --allow-adapter-loading, else 0)")
    g.add_argument("--chat-template", default=None, metavar="FILE_OR_TEMPLATE",
                   help="a Jinja chat template, or a file holding one, used in place of the checkpoint's")
    g.add_argument("--memory-budget-gb", type=positive_float_arg, default=None, metavar="GB",
                   help="memory for weights plus the KV pool; sizes the pool and holds MLX to it (default: a share of "
                        "the machine, and MLX's buffer cache held to half of what its memory limit leaves)")
    g.add_argument("--kv-blocks", type=whole_number_arg(1), default=None, metavar="N",
                   help="exact KV pool size in blocks (overrides --memory-budget-gb)")
    g.add_argument("--state-snapshots", type=whole_number_arg(0), default=None, metavar="N",
                   help="a model with recurrent layers (Qwen3-Next, Qwen3.5, LFM2, Granite 4) keeps N snapshots of "
                        "requests' states at block boundaries, where its prefix-cache hits may end (each costs one "
                        "request's state of memory; default: --max-running of them; 0: no prefix hits)")
    g.add_argument("--window-kv-tokens", type=whole_number_arg(0), default=None, metavar="N",
                   help="a model with sliding-window layers keeps their KV in a space of N tokens where each request "
                        "holds only what its window reaches, the rest of the pool going to the full-attention layers "
                        "(0: off, those layers keep every token; default: room for every running request's window "
                        "and a chunk, twice over where that fits, where it is less than the pool would give them)")
    g.add_argument("--kv-bits", type=int, choices=(2, 3, 4, 5, 6, 8), default=None,
                   help="store KV quantized to this many bits, as mlx-lm's --kv-bits does (its quantized caches and "
                        "attention): 8 bits hold about half of bf16's bytes a token (default: the model's dtype)")
    g.add_argument("--kv-group-size", type=int, choices=(32, 64, 128), default=64,
                   help="with --kv-bits: values sharing one scale and bias (default: %(default)s)")
    g.add_argument("--block-size", type=whole_number_arg(1), default=16,
                   help="tokens per KV block (default: %(default)s)")
    g.add_argument("--max-running", type=whole_number_arg(1), default=64,
                   help="most requests holding KV at once (default: %(default)s)")
    g.add_argument("--queue-limit", type=whole_number_arg(0), default=1024,
                   help="most waiting requests; past it new ones get HTTP 429 (default: %(default)s)")
    g.add_argument("--max-model-len", type=whole_number_arg(1), default=None, metavar="TOKENS",
                   help="context length limit (default: the model's max_position_embeddings)")


def _add_runtime_arguments(g: Any) -> None:
    """Warm-up, speculative decoding, pipelining and progress output."""
    g.add_argument("--no-warm-up", action="store_true",
                   help="skip building the prefill attention shapes at start (CUDA: the first chunk of each shape "
                        "then stalls the streams for tens of ms)")
    g.add_argument("--warm-chunk-rows", type=whole_number_arg(0), default=0, metavar="LANES",
                   help="at start, one eager step of LANES decode lanes beside a chunk of each rows bucket (CUDA: a "
                        "rows bucket's first eager step ran 5.4 ms over its price on an H100, 1.7 once the bucket "
                        "had run); unmeasured as a warm-up yet (0 = off; default: %(default)s)")
    g.add_argument("--speculative-tokens", type=whole_number_arg(0), default=0, metavar="K",
                   help="speculative decoding by prompt lookup: a request also verifies up to K tokens that followed "
                        "an earlier occurrence of its last few tokens (its prompt or its output) in the same step; "
                        "greedy answers stay token for token, sampled ones keep their distribution (default: 0, off)")
    g.add_argument("--speculative-ngram", type=whole_number_arg(1), default=3, metavar="N",
                   help="with --speculative-tokens: match the last N tokens, down to 2 (default: %(default)s)")
    g.add_argument("--draft-model", default=None, metavar="DIR_OR_ID",
                   help="a small model of the same vocabulary drafts the tokens instead of prompt lookup (mlx-lm's "
                        "--draft-model; with no --speculative-tokens, 3 a step)")
    g.add_argument("--draft-kv-tokens", type=whole_number_arg(1), default=16384, metavar="N",
                   help="tokens the draft model's caches hold together, kept from the KV pool's memory; a request "
                        "whose cache would take more stops drafting (default: %(default)s)")
    g.add_argument("--no-pipeline", action="store_true",
                   help="read every step back before planning the next (normally a step that samples stays in "
                        "flight while the next is queued)")
    g.add_argument("--no-progress", action="store_true", help="no progress bar while the model loads")


def _add_scheduler_arguments(s: Any) -> None:
    """Admission, row budgets, the prefill cost model, the ANE lane and tracing."""
    s.add_argument("--step-target-ms", type=step_target_arg, default=500.0, metavar="MS|auto",
                   help="a contended step's row budget is halved while its predicted time exceeds this; 500 suits "
                        "Apple GPUs, fast datacenter GPUs want far less; auto: --step-target-factor x the measured "
                        "decode step, at least --step-target-floor-ms (default: %(default)s)")
    s.add_argument("--step-target-factor", type=positive_float_arg, default=AUTO_STEP_FACTOR, metavar="F",
                   help="with --step-target-ms auto: how many measured decode steps a contended step may take "
                        "(default: %(default)s)")
    s.add_argument("--step-target-floor-ms", type=nonnegative_float_arg, default=AUTO_STEP_FLOOR_MS, metavar="MS",
                   help="with --step-target-ms auto: the least step target (default: %(default)s)")
    s.add_argument("--row-ceiling", type=whole_number_arg(1), default=2048,
                   help="most rows (tokens) per step (default: %(default)s)")
    s.add_argument("--row-floor", type=whole_number_arg(1), default=64,
                   help="fewest prefill rows a contended step is cut to (default: %(default)s)")
    s.add_argument("--row-quantum", type=row_quantum_arg, default="auto", metavar="N|auto",
                   help="a contended step's rows (decode lanes + prefill) grow to fill their last tile of N rows, "
                        "the cheapest rows a step can add where GEMMs run in row tiles; auto: 64 (MLX's CUDA quantized "
                        "GEMM) for quantized models with CUDA, else 1 = off (default: %(default)s)")
    s.add_argument("--budget-midpoints", choices=["on", "off"], default="on",
                   help="a contended budget halved to fit the step target grows by half again (256 -> 384 rows) "
                        "where that is still predicted to fit; off: plain halving (default: %(default)s)")
    s.add_argument("--price-first-runs", choices=["on", "off"], default="off",
                   help="a contended step whose shape has not run yet, and would overrun the target by what such "
                        "first runs took over their prices, gives way to the largest smaller step whose shape has run "
                        "(default: %(default)s)")
    s.add_argument("--checked-fill", choices=["off", "untraced", "on"], default="on",
                   help="a contended budget grown to fill its last row tile with the decode lanes (--row-quantum) "
                        "past its own query bucket (256 -> 384, 512 -> 768 with 8 lanes): off keeps the rows; on "
                        "only where that step is still predicted to fit; untraced also where it keeps the "
                        "compiled trace the smaller step replays (default: %(default)s)")
    s.add_argument("--plan-headroom", type=_headroom, default=0.9,
                   help="contended steps are planned to this fraction of the step target, below 1 so that a step's "
                        "usual spread stays under the target (0 < x <= 1; default: %(default)s)")
    s.add_argument("--floor-slack", type=floor_slack_arg, default="auto", metavar="X|auto",
                   help="a contended step may take X times the smallest contended step's (--row-floor rows) "
                        "predicted time where that is more than the step target: a fixed cost that fills the "
                        "target buys nothing by halving (X >= 1; 1: off; auto: 2.0 where a row-tile fill is "
                        "checked, --checked-fill on with --row-quantum > 1, else 1.5; default: %(default)s)")
    s.add_argument("--slack-guard-rows", type=whole_number_arg(0), default=512, metavar="N",
                   help="the floor slack only where a contended step of N prefill rows (compiled, where prefill "
                        "compiles) is predicted over the step target: where such a step fits, halving buys rows; "
                        "and the slack allows at most that step's price (0: off; default: %(default)s)")
    s.add_argument("--untrained-rows", type=whole_number_arg(0), default=0, metavar="N",
                   help="a contended step the cost model cannot price yet (a fresh engine's first steps, each a "
                        "shape's first run) takes at most N prefill rows (0: up to --row-ceiling; default: "
                        "%(default)s)")
    s.add_argument("--max-prefill-slowdown", type=_factor_or_off, default=0.0, metavar="X",
                   help="a contended chunk grows (to at most twice what a step may take) until a long prompt's "
                        "prefill runs at least 1/X of its speed alone, by the cost model (X >= 1; 0: off; "
                        "default: %(default)s)")
    s.add_argument("--plan-padding", choices=["on", "off"], default="on",
                   help="contended budgets land on the query buckets the engine pads chunks to (CUDA) and the "
                        "affine cost model counts the padded work; off: exact counts (default: %(default)s)")
    s.add_argument("--prefill-cost-model", choices=["ema", "bucketed", "affine"], default="ema",
                   help="step-time predictor for row budgets: one EMA ms-per-row, the 96-cell bucketed table, or "
                        "an affine fit (fixed + rows + attention pairs + decode lanes + extra prompt lanes) "
                        "(default: %(default)s; env MLX_SERVE_PREFILL_COST_MODEL overrides)")
    s.add_argument("--cost-trust-factor", type=_factor_or_off, default=1.5, metavar="X",
                   help="affine: a step of more than X times the rows of the largest recent step is priced at least "
                        "at that step's cost per row, not by the fit's extrapolation; 0: off (default: %(default)s)")
    s.add_argument("--cost-residual-weight", type=weight_arg, default=0.3, metavar="W",
                   help="affine: correct a price by what the fit recently missed by on steps of its rows bucket, "
                        "each step weighing W; 0: off (default: %(default)s)")
    s.add_argument("--max-overtakes", type=whole_number_arg(0), default=4,
                   help="how often a waiting request may be overtaken by shorter ones before it goes first "
                        "(default: %(default)s)")
    s.add_argument("--no-prefix-cache", action="store_true", help="do not reuse KV blocks of shared prefixes")
    s.add_argument("--shared-prefill-tokens", type=whole_number_arg(0), default=256, metavar="N",
                   help="a waiting request whose next N prompt tokens a running prefill is computing (the same "
                        "tokens and cache salt) waits for them and takes them from the prefix cache instead of "
                        "computing them again, e.g. a burst over one system prompt (0 = off; default: %(default)s)")
    s.add_argument("--no-decode-debt", action="store_true",
                   help="turn off decode debt (a late stream normally blocks new prefill rows for a step)")
    s.add_argument("--debt-tolerance", type=factor_arg, default=1.25, metavar="X",
                   help="a stream is in decode debt only once it waited, or its last gap lasted, X times what a "
                        "contended step may take: a decode-only step cannot shorten a gap already suffered, so a step "
                        "within the cost model's usual error of its plan is not paid back (X >= 1; default: "
                        "%(default)s)")
    s.add_argument("--ane-lane", choices=["off", "cpu", "ane"], default="off",
                   help="where prefill chunks may also run: off; cpu = the MLX CPU stand-in for testing the lane; "
                        "ane = Core ML on the Neural Engine (macOS only) (default: %(default)s)")
    s.add_argument("--ane-package", default=None, metavar="PKG",
                   help="the Core ML package `python -m mlx_serve ane build` wrote, for --ane-lane ane")
    s.add_argument("--ane-timeout-s", type=positive_float_arg, default=30.0, metavar="S",
                   help="an ANE chunk slower than this is rerun on the GPU (default: %(default)s)")
    s.add_argument("--trace", default=None, metavar="FILE",
                   help="capture trace events in memory and write them to FILE (JSONL) at exit")


def _add_step_arguments(g: Any) -> None:
    """How steps run: attention paths, compiled and fused traces, expert and quantized kernels."""
    g.add_argument("--decode-attention", choices=["auto", "reference", "batched", "kernel"], default="auto",
                   help="attention of decode lanes: auto = the paged CUDA kernel on CUDA, one batched SDPA on the "
                        "CPU, the per-lane reference elsewhere (default: %(default)s)")
    g.add_argument("--compile-decode", choices=["auto", "on", "off"], default="auto",
                   help="replay single-row (decode) steps as one mx.compile'd graph: auto = on with MLX's CUDA "
                        "backend (default: %(default)s)")
    g.add_argument("--fuse-decode", choices=["auto", "on", "off"], default="auto",
                   help="compiled decode steps run q/k/v and gate/up as single matmuls and the attention prologue "
                        "as one kernel: auto = on with MLX's CUDA backend for Qwen3, Qwen3-MoE and Llama "
                        "(default: %(default)s)")
    g.add_argument("--fuse-mixed", choices=["auto", "on", "off"], default="auto",
                   help="steps with prefill chunks take the fused forward too (fewer ops to launch a layer; needs "
                        "--fuse-decode; auto = on with CUDA; default: %(default)s)")
    g.add_argument("--compile-mixed", choices=["auto", "on", "off"], default="auto",
                   help="a step of decode lanes and one prefill chunk replays a compiled trace per bucketed shape "
                        "(needs --fuse-mixed; auto = on with CUDA; default: %(default)s)")
    g.add_argument("--defer-mixed-traces", choices=["on", "off"], default="on",
                   help="a new compiled mixed shape runs eager until the idle engine has traced it (off: traced at "
                        "first use, a 25-50 ms stall of that step on the H200; default: %(default)s)")
    g.add_argument("--run-idle-traces", choices=["on", "off"], default="on",
                   help="with deferred traces: each shape traced while the engine is quiet also runs once there over "
                        "a scratch block, so its first real step pays no first-run work (default: %(default)s)")
    g.add_argument("--time-idle-traces", choices=["on", "off"], default="on",
                   help="with --run-idle-traces: each such shape runs a second time there, timed, so it may stand in "
                        "for smaller steps before a real step of its own ran (default: %(default)s)")
    g.add_argument("--stand-in-traces", choices=["on", "off"], default="on",
                   help="with deferred traces: a step whose shape has no trace yet replays the traced shape of its "
                        "lanes with the fewest rows, then the nearest history bucket, at or past its own, padded, "
                        "where that shape ran no longer than eager steps take to build or than the step was "
                        "planned to take (default: %(default)s)")
    g.add_argument("--price-stand-ins", choices=["on", "off"], default="off",
                   help="contended budgets price a step that a stand-in trace would replay as a compiled step, not "
                        "an eager one (default: %(default)s)")
    g.add_argument("--fill-stand-ins", choices=["on", "off"], default="on",
                   help="a contended step that a larger stand-in trace would replay grows to the rows that trace "
                        "carries, at the same cost (default: %(default)s)")
    g.add_argument("--price-stand-in-runs", choices=["on", "off"], default="on",
                   help="a contended step that a larger trace would replay in place of its own is priced at that "
                        "trace's last run, which may be over the step's target (default: %(default)s)")
    g.add_argument("--trace-neighbour-shapes", type=whole_number_arg(0), default=0, metavar="N",
                   help="with deferred traces: also trace up to N shapes next to met ones (a query bucket either "
                        "side, the next history bucket, a cached prefix's continuation) while the engine is quiet, "
                        "so the steps that meet them replay at once; unmeasured on a GPU yet (default: %(default)s)")
    g.add_argument("--dense-experts", choices=["auto", "on", "off"], default="auto",
                   help="steps of enough (up to 1,024) rows that --expert-tiles does not take compute every expert of "
                        "a Qwen3-MoE block in three batched matmuls instead of gather_mm: auto = on with MLX's CUDA "
                        "backend, where it made 30B-A3B decode 2-4x faster on the H200 (default: %(default)s)")
    g.add_argument("--expert-tiles", choices=["auto", "on", "off"], default="auto",
                   help="MoE steps of more than 64 rows (a full decode batch) sort their (row, expert) pairs into tiles of one expert each and "
                        "multiply each tile by its expert: auto = a CUDA kernel with MLX's CUDA backend, else off; "
                        "on elsewhere: MLX's gather_mm over the tiles (default: %(default)s)")
    g.add_argument("--quantized-gemv", choices=["auto", "on", "off"], default="auto",
                   help="4-bit projections of decode steps of up to 8 rows run through a matrix-vector kernel that "
                        "reads the packed weights once for all rows: auto = the CUDA kernel with MLX's CUDA backend, "
                        "else MLX's quantized matmul; on elsewhere: dequantize then matmul (default: %(default)s)")
    g.add_argument("--quantized-tiles", choices=["auto", "on", "off"], default="auto",
                   help="4-bit projections of steps of 33 rows or more (prefill chunks) run through a GEMM that "
                        "dequantizes packed weights in registers, and from 129 rows through a dequantize kernel and "
                        "the bf16 GEMM: auto = these CUDA kernels with MLX's CUDA backend, else MLX's quantized "
                        "matmul; on elsewhere: dequantize then matmul (default: %(default)s)")
    g.add_argument("--split-quantized-k", choices=["auto", "on", "off", "all"], default="auto",
                   help="quantized models: narrow projections (o_proj, down_proj; all: the fused q/k/v and gate/up "
                        "too) run as one batched product over slices of their input dimension, summed, so that "
                        "MLX's CUDA quantized GEMM fills the GPU: auto = all with MLX's CUDA backend and the fused "
                        "mixed forward, on (o_proj, down_proj) with CUDA otherwise (default: %(default)s)")
    g.add_argument("--chunk-attention", choices=["auto", "sdpa", "matmul", "paged"], default="auto",
                   help="how prefill chunks attend: MLX's fused attention (sdpa) over the history gathered from the "
                        "paged pool; (matmul) chunks of up to 128 rows as two matmuls and a softmax, which keeps "
                        "every SM busy where a small chunk reads a long history; (paged) one flash-attention kernel "
                        "reading the pool through the block table, no copy and no work on padding; auto = paged "
                        "with MLX's CUDA backend, sdpa elsewhere (default: %(default)s)")
    g.add_argument("--dequantize-rows", type=whole_number_arg(0), default=0, metavar="N",
                   help="quantized models: steps of at least N rows (prefill chunks, decode batches, logits) run each "
                        "projection as a dense matmul over its dequantized weights, since MLX's quantized matmul "
                        "re-reads the packed weights per row on CUDA; the weights round to bf16 once, as MLX's "
                        "dequantization rounds them (0 = never; default: %(default)s)")


def _adapter_memory_gb(args: argparse.Namespace) -> float:
    """As given, else 1 GiB where clients may load adapters (a rank-16 adapter of every linear of Qwen3-8B in bf16
    takes 83 MiB a slot, the base's zeros one more: eleven fit), else none."""
    if args.adapter_memory_gb is not None:
        return args.adapter_memory_gb
    return 1.0 if getattr(args, "allow_adapter_loading", False) else 0.0


def engine_config(args: argparse.Namespace, observer: object | None = None) -> Any:
    from mlx_serve.engine import EngineConfig
    from tracing import sink_from_env

    return EngineConfig(
        model=args.model, adapter_path=args.adapter_path, adapters=tuple(args.lora), chat_template=args.chat_template,
        adapter_memory_gb=_adapter_memory_gb(args),
        memory_budget_gb=args.memory_budget_gb, kv_blocks=args.kv_blocks, window_kv_tokens=args.window_kv_tokens,
        state_snapshots=args.state_snapshots,
        kv_bits=args.kv_bits, kv_group_size=args.kv_group_size,
        block_size=args.block_size, max_running=args.max_running, queue_limit=args.queue_limit,
        max_model_len=args.max_model_len, step_target_ms=args.step_target_ms,
        step_target_factor=args.step_target_factor, step_target_floor_ms=args.step_target_floor_ms,
        row_ceiling=args.row_ceiling, row_floor=args.row_floor,
        row_quantum=args.row_quantum, budget_midpoints=args.budget_midpoints == "on",
        price_first_runs=args.price_first_runs == "on",
        checked_fill=args.checked_fill, plan_headroom=args.plan_headroom, floor_slack=args.floor_slack,
        slack_guard_rows=args.slack_guard_rows, untrained_rows=args.untrained_rows,
        max_prefill_slowdown=args.max_prefill_slowdown, plan_padding=args.plan_padding == "on",
        cost_model=args.prefill_cost_model, cost_trust_factor=args.cost_trust_factor,
        cost_residual_weight=args.cost_residual_weight, max_overtakes=args.max_overtakes,
        enable_prefix_cache=not args.no_prefix_cache, shared_prefill_tokens=args.shared_prefill_tokens,
        decode_debt=not args.no_decode_debt, debt_tolerance=args.debt_tolerance,
        speculative_tokens=args.speculative_tokens, speculative_ngram=args.speculative_ngram,
        draft_model=args.draft_model, draft_kv_tokens=args.draft_kv_tokens,
        ane_lane=args.ane_lane, ane_package=args.ane_package, ane_timeout_s=args.ane_timeout_s,
        decode_attention=args.decode_attention, compile_decode=args.compile_decode, fuse_decode=args.fuse_decode,
        dense_experts=args.dense_experts, expert_tiles=args.expert_tiles, fuse_mixed=args.fuse_mixed,
        compile_mixed=args.compile_mixed, defer_mixed_traces=args.defer_mixed_traces == "on",
        run_idle_traces=args.run_idle_traces == "on", time_idle_traces=args.time_idle_traces == "on",
        stand_in_traces=args.stand_in_traces == "on", price_stand_ins=args.price_stand_ins == "on",
        fill_stand_ins=args.fill_stand_ins == "on", price_stand_in_runs=args.price_stand_in_runs == "on",
        trace_neighbour_shapes=args.trace_neighbour_shapes,
        split_quantized_k=args.split_quantized_k, chunk_attention=args.chunk_attention,
        dequantize_rows=args.dequantize_rows, quantized_tiles=args.quantized_tiles, quantized_gemv=args.quantized_gemv,
        warm_up=not args.no_warm_up, warm_chunk_rows=args.warm_chunk_rows,
        pipeline=not args.no_pipeline,
        trace=sink_from_env(args.trace), observer=observer,
        progress=not args.no_progress,
    )


def load_engine(args: argparse.Namespace, observer: object | None = None) -> Any:
    """Engine.load with a progress bar over the layers (unless --no-progress), then what it allocated."""
    from mlx_serve.engine import Engine
    from mlx_serve.errors import InvalidRequest

    if args.row_floor > args.row_ceiling:
        raise InvalidRequest(f"--row-floor ({args.row_floor}) must be at most --row-ceiling ({args.row_ceiling})")
    engine = Engine.load(engine_config(args, observer))
    print(engine.allocation_summary(), file=sys.stderr)
    return engine


def check_listen(host: str, port: int) -> None:
    """Raise a clear error (the CLI prints it, exit 1) where the address cannot be listened on."""
    from mlx_serve.errors import MlxServeError

    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    try:
        with socket.create_server((host, port), family=family):
            pass
    except OSError as exc:
        raise MlxServeError(f"cannot listen on {host}:{port}: {exc.strerror or exc}") from None


def check_tls(certfile: str | None, keyfile: str | None) -> None:
    """Both or neither, each a readable certificate chain and key (checked before the model loads)."""
    import ssl

    from mlx_serve.errors import MlxServeError

    if certfile is None and keyfile is None:
        return
    if certfile is None or keyfile is None:
        raise MlxServeError("--ssl-certfile and --ssl-keyfile go together")
    try:
        ssl.create_default_context(ssl.Purpose.CLIENT_AUTH).load_cert_chain(certfile, keyfile)
    except (OSError, ssl.SSLError) as exc:
        raise MlxServeError(f"cannot use {certfile} and {keyfile} for HTTPS: {exc}") from None


def run(args: argparse.Namespace) -> int:
    import logging

    from mlx_serve.server import ServerMetrics, create_app
    from mlx_serve.server.http import hypercorn_config, serve_until_signalled

    logging.basicConfig(level=args.log_level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    check_listen(args.host, args.port)  # before the model loads: a taken port is known in a millisecond
    check_tls(args.ssl_certfile, args.ssl_keyfile)
    metrics = ServerMetrics()
    engine = load_engine(args, observer=metrics)
    app = create_app(engine, metrics, aliases=args.served_model_name, split_reasoning=args.reasoning == "split",
                     adapter_loading=args.allow_adapter_loading, pooling=args.pooling, api_key=args.api_key,
                     allowed_origins=args.allowed_origins)
    log = logging.getLogger("mlx_serve.server")
    scheme = "https" if args.ssl_certfile else "http"
    log.info("model %s loaded; serving on %s://%s:%d", engine.model_id, scheme, args.host, args.port)
    host = f"[{args.host}]" if ":" in args.host else args.host  # IPv6 literals need brackets
    try:
        config = hypercorn_config(f"{host}:{args.port}", args.drain_timeout, args.access_log, args.ssl_certfile,
                                  args.ssl_keyfile)  # fmt: skip
        serve_until_signalled(app, config)
    finally:
        log.info("stopping the engine")
        engine.shutdown(timeout_s=min(args.drain_timeout, 5.0))
    return 0
