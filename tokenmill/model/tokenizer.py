"""Tokenizer (HF `tokenizers`), chat template (jinja2) and an incremental detokenizer for streaming."""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
import tempfile
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import jinja2
import jinja2.sandbox
from tokenizers import AddedToken, Regex, decoders, models, normalizers, pre_tokenizers
from tokenizers import Tokenizer as HFTokenizer

from tokenmill.model.families import GGUF_CONTROL_TOKEN, GGUF_NORMAL_TOKEN, GGUF_USER_DEFINED_TOKEN
from tokenmill.model.gguf_file import GGUFFile
from tokenmill.model.metadata import gguf_field
from tokenmill.platform import cache_root, release_freed_heap

_NORMAL, _CONTROL, _USER_DEFINED = GGUF_NORMAL_TOKEN, GGUF_CONTROL_TOKEN, GGUF_USER_DEFINED_TOKEN
SPIECE_SPACE = "\u2581"


# Templates for families whose files may carry none (llama.cpp has the same built in). Gemma: no system role
# (a system message is prefixed to the first user turn), the assistant is "model".
GEMMA_CHAT_TEMPLATE = (
    "{{ bos_token }}{% if messages[0]['role'] == 'system' %}{% set first = messages[0]['content'] + '\n\n' %}"
    "{% set messages = messages[1:] %}{% else %}{% set first = '' %}{% endif %}"
    "{% for message in messages %}{% set role = 'model' if message['role'] == 'assistant' else message['role'] %}"
    "{{ '<start_of_turn>' + role + '\n' + (first if loop.first else '') + message['content'] | trim + "
    "'<end_of_turn>\n' }}{% endfor %}{% if add_generation_prompt %}{{ '<start_of_turn>model\n' }}{% endif %}"
)
BUILTIN_CHAT_TEMPLATES = {"gemma3": GEMMA_CHAT_TEMPLATE}


