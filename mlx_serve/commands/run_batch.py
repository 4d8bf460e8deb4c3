"""`run-batch`: an OpenAI Batch API input file through the server's own routes, in process (vLLM's `run-batch`).

Each input line is `{"custom_id", "method": "POST", "url", "body"}` for /v1/chat/completions, /v1/completions,
/v1/embeddings or /v1/responses. Every request is sent at once (at most `--max-concurrency` in flight), so the engine
batches them as it would a server's clients; the output has one line a request, in input order, as OpenAI's batch
output has them: the route's status and body under `response`, or under `error` why the line was not run.
"""

from __future__ import annotations

import argparse
import json
import sys
import uuid
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

from mlx_serve.commands.serve import add_answer_arguments, add_engine_arguments, whole_number_arg
from mlx_serve.errors import InvalidRequest, parse_client_json

HELP = "run an OpenAI batch file (JSONL of chat, completion, embedding or responses requests) offline"
ROUTES = ("/v1/chat/completions", "/v1/completions", "/v1/embeddings", "/v1/responses")


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("-i", "--input", required=True, type=Path, metavar="FILE",
                        help="requests, one JSON object a line: custom_id, method (POST), url, body")
    parser.add_argument("-o", "--output", required=True, type=Path, metavar="FILE",
                        help="results, one JSON object a line in input order (written when every request is done)")
    parser.add_argument("--max-concurrency", type=whole_number_arg(1), default=256, metavar="N",
                        help="requests in flight at once (default 256; the engine admits --max-running of them)")
    add_answer_arguments(parser.add_argument_group("answers"))
    add_engine_arguments(parser)


def run(args: argparse.Namespace) -> int:
    from starlette.testclient import TestClient

    from mlx_serve.commands.serve import load_engine
    from mlx_serve.errors import MlxServeError
    from mlx_serve.server import create_app

    try:
        lines = [line for line in args.input.read_text().splitlines() if line.strip()]
    except (OSError, UnicodeDecodeError) as exc:
        raise MlxServeError(f"cannot read {args.input}: {exc}") from None
    engine = load_engine(args)
    try:
        app = create_app(engine, aliases=args.served_model_name, split_reasoning=args.reasoning == "split",
                         pooling=args.pooling)  # fmt: skip
        with TestClient(app) as client, ThreadPoolExecutor(args.max_concurrency) as pool:
            results = list(pool.map(lambda line: answer(client, line), lines))
    finally:
        engine.shutdown()
    try:
        args.output.write_text("".join(json.dumps(result) + "\n" for result in results))
    except OSError as exc:
        raise MlxServeError(f"cannot write {args.output}: {exc}") from None
    failed = sum(result["error"] is not None or result["response"]["status_code"] >= 400 for result in results)
    print(f"{len(results)} requests, {failed} failed: {args.output}", file=sys.stderr)
    return 0


def answer(client: Any, line: str) -> dict[str, Any]:
    """One output line for one input line."""
    try:
        item = parse_client_json(line, "the line")
    except InvalidRequest as exc:
        return _output(None, error=f"not JSON: {exc.message}")
    if not isinstance(item, dict):
        return _output(None, error="a line must be a JSON object")
    custom_id = item.get("custom_id")
    problem = _problem(item)
    if problem is not None:
        return _output(custom_id, error=problem)
    reply = client.post(item["url"], json=item["body"])
    body = reply.json()
    request_id = body.get("id") if isinstance(body, dict) and isinstance(body.get("id"), str) else None
    return _output(custom_id, response={"status_code": reply.status_code,
                                        "request_id": request_id or f"req_{uuid.uuid4().hex}", "body": body})  # fmt: skip


def _problem(item: dict[str, Any]) -> str | None:
    """Why an input line cannot be run (None: it can)."""
    if not isinstance(item.get("custom_id"), str):
        return "custom_id must be a string"
    if item.get("method") != "POST":
        return f"method must be POST, not {item.get('method')!r}"
    if item.get("url") not in ROUTES:
        return f"url must be one of {', '.join(ROUTES)}, not {item.get('url')!r}"
    if not isinstance(item.get("body"), dict):
        return "body must be a JSON object"
    if item["body"].get("stream"):
        return "a batch request cannot stream"
    return None


def _output(custom_id: Any, response: dict | None = None, error: str | None = None) -> dict[str, Any]:
    return {"id": f"batch_req_{uuid.uuid4().hex}", "custom_id": custom_id, "response": response,
            "error": None if error is None else {"code": "invalid_request", "message": error}}  # fmt: skip
