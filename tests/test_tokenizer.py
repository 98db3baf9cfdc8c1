"""Tokenizer built from GGUF metadata against transformers' GGUF tokenizer; chat template; streaming."""

from __future__ import annotations

import pytest

from tests.conftest import CHAT_PROMPTS
from tokenmill.model.tokenizer import IncrementalDetokenizer

TEXTS = [
    "Hello, world!",
    "  leading spaces and trailing   ",
    "Numbers: 12345 3.14159 -42 1e10 2024-11-29",
    "Emoji: 🚀🔥👩‍👩‍👧‍👦 🇫🇷 and more 😀😃",
    "Unicode: naïve café, Straße, Ελληνικά, русский, 東京, 한국어, العربية, हिन्दी",
    "Code:\n\tdef f(x):\n\t\treturn x ** 2  # comment\n",
    "Mixed\r\nline\rendings\n\n\n",
    "Special tokens inline: <|im_start|>user\nhi<|im_end|>",
    "Contractions: don't won't it's we'll they're I'd",
    "URL https://example.com/path?q=1&r=2#frag and email a.b@c.de",
    "",
    " ",
    "a" * 300,
    "Zero-width\u200bjoiner and combining e\u0301",
]


@pytest.mark.parametrize("text", TEXTS)
def test_encode_decode_match_transformers(tokenizer, hf_tokenizer, text: str) -> None:  # noqa: ANN001
    ids = tokenizer.encode(text)
    assert ids == hf_tokenizer(text, add_special_tokens=True).input_ids
    assert tokenizer.decode(ids, skip_special_tokens=False) == hf_tokenizer.decode(ids, skip_special_tokens=False)
    assert tokenizer.decode(ids) == hf_tokenizer.decode(ids, skip_special_tokens=True)


def test_special_token_ids(tokenizer, hf_tokenizer) -> None:  # noqa: ANN001
    assert tokenizer.bos_token_id == hf_tokenizer.bos_token_id
    assert tokenizer.eos_token_id == hf_tokenizer.eos_token_id
    assert tokenizer.vocab_size == len(hf_tokenizer)
    assert tokenizer.encode("<|im_end|>") == [tokenizer.eos_token_id]


@pytest.mark.parametrize("messages", CHAT_PROMPTS)
def test_chat_template_matches_apply_chat_template(tokenizer, hf_tokenizer, messages) -> None:  # noqa: ANN001
    for generation_prompt in (True, False):
        expected = hf_tokenizer.apply_chat_template(messages, add_generation_prompt=generation_prompt, tokenize=False)
        assert tokenizer.apply_chat_template(messages, add_generation_prompt=generation_prompt) == expected
    expected_ids = hf_tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=True,
                                                    return_dict=False)
    assert tokenizer.encode_chat(messages) == list(expected_ids)


def test_empty_conversation_is_an_error(tokenizer) -> None:  # noqa: ANN001
    with pytest.raises(ValueError, match="empty"):
        tokenizer.apply_chat_template([])


@pytest.mark.parametrize("text", [t for t in TEXTS if t.strip()])
def test_streaming_deltas_concatenate_to_the_full_decode(tokenizer, text: str) -> None:  # noqa: ANN001
    ids = tokenizer.encode(text)
    detok = IncrementalDetokenizer(tokenizer, skip_special_tokens=True)
    deltas = [detok.add_tokens([t]) for t in ids]
    deltas.append(detok.finish())
    assert all("\ufffd" not in d for d in deltas)
    assert "".join(deltas) == tokenizer.decode(ids)


def test_streaming_waits_for_split_multibyte_characters(tokenizer) -> None:  # noqa: ANN001
    # An emoji is several byte-level tokens: nothing may be emitted until its last byte arrives.
    ids = tokenizer.encode("🚀")
    assert len(ids) > 1
    detok = IncrementalDetokenizer(tokenizer)
    assert [detok.add_tokens([t]) for t in ids[:-1]] == [""] * (len(ids) - 1)
    assert detok.add_tokens(ids[-1:]) == "🚀"


def test_converted_gguf_tokenizer_is_cached_and_reads_back_the_same(model_path: str, tmp_path,  # noqa: ANN001
                                                                     monkeypatch) -> None:  # noqa: ANN001
    """The first start converts the file's vocabulary and keeps tokenizer.json in the cache; the next reads it
    back and tokenizes the same (a damaged entry is rebuilt, not trusted)."""
    from tokenmill.model.tokenizer import Tokenizer

    monkeypatch.setenv("TOKENMILL_CACHE_DIR", str(tmp_path))
    built = Tokenizer.from_gguf(model_path)
    entries = list((tmp_path / "tokenizers").glob("*.json"))
    assert len(entries) == 1
    cached = Tokenizer.from_gguf(model_path)
    text = "Héllo wörld <|im_start|>user\n  indented\tcode() 12345 🙂"
    assert cached.encode(text) == built.encode(text) and cached.decode(built.encode(text)) == built.decode(
        built.encode(text))
    entries[0].write_text("{not json")
    assert Tokenizer.from_gguf(model_path).encode(text) == built.encode(text)
