"""`generate`: run one prompt through the engine and print the completion."""

from __future__ import annotations

import argparse
import json
import math
import sys
import time
from pathlib import Path

from mlx_serve.commands.serve import positive_float_arg, whole_number_arg

HELP = "generate text for one prompt (offline, through the engine)"


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--model", default=None, help="model directory or hub id (default: the built-in tiny dummy model)")
    parser.add_argument("--adapter-path", default=None, metavar="DIR",
                        help="an mlx_lm.lora adapter applied to the model, as mlx_lm.load applies it")
    parser.add_argument("--chat-template", default=None, metavar="FILE_OR_TEMPLATE",
                        help="a Jinja chat template, or a file holding one, in place of the checkpoint's")
    parser.add_argument("--prompt", required=True, help="the user message (the chat template is applied)")
    parser.add_argument("--raw", action="store_true", help="use the prompt as is, without the chat template")
    parser.add_argument("--max-tokens", type=int, default=128, help="most tokens to generate (default 128)")
    parser.add_argument("--temperature", type=float, default=0.0, help="0 is greedy (default)")
    parser.add_argument("--top-p", type=float, default=1.0, help="nucleus sampling threshold (default 1.0: off)")
    parser.add_argument("--top-k", type=int, default=0, help="sample from the k most likely tokens (default 0: off)")
    parser.add_argument("--seed", type=int, default=None, help="seed for sampling")
    parser.add_argument("--stop", action="append", default=[], help="stop string (repeatable)")
    parser.add_argument("--memory-budget-gb", type=positive_float_arg, default=None,
                        help="weights + KV pool budget in GiB")
    parser.add_argument("--speculative-tokens", type=whole_number_arg(0), default=0, metavar="K",
                        help="verify up to K prompt-lookup drafts a step (default 0: off)")
    parser.add_argument("--draft-model", default=None, metavar="DIR_OR_ID",
                        help="a small model of the same vocabulary drafts instead (with no --speculative-tokens: 3)")
    parser.add_argument("--json", action="store_true", help="print one JSON object on the last line")
    parser.add_argument("--json-schema", type=Path, default=None, metavar="FILE",
                        help="answer with JSON that follows this JSON Schema, enforced token by token")
    parser.add_argument("--score", action="store_true",
                        help="also score the prompt: its log-probability and perplexity (with --json, each token's)")


def run(args: argparse.Namespace) -> int:
    from mlx_serve.engine import Engine, EngineConfig
    from mlx_serve.types import GenerationRequest, SamplingParams

    grammar = _schema_grammar(args.json_schema) if args.json_schema else None
    t_load = time.perf_counter()
    engine = Engine.load(EngineConfig(model=args.model, adapter_path=args.adapter_path,
                                      chat_template=args.chat_template, memory_budget_gb=args.memory_budget_gb,
                                      speculative_tokens=args.speculative_tokens, draft_model=args.draft_model))
    load_s = time.perf_counter() - t_load
    try:
        if args.raw:
            prompt_ids = engine.tokenizer.encode(args.prompt)
        else:
            messages = [{"role": "user", "content": args.prompt}]
            prompt_ids = engine.tokenizer.apply_chat_template(messages, add_generation_prompt=True)
        sampling = SamplingParams(
            temperature=args.temperature, top_p=args.top_p, top_k=args.top_k, seed=args.seed, grammar=grammar,
            prompt_logprobs=0 if args.score else None,
        )
        request = GenerationRequest(
            prompt_ids=tuple(prompt_ids), max_tokens=args.max_tokens, sampling=sampling, stop=tuple(args.stop)
        )
        t0 = time.perf_counter()
        handle = engine.submit(request)
        token_ids, pieces, first = [], [], None
        finish, error, scores = None, None, None
        for event in handle:
            first = first or time.perf_counter()
            scores = scores or event.prompt_logprobs
            if event.token_id is not None:
                token_ids.append(event.token_id)
            pieces.append(event.text)
            if not args.json:
                sys.stdout.write(event.text)
                sys.stdout.flush()
            finish, error = event.finish_reason, event.error
        total = time.perf_counter() - t0
    finally:
        engine.shutdown()
    if error:
        print(f"error: {error}", file=sys.stderr)
        return 1
    score = _prompt_score(scores) if args.score else {}
    if args.json:
        decode_s = total - (first - t0) if first else 0.0
        print(
            json.dumps(
                {
                    **score,
                    "token_ids": token_ids,
                    "text": "".join(pieces),
                    "finish_reason": finish,
                    "prompt_tokens": len(prompt_ids),
                    "timings": {
                        "load_s": round(load_s, 4),
                        "ttft_s": round((first - t0) if first else 0.0, 4),
                        "total_s": round(total, 4),
                        "decode_tokens_per_s": round((len(token_ids) - 1) / decode_s, 2) if decode_s > 0 else None,
                    },
                }
            )
        )
    else:
        print()
        if score:
            print(f"prompt: {len(prompt_ids)} tokens, log-probability {score['prompt_logprob']:.4f}, "
                  f"perplexity {score['prompt_perplexity']:.4f}", file=sys.stderr)
    return 0


def _prompt_score(entries: tuple) -> dict:
    """The prompt's summed log-probability (its first token is not scored), perplexity over the tokens scored,
    and each token's entry."""
    logprobs = [e.logprob for e in entries[1:]]
    total = sum(logprobs)
    return {"prompt_logprob": total, "prompt_perplexity": math.exp(-total / len(logprobs)) if logprobs else None,
            "prompt_logprobs": [[e.token_id, e.logprob] for e in entries]}


def _schema_grammar(path: Path) -> str:
    """The grammar of a JSON Schema file, or InvalidRequest (a clear message and exit 1) for a bad one."""
    from mlx_serve.errors import InvalidRequest, parse_client_json
    from mlx_serve.grammar import grammar_for_response_format

    try:
        text = path.read_text()
    except (OSError, ValueError) as exc:  # ValueError: not UTF-8
        raise InvalidRequest(f"--json-schema {path}: {exc}", param="json_schema") from None
    schema = parse_client_json(text, f"--json-schema {path}", "json_schema")
    return grammar_for_response_format({"type": "json_schema", "json_schema": {"schema": schema}})