class Tokenizer:
    def __init__(self, backend: HFTokenizer, *, bos_token_id: int | None, eos_token_id: int | None,
                 add_bos_token: bool, chat_template: str | None, add_eos_token: bool = False) -> None:
        self.backend = backend
        self.bos_token_id = bos_token_id
        self.eos_token_id = eos_token_id
        self.add_bos_token = add_bos_token
        self.add_eos_token = add_eos_token  # a GGUF's flag, read by embedding inputs (encode_for_pooling)
        self.from_hf_files = False  # its tokenizer.json's own template applies (encode_for_pooling)
        self.vocab_size = backend.get_vocab_size(with_added_tokens=True)
        self.set_chat_template(chat_template)

    def set_chat_template(self, source: str | None) -> None:
        """None or "": the model has none, and chat requests are refused with a clear error."""
        self.chat_template = source or ""
        self._template = _compile_template(source) if source else None

    @property
    def bos_token(self) -> str:
        return "" if self.bos_token_id is None else (self.backend.id_to_token(self.bos_token_id) or "")

    @property
    def eos_token(self) -> str:
        return "" if self.eos_token_id is None else (self.backend.id_to_token(self.eos_token_id) or "")

    # ------------------------------------------------------------ construction

    @classmethod
    def from_path(cls, path: str, gguf_reader: Any = None, chat_template: str | None = None) -> Tokenizer:
        """`chat_template` (vLLM's --chat-template): a file with a Jinja template, or the template itself,
        used instead of the model's."""
        tokenizer = cls.from_hf_dir(path) if os.path.isdir(path) else cls.from_gguf(path, gguf_reader)
        if chat_template is not None:
            tokenizer.set_chat_template(Path(chat_template).read_text() if os.path.isfile(chat_template)
                                        else chat_template)
        return tokenizer

    @classmethod
    def from_gguf(cls, path: str, reader: Any = None) -> Tokenizer:
        if reader is None:
            reader = GGUFFile(path)
        tokens = gguf_field(reader, "tokenizer.ggml.tokens")  # decoded only if the cache misses
        backend = _cached_backend(reader, lambda: _gguf_backend(reader, list(tokens)))
        architecture = str(gguf_field(reader, "general.architecture"))

        def token_id(key: str) -> int | None:
            value = gguf_field(reader, key)
            return None if value is None else int(value)

        return cls(
            backend,
            bos_token_id=token_id("tokenizer.ggml.bos_token_id"),
            eos_token_id=token_id("tokenizer.ggml.eos_token_id"),
            add_bos_token=bool(gguf_field(reader, "tokenizer.ggml.add_bos_token", False)),
            add_eos_token=bool(gguf_field(reader, "tokenizer.ggml.add_eos_token", False)),
            chat_template=gguf_field(reader, "tokenizer.chat_template") or BUILTIN_CHAT_TEMPLATES.get(architecture),
        )

    @classmethod
    def from_hf_dir(cls, path: str) -> Tokenizer:
        backend = _read_tokenizer_json(os.path.join(path, "tokenizer.json"))
        config: dict[str, Any] = {}
        config_path = os.path.join(path, "tokenizer_config.json")
        if os.path.exists(config_path):
            with open(config_path) as f:
                config = json.load(f)
        template = config.get("chat_template")
        template_path = os.path.join(path, "chat_template.jinja")
        if template is None and os.path.exists(template_path):
            with open(template_path) as f:
                template = f.read()

        def token_id(name: str) -> int | None:
            token = config.get(name)
            if isinstance(token, dict):
                token = token.get("content")
            return None if token is None else backend.token_to_id(token)

        tokenizer = cls(backend, bos_token_id=token_id("bos_token"), eos_token_id=token_id("eos_token"),
                        add_bos_token=bool(config.get("add_bos_token", False)), chat_template=template)
        tokenizer.from_hf_files = True
        return tokenizer

    # ------------------------------------------------------------ encode / decode

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        ids = self.backend.encode(text, add_special_tokens=False).ids
        if add_special_tokens and self.add_bos_token and self.bos_token_id is not None:
            ids = [self.bos_token_id, *ids]
        return ids

    def encode_for_pooling(self, text: str) -> list[int]:
        """An embedding model's input: with the special tokens its tokenizer adds (an HF tokenizer.json's
        template, e.g. Qwen3-Embedding's closing <|endoftext|>; a GGUF's add_bos / add_eos flags), since
        last-token pooling reads the state after the closing one."""
        if not self.add_eos_token and self.backend.post_processor is not None and self.from_hf_files:
            return list(self.backend.encode(text, add_special_tokens=True).ids)
        ids = self.encode(text)
        return ids + [self.eos_token_id] if self.add_eos_token and self.eos_token_id is not None else ids

    def decode(self, ids: Sequence[int], skip_special_tokens: bool = True) -> str:
        return self.backend.decode(list(ids), skip_special_tokens=skip_special_tokens)

    def id_to_token(self, token_id: int) -> str:
        return self.backend.id_to_token(token_id) or ""

    def apply_chat_template(self, messages: Sequence[dict[str, Any]], add_generation_prompt: bool = True,
                            **kwargs: Any) -> str:
        if not messages:
            raise ValueError("messages must not be empty")
        if self._template is None:
            raise ValueError("this model has no chat template: give one with --chat-template FILE (or "
                             "LLM(chat_template=...)), or send a completion request with a plain prompt")
        return self._template.render(messages=list(messages), add_generation_prompt=add_generation_prompt,
                                     bos_token=self.bos_token, eos_token=self.eos_token, **kwargs)

    def encode_chat(self, messages: Sequence[dict[str, Any]], add_generation_prompt: bool = True, *,
                    add_special_tokens: bool = False, **kwargs: Any) -> list[int]:
        # The template writes the special tokens itself, so none are added by default (as transformers does).
        text = self.apply_chat_template(messages, add_generation_prompt, **kwargs)
        return self.encode(text, add_special_tokens=add_special_tokens)


# The word-splitting regex of llama.cpp's pre-tokenizer types (`tokenizer.ggml.pre`) that differ from GPT-2's:
# a letter run may take one leading non-letter ("(n"), digits go one at a time (Qwen2) or up to three (Llama 3).
_WORDS = r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|"
_REST = r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
_PRE_TOKENIZER_REGEX = {
    "qwen2": _WORDS + r"\p{N}" + _REST,
    "llama-bpe": _WORDS + r"\p{N}{1,3}" + _REST,
}


def _gguf_backend(reader: Any, tokens: list[str]) -> HFTokenizer:
    """The `tokenizers` model of a GGUF's vocabulary, with its control and user-defined tokens."""
    kind = gguf_field(reader, "tokenizer.ggml.model")
    types: list[int] = list(gguf_field(reader, "tokenizer.ggml.token_type", [1] * len(tokens)))
    if kind == "gpt2":
        backend = _byte_level_bpe(reader, tokens)
    elif kind == "llama":
        backend = _sentencepiece_bpe(tokens, types, bool(gguf_field(reader, "tokenizer.ggml.add_space_prefix", True)))
    else:
        raise ValueError(f"GGUF tokenizer model {kind!r} is not supported (supported: 'gpt2' byte-level BPE, "
                         "'llama' SentencePiece)")
    backend.add_special_tokens(
        [AddedToken(tokens[i], special=True, normalized=False) for i, t in enumerate(types) if t == _CONTROL])
    # user-defined pieces are matched whole, except runs of spaces, which the SentencePiece merges build
    backend.add_tokens([AddedToken(tokens[i], special=False, normalized=False) for i, t in enumerate(types)
                        if t == _USER_DEFINED and backend.token_to_id(tokens[i]) == i])
    return backend


