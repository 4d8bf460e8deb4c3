"""Prompts with exact token counts, and first tokens that make every request's prefix unique.

Servers tokenize a text prompt themselves, so the harness builds text whose tokenization it knows exactly: words
that the pre-tokenizer splits at spaces, so a prompt's token count is the sum of its words' counts. The final
text is re-encoded and checked; a tokenizer that breaks the assumption fails loudly instead of skewing a run.

A peer without `cache_salt` reuses any common prefix (mlx-lm's prompt cache trims a cached sequence to the
common part), so uniqueness must start at the first token: each request opens with its own one-token word.
"""

from __future__ import annotations

import random
import string
from collections.abc import Callable
from pathlib import Path

Encode = Callable[[str], list[int]]


class PromptError(Exception):
    """The tokenizer does not allow an exact prompt of the asked length."""


def load_encoder(model_dir: str | Path) -> Encode:
    """The model's tokenizer as servers apply it to a text prompt (Hugging Face fast tokenizers add special
    tokens through the same post-processor)."""
    from tokenizers import Tokenizer

    tokenizer = Tokenizer.from_file(str(Path(model_dir) / "tokenizer.json"))
    return lambda text: tokenizer.encode(text, add_special_tokens=True).ids


def vocabulary_words(model_dir: str | Path, limit: int = 20_000) -> list[str]:
    """Alphabetic words the vocabulary holds with a leading space: candidates for distinct first tokens."""
    from tokenizers import Tokenizer

    tokenizer = Tokenizer.from_file(str(Path(model_dir) / "tokenizer.json"))
    words = []
    for token_id in range(min(tokenizer.get_vocab_size(), limit)):
        text = tokenizer.decode([token_id])
        if text.startswith(" ") and text[1:].isalpha() and text[1:].isascii():
            words.append(text[1:])
    return words


class PromptBuilder:
    def __init__(self, encode: Encode, seed: int = 0, pool_size: int = 400, extra_words: list[str] = ()) -> None:
        self.encode = encode
        self.extra_words = list(extra_words)
        self.rng = random.Random(seed)
        self.overhead = len(encode(""))  # BOS and the like
        self.word_tokens = self._measure_pool(pool_size)
        self.single_words = sorted(w for w, n in self.word_tokens.items() if n == 1)
        if not self.single_words:
            raise PromptError("the tokenizer has no one-token words; exact prompt lengths are not possible")
        self.openers = self._one_token_openers()

    def _count(self, word: str) -> int:
        return len(self.encode(" " + word)) - self.overhead

    def _measure_pool(self, size: int) -> dict[str, int]:
        pool = {letter: self._count(letter) for letter in string.ascii_lowercase}
        while len(pool) < size:
            word = "".join(self.rng.choice(string.ascii_lowercase) for _ in range(self.rng.randint(2, 7)))
            pool[word] = self._count(word)
        return pool

    def _one_token_openers(self) -> list[str]:
        """Distinct one-token words that can open a prompt (their ids differ, so no two prompts share token 0)."""
        candidates = list(string.ascii_letters) + list(string.digits) + sorted(self.word_tokens) + self.extra_words
        seen, openers = set(), []
        for word in candidates:
            ids = self.encode(" " + word)[self.overhead:]
            if len(ids) == 1 and ids[0] not in seen:
                seen.add(ids[0])
                openers.append(word)
        return openers

    def opener(self, index: int) -> str:
        if index >= len(self.openers):
            raise PromptError(
                f"only {len(self.openers)} distinct first tokens; a server sees more unique requests than that"
            )
        return self.openers[index]

    def text(self, tokens: int, opener: str | None = None, rng: random.Random | None = None) -> str:
        """A text of exactly `tokens` tokens (including any BOS), optionally opening with `opener`."""
        rng = rng or self.rng
        words = [opener] if opener else []
        remaining = tokens - self.overhead - (1 if opener else 0)
        if remaining < 0:
            raise PromptError(f"cannot build a {tokens}-token prompt")
        pool = list(self.word_tokens.items())
        while remaining > 0:
            word, count = rng.choice(pool)
            if count > remaining:
                word, count = rng.choice(self.single_words), 1
            words.append(word)
            remaining -= count
        text = " " + " ".join(words)
        actual = len(self.encode(text))
        if actual != tokens:
            raise PromptError(f"built a {tokens}-token prompt but the tokenizer gives {actual} tokens")
        return text
