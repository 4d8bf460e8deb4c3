"""`python -m mlx_serve serve` and `chat` as users run them: real processes, real signals."""

from __future__ import annotations

import json
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import httpx
import pytest

from mlx_serve.cli import build_parser


def test_help_lists_the_commands(capsys):
    with pytest.raises(SystemExit):
        build_parser().parse_args(["--help"])
    out = capsys.readouterr().out
    for command in ("serve", "chat", "generate", "make-model", "bench"):
        assert command in out


def test_serve_help_explains_the_engine_flags(capsys):
    with pytest.raises(SystemExit):
        build_parser().parse_args(["serve", "--help"])
    out = capsys.readouterr().out
    for flag in ("--model", "--memory-budget-gb", "--max-running", "--queue-limit", "--step-target-ms",
                 "--prefill-cost-model", "--max-overtakes", "--block-size", "--ane-lane", "--trace", "--drain-timeout"):
        assert flag in out


@pytest.mark.parametrize(
    ("flag", "parsed", "bad"),
    [
        ("--step-target-ms", {None: 500.0, "auto": "auto", "40": 40.0}, ("fast", "0", "-5", "inf")),
        ("--step-target-factor", {None: 3.0, "2.5": 2.5}, ("many", "0", "-1")),
        ("--step-target-floor-ms", {None: 11.0, "0": 0.0, "8.5": 8.5}, ("low", "-1", "nan")),
        ("--row-quantum", {None: "auto", "auto": "auto", "64": 64}, ("tile", "0", "-64", "1.5")),
        ("--budget-midpoints", {None: "on", "off": "off"}, ("yes", "")),
        ("--checked-fill", {None: "on", "off": "off", "untraced": "untraced"}, ("maybe",)),
        ("--price-first-runs", {None: "off", "on": "on"}, ("yes",)),
        ("--slack-guard-rows", {None: 512, "0": 0, "256": 256}, ("-1", "many", "1.5")),
        ("--untrained-rows", {None: 0, "512": 512}, ("-1", "some", "1.5")),
        ("--plan-padding", {None: "on", "off": "off"}, ("exact",)),
        ("--defer-mixed-traces", {None: "on", "off": "off"}, ("later",)),
        ("--run-idle-traces", {None: "on", "off": "off"}, ("once",)),
        ("--time-idle-traces", {None: "on", "off": "off"}, ("timed",)),
        ("--stand-in-traces", {None: "on", "off": "off"}, ("padded",)),
        ("--price-stand-ins", {None: "off", "on": "on"}, ("priced",)),
        ("--trace-neighbour-shapes", {None: 0, "64": 64}, ("-1", "many", "1.5")),
        ("--warm-chunk-rows", {None: 0, "8": 8}, ("-1", "all", "1.5")),
        ("--expert-tiles", {None: "auto", "on": "on", "off": "off"}, ("kernel",)),
        ("--quantized-tiles", {None: "auto", "on": "on", "off": "off"}, ("kernel",)),
        ("--plan-headroom", {None: 0.9, "1": 1.0, "0.75": 0.75}, ("most", "0", "1.5", "-0.5")),
        ("--cost-trust-factor", {None: 1.5, "0": 0.0, "2": 2.0}, ("wide", "0.5", "-1")),
        ("--cost-residual-weight", {None: 0.3, "0": 0.0, "1": 1.0}, ("some", "1.5", "-0.1", "nan")),
        ("--floor-slack", {None: "auto", "auto": "auto", "1": 1.0, "1.25": 1.25}, ("some", "0.9", "-1")),
        ("--debt-tolerance", {None: 1.25, "1": 1.0, "1.5": 1.5}, ("late", "0.9", "0", "nan", "inf")),
        ("--max-prefill-slowdown", {None: 0.0, "0": 0.0, "1.3": 1.3}, ("fast", "0.5", "-1")),
        ("--port", {None: 8080, "0": 0, "65535": 65535}, ("http", "-5", "70000", "80.5")),
        ("--block-size", {None: 16, "32": 32}, ("0", "-16", "big")),
        ("--kv-blocks", {None: None, "100": 100}, ("0", "-1")),
        ("--window-kv-tokens", {None: None, "0": 0, "8192": 8192}, ("-1", "some", "1.5")),
        ("--kv-bits", {None: None, "8": 8, "4": 4}, ("7", "16", "eight")),
        ("--kv-group-size", {None: 64, "32": 32, "128": 128}, ("48", "0")),
        ("--max-running", {None: 64, "1": 1}, ("0",)),
        ("--queue-limit", {None: 1024, "0": 0}, ("-1",)),
        ("--max-overtakes", {None: 4, "0": 0}, ("-1",)),
        ("--row-ceiling", {None: 2048}, ("0",)),
        ("--max-model-len", {None: None, "4096": 4096}, ("0",)),
        ("--memory-budget-gb", {None: None, "1.5": 1.5}, ("0", "-1", "inf", "nan")),
        ("--drain-timeout", {None: 10.0, "0": 0.0}, ("-1", "soon", "inf")),
    ],
)
def test_scheduler_flags_parse_their_values_and_refuse_bad_ones(capsys, flag, parsed, bad):
    parser = build_parser()
    attribute = flag.removeprefix("--").replace("-", "_")
    for text, value in parsed.items():  # None: the default
        args = parser.parse_args(["serve"] if text is None else ["serve", flag, text])
        assert getattr(args, attribute) == value
    for text in bad:
        with pytest.raises(SystemExit):
            parser.parse_args(["serve", flag, text])
        assert flag in capsys.readouterr().err