def _read_tokenizer_json(path: str) -> HFTokenizer:
    backend = HFTokenizer.from_file(path)
    release_freed_heap()  # parsing Gemma 3's 33 MB of JSON leaves 200 MB of freed heap resident
    return backend


def _cached_backend(reader: GGUFFile, build: Callable[[], HFTokenizer]) -> HFTokenizer:
    """`build()`, kept as tokenizer.json in the cache (keyed by every tokenizer field of the file and by this
    module's code): converting a 262k-piece SentencePiece vocabulary takes seconds, reading it back a fraction,
    and the front end and each engine core load it at every start."""
    digest = hashlib.sha256(Path(__file__).read_bytes())
    for key in sorted(k for k in reader.fields if k.startswith("tokenizer.ggml.")):
        digest.update(key.encode() + b"\0" + reader.field_bytes(key) + b"\0")
    path = cache_root() / "tokenizers" / f"{digest.hexdigest()[:24]}.json"
    if path.exists():
        with contextlib.suppress(Exception):  # a damaged entry is rebuilt
            return _read_tokenizer_json(str(path))
    backend = build()
    with contextlib.suppress(OSError):  # a read-only cache only costs the next start its build
        path.parent.mkdir(parents=True, exist_ok=True)
        with tempfile.NamedTemporaryFile("w", dir=path.parent, delete=False, suffix=".tmp") as f:
            f.write(backend.to_str())
        os.replace(f.name, path)  # atomic: concurrent starts never read a half-written file
    return backend


def _byte_level_bpe(reader: Any, tokens: list[str]) -> HFTokenizer:
    """GPT-2-style byte-level BPE with the file's merges (Llama 3, Qwen, SmolLM)."""
    merges = [tuple(m.split(" ", 1)) for m in gguf_field(reader, "tokenizer.ggml.merges", [])]
    backend = HFTokenizer(models.BPE(vocab={tok: i for i, tok in enumerate(tokens)}, merges=merges, fuse_unk=False))
    pre = gguf_field(reader, "tokenizer.ggml.pre")
    steps: list[pre_tokenizers.PreTokenizer] = []
    if pre == "smollm":
        # llama.cpp's smollm pre-tokenizer splits digits one by one before the GPT-2 regex.
        steps.append(pre_tokenizers.Digits(individual_digits=True))
    if pre in _PRE_TOKENIZER_REGEX:
        steps.append(pre_tokenizers.Split(Regex(_PRE_TOKENIZER_REGEX[pre]), behavior="isolated", invert=False))
        steps.append(pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False))
    else:
        steps.append(pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True))  # GPT-2's regex
    backend.pre_tokenizer = pre_tokenizers.Sequence(steps)
    backend.decoder = decoders.ByteLevel()
    return backend


def _sentencepiece_bpe(tokens: list[str], types: list[int], add_space_prefix: bool) -> HFTokenizer:
    """SentencePiece BPE (llama.cpp's 'llama' tokenizer model: Gemma, Llama 2, Mistral) as a `tokenizers` BPE:
    SentencePiece merges the adjacent pair whose merged piece ranks best, which is BPE with merges ranked by
    the merged piece. The rank is the piece's place in the vocabulary: the scores say the same for normal pieces
    but give user-defined ones (Gemma's runs of spaces) -1000, though SentencePiece builds them first.
    Spaces are written as U+2581; bytes missing from the vocabulary fall back to <0xNN> tokens."""
    # Gemma files spell whitespace-only pieces with real spaces; the normalizer writes U+2581 for them
    pieces = [t.replace(" ", SPIECE_SPACE) if " " in t and not t.strip() else t for t in tokens]
    vocab = {piece: i for i, piece in enumerate(pieces)}
    candidates: list[tuple[int, int, int, str, str]] = []
    for index, piece in enumerate(pieces):
        if types[index] not in (_NORMAL, _USER_DEFINED) or len(piece) < 2:
            continue  # control and byte pieces are never merge results
        for cut in range(1, len(piece)):
            left, right = piece[:cut], piece[cut:]
            if left in vocab and right in vocab:
                candidates.append((index, -len(left), vocab[left], left, right))
    candidates.sort()  # best piece first; for one piece, the longer left part first
    merges = _applicable_merges([(c[3], c[4]) for c in candidates], vocab)
    backend = HFTokenizer(models.BPE(vocab=vocab, merges=merges, unk_token="<unk>", fuse_unk=True,
                                     byte_fallback=True))
    steps: list[normalizers.Normalizer] = [normalizers.Prepend(SPIECE_SPACE)] if add_space_prefix else []
    backend.normalizer = normalizers.Sequence([*steps, normalizers.Replace(" ", SPIECE_SPACE)])
    out: list[decoders.Decoder] = [decoders.Replace(SPIECE_SPACE, " "), decoders.ByteFallback(), decoders.Fuse()]
    if add_space_prefix:
        out.append(decoders.Strip(content=" ", left=1, right=0))
    backend.decoder = decoders.Sequence(out)
    return backend


