"""Expected outputs for server tests: mlx-lm's greedy generation on the same prompt token ids."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from mlx_serve.server.tools import normalize_messages, render_chat
from tests.engine.reference import reference_tokens


def chat_prompt_ids(tokenizer: Any, messages: list[dict[str, Any]], tools: list[dict[str, Any]] | None = None) -> list[int]:
    """The prompt the server builds for these messages (same template, same normalisation)."""
    return render_chat(tokenizer, normalize_messages(messages), tools)


def greedy_text(model_path: Path, tokenizer: Any, prompt_ids: list[int], max_tokens: int) -> tuple[str, int, str]:
    """mlx-lm's greedy continuation: (text without the eos token, number of tokens, finish reason)."""
    tokens = reference_tokens(model_path, prompt_ids, max_tokens)
    eos = set(tokenizer.eos_token_ids)
    ended = bool(tokens) and tokens[-1] in eos
    text = tokenizer.decode([t for t in tokens if t not in eos])
    return text, len(tokens), "stop" if ended else "length"