def test_serve_refuses_a_taken_port_before_loading_the_model(tmp_path):
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        done = subprocess.run([sys.executable, "-m", "mlx_serve", "serve", "--port", str(port), "--no-progress"],
                              capture_output=True, text=True, timeout=60)
    assert done.returncode == 1
    assert f"error: cannot listen on 127.0.0.1:{port}" in done.stderr and "Traceback" not in done.stderr
    assert "loading" not in done.stderr  # refused before the model loaded


def test_serve_refuses_a_row_floor_above_the_ceiling():
    done = subprocess.run([sys.executable, "-m", "mlx_serve", "serve", "--row-floor", "512", "--row-ceiling", "64",
                           "--port", str(_free_port()), "--no-progress"], capture_output=True, text=True, timeout=120)
    assert done.returncode == 1 and "Traceback" not in done.stderr
    assert "error: --row-floor (512) must be at most --row-ceiling (64)" in done.stderr


def test_serve_refuses_a_window_space_too_small_for_one_window(tmp_path):
    from mlx_serve.checkpoints import make_checkpoint

    path = make_checkpoint(tmp_path / "gemma3", arch="gemma3", seed=0)  # 16-token windows
    done = subprocess.run([sys.executable, "-m", "mlx_serve", "serve", "--model", str(path), "--window-kv-tokens", "8",
                           "--port", str(_free_port()), "--no-progress"], capture_output=True, text=True, timeout=120)
    assert done.returncode == 1 and "Traceback" not in done.stderr
    assert "error: window_kv_tokens 8 cannot hold one request's window of 16 tokens" in done.stderr


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _wait_for_health(url: str, process: subprocess.Popen, timeout_s: float = 120.0) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        assert process.poll() is None, process.stderr.read()
        try:
            if httpx.get(f"{url}/health", timeout=1).status_code == 200:
                return
        except httpx.TransportError:
            time.sleep(0.1)
    raise AssertionError("the server did not come up")


def _start_server(model: Path, port: int, *flags: str) -> subprocess.Popen:
    return subprocess.Popen(
        [sys.executable, "-m", "mlx_serve", "serve", "--model", str(model), "--port", str(port), "--no-progress",
         *flags], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)


def _stream_then_signal(url: str, process: subprocess.Popen, max_tokens: int) -> list[str]:
    """Open a completion stream, SIGTERM the server after its first chunk, return every data line read."""
    body = {"model": "qwen3", "prompt": "drain me", "max_tokens": max_tokens, "temperature": 0,
            "ignore_eos": True, "stream": True}
    received = []
    try:
        with httpx.stream("POST", f"{url}/v1/completions", json=body, timeout=60) as response:
            for line in response.iter_lines():
                if line.startswith("data: "):
                    received.append(line)
                    if len(received) == 1:
                        process.send_signal(signal.SIGTERM)
    except httpx.TransportError:  # a stream cut at the drain bound ends without its last chunk
        pass
    return received


def test_sigterm_lets_open_streams_finish_then_exits(tiny_qwen3: Path, tmp_path: Path):
    port, trace = _free_port(), tmp_path / "trace.jsonl"
    process = _start_server(tiny_qwen3, port, "--kv-blocks", "128", "--drain-timeout", "60", "--trace", str(trace))
    try:
        _wait_for_health(f"http://127.0.0.1:{port}", process)
        lines = _stream_then_signal(f"http://127.0.0.1:{port}", process, max_tokens=300)
        assert lines[-1] == "data: [DONE]"
        assert json.loads(lines[-2][6:])["choices"][0]["finish_reason"] == "length"
        assert process.wait(timeout=60) == 0
    finally:
        if process.poll() is None:
            process.kill()
            process.wait()
    assert "draining" in process.stderr.read()
    assert trace.exists() and trace.read_text().strip()


def test_drain_is_bounded(tiny_qwen3: Path):
    port = _free_port()
    process = _start_server(tiny_qwen3, port, "--kv-blocks", "300", "--drain-timeout", "1")
    try:
        _wait_for_health(f"http://127.0.0.1:{port}", process)
        lines = _stream_then_signal(f"http://127.0.0.1:{port}", process, max_tokens=4000)
        signalled = time.monotonic()
        assert process.wait(timeout=60) == 0
        assert time.monotonic() - signalled < 30
        assert "data: [DONE]" not in lines  # cut at the bound, long before 4000 tokens
    finally:
        if process.poll() is None:
            process.kill()
            process.wait()


