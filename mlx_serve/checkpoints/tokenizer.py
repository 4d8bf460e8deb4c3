"""A byte-level BPE tokenizer with exactly `vocab_size` entries, built with the `tokenizers` library.

Layout: ids 0-255 are the 256 bytes, then programmatic merges, then the ChatML added tokens at the very end,
so every id the model can emit decodes. Byte-level BPE round-trips any text, whatever the merges are.
"""

from __future__ import annotations

import json
from pathlib import Path

from mlx_serve.checkpoints.chat_template import CHAT_TEMPLATE

# (content, special): specials are dropped by decode(skip_special_tokens=True); the others stay visible,
# as in Qwen's tokenizer, so tool calls and thinking survive in the generated text.
ADDED_TOKENS = (
    ("<|endoftext|>", True),
    ("<|im_start|>", True),
    ("<|im_end|>", True),
    ("<think>", False),
    ("</think>", False),
    ("<tool_call>", False),
    ("</tool_call>", False),
    ("<tool_response>", False),
    ("</tool_response>", False),
)
EOS_TOKENS = ("<|im_end|>", "<|endoftext|>")
PAD_TOKEN = "<|endoftext|>"

_LETTERS_BY_FREQUENCY = "etaoinshrdlcumwfgypbvkjxqz"
_MERGE_EXTENSIONS = _LETTERS_BY_FREQUENCY + _LETTERS_BY_FREQUENCY.upper()


def byte_to_unicode() -> dict[int, str]:
    """The GPT-2 byte-level alphabet: printable bytes map to themselves, the rest to chars from U+0100 up."""
    printable = [
        *range(ord("!"), ord("~") + 1),
        *range(ord("¡"), ord("¬") + 1),
        *range(ord("®"), ord("ÿ") + 1),
    ]
    mapping = {b: chr(b) for b in printable}
    shifted = 0
    for b in range(256):
        if b not in mapping:
            mapping[b] = chr(256 + shifted)
            shifted += 1
    return mapping


def _merges(count: int, alphabet: dict[int, str]) -> list[tuple[str, str]]:
    """`count` deterministic merges, grown level by level: each new token is an old token plus one letter.

    Within a level the pairs whose parts ranked early come first, a stand-in for corpus frequency.
    """
    space = alphabet[ord(" ")]
    level = [space, *_MERGE_EXTENSIONS]
    merges: list[tuple[str, str]] = []
    while len(merges) < count:
        remaining = count - len(merges)
        roots = level[: -(-remaining // len(_MERGE_EXTENSIONS)) * 2]  # enough candidates, not all of them
        ranked = sorted(
            ((r + e, root, ext) for r, root in enumerate(roots) for e, ext in enumerate(_MERGE_EXTENSIONS)),
            key=lambda item: item[0],
        )
        chosen = [(root, ext) for _, root, ext in ranked[:remaining]]
        merges.extend(chosen)
        level = [root + ext for root, ext in chosen]
    return merges


def build_tokenizer(vocab_size: int):
    """A `tokenizers.Tokenizer` whose length is exactly `vocab_size`."""
    from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers

    alphabet = byte_to_unicode()
    merge_count = vocab_size - 256 - len(ADDED_TOKENS)
    if merge_count < 0:
        raise ValueError(f"vocab_size {vocab_size} is too small for a byte-level tokenizer")
    merges = _merges(merge_count, alphabet)
    vocab = {alphabet[b]: b for b in range(256)}
    for left, right in merges:
        vocab[left + right] = len(vocab)
    tokenizer = Tokenizer(models.BPE(vocab=vocab, merges=merges, fuse_unk=False))
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    tokenizer.decoder = decoders.ByteLevel()
    tokenizer.add_tokens(
        [AddedToken(text, special=special, normalized=False) for text, special in ADDED_TOKENS]
    )
    if tokenizer.get_vocab_size(with_added_tokens=True) != vocab_size:
        raise AssertionError("tokenizer size does not match vocab_size")
    return tokenizer


def token_ids(vocab_size: int) -> dict[str, int]:
    """Ids of the added tokens: they sit at the end of the vocabulary, in ADDED_TOKENS order."""
    first = vocab_size - len(ADDED_TOKENS)
    return {text: first + i for i, (text, _) in enumerate(ADDED_TOKENS)}


def tokenizer_config(vocab_size: int) -> dict:
    ids = token_ids(vocab_size)
    decoder = {
        str(ids[text]): {
            "content": text,
            "lstrip": False,
            "normalized": False,
            "rstrip": False,
            "single_word": False,
            "special": special,
        }
        for text, special in ADDED_TOKENS
    }
    return {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "added_tokens_decoder": decoder,
        "additional_special_tokens": [text for text, special in ADDED_TOKENS if special],
        "bos_token": None,
        "eos_token": EOS_TOKENS[0],
        "pad_token": PAD_TOKEN,
        "unk_token": None,
        "add_bos_token": False,
        "add_prefix_space": False,
        "clean_up_tokenization_spaces": False,
        "errors": "replace",
        "model_max_length": 131072,
        "split_special_tokens": False,
        "chat_template": CHAT_TEMPLATE,
    }


def write_tokenizer(out_dir: Path, vocab_size: int) -> None:
    """Write tokenizer.json and tokenizer_config.json into `out_dir`."""
    build_tokenizer(vocab_size).save(str(out_dir / "tokenizer.json"))
    with open(out_dir / "tokenizer_config.json", "w") as f:
        json.dump(tokenizer_config(vocab_size), f, indent=2, ensure_ascii=False)
