"""`run-batch`: an OpenAI batch file through the server's routes in process. Every line gets one output line, in
input order: a run request its route's status and body (greedy answers are mlx-lm's), a malformed one the reason."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from mlx_serve.cli import main
from mlx_serve.commands.run_batch import answer
from tests.engine.reference import load_reference, prompt_of, reference_tokens


def _line(custom_id: str, url: str, body: dict) -> dict:
    return {"custom_id": custom_id, "method": "POST", "url": url, "body": body}


def _run(tmp_path: Path, model: Path, lines: list, *options: str) -> tuple[int, list[dict]]:
    source, target = tmp_path / "in.jsonl", tmp_path / "out.jsonl"
    source.write_text("\n".join(line if isinstance(line, str) else json.dumps(line) for line in lines) + "\n")
    code = main(["run-batch", "-i", str(source), "-o", str(target), "--model", str(model), "--kv-blocks", "64",
                 "--no-progress", "--no-warm-up", "--max-concurrency", "4", *options])  # fmt: skip
    return code, [json.loads(line) for line in target.read_text().splitlines()] if target.exists() else []


def test_every_line_gets_its_answer_in_input_order(tmp_path, tiny_qwen3):
    prompts = [prompt_of(n, seed=900 + i) for i, n in enumerate((12, 40, 7, 25))]
    lines = [_line(f"c{i}", "/v1/completions", {"prompt": p, "max_tokens": 8, "temperature": 0})
             for i, p in enumerate(prompts)]  # fmt: skip
    lines += [
        _line("chat", "/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 4}),
        _line("embed", "/v1/embeddings", {"input": "a sentence"}),
        "not json",
        _line("bad-url", "/v1/nope", {}),
        _line("streams", "/v1/completions", {"prompt": "x", "stream": True}),
        _line("bad-body", "/v1/chat/completions", {"messages": [], "max_tokens": 3}),
        {"custom_id": 7, "method": "POST", "url": "/v1/completions", "body": {}},
    ]
    code, results = _run(tmp_path, tiny_qwen3, lines)
    assert code == 0
    assert [r["custom_id"] for r in results] == ["c0", "c1", "c2", "c3", "chat", "embed", None, "bad-url", "streams",
                                                 "bad-body", 7]  # fmt: skip
    _, tokenizer = load_reference(str(tiny_qwen3))
    for prompt, result in zip(prompts, results):
        assert result["error"] is None and result["response"]["status_code"] == 200
        assert result["response"]["body"]["choices"][0]["text"] == tokenizer.decode(reference_tokens(tiny_qwen3, prompt, 8))
    assert results[4]["response"]["body"]["object"] == "chat.completion"
    assert results[5]["response"]["body"]["data"][0]["object"] == "embedding"
    assert "not JSON" in results[6]["error"]["message"] and results[6]["response"] is None
    assert "url must be one of" in results[7]["error"]["message"]
    assert "cannot stream" in results[8]["error"]["message"]
    assert results[9]["error"] is None and results[9]["response"]["status_code"] == 400
    assert "messages" in results[9]["response"]["body"]["error"]["message"]
    assert "custom_id must be a string" in results[10]["error"]["message"]
    assert len({r["id"] for r in results}) == len(results)


def test_an_unreadable_input_is_a_clear_error(tmp_path, tiny_qwen3, capsys):
    code = main(["run-batch", "-i", str(tmp_path / "missing.jsonl"), "-o", str(tmp_path / "out.jsonl"),
                 "--model", str(tiny_qwen3), "--no-progress"])  # fmt: skip
    assert code == 1
    assert "cannot read" in capsys.readouterr().err and not (tmp_path / "out.jsonl").exists()


def test_the_answer_options_are_serves(tmp_path, tiny_qwen3):
    """--served-model-name names the model as serve's does; --pooling mean pools as serve's /v1/embeddings does."""
    lines = [_line("named", "/v1/completions", {"model": "my-model", "prompt": "x", "max_tokens": 2}),
             _line("embed", "/v1/embeddings", {"input": "a longer sentence to pool"})]  # fmt: skip
    _, plain = _run(tmp_path, tiny_qwen3, lines)
    _, named = _run(tmp_path, tiny_qwen3, lines, "--served-model-name", "my-model", "--pooling", "mean")
    assert plain[0]["response"]["status_code"] == 404 and named[0]["response"]["status_code"] == 200
    last, mean = (r[1]["response"]["body"]["data"][0]["embedding"] for r in (plain, named))
    assert len(last) == len(mean) and last != mean


@pytest.mark.parametrize("line", ['{"custom_id": ' + "1" * 5000 + "}", "[" * 100_000])
def test_a_line_json_cannot_read_is_an_error_line_not_a_crash(line):
    result = answer(None, line)  # fails before any request is made
    assert result["response"] is None and "not JSON" in result["error"]["message"]
