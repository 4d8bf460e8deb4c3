"""A thinking model's reasoning, split from its answer (`reasoning_content`, as mlx-lm's and vLLM's servers do).

The text between the tokenizer's think markers (mlx-lm infers them: Qwen3's `<think>` / `</think>`, and others) is
reasoning; the rest is the answer. A prompt whose generation prompt opened a think block starts in reasoning.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from mlx_serve.server.tools import partial_suffix


@dataclass(slots=True)
class ReasoningSplitter:
    """Splits streamed text into (answer, reasoning) at the think markers; holds back a marker's possible start."""

    start: str
    end: str
    in_reasoning: bool = False
    _held: str = ""

    def feed(self, text: str) -> tuple[str, str]:
        """The answer text and reasoning text safe to show now."""
        self._held += text
        answer, reasoning = "", ""
        while (at := self._held.find(marker := self.end if self.in_reasoning else self.start)) >= 0:
            if self.in_reasoning:
                reasoning += self._held[:at]
            else:
                answer += self._held[:at]
            self._held = self._held[at + len(marker) :]
            self.in_reasoning = not self.in_reasoning
        keep = partial_suffix(self._held, self.end if self.in_reasoning else self.start)
        ready, self._held = self._held[: len(self._held) - keep], self._held[len(self._held) - keep :]
        return (answer, reasoning + ready) if self.in_reasoning else (answer + ready, reasoning)

    def finish(self) -> tuple[str, str]:
        """What is held at the end of output (a marker's start that never completed)."""
        held, self._held = self._held, ""
        return ("", held) if self.in_reasoning else (held, "")


def make_reasoning_splitter(tokenizer: Any, prompt_ids: Sequence[int], enabled: bool) -> ReasoningSplitter | None:
    """A splitter for a thinking model's chat answer (None: off, or the tokenizer has no think markers)."""
    if not enabled or not getattr(tokenizer, "has_thinking", False):
        return None
    opened = tokenizer.rfind_think_start(list(prompt_ids)) > tokenizer.rfind_think_end(list(prompt_ids))
    return ReasoningSplitter(tokenizer.think_start, tokenizer.think_end, in_reasoning=opened)