def _applicable_merges(merges: list[tuple[str, str]], vocab: dict[str, int]) -> list[tuple[str, str]]:
    """The merges that BPE can ever apply, in their order: for each piece, the last merge of BPE run on the
    piece's characters alone. Wherever a piece forms in a longer text, no merge crossed its edges, so the
    merges inside it ran exactly as they do on its characters alone and its last merge is that one; every other
    split of the piece is never applied. Dropping those leaves every encoding unchanged (tests/test_real_models.py
    checks against the full list) and halves Gemma 3's merges (515k -> 236k), and so the time every start spends
    reading them back."""
    rank = {pair: i for i, pair in enumerate(merges)}
    kept: set[int] = set()
    for piece in {left + right for left, right in merges}:
        symbols = list(piece)
        if any(symbol not in vocab for symbol in symbols):
            continue  # a character outside the vocabulary falls back to bytes, which never merge
        last = -1
        while len(symbols) > 1:
            best, at = min((rank.get((symbols[i], symbols[i + 1]), len(merges)), i) for i in range(len(symbols) - 1))
            if best == len(merges):
                break  # stuck: the piece never forms from its characters
            symbols[at:at + 2] = [symbols[at] + symbols[at + 1]]
            last = best
        if len(symbols) == 1:
            kept.add(last)
    return [merges[i] for i in sorted(kept)]


def _compile_template(source: str) -> jinja2.Template:
    def raise_exception(message: str) -> None:
        raise jinja2.TemplateError(message)

    env = jinja2.sandbox.ImmutableSandboxedEnvironment(
        trim_blocks=True, lstrip_blocks=True, extensions=["jinja2.ext.loopcontrols"]
    )
    env.filters["tojson"] = lambda value, indent=None: json.dumps(value, ensure_ascii=False, indent=indent)
    env.globals["raise_exception"] = raise_exception
    return env.from_string(source)


class IncrementalDetokenizer:
    """Turns a growing token list into text deltas that never split a UTF-8 character.

    Decodes a short window of recent tokens (`prefix_offset` .. end) and emits only what extends the text
    already read; text ending in U+FFFD means a multi-byte character is still incomplete, so it waits. `finish`
    emits whatever is left, so the concatenated deltas always equal the full decode.
    """

    def __init__(self, tokenizer: Tokenizer, skip_special_tokens: bool = True) -> None:
        self.tokenizer = tokenizer
        self.skip_special_tokens = skip_special_tokens
        self.token_ids: list[int] = []
        self.text = ""
        self._prefix_offset = 0
        self._read_offset = 0

    def _decode(self, ids: Sequence[int]) -> str:
        return self.tokenizer.decode(ids, skip_special_tokens=self.skip_special_tokens)

    def add_tokens(self, token_ids: Sequence[int]) -> str:
        self.token_ids.extend(token_ids)
        prefix_text = self._decode(self.token_ids[self._prefix_offset:self._read_offset])
        new_text = self._decode(self.token_ids[self._prefix_offset:])
        if len(new_text) <= len(prefix_text) or new_text.endswith("\ufffd"):
            return ""
        delta = new_text[len(prefix_text):]
        self._prefix_offset = self._read_offset
        self._read_offset = len(self.token_ids)
        self.text += delta
        return delta

    def finish(self) -> str:
        full = self._decode(self.token_ids)
        delta = full[len(self.text):] if full.startswith(self.text) else ""
        self.text += delta
        return delta
