"""An encoder's WordPiece tokenizer through the `tokenizers` library: an HF directory's `tokenizer.json` as it
is, or one built from a GGUF file's vocabulary.

llama.cpp's converter stores BERT vocabularies with a "phantom space": a word-initial piece `x` as `▁x` and a
continuation `##x` as plain `x`. Reversed here, the vocabulary is BERT's again, and the standard BERT
normalizer (lowercase, accents stripped, as llama.cpp's WPM tokenizer does), pre-tokenizer and [CLS]/[SEP]
template apply.
"""

from __future__ import annotations

import os

from tokenizers import Tokenizer, models, normalizers, pre_tokenizers, processors

from tokenmill.model.gguf_file import GGUFFile
from tokenmill.model.tokenizer import Tokenizer as TextTokenizer

PHANTOM_SPACE = "\u2581"
GGUF_CONTROL_TOKEN = 3


class EncoderTokenizer:
    def __init__(self, tokenizer: Tokenizer) -> None:
        tokenizer.no_truncation()
        tokenizer.no_padding()
        self._tokenizer = tokenizer

    @classmethod
    def from_path(cls, path: str, reader: GGUFFile | None = None) -> EncoderTokenizer:
        if os.path.isdir(path):
            return cls(Tokenizer.from_file(os.path.join(path, "tokenizer.json")))
        return cls(_from_gguf(reader or GGUFFile(path)))

    @property
    def vocab_size(self) -> int:
        return self._tokenizer.get_vocab_size(with_added_tokens=True)

    def encode(self, text: str, pair: str | None = None) -> tuple[list[int], list[int]]:
        """Token ids with the model's special tokens, and their token types (0; 1 for the pair's)."""
        encoding = self._tokenizer.encode(text, pair)
        return list(encoding.ids), list(encoding.type_ids)

    def decode(self, token_ids: list[int]) -> str:
        return self._tokenizer.decode(token_ids)

    def as_tokenizer(self) -> TextTokenizer:
        """The engine's Tokenizer over the same vocabulary (the front end's /tokenize and input checks)."""
        return _EncoderTextTokenizer(self._tokenizer)


class _EncoderTextTokenizer(TextTokenizer):
    """An encoder's vocabulary as the engine's Tokenizer: special tokens from the tokenizer's own template
    ([CLS] ... [SEP]); no chat template, no end-of-sequence to stop at."""

    def __init__(self, backend: Tokenizer) -> None:
        super().__init__(backend, bos_token_id=None, eos_token_id=None, add_bos_token=False, chat_template=None)

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        return list(self.backend.encode(text, add_special_tokens=add_special_tokens).ids)


def _from_gguf(reader: GGUFFile) -> Tokenizer:
    kind = reader.fields.get("tokenizer.ggml.model")
    if kind != "bert":
        raise ValueError(f"encoder GGUF tokenizer {kind!r} is not supported (bert: WordPiece)")
    tokens = list(reader.fields["tokenizer.ggml.tokens"])
    types = list(reader.fields.get("tokenizer.ggml.token_type", [1] * len(tokens)))
    vocab: dict[str, int] = {}
    for i, (token, kind_id) in enumerate(zip(tokens, types, strict=True)):
        if kind_id == GGUF_CONTROL_TOKEN or (token.startswith("[") and token.endswith("]")):
            piece = token
        elif token.startswith(PHANTOM_SPACE):
            piece = token[1:]
        else:
            piece = "##" + token
        vocab.setdefault(piece, i)

    def special(key: str, default: int) -> str:
        return tokens[int(reader.fields.get(f"tokenizer.ggml.{key}_token_id", default))]

    unk, cls, sep = special("unknown", 100), special("bos", 101), special("seperator", 102)
    tokenizer = Tokenizer(models.WordPiece(vocab, unk_token=unk, max_input_chars_per_word=100))
    tokenizer.normalizer = normalizers.BertNormalizer(clean_text=True, handle_chinese_chars=True,
                                                      strip_accents=True, lowercase=True)
    tokenizer.pre_tokenizer = pre_tokenizers.BertPreTokenizer()
    tokenizer.post_processor = processors.TemplateProcessing(
        single=f"{cls} $A {sep}", pair=f"{cls} $A {sep} $B:1 {sep}:1",
        special_tokens=[(cls, vocab[cls]), (sep, vocab[sep])])
    return tokenizer
