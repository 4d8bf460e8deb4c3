"""`chat`: an interactive terminal chat with a model, streamed token by token (no HTTP in between)."""

from __future__ import annotations

import argparse
import sys
from typing import Any, TextIO

from mlx_serve.commands.serve import add_engine_arguments

HELP = "Chat with a model in the terminal (streaming; /reset clears the conversation, /exit or Ctrl-D quits)."


def add_arguments(parser: argparse.ArgumentParser) -> None:
    add_engine_arguments(parser)
    c = parser.add_argument_group("chat")
    c.add_argument("--system", default=None, help="a system prompt for the conversation")
    c.add_argument("--max-tokens", type=int, default=512, help="most tokens per reply (default: %(default)s)")
    c.add_argument("--temperature", type=float, default=0.7, help="sampling temperature; 0 = greedy "
                                                                  "(default: %(default)s)")
    c.add_argument("--top-p", type=float, default=0.95, help="nucleus sampling mass (default: %(default)s)")
    c.add_argument("--seed", type=int, default=None, help="sampling seed, for reproducible replies")
    c.add_argument("--adapter", default=None, metavar="NAME",
                   help="answer through the --lora adapter of this name (default: the model itself)")


def run(args: argparse.Namespace) -> int:
    from mlx_serve.commands.serve import load_engine
    from mlx_serve.errors import InvalidRequest

    if args.adapter is not None and args.adapter not in {spec.name for spec in args.lora}:
        raise InvalidRequest(f"--adapter {args.adapter!r} names no --lora adapter", param="adapter")
    engine = load_engine(args)
    try:
        chat_loop(engine, args, sys.stdin, sys.stdout)
    finally:
        engine.shutdown(timeout_s=2.0)
    return 0


def chat_loop(engine: Any, args: argparse.Namespace, stdin: TextIO, stdout: TextIO) -> None:
    """Read a line, stream the reply, remember both; until /exit or end of input."""
    history = _fresh(args.system)
    print(f"chatting with {engine.model_id}  (/reset, /exit)", file=stdout)
    while True:
        print("you> ", end="", file=stdout, flush=True)
        line = stdin.readline()
        if not line or line.strip() == "/exit":
            print(file=stdout)
            return
        if line.strip() == "/reset":
            history = _fresh(args.system)
            continue
        if not line.strip():
            continue
        history.append({"role": "user", "content": line.rstrip("\n")})
        reply = stream_reply(engine, history, args, stdout)
        history.append({"role": "assistant", "content": reply})


def _fresh(system: str | None) -> list[dict[str, str]]:
    return [{"role": "system", "content": system}] if system else []


def stream_reply(engine: Any, history: list[dict[str, str]], args: argparse.Namespace, stdout: TextIO) -> str:
    from mlx_serve.server.tools import render_chat
    from mlx_serve.types import GenerationRequest, SamplingParams

    prompt = render_chat(engine.tokenizer, history, None)
    room = max(1, engine.context_length - len(prompt))
    sampling = SamplingParams(temperature=args.temperature, top_p=args.top_p, seed=args.seed)
    handle = engine.submit(GenerationRequest(prompt_ids=tuple(prompt), max_tokens=min(args.max_tokens, room),
                                             sampling=sampling, adapter=getattr(args, "adapter", None)))
    print("model> ", end="", file=stdout, flush=True)
    pieces = []
    try:
        for event in handle:  # submitted outside an event loop: the handle is read blocking
            pieces.append(event.text)
            print(event.text, end="", file=stdout, flush=True)
            if event.finish_reason == "error":
                print(f"\n[error: {event.error}]", end="", file=stdout)
    except KeyboardInterrupt:  # Ctrl-C stops this reply, not the chat
        handle.cancel()
        print(" [stopped]", end="", file=stdout)
    print(file=stdout)
    return "".join(pieces)
