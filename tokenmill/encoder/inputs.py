"""One input to embed, and the checks every embedding path applies to it (torch-free: the API front end runs
them for decoders served through the engine cores)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from tokenmill.model.tokenizer import Tokenizer


@dataclass
class EncoderInput:
    token_ids: list[int]
    token_type_ids: list[int] | None = None  # 0 for every token when None


def checked_input(token_ids: list[int], token_type_ids: list[int] | None, vocab_size: int, max_len: int,
                  truncate_prompt_tokens: int | None, keep_last: bool) -> EncoderInput:
    """ValueError for an empty input, a token id outside the vocabulary, or one longer than `max_len` unless the
    request asks to truncate (`truncate_prompt_tokens`: keep that many, the last one too when `keep_last`, as a
    tokenizer's closing special token)."""
    if not token_ids:
        raise ValueError("an input is empty")
    bad = next((t for t in token_ids if not 0 <= t < vocab_size), None)
    if bad is not None:
        raise ValueError(f"token id {bad} is out of the vocabulary (0..{vocab_size - 1})")
    types = token_type_ids or [0] * len(token_ids)
    if truncate_prompt_tokens is not None:
        if truncate_prompt_tokens < 1:
            raise ValueError("truncate_prompt_tokens must be >= 1")
        keep = min(truncate_prompt_tokens, max_len)
        if len(token_ids) > keep:
            tail = 1 if keep_last and keep > 1 else 0
            token_ids = token_ids[:keep - tail] + token_ids[len(token_ids) - tail:]
            types = types[:keep - tail] + types[len(types) - tail:]
    if len(token_ids) > max_len:
        raise ValueError(f"an input has {len(token_ids)} tokens, more than this model's maximum of {max_len}: "
                         "shorten it or set truncate_prompt_tokens")
    return EncoderInput(token_ids, types if token_type_ids is not None else None)


def decoder_input(tokenizer: Tokenizer, vocab_size: int, max_len: int, text: str | list[int],
                  truncate_prompt_tokens: int | None = None) -> EncoderInput:
    """A decoder embedding model's input: a text with the special tokens its tokenizer adds for pooling, or
    token ids as they are."""
    if isinstance(text, str):
        if not text:
            raise ValueError("an input is an empty string")
        return checked_input(tokenizer.encode_for_pooling(text), None, vocab_size, max_len, truncate_prompt_tokens,
                             keep_last=True)
    return checked_input([int(t) for t in text], None, vocab_size, max_len, truncate_prompt_tokens,
                         keep_last=False)