def test_chat_streams_replies_until_exit(tiny_qwen3: Path):
    script = "hello\n/reset\nhi again\n/exit\n"
    done = subprocess.run(
        [sys.executable, "-m", "mlx_serve", "chat", "--model", str(tiny_qwen3), "--kv-blocks", "64",
         "--max-tokens", "4", "--temperature", "0", "--no-progress"],
        input=script, capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    assert done.stdout.count("model> ") == 2
    assert done.stdout.count("you> ") == 4


def test_scheduling_flags_reach_the_engine_config():
    from mlx_serve.commands.serve import engine_config

    args = build_parser().parse_args(["serve", "--floor-slack", "1.25", "--max-prefill-slowdown", "1.3",
                                      "--checked-fill", "untraced", "--price-first-runs", "on", "--warm-chunk-rows", "8",
                                      "--debt-tolerance", "1.5"])  # fmt: skip
    config = engine_config(args)
    assert (config.floor_slack, config.max_prefill_slowdown, config.checked_fill) == (1.25, 1.3, "untraced")
    assert config.price_first_runs is True
    assert config.warm_chunk_rows == 8 and engine_config(build_parser().parse_args(["serve"])).warm_chunk_rows == 0
    assert config.debt_tolerance == 1.5
    defaults = engine_config(build_parser().parse_args(["serve"]))
    assert (defaults.checked_fill, defaults.floor_slack) == ("on", "auto")
    assert defaults.price_first_runs is False and defaults.debt_tolerance == 1.25
    assert defaults.price_stand_in_runs is True
    assert engine_config(build_parser().parse_args(["serve", "--price-stand-in-runs", "off"])).price_stand_in_runs is False
    assert (defaults.run_idle_traces, defaults.time_idle_traces) == (True, True)
    untimed = engine_config(build_parser().parse_args(["serve", "--time-idle-traces", "off"]))
    assert (untimed.run_idle_traces, untimed.time_idle_traces) == (True, False)
    assert engine_config(build_parser().parse_args(["serve", "--run-idle-traces", "off"])).run_idle_traces is False


def test_adapter_memory_is_kept_only_where_adapters_may_be_loaded():
    from mlx_serve.commands.serve import engine_config

    def kept(*flags: str) -> float:
        return engine_config(build_parser().parse_args(["serve", *flags])).adapter_memory_gb

    assert kept() == 0.0 and kept("--allow-adapter-loading") == 1.0
    assert kept("--allow-adapter-loading", "--adapter-memory-gb", "0.25") == 0.25
    assert kept("--adapter-memory-gb", "2") == 2.0  # for Engine.load_adapter from Python, or a later flag


def test_a_draft_model_drafts_three_tokens_unless_told(tmp_path):
    from mlx_serve import engine_setup
    from mlx_serve.commands.serve import engine_config

    def config(*flags: str):
        return engine_config(build_parser().parse_args(["serve", *flags]))

    drafted = config("--draft-model", str(tmp_path), "--draft-kv-tokens", "4096")
    assert (drafted.draft_model, drafted.draft_kv_tokens) == (str(tmp_path), 4096)
    assert engine_setup.speculative_tokens(drafted) == 3
    assert engine_setup.speculative_tokens(config("--draft-model", "d", "--speculative-tokens", "5")) == 5
    assert engine_setup.speculative_tokens(config()) == 0


def test_chat_answers_through_a_named_adapter_and_refuses_an_unknown_one(tiny_qwen3: Path, tmp_path: Path,
                                                                        tiny_tokenizer) -> None:  # fmt: skip
    import io

    from mlx_serve.commands.chat import stream_reply
    from mlx_serve.types import TokenEvent

    refused = subprocess.run([sys.executable, "-m", "mlx_serve", "chat", "--model", str(tiny_qwen3), "--adapter",
                              "sql", "--no-progress"], input="", capture_output=True, text=True, timeout=120)
    assert refused.returncode == 1 and "--adapter 'sql' names no --lora adapter" in refused.stderr

    class Engine:  # what stream_reply needs of an engine, recording the request it gets
        tokenizer = tiny_tokenizer
        context_length = 4096
        submitted: list = []

        def submit(self, request):
            self.submitted.append(request)
            return iter([TokenEvent(request.request_id, 5, "ok", finish_reason="stop")])

    args = build_parser().parse_args(["chat", "--lora", f"sql={tmp_path}", "--adapter", "sql"])
    engine = Engine()
    assert stream_reply(engine, [{"role": "user", "content": "hi"}], args, io.StringIO()) == "ok"
    assert engine.submitted[0].adapter == "sql"
